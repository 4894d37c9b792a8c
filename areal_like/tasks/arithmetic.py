"""Arithmetic problems with exactly checkable answers, the quickstart's task.

Problems are `abc+def` (3-digit + 3-digit) and `abc*de` (3-digit × 2-digit): a tiny
model cannot multiply in its head, so it learns to call the calculator and copy the
result (docs/design.md §8). The `chat` form is the real-model recipe's task
(configs/smollm2.yaml): "What is 14 + 7? Answer with the number only." for 2–19 plus
1–9, a question a pretrained chat model of 135M parameters answers right at T = 1 12.5–16 %
of the time (its last integer; 0.36 greedy), so RL has signal from the start and room to
rise; it is scored by `last_integer_reward`. Rows follow the dataset format of docs/design.md §9.11: `prompt`
(chat messages), `answer`, `agent_name`, `data_source`.

The calculator parses numbers itself (leading zeros allowed) with a tiny
recursive-descent parser over `+ - * ( )` and integers; no `eval`.
"""

from __future__ import annotations

import random
import re
from typing import Any

__all__ = [
    "CalculatorError",
    "calculate",
    "make_problem",
    "generate_problems",
    "extract_answer",
    "arithmetic_reward",
    "last_integer_reward",
]

_MAX_EXPR = 64
_MAX_DIGITS = 18
_TOKEN = re.compile(r"\s*(\d+|[-+*()])")


class CalculatorError(ValueError):
    """The expression is not integer arithmetic over + - * and parentheses."""


def calculate(expression: str) -> int:
    """Evaluate integer `+ - *` arithmetic with parentheses, precedence as usual."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > _MAX_EXPR:
        raise CalculatorError(f"expression longer than {_MAX_EXPR} characters")
    tokens: list[str] = []
    pos = 0
    text = expression.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise CalculatorError(f"unexpected character {text[pos]!r} at position {pos}")
        tokens.append(m.group(1))
        pos = m.end()
    if not tokens:
        raise CalculatorError("empty expression")
    value, rest = _sum(tokens)
    if rest:
        raise CalculatorError(f"unexpected {rest[0]!r} after a complete expression")
    return value


def _sum(t: list[str]) -> tuple[int, list[str]]:
    value, t = _product(t)
    while t and t[0] in "+-":
        op, (rhs, t) = t[0], _product(t[1:])
        value = value + rhs if op == "+" else value - rhs
    return value, t


def _product(t: list[str]) -> tuple[int, list[str]]:
    value, t = _atom(t)
    while t and t[0] == "*":
        rhs, t = _atom(t[1:])
        value *= rhs
        if abs(value) >= 10**_MAX_DIGITS:
            raise CalculatorError("result too large")
    return value, t


def _atom(t: list[str]) -> tuple[int, list[str]]:
    if not t:
        raise CalculatorError("expression ends where a number was expected")
    head = t[0]
    if head == "(":
        value, rest = _sum(t[1:])
        if not rest or rest[0] != ")":
            raise CalculatorError("missing ')'")
        return value, rest[1:]
    if head == "-":
        value, rest = _atom(t[1:])
        return -value, rest
    if head.isdigit():
        if len(head) > _MAX_DIGITS:
            raise CalculatorError(f"number with more than {_MAX_DIGITS} digits")
        return int(head), t[1:]
    raise CalculatorError(f"expected a number, got {head!r}")


def make_problem(rng: random.Random, form: str = "tool") -> dict[str, Any]:
    """One problem row: 3-digit + 3-digit or 3-digit × 2-digit, equally often."""
    a = rng.randint(100, 999)
    if rng.random() < 0.5:
        b, op = rng.randint(100, 999), "+"
        answer = a + b
    else:
        b, op = rng.randint(10, 99), "*"
        answer = a * b
    return {
        "prompt": [{"role": "user", "content": f"{a}{op}{b}"}],
        "answer": str(answer),
        "agent_name": {"tool": "tool_agent", "long_answer": "long_answer"}.get(form, "single_turn"),
        "data_source": "arithmetic",
        "extra": {"expression": f"{a}{op}{b}"},
    }


def _chat_problem(a: int, b: int) -> dict[str, Any]:
    return {
        "prompt": [{"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}],
        "answer": str(a + b),
        "agent_name": "single_turn",
        "data_source": "arithmetic_chat",
        "extra": {"expression": f"{a}+{b}"},
    }


CHAT_PROBLEMS = [(a, b) for a in range(2, 20) for b in range(1, 10)]
"""All 162 problems of the `chat` form."""


def generate_problems(n: int, seed: int, form: str = "tool") -> list[dict[str, Any]]:
    rng = random.Random(seed)
    if form == "chat":  # a seeded order of the small set, repeated to n rows
        order = list(CHAT_PROBLEMS)
        rng.shuffle(order)
        return [_chat_problem(*order[i % len(order)]) for i in range(n)]
    return [make_problem(rng, form) for _ in range(n)]


_ANSWER = re.compile(r"^\s*(-?\d+)\s*$")


def extract_answer(text: str) -> str | None:
    """The final answer: the assistant's last message must be just an integer."""
    m = _ANSWER.match(text or "")
    return str(int(m.group(1))) if m else None


def arithmetic_reward(sample: dict[str, Any], output: Any) -> float:
    """1.0 if the final assistant text is exactly the answer, else 0.0.

    `output` is an `AgentLoopOutput`; agent loops put the decoded text of the last
    assistant turn in `output.final_text`.
    """
    final = output.final_text if hasattr(output, "final_text") else str(output)
    got = extract_answer(final)
    return 1.0 if got is not None and got == str(sample["answer"]).strip() else 0.0


_INT = re.compile(r"-?\d+")


def last_integer_reward(sample: dict[str, Any], output: Any) -> float:
    """1.0 if the last integer in the final assistant text is the answer, else 0.0.

    Lenient about form ("14 + 7 = 21." scores), as a chat model's answers are; the
    `chat` form's reward. Text cut by the length limit is read like any other: the
    truncation options (`train.loss.mask_truncated`, `train.loss.overlong_buffer`) decide
    what such answers teach."""
    final = output.final_text if hasattr(output, "final_text") else str(output)
    found = _INT.findall(final or "")
    return 1.0 if found and str(int(found[-1])) == str(sample["answer"]).strip() else 0.0
