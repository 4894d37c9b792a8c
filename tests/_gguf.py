"""A tiny Llama GGUF written with the `gguf` package, as llama.cpp's converter lays one out
(Q and K rows permuted, tied embeddings, a byte-level BPE tokenizer with a ChatML template),
plus the HF state dict it came from, so a conversion can be checked exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _byte_chars() -> list[str]:
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            chars.append(256 + extra)
            extra += 1
    return [chr(c) for c in chars]


def _permute(w: Any, n_head: int) -> Any:
    """llama.cpp's reordering of Q/K rows (transformers undoes it on load)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, *, eos: str = "<|im_end|>", chat_template: str | None = CHATML,
                    seed: int = 0) -> dict[str, Any]:
    """Write the GGUF; returns the HF state dict (torch tensors) it encodes. `eos` is the
    tokenizer's eos (`</s>` for a model whose turns end with another token)."""
    import gguf
    import numpy as np
    import torch
    import transformers

    tokens = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", *_byte_chars(), "Ġt", "he"]
    types = [3] * 5 + [1] * (len(tokens) - 5)
    vocab, hidden, layers, heads, kv_heads = len(tokens), 32, 2, 4, 2
    eos_id = tokens.index(eos)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=64,
                                   num_hidden_layers=layers, num_attention_heads=heads,
                                   num_key_value_heads=kv_heads, max_position_embeddings=128, rms_norm_eps=1e-5,
                                   rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1,
                                   eos_token_id=eos_id, pad_token_id=eos_id)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    n = {k: v.numpy().astype(np.float32) for k, v in sd.items()}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(64)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(eos_id)
    w.add_pad_token_id(eos_id)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.add_tensor("token_embd.weight", n["model.embed_tokens.weight"])
    for i in range(layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(n[p + "self_attn.q_proj.weight"], heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(n[p + "self_attn.k_proj.weight"], kv_heads))
        w.add_tensor(f"blk.{i}.attn_v.weight", n[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", n[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", n[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", n[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", n[p + "mlp.down_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_norm.weight", n[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", n[p + "post_attention_layernorm.weight"])
    w.add_tensor("output_norm.weight", n["model.norm.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sd
