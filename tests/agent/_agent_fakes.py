"""Fakes for the edges of the agent loops: a scripted server with exact, checkable outputs.

The server answers turn k of an episode (taken from the request id `episode/k`) with
a scripted text, tokenized with the real tokenizer and followed by end-of-turn. Its
logprobs are a deterministic function of (turn, position) and its versions are the
server's current `version`, so a test can state the exact trajectory it expects.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from areal_like.core.types import GenerateResult, SamplingParams


def turn_logprobs(turn: int, n: int) -> list[float]:
    return [-0.001 * (turn * 100 + i + 1) for i in range(n)]


class FakeServer:
    """Answers with `script[episode][turn]` (or `script[turn]` for a list); records calls.

    A script entry is a text (tokenized, then end-of-turn appended), or a tuple
    `(text, stop_reason)` where the text is used as-is (no end-of-turn added).
    """

    def __init__(
        self,
        tokenizer: Any,
        script: list[Any] | dict[str, list[Any]] | Callable[[str, int], Any],
        *,
        name: str = "fake",
        version: int = 0,
        delay: float = 0.0,
        fail_with: BaseException | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.name = name
        self.version = version
        self.delay = delay
        self.fail_with = fail_with
        self.calls: list[tuple[str, list[int], SamplingParams]] = []
        self.in_flight = 0
        self.max_in_flight = 0

    def _entry(self, episode: str, turn: int) -> Any:
        if callable(self.script):
            return self.script(episode, turn)
        if isinstance(self.script, dict):
            return self.script[episode][turn]
        return self.script[turn]

    async def generate(
        self, *, request_id: str, prompt_ids: list[int], sampling_params: SamplingParams
    ) -> GenerateResult:
        self.calls.append((request_id, list(prompt_ids), sampling_params))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
            if self.fail_with is not None:
                raise self.fail_with
        finally:
            self.in_flight -= 1
        episode, _, turn_s = request_id.rpartition("/")
        turn = int(turn_s) if turn_s.isdigit() else 0
        entry = self._entry(episode or request_id, turn)
        ids, stop = self.turn_ids(entry)
        if len(ids) > sampling_params.max_tokens:
            ids, stop = ids[: sampling_params.max_tokens], "length"
        return GenerateResult(
            request_id=request_id,
            token_ids=ids,
            logprobs=turn_logprobs(turn, len(ids)),
            versions=[self.version] * len(ids),
            stop_reason=stop,
        )

    def turn_ids(self, entry: Any) -> tuple[list[int], str]:
        if isinstance(entry, tuple):
            text, stop = entry
            return self.tokenizer.encode(text, add_special_tokens=False), stop
        return self.tokenizer.encode(entry, add_special_tokens=False) + [self.tokenizer.eos_token_id], "stop"


def call_text(expression: str, name: str = "calculator") -> str:
    """A hermes tool call exactly as the chat template renders it."""
    return f'<tool_call>{{"name": "{name}", "arguments": {{"expression": "{expression}"}}}}</tool_call>'
