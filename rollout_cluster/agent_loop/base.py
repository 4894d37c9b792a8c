"""The agent-loop contract: one async function per episode (docs/design.md §4).

An agent loop receives a dataset row and sampling parameters, talks to the servers
through the `ServerManager` (and to tools), and returns an `AgentLoopOutput`, or
`None` when the workflow rejects the episode (counted as `rejected`). It is built
once with what it needs and then runs many episodes concurrently, so per-episode
state lives in locals, never on `self`.

Loops are chosen per row by `agent_name` (default `agent.default_loop`): a name
registered with `@register(...)`, a class passed directly, or user code
(`file.py:Name` / `pkg.mod:Name`); a user *function* there is taken to be an
OpenAI-shaped agent and wrapped by `rollout_cluster.openai_client`.

What every loop fills in `AgentLoopOutput` besides the tokens (the reward and the
controller read them): `final_text` (decoded text of the last assistant turn, tool calls
removed), `messages` (the chat so far), `episode_id`, `stop_reason` (of the last
generate call), `termination` (why the loop ended), `truncated` (the response budget cut
the episode). `extra` is the loop's own, never read by the pipeline.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from areal_like.core.config import AgentConfig
from areal_like.core.types import AgentLoopOutput, SamplingParams
from areal_like.models.fetch import end_of_turn_ids
from rollout_cluster.agent_loop.chat import ChatTemplate
from rollout_cluster.tool_parser import ToolParser, get_tool_parser
from rollout_cluster.tools.base import BaseTool

__all__ = ["AGENT_LOOPS", "AgentLoopBase", "register"]


class AgentLoopBase(ABC):
    """Base of every agent loop. Implement `run`.

    `response_length` is the token budget of the whole response (all assistant
    turns and observations); `server_manager` is anything with the manager's
    `generate(*, request_id, prompt_ids, sampling_params, session_id)`.
    """

    def __init__(
        self,
        *,
        server_manager: Any,
        tokenizer: Any,
        config: AgentConfig,
        response_length: int,
        tools: Sequence[BaseTool] = (),
        tool_parser: ToolParser | None = None,
    ) -> None:
        if response_length < 1:
            raise ValueError("response_length must be >= 1")
        self.server_manager = server_manager
        self.tokenizer = tokenizer
        self.config = config
        self.response_length = response_length
        self.tools: dict[str, BaseTool] = {t.name: t for t in tools}
        self.tool_parser = tool_parser or get_tool_parser(config.tool_parser)
        self.chat = ChatTemplate(tokenizer)

    @abstractmethod
    async def run(self, sampling_params: SamplingParams, **sample: Any) -> AgentLoopOutput | None:
        """Run one episode on the dataset row `sample` (plus `episode_id` from the runner)."""

    # --- helpers shared by loops ------------------------------------------------------

    @staticmethod
    def episode_id(sample: dict[str, Any]) -> str:
        return str(sample.get("episode_id") or uuid.uuid4().hex)

    @staticmethod
    def prompt_messages(sample: dict[str, Any]) -> list[dict[str, Any]]:
        """The row's `prompt` as chat messages (a string is one user message)."""
        prompt = sample.get("prompt")
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        if isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt):
            return [dict(m) for m in prompt]
        raise ValueError(
            f"sample 'prompt' must be a string or a list of chat messages, got {type(prompt).__name__}"
        )

    def turn_params(self, sampling_params: SamplingParams, remaining: int) -> SamplingParams:
        """This turn's sampling: at most `remaining` budget tokens, stopping at end-of-turn:
        the tokenizer's eos and the token with which its chat template ends an assistant
        turn (every prompt here is rendered with it), whatever the generation config says."""
        stop = list(sampling_params.stop_token_ids)
        for tid in (self.tokenizer.eos_token_id, *end_of_turn_ids(self.tokenizer)):
            if tid is not None and tid not in stop:
                stop.append(tid)
        return sampling_params.model_copy(
            update={"max_tokens": max(1, min(sampling_params.max_tokens, remaining)), "stop_token_ids": stop}
        )

    def decode(self, ids: list[int]) -> str:
        """Text of generated ids, for parsing and rewards only; the ids themselves are kept."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)


AGENT_LOOPS: dict[str, type[AgentLoopBase]] = {}

_L = TypeVar("_L", bound=type[AgentLoopBase])


def register(name: str) -> Callable[[_L], _L]:
    """Class decorator: make a loop selectable by `agent_name` / `agent.default_loop`."""

    def deco(cls: _L) -> _L:
        if name in AGENT_LOOPS and AGENT_LOOPS[name] is not cls:
            raise ValueError(f"agent loop {name!r} is already registered to {AGENT_LOOPS[name].__qualname__}")
        AGENT_LOOPS[name] = cls
        return cls

    return deco
