"""Multi-turn tool use as an explicit state machine.

    PENDING ──> GENERATING ──> PROCESSING_TOOLS ──> GENERATING ──> … ──> TERMINATED

PENDING renders the prompt (with the tool schemas). GENERATING asks the server for
one assistant turn, continuing the episode's exact token sequence, records its ids
with mask 1 and the engine's logprobs and versions, and parses tool calls from its
text. PROCESSING_TOOLS runs up to `max_parallel_calls` calls concurrently, answers
each (malformed, unknown, bad arguments, timed out and failed calls get an error
text), truncates long answers, and appends the tool messages' template ids with
mask 0, logprob 0 and version -1.

It terminates when a turn has no tool call, the server stopped for length or
abort, the response budget (`response_length`, observations included) is spent, or
`max_assistant_turns` / `max_user_turns` is reached. The last turn is never a tool
turn: if the observation would not leave room for another assistant turn, it is not
appended and the episode ends as truncated.

All generate calls of an episode share the episode id as their sticky session, so
later turns hit the server whose prefix cache holds the conversation.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from areal_like.core.types import AgentLoopOutput, GenerateResult, SamplingParams
from rollout_cluster.agent_loop.base import AgentLoopBase, register
from rollout_cluster.tool_parser import ToolCall
from rollout_cluster.tools.base import ToolOutcome, call_tool

logger = logging.getLogger(__name__)

__all__ = ["AgentState", "ToolAgentLoop", "truncate_text"]


class AgentState(enum.Enum):
    PENDING = "pending"
    GENERATING = "generating"
    PROCESSING_TOOLS = "processing_tools"
    TERMINATED = "terminated"


def truncate_text(text: str, max_chars: int, side: str) -> str:
    """Cut an over-long tool answer. `side` names the part that is cut:
    `left` keeps the end, `right` keeps the beginning, `middle` keeps both ends."""
    if len(text) <= max_chars:
        return text
    if side == "left":
        return "..." + text[len(text) - max_chars :]
    if side == "right":
        return text[:max_chars] + "..."
    if side == "middle":
        head = (max_chars + 1) // 2
        tail = max_chars - head
        return text[:head] + "..." + (text[len(text) - tail :] if tail else "")
    raise ValueError(f"unknown truncation side {side!r}")


@dataclass
class _Episode:
    """Everything one episode accumulates; the loop object itself stays stateless."""

    episode_id: str
    messages: list[dict[str, Any]]
    tools_kwargs: dict[str, Any]
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    response_versions: list[int] = field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    pending_calls: list[ToolCall] = field(default_factory=list)
    final_text: str = ""
    stop_reason: str = ""
    stop_token_id: int | None = None
    termination: str = ""
    truncated: bool = False
    tool_rewards: list[float] = field(default_factory=list)
    instances: dict[str, str] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)
    counts: Counter[str] = field(default_factory=Counter)

    def add_generated(self, result: GenerateResult) -> None:
        self.response_ids += result.token_ids
        self.response_mask += [1] * len(result.token_ids)
        self.response_logprobs += result.logprobs
        self.response_versions += result.versions

    def add_observation(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.response_mask += [0] * len(ids)
        self.response_logprobs += [0.0] * len(ids)
        self.response_versions += [-1] * len(ids)


@register("tool_agent")
class ToolAgentLoop(AgentLoopBase):
    """verl-style tool agent loop; see the module docstring for the states and limits."""

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    async def run(self, sampling_params: SamplingParams, **sample: Any) -> AgentLoopOutput | None:
        ep = _Episode(
            episode_id=self.episode_id(sample),
            messages=self.prompt_messages(sample),
            tools_kwargs=dict(sample.get("tools_kwargs") or {}),
        )
        state = AgentState.PENDING
        try:
            while state is not AgentState.TERMINATED:
                if state is AgentState.PENDING:
                    state = self._pending(ep)
                elif state is AgentState.GENERATING:
                    state = await self._generating(ep, sampling_params)
                else:
                    state = await self._processing_tools(ep)
        finally:
            self.server_manager.release_session(ep.episode_id)
            await self._release_tools(ep)
        return self._output(ep)

    # --- states -----------------------------------------------------------------------

    def _pending(self, ep: _Episode) -> AgentState:
        ep.prompt_ids = self.chat.prompt_ids(ep.messages, tools=self.tool_schemas)
        return AgentState.GENERATING

    async def _generating(self, ep: _Episode, sampling_params: SamplingParams) -> AgentState:
        remaining = self.response_length - len(ep.response_ids)
        start = time.perf_counter()
        result = await self.server_manager.generate(
            request_id=f"{ep.episode_id}/{ep.assistant_turns}",
            session_id=ep.episode_id,
            prompt_ids=ep.prompt_ids + ep.response_ids,
            sampling_params=self.turn_params(sampling_params, remaining),
        )
        ep.counts["generate_s"] += time.perf_counter() - start
        ep.counts["num_interrupts"] += result.num_interrupts
        ep.assistant_turns += 1
        ep.add_generated(result)
        ep.stop_reason, ep.stop_token_id = result.stop_reason, result.stop_token_id
        parsed = self.tool_parser.parse(self.decode(result.token_ids))
        ep.final_text = parsed.content
        ep.messages.append(_assistant_message(parsed.content, parsed.calls))
        if result.stop_reason == "abort":
            return self._terminate(ep, "abort", truncated=True)
        if result.stop_reason == "length" or len(ep.response_ids) >= self.response_length:
            return self._terminate(ep, "response_length", truncated=True)
        if not parsed.calls:
            return self._terminate(ep, "no_tool_call")
        if ep.assistant_turns >= self.config.max_assistant_turns:
            return self._terminate(ep, "max_assistant_turns")
        if ep.user_turns >= self.config.max_user_turns:
            return self._terminate(ep, "max_user_turns")
        ep.pending_calls = parsed.calls
        return AgentState.PROCESSING_TOOLS

    async def _processing_tools(self, ep: _Episode) -> AgentState:
        calls = ep.pending_calls[: self.config.max_parallel_calls]
        ep.counts["dropped_calls"] += len(ep.pending_calls) - len(calls)
        ep.pending_calls = []
        await self._create_instances(ep, calls)
        start = time.perf_counter()
        outcomes = await asyncio.gather(*(self._call(ep, c) for c in calls))
        ep.counts["tool_s"] += time.perf_counter() - start
        tool_messages = []
        for call, outcome in zip(calls, outcomes, strict=True):
            ep.counts["tool_calls"] += 1
            ep.counts[f"tool_{outcome.status}"] += 1
            if outcome.reward is not None:
                ep.tool_rewards.append(outcome.reward)
            text = truncate_text(
                outcome.text, self.config.max_tool_response_length, self.config.tool_response_truncate_side
            )
            message = {"role": "tool", "content": text}
            if call.name:
                message["name"] = call.name
            tool_messages.append(message)
        ids = self.chat.observation_ids(tool_messages)
        if len(ep.response_ids) + len(ids) >= self.response_length:
            return self._terminate(ep, "response_length", truncated=True)
        ep.add_observation(ids)
        ep.messages.extend(tool_messages)
        ep.user_turns += 1
        return AgentState.GENERATING

    @staticmethod
    def _terminate(ep: _Episode, reason: str, *, truncated: bool = False) -> AgentState:
        ep.termination = reason
        ep.truncated = truncated
        return AgentState.TERMINATED

    # --- tools --------------------------------------------------------------------------

    async def _create_instances(self, ep: _Episode, calls: list[ToolCall]) -> None:
        """Create each tool's per-episode instance before its first call (once per episode)."""
        for name in dict.fromkeys(c.name for c in calls if c.error is None and c.name in self.tools):
            if name in ep.instances or name in ep.unavailable:
                continue
            tool = self.tools[name]
            instance_id = f"{ep.episode_id}/{name}"
            try:
                await asyncio.wait_for(
                    tool.create(instance_id, **ep.tools_kwargs.get(name, {})), tool.timeout_s
                )
            except Exception as e:  # the model hears the tool is unavailable; the episode goes on
                logger.warning("creating tool %s instance %s failed", name, instance_id, exc_info=True)
                ep.unavailable[name] = f"{type(e).__name__}: {e}"
                continue
            ep.instances[name] = instance_id

    async def _call(self, ep: _Episode, call: ToolCall) -> ToolOutcome:
        if call.error is not None:
            return ToolOutcome(f"Error: {call.error}", "malformed")
        if call.name in ep.unavailable:
            return ToolOutcome(f"Error: {call.name} is unavailable: {ep.unavailable[call.name]}", "error")
        tool = self.tools.get(call.name)
        instance_id = ep.instances.get(call.name, "")
        return await call_tool(tool, call.name, call.arguments, instance_id, list(self.tools))

    async def _release_tools(self, ep: _Episode) -> None:
        for name, instance_id in ep.instances.items():
            try:
                await asyncio.wait_for(self.tools[name].release(instance_id), self.tools[name].timeout_s)
            except Exception:  # a leaky tool must not turn a finished episode into a failed one
                logger.warning("releasing tool %s instance %s failed", name, instance_id, exc_info=True)

    # --- output -------------------------------------------------------------------------

    def _output(self, ep: _Episode) -> AgentLoopOutput:
        metrics = {k: float(v) for k, v in ep.counts.items()}
        metrics.update(assistant_turns=float(ep.assistant_turns), user_turns=float(ep.user_turns))
        return AgentLoopOutput(
            prompt_ids=ep.prompt_ids,
            response_ids=ep.response_ids,
            response_mask=ep.response_mask,
            response_logprobs=ep.response_logprobs,
            response_versions=ep.response_versions,
            num_turns=ep.assistant_turns + ep.user_turns,
            truncated=ep.truncated,
            metrics=metrics,
            episode_id=ep.episode_id,
            final_text=ep.final_text,
            messages=ep.messages,
            stop_reason=ep.stop_reason,
            stop_token_id=None if ep.truncated else ep.stop_token_id,
            termination=ep.termination,
            extra={
                "tool_rewards": ep.tool_rewards,
            },
        )


def _assistant_message(content: str, calls: list[ToolCall]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    valid = [c for c in calls if c.error is None]
    if valid:
        message["tool_calls"] = [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in valid
        ]
    return message
