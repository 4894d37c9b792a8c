"""The embedded default model: a ~1M-parameter Qwen2 and a character tokenizer.

No model hub is reachable, so the quickstart model is made here from a config.
The tokenizer is character-level (one token per character) with a few added
tokens: the chat markers, the hermes tool-call tags, and, crucially for learning
speed, the fixed JSON prefix and suffix of a calculator call as single tokens, so a
whole call is about ten generated tokens (docs/design.md §8).

The chat template renders hermes tool calls (`<tool_call>{json}</tool_call>`) for
assistant messages with `tool_calls`, and tool responses in a `tool` role wrapped in
`<tool_response>...</tool_response>`. Token ids round-trip exactly through
encode/decode because every character has its own id.

Imports transformers/tokenizers lazily: `import areal_like` stays light.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

__all__ = ["CALL_PREFIX", "CALL_SUFFIX", "CHAT_TEMPLATE", "build_tokenizer", "load_tokenizer", "init_model", "tiny_qwen2_config"]

CALL_PREFIX = '<tool_call>{"name": "calculator", "arguments": {"expression": "'
CALL_SUFFIX = '"}}</tool_call>'
_MARKER = "areal_like_char_tokenizer"
PAD, UNK, IM_START, IM_END = "<pad>", "<unk>", "<|im_start|>", "<|im_end|>"
_SPECIAL = [PAD, UNK, IM_START, IM_END]
_ADDED = [
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    CALL_PREFIX,
    CALL_SUFFIX,
    "system",
    "user",
    "assistant",
    "tool",
]
_CHARS = string.digits + string.ascii_lowercase + string.ascii_uppercase + " \n!\"#'()*+,-./:;<=>?[]_{}|%&@$^~`\\"

# Hermes-style template. Tools (if given) are listed by name in a system block; the
# tiny model learns their use in SFT, a large model would get full schemas.
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>systemtools:"
    "{%- for t in tools %} {{ t.function.name if t.function is defined else t.name }}{%- endfor %}"
    "<|im_end|>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant"
    "{%- if m.content %}{{ m.content }}{%- endif %}"
    "{%- if m.tool_calls %}{%- for tc in m.tool_calls %}"
    "{%- set f = tc.function if tc.function is defined else tc %}"
    '<tool_call>{"name": "{{ f.name }}", "arguments": '
    "{%- if f.arguments is string %} {{ f.arguments }}{%- else %} {{ f.arguments | tojson }}{%- endif %}"
    "}</tool_call>"
    "{%- endfor %}{%- endif %}<|im_end|>"
    "{%- elif m.role == 'tool' %}<|im_start|>tool<tool_response>{{ m.content }}</tool_response><|im_end|>"
    "{%- else %}<|im_start|>{{ m.role }}{{ m.content }}<|im_end|>"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant{%- endif %}"
)


def build_tokenizer() -> Any:
    """A `PreTrainedTokenizerFast` with one id per character plus the added tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(_SPECIAL)}
    for ch in _CHARS:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=UNK,
        pad_token=PAD,
        eos_token=IM_END,
        bos_token=None,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
    )
    fast.add_tokens(_ADDED)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 512
    fast.init_kwargs[_MARKER] = True
    return fast


_PLAIN_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""`tokenizer_class` values whose whole tokenizer is `tokenizer.json` as it stands (transformers
builds nothing of its own around it): what `areal-like model fetch` writes (docs/design.md §10.33)."""


def load_tokenizer(path: str | Path, *, hf: bool = False) -> Any:
    """Load a tokenizer folder. Ours, and any folder whose `tokenizer_config.json` names a
    plain `tokenizers` class (`_PLAIN_CLASSES`: the folders `areal-like model fetch`
    writes), load without transformers as a `LiteTokenizer` (the same ids and text,
    docs/design.md §10.33); transformers' import and class cost 3-4 s of CPU in each
    process that loads the real recipe's tokenizer. `hf=True` is for a library that requires
    transformers' class (TRL's `GRPOTrainer`): ours then loads as `PreTrainedTokenizerFast`
    (transformers 5's `AutoTokenizer` would swap in the model type's tokenizer class, Qwen2's
    byte-level pre-tokenizer, and drop spaces), any other folder through AutoTokenizer, as
    does every folder with a model-specific class (Llama's, Qwen2's...)."""
    import json

    folder = Path(path)
    cfg_file = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    if cfg.get(_MARKER) and hf:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    if (cfg.get(_MARKER) or cfg.get("tokenizer_class") in _PLAIN_CLASSES) and not hf \
            and (folder / "tokenizer.json").is_file():
        from areal_like.models.lite_tokenizer import LiteTokenizer

        return LiteTokenizer(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def tiny_qwen2_config(vocab_size: int, tokenizer: Any | None = None, **overrides: Any) -> Any:
    """The quickstart architecture: hidden 128, 4 layers, 4/2 heads, tied embeddings."""
    from transformers import Qwen2Config

    kw: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        torch_dtype="float32",
        use_cache=True,
    )
    if tokenizer is not None:
        kw.update(
            eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=None,
        )
    kw.update(overrides)
    return Qwen2Config(**kw)


def init_model(out_dir: str | Path, seed: int = 0, **config_overrides: Any) -> Path:
    """Create tokenizer + randomly initialised model and save both as an HF folder."""
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = tiny_qwen2_config(len(tokenizer), tokenizer, **config_overrides)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
