"""The embedded task and tokenizer: exact rewards, safe calculator, id round trips."""

from __future__ import annotations

import random

import pytest

from areal_like.core.types import AgentLoopOutput
from areal_like.models.tiny_model import CALL_PREFIX, CALL_SUFFIX
from areal_like.tasks.arithmetic import (
    CalculatorError,
    arithmetic_reward,
    calculate,
    extract_answer,
    generate_problems,
)


def test_generator_is_seeded_and_answers_are_exact() -> None:
    a, b = generate_problems(200, seed=3), generate_problems(200, seed=3)
    assert a == b and generate_problems(5, seed=4) != a[:5]
    for row in a:
        expr = row["extra"]["expression"]
        assert row["prompt"][0]["content"] == expr
        x, op, y = (expr.partition("+") if "+" in expr else expr.partition("*"))
        assert int(row["answer"]) == (int(x) + int(y) if op == "+" else int(x) * int(y))
        assert 100 <= int(x) <= 999
    ops = {("+" in r["answer"]) for r in a}
    assert ops == {False}
    assert {"+" in r["extra"]["expression"] for r in a} == {True, False}


@pytest.mark.parametrize("expr, value", [("123+456", 579), ("007*2", 14), ("2+3*4", 14), ("(2+3)*4", 20), ("-5+2", -3), (" 1 - 2 ", -1)])
def test_calculator(expr, value) -> None:
    assert calculate(expr) == value


@pytest.mark.parametrize("expr", ["", "1+", "__import__('os')", "1/2", "2**100", "9" * 70, "(1+2", "1 2"])
def test_calculator_refuses(expr) -> None:
    with pytest.raises(CalculatorError):
        calculate(expr)


def test_calculator_is_fuzz_safe() -> None:
    rng = random.Random(0)
    alphabet = "0123456789+-*() x"
    outcomes = {"value": 0, "refused": 0}
    for _ in range(2000):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        try:  # any exception other than CalculatorError fails the test
            assert isinstance(calculate(s), int)
            outcomes["value"] += 1
        except CalculatorError:
            outcomes["refused"] += 1
    assert outcomes["value"] > 0 and outcomes["refused"] > 0, outcomes


def _out(text: str) -> AgentLoopOutput:
    return AgentLoopOutput(prompt_ids=[1], response_ids=[], response_mask=[], response_logprobs=[], response_versions=[], extra={"final_text": text})


def test_reward_is_exact() -> None:
    sample = {"answer": "5535"}
    assert arithmetic_reward(sample, _out("5535")) == 1.0
    assert arithmetic_reward(sample, _out(" 5535 ")) == 1.0
    assert arithmetic_reward(sample, _out("05535")) == 1.0  # leading zeros are the same integer
    for wrong in ["5536", "5535 apples", "", "55 35", "5535.0"]:
        assert arithmetic_reward(sample, _out(wrong)) == 0.0
    assert extract_answer("-12") == "-12"


def test_chat_template_with_tool_calls_round_trips(tokenizer) -> None:
    msgs = [
        {"role": "user", "content": "123*45"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "123*45"}}}]},
        {"role": "tool", "content": "5535"},
        {"role": "assistant", "content": "5535"},
    ]
    tools = [{"type": "function", "function": {"name": "calculator", "description": "d", "parameters": {}}}]
    text = tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False)
    ids = tokenizer.apply_chat_template(msgs, tools=tools, tokenize=True)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode(text) == ids
    # the calculator call's fixed JSON prefix and suffix are single tokens
    call_tokens = tokenizer.encode(CALL_PREFIX + "123*45" + CALL_SUFFIX)
    assert len(call_tokens) == 1 + 6 + 1
    assert "<tool_response>5535</tool_response>" in text
    # arguments given as a JSON string render the same
    msgs[1]["tool_calls"][0]["function"]["arguments"] = '{"expression": "123*45"}'
    assert tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False) == text


def test_every_id_decodes_and_reencodes(tokenizer) -> None:
    for i in range(len(tokenizer)):
        s = tokenizer.decode([i])
        if s in ("<pad>", "<unk>"):
            continue
        assert tokenizer.encode(s) == [i], (i, s)


def test_model_loads_with_auto_classes(tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    n = sum(p.numel() for p in m.parameters())
    assert 0.5e6 < n < 2e6
    assert m.config.tie_word_embeddings
