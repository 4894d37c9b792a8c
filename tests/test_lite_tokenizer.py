"""`LiteTokenizer` (our tokenizer folders without transformers) gives transformers' ids and
text: encode, decode, special tokens, chat templates with tools and tool calls, and files
that load back in either class (docs/design.md §10.33)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from areal_like.models.lite_tokenizer import LiteTokenizer
from areal_like.models.tiny_model import load_tokenizer

QUICKSTART = Path(__file__).resolve().parents[1] / "areal_like" / "assets" / "quickstart_model"
TOOLS = [{"type": "function", "function": {"name": "python", "description": "run code", "parameters": {}}}]
CONVERSATIONS = [
    ([{"role": "user", "content": "What is 12+7?"}], None),
    ([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
      {"role": "assistant", "content": "ok"}], None),
    ([{"role": "user", "content": "calc"},
      {"role": "assistant", "content": "", "tool_calls": [
          {"type": "function", "function": {"name": "python", "arguments": {"code": "print(1)"}}}]},
      {"role": "tool", "content": "1\n"}], TOOLS),
    ([{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]}],
     [{"name": "f"}]),
    ([{"role": "user", "content": "üñí <tool_call> x <|im_end|>"}], None),
]


@pytest.fixture(scope="module")
def pair() -> tuple[LiteTokenizer, PreTrainedTokenizerFast]:
    lite = load_tokenizer(QUICKSTART)
    assert isinstance(lite, LiteTokenizer)
    return lite, PreTrainedTokenizerFast.from_pretrained(str(QUICKSTART))


def test_ids_text_and_special_tokens_are_transformers(pair) -> None:
    lite, hf = pair
    for attr in ("eos_token", "pad_token", "unk_token", "bos_token", "eos_token_id", "pad_token_id", "unk_token_id",
                 "bos_token_id", "vocab_size", "chat_template"):
        assert getattr(lite, attr) == getattr(hf, attr), attr
    assert len(lite) == len(hf)
    assert set(lite.all_special_tokens) == set(hf.all_special_tokens)
    assert {i: (t.content, t.special) for i, t in lite.added_tokens_decoder.items()} == \
        {i: (t.content, t.special) for i, t in hf.added_tokens_decoder.items()}
    assert lite.convert_tokens_to_ids(["<tool_call>", "no such token", "a"]) == \
        hf.convert_tokens_to_ids(["<tool_call>", "no such token", "a"])
    rng = random.Random(0)
    alphabet = list("abc XYZ 0129\n\t{}\"'üñ") + ["<|im_start|>", "<|im_end|>", "<tool_call>", "<pad>"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        ids = hf.encode(text)
        assert lite.encode(text) == ids, text
        assert lite.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
        for skip in (False, True):
            assert lite.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text


@pytest.mark.parametrize("k", range(len(CONVERSATIONS)))
def test_chat_templates_render_as_transformers_does(pair, k: int) -> None:
    lite, hf = pair
    messages, tools = CONVERSATIONS[k]
    for gen in (False, True):
        text = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=False)
        assert lite.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=False) == text
        out = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=True)
        assert dict(lite.apply_chat_template(messages, tools=tools, add_generation_prompt=gen)) == dict(out)
        ids = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, return_dict=False)
        assert lite.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, return_dict=False) == ids


def test_what_it_does_not_cover_goes_to_transformers(pair) -> None:
    lite, hf = pair
    for tok in (lite, hf):
        with pytest.raises(ValueError, match="empty conversation"):
            tok.apply_chat_template([], tools=TOOLS)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "he"}]
    # an option it does not render itself, and an attribute it does not have
    assert lite.apply_chat_template(messages, continue_final_message=True, tokenize=False) == \
        hf.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    assert lite.get_vocab() == hf.get_vocab()
    assert lite.batch_decode([[5, 6], [7]]) == hf.batch_decode([[5, 6], [7]])


def test_saved_files_load_back_in_both_classes_with_a_changed_template(pair, tmp_path: Path) -> None:
    lite, _ = pair
    copy = LiteTokenizer(QUICKSTART)
    copy.chat_template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    copy.save_pretrained(tmp_path)
    again, hf = load_tokenizer(tmp_path), PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    assert isinstance(again, LiteTokenizer)
    messages = [{"role": "user", "content": "x"}]
    assert again.apply_chat_template(messages, tokenize=False) == hf.apply_chat_template(messages, tokenize=False) \
        == "[user]x"
    assert again.encode("a b") == lite.encode("a b")


def test_a_library_that_requires_transformers_class_gets_it() -> None:
    """TRL's GRPOTrainer refuses anything but transformers' tokenizer classes
    (bench/_trl_contender.py asks for one)."""
    from transformers import PreTrainedTokenizerBase

    hf = load_tokenizer(QUICKSTART, hf=True)
    assert isinstance(hf, PreTrainedTokenizerBase) and hf.encode("1+2") == load_tokenizer(QUICKSTART).encode("1+2")
    assert "load_tokenizer(model_path, hf=True)" in (QUICKSTART.parents[2] / "bench" / "_trl_contender.py").read_text()


def test_the_end_of_turn_of_a_turn_is_found_without_transformers() -> None:
    """Every agent-loop turn asks for the template's end-of-turn token; on our tokenizer that
    must not import transformers (1-2 s in the rollout controller, before its first group)."""
    import subprocess
    import sys

    code = ("import sys; from areal_like.models.tiny_model import load_tokenizer; "
            "from areal_like.models.fetch import end_of_turn_ids; "
            f"tok = load_tokenizer({str(QUICKSTART)!r}); print(end_of_turn_ids(tok), tok.eos_token_id, "
            "'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["(3,)", "3", "False"], out.stdout
