"""An OpenAI-SDK-shaped chat client that records exact tokens, and an agent-loop adapter.

Most agent code is written against `client.chat.completions.create(messages=...,
tools=...)` and keeps its history as messages. Re-rendering those messages with the
chat template on every call would re-tokenize what the model generated, which is
not what it generated (parsers drop text, decode/encode is not an identity), and
RL on such trajectories trains on tokens the policy never sampled (verl's agent
loop docs; docs/design.md §9.17, invariant 4).

`ChatClient` is therefore stateful, one per episode. It keeps the token sequence
the conversation has produced so far and the messages it stands for. When a call
comes back with those messages plus new non-assistant ones (tool results, user
turns), only the new ones are tokenized (template of those messages minus the
template's prefix, as in the tool agent loop) and appended; the assistant turns
keep the engine's ids, logprobs and versions. Any other history (edited, reordered
or dropped messages, changed tools) falls back to rendering the whole conversation:
the longest common token prefix with what was recorded is kept, the rest is added
as observation (mask 0) tokens, and the fallback is counted and logged.

`make_openai_agent_loop(agent_fn)` turns `async def agent_fn(client, sample)` into an
`AgentLoopBase` subclass; the episode's trajectory is what the client recorded.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from areal_like.core.types import AgentLoopOutput, SamplingParams
from rollout_cluster.agent_loop.base import AgentLoopBase
from rollout_cluster.agent_loop.chat import ChatTemplate
from rollout_cluster.tool_parser import HermesToolParser, ToolParser

logger = logging.getLogger(__name__)

__all__ = [
    "ChatClient",
    "ChatCompletion",
    "ChatCompletionMessage",
    "GenerationAborted",
    "OpenAIAgentLoop",
    "RejectEpisode",
    "ResponseBudgetExceeded",
    "make_openai_agent_loop",
]


class ResponseBudgetExceeded(Exception):
    """The episode's `response_length` is spent; the agent must stop (the adapter ends the episode)."""


class GenerationAborted(Exception):
    """The engine aborted the request; the episode is cancelled."""


class RejectEpisode(Exception):
    """Raised by an agent function to reject its episode (the loop returns None)."""


# --- OpenAI response shapes (attribute access like the SDK's objects) ----------------------


@dataclass
class Function:
    name: str
    arguments: str
    """JSON text, as in the OpenAI API."""


@dataclass
class ChatCompletionMessageToolCall:
    id: str
    function: Function
    type: str = "function"


@dataclass
class ChatCompletionMessage:
    content: str | None
    tool_calls: list[ChatCompletionMessageToolCall] | None = None
    role: str = "assistant"

    def model_dump(self, exclude_none: bool = False) -> dict[str, Any]:
        d = asdict(self)
        return {k: v for k, v in d.items() if v is not None} if exclude_none else d


@dataclass
class Choice:
    index: int
    message: ChatCompletionMessage
    finish_reason: str


@dataclass
class CompletionUsage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass
class ChatCompletion:
    id: str
    choices: list[Choice]
    usage: CompletionUsage
    model: str = "areal_like"
    object: str = "chat.completion"


# --- message normalisation ---------------------------------------------------------------


def _get(obj: Any, key: str, default: Any = None) -> Any:
    return obj.get(key, default) if isinstance(obj, dict) else getattr(obj, key, default)


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def _as_template_message(message: Any) -> dict[str, Any]:
    """A message (dict or SDK-like object) as a plain dict the chat template renders."""
    out: dict[str, Any] = {"role": _get(message, "role"), "content": _get(message, "content") or ""}
    for key in ("name", "tool_call_id"):
        if _get(message, key) is not None:
            out[key] = _get(message, key)
    calls = _get(message, "tool_calls") or []
    if calls:
        out["tool_calls"] = [
            {
                "type": "function",
                "function": {
                    "name": _get(_get(c, "function"), "name"),
                    "arguments": _arguments(_get(_get(c, "function"), "arguments")),
                },
            }
            for c in calls
        ]
    return out


def _key(message: dict[str, Any]) -> tuple[Any, ...]:
    """What must match for a message to count as "the same message came back"."""
    calls = tuple(
        (c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
        for c in message.get("tool_calls", [])
    )
    return (message["role"], message["content"], calls)


# --- the client --------------------------------------------------------------------------


@dataclass
class _Record:
    """The episode's token sequence and what it means."""

    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def add(
        self,
        ids: list[int],
        mask: int,
        logprobs: list[float] | None = None,
        versions: list[int] | None = None,
    ) -> None:
        self.ids += ids
        self.mask += [mask] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.versions += versions if versions is not None else [-1] * len(ids)

    def cut(self, n: int) -> None:
        del self.ids[n:], self.mask[n:], self.logprobs[n:], self.versions[n:]


class _Completions:
    def __init__(self, client: ChatClient) -> None:
        self._client = client

    async def create(self, *, messages: list[Any], **kwargs: Any) -> ChatCompletion:
        return await self._client.create(messages=messages, **kwargs)


class _Chat:
    def __init__(self, client: ChatClient) -> None:
        self.completions = _Completions(client)


class ChatClient:
    """`client.chat.completions.create(...)` over a `ServerManager`, for ONE episode.

    Calls are serialised (one conversation, one token sequence). `response_length`
    bounds the whole response as in the agent loops; when it is spent, `create`
    raises `ResponseBudgetExceeded` without appending anything, so the trajectory
    never ends on observation tokens.
    """

    def __init__(
        self,
        server_manager: Any,
        tokenizer: Any,
        *,
        episode_id: str,
        response_length: int,
        sampling_params: SamplingParams | None = None,
        tool_parser: ToolParser | None = None,
    ) -> None:
        self.server_manager = server_manager
        self.tokenizer = tokenizer
        self.episode_id = episode_id
        self.response_length = response_length
        self.sampling_params = sampling_params or SamplingParams()
        self.tool_parser = tool_parser or HermesToolParser()
        self.chat = _Chat(self)
        self.record = _Record()
        self.messages: list[dict[str, Any]] = []
        """The conversation the recorded tokens stand for (ends with the last assistant turn)."""
        self.final_text = ""
        self.stop_reason = ""
        self.stop_token_id: int | None = None
        self.num_calls = 0
        self.num_observations = 0
        self.num_fallbacks = 0
        self.num_interrupts = 0
        self._tools: list[dict[str, Any]] | None = None
        self._template = ChatTemplate(tokenizer)
        self._lock = asyncio.Lock()

    async def create(
        self,
        *,
        messages: list[Any],
        tools: list[dict[str, Any]] | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        max_tokens: int | None = None,
        max_completion_tokens: int | None = None,
        seed: int | None = None,
        n: int = 1,
        **ignored: Any,
    ) -> ChatCompletion:
        """OpenAI `chat.completions.create`. Other keyword arguments are accepted and ignored."""
        if n != 1:
            raise ValueError("ChatClient records one trajectory per episode: n must be 1")
        if ignored:
            logger.debug("ChatClient ignores %s", sorted(ignored))
        async with self._lock:
            rendered = [_as_template_message(m) for m in messages]
            self._extend_context(rendered, tools or None)
            remaining = self.response_length - len(self.record.ids)
            limit = max_completion_tokens or max_tokens or self.sampling_params.max_tokens
            stop = list(self.sampling_params.stop_token_ids)
            if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in stop:
                stop.append(self.tokenizer.eos_token_id)
            update: dict[str, Any] = {"max_tokens": min(limit, remaining), "stop_token_ids": stop}
            if temperature is not None:
                update["temperature"] = temperature
            if top_p is not None:
                update["top_p"] = top_p
            if seed is not None:
                update["seed"] = seed
            result = await self.server_manager.generate(
                request_id=f"{self.episode_id}/{self.num_calls}",
                session_id=self.episode_id,
                prompt_ids=self.record.prompt_ids + self.record.ids,
                sampling_params=self.sampling_params.model_copy(update=update),
            )
            self.num_calls += 1
            self.num_interrupts += result.num_interrupts
            self.stop_reason, self.stop_token_id = result.stop_reason, result.stop_token_id
            self.record.add(result.token_ids, 1, result.logprobs, result.versions)
            if result.stop_reason == "abort":
                raise GenerationAborted(f"episode {self.episode_id}: the engine aborted the request")
            message = self._message(result.token_ids)
            self.final_text = message.content or ""
            self.messages = [*rendered, _as_template_message(message)]
            finish = (
                "length" if result.stop_reason == "length" else "tool_calls" if message.tool_calls else "stop"
            )
            n_prompt = len(self.record.prompt_ids) + len(self.record.ids) - len(result.token_ids)
            return ChatCompletion(
                id=f"chatcmpl-{self.episode_id}-{self.num_calls}",
                choices=[Choice(index=0, message=message, finish_reason=finish)],
                usage=CompletionUsage(n_prompt, len(result.token_ids), n_prompt + len(result.token_ids)),
            )

    def _extend_context(self, rendered: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> None:
        """Make the recorded sequence stand for `rendered` (+ the generation header)."""
        if not self.record.prompt_ids:
            self.record.prompt_ids = self._template.prompt_ids(rendered, tools=tools)
            self._tools = tools
        else:
            known = len(self.messages)
            new = rendered[known:]
            same_history = tools == self._tools and [_key(m) for m in rendered[:known]] == [
                _key(m) for m in self.messages
            ]
            if same_history and new and all(m["role"] != "assistant" for m in new):
                self._append_observation(self._template.observation_ids(new))
                self.num_observations += 1
            else:
                self._fallback(rendered, tools)
        if len(self.record.ids) >= self.response_length:
            raise ResponseBudgetExceeded(f"episode {self.episode_id}: response budget spent")

    def _append_observation(self, ids: list[int]) -> None:
        if len(self.record.ids) + len(ids) >= self.response_length:
            raise ResponseBudgetExceeded(f"episode {self.episode_id}: no room left after the new messages")
        self.record.add(ids, 0)

    def _fallback(self, rendered: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> None:
        """History changed: re-render it all, keep what still matches token for token."""
        self.num_fallbacks += 1
        logger.warning(
            "episode %s: chat history does not extend the recorded conversation; re-tokenizing (fallback %d)",
            self.episode_id,
            self.num_fallbacks,
        )
        full = self._template.prompt_ids(rendered, tools=tools)
        current = self.record.prompt_ids + self.record.ids
        common = 0
        for a, b in zip(full, current, strict=False):
            if a != b:
                break
            common += 1
        prompt_len = len(self.record.prompt_ids)
        if common < prompt_len:  # the prompt itself changed: the episode starts over
            self.record = _Record(prompt_ids=full)
        else:
            self.record.cut(common - prompt_len)
            self._append_observation(full[common:])
        self._tools = tools

    def _message(self, token_ids: list[int]) -> ChatCompletionMessage:
        parsed = self.tool_parser.parse(self.tokenizer.decode(token_ids, skip_special_tokens=True))
        calls = [
            ChatCompletionMessageToolCall(
                id=f"call_{self.num_calls}_{i}", function=Function(c.name, json.dumps(c.arguments))
            )
            for i, c in enumerate(parsed.calls)
            if c.error is None
        ]
        # Like vLLM: a call that cannot be parsed stays in the text for the agent to see.
        broken = "".join(f"<tool_call>{c.raw}</tool_call>" for c in parsed.calls if c.error is not None)
        content = (parsed.content + broken) or None
        return ChatCompletionMessage(content=content, tool_calls=calls or None)

    def output(self, termination: str) -> AgentLoopOutput:
        """The recorded episode as an agent-loop output."""
        r = self.record
        truncated = termination == "response_length" or self.stop_reason == "length"
        return AgentLoopOutput(
            prompt_ids=r.prompt_ids,
            response_ids=r.ids,
            response_mask=r.mask,
            response_logprobs=r.logprobs,
            response_versions=r.versions,
            num_turns=self.num_calls + self.num_observations,
            truncated=truncated,
            metrics={
                "assistant_turns": float(self.num_calls),
                "fallback_retokenizations": float(self.num_fallbacks),
                "num_interrupts": float(self.num_interrupts),
            },
            episode_id=self.episode_id,
            final_text=self.final_text,
            messages=self.messages,
            stop_reason=self.stop_reason,
            stop_token_id=None if truncated else self.stop_token_id,
            termination=termination,
        )


# --- the adapter -------------------------------------------------------------------------

AgentFn = Callable[[ChatClient, dict[str, Any]], Awaitable[Any]]


class OpenAIAgentLoop(AgentLoopBase):
    """Runs `agent_fn(client, sample)`; the trajectory is what its `ChatClient` recorded.

    The episode ends when the agent function returns, or when the client raises
    `ResponseBudgetExceeded` (truncated) or `GenerationAborted`. An agent that raises
    `RejectEpisode`, or never calls the model, yields no sample (None).
    """

    agent_fn: AgentFn

    async def run(self, sampling_params: SamplingParams, **sample: Any) -> AgentLoopOutput | None:
        episode_id = self.episode_id(sample)
        client = ChatClient(
            self.server_manager,
            self.tokenizer,
            episode_id=episode_id,
            response_length=self.response_length,
            sampling_params=sampling_params,
            tool_parser=self.tool_parser,
        )
        termination = "agent_returned"
        try:
            await type(self).agent_fn(client, sample)
        except ResponseBudgetExceeded:
            termination = "response_length"
        except GenerationAborted:
            termination = "abort"
        except RejectEpisode:
            return None
        finally:
            self.server_manager.release_session(episode_id)
        if client.num_calls == 0:
            return None
        return client.output(termination)


def make_openai_agent_loop(agent_fn: AgentFn, name: str | None = None) -> type[OpenAIAgentLoop]:
    """An agent-loop class around `async def agent_fn(client, sample)`."""
    if not inspect.iscoroutinefunction(agent_fn):
        raise TypeError(f"agent function {agent_fn!r} must be `async def agent(client, sample)`")
    cls_name = name or f"OpenAIAgentLoop_{getattr(agent_fn, '__name__', 'agent')}"
    return type(cls_name, (OpenAIAgentLoop,), {"agent_fn": staticmethod(agent_fn)})
