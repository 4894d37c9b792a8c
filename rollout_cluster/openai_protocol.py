"""OpenAI's request and response shapes, translated to and from our types (sans-IO).

Pure functions, no sockets, no aiohttp (`rollout_cluster.http_api` serves them): sampling
params from a body, text content parts, tool calls as OpenAI `tool_calls`, completion and
chat replies, `logprobs` / `top_logprobs`, SSE chunks, and OpenAI's error shape.

Every choice also carries the RL extras the trainer needs, which plain OpenAI responses
lack: `token_ids`, `token_logprobs` (behaviour logprobs), `versions` and `stop_token_id` (the
id that ended the answer, null when the length cut it); the response carries
`prompt_token_ids`. They are additive fields; SDKs ignore them.

The same replies as server-sent-event chunks are in `rollout_cluster.openai_stream`.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from areal_like.core.types import GenerateResult, SamplingParams
from rollout_cluster.engine.base import InvalidSamplingParamsError, coerce_sampling_params
from rollout_cluster.tool_parser import ToolParser

MAX_TOP_LOGPROBS = 20
"""OpenAI's limit for chat `top_logprobs` (we allow the same for completions' `logprobs`)."""

_LOGPROB_FLOOR = -9999.0
"""JSON has no -inf: a logprob that underflowed is sent as this (as vLLM does)."""

# OpenAI fields we accept and ignore (they do not change what the engine does), or that
# the handlers read themselves (messages, tools, logprobs, stream, ...).
_IGNORED = {
    "model",
    "user",
    "logprobs",
    "top_logprobs",
    "echo",
    "tool_choice",
    "parallel_tool_calls",
    "frequency_penalty",
    "presence_penalty",
    "session_id",
    "messages",
    "prompt",
    "tools",
    "stream",
    "stream_options",
    "logit_bias",
    "response_format",
    "suffix",
    "best_of",
    "metadata",
    "store",
}
_MAPPED = {
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "max_completion_tokens",
    "seed",
    "n",
    "stop_token_ids",
    "stop",
}


class ApiError(Exception):
    """A request refused with an OpenAI-shaped error (`status`, `type`, `param`, `code`)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _error_type(status)


def _error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(
    message: str,
    *,
    status: int = 400,
    param: str | None = None,
    code: str | None = None,
    type: str | None = None,
) -> dict[str, Any]:
    """OpenAI's error shape: what the SDKs read into `APIError.message` / `.code` / `.param`."""
    return {"error": {"message": message, "type": type or _error_type(status), "param": param, "code": code}}


def sampling_from_openai(body: dict[str, Any]) -> SamplingParams:
    """OpenAI request fields -> `SamplingParams` (vLLM's `top_k` / `stop_token_ids` too).

    Refuses what we cannot honour instead of silently ignoring it: stop strings
    (decode-time string matching would break token continuity; use
    `stop_token_ids`), `echo`, and unknown fields.
    """
    unknown = sorted(set(body) - _IGNORED - _MAPPED)
    if unknown:
        raise InvalidSamplingParamsError(f"unsupported request fields: {unknown}")
    if body.get("stop"):
        raise InvalidSamplingParamsError("stop strings are not supported; use stop_token_ids")
    if body.get("echo"):
        raise InvalidSamplingParamsError("echo=true is not supported; prompt_token_ids carries the prompt")
    params: dict[str, Any] = {}
    for key in ("temperature", "top_p", "top_k", "seed", "n", "stop_token_ids"):
        if body.get(key) is not None:
            params[key] = body[key]
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    return coerce_sampling_params(params)


@dataclass(frozen=True)
class OutputOptions:
    """How to shape the reply (not what to generate): streaming and logprobs."""

    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0


def _bool(body: dict[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{key} must be true or false, got {value!r}", param=key)
    return value


def _top_k(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ApiError(
            400, f"{key} must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {value!r}", param=key
        )
    return value


def output_options(body: dict[str, Any], *, chat: bool) -> OutputOptions:
    """`stream`, `stream_options`, `logprobs`, `top_logprobs`, checked as OpenAI checks them.

    Chat: `logprobs: true` and `top_logprobs: k` (k needs `logprobs`). Completions:
    `logprobs: k` (an integer; null means none).
    """
    stream = _bool(body, "stream")
    include_usage = False
    opts = body.get("stream_options")
    if opts is not None:
        if not stream:
            raise ApiError(400, "stream_options is only allowed with stream=true", param="stream_options")
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
            raise ApiError(
                400, f"stream_options must be {{'include_usage': bool}}, got {opts!r}", param="stream_options"
            )
        include_usage = _bool(opts, "include_usage")
    if chat:
        logprobs = _bool(body, "logprobs")
        top = body.get("top_logprobs")
        k = 0 if top is None else _top_k(top, "top_logprobs")
        if top is not None and not logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        return OutputOptions(stream, include_usage, logprobs, k)
    value = body.get("logprobs")
    if value is None:
        return OutputOptions(stream, include_usage)
    return OutputOptions(stream, include_usage, True, _top_k(value, "logprobs"))


# ---- messages ------------------------------------------------------------------------


def _message_text(content: Any, where: str) -> str:
    """A message's content as text: a string, null, or a list of text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of content parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            what = f"type {kind!r}" if kind is not None else repr(part)[:80]
            raise ApiError(
                400,
                f"{where}[{j}]: content parts of {what} are not supported; this server takes text only "
                "(parts like {'type': 'text', 'text': '...'})",
                param=where,
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ApiError(400, f"{where}[{j}].text must be a string", param=where)
        texts.append(text)
    return "".join(texts)


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Check `messages` and turn content-part lists into plain text (what templates expect).

    Only text parts are accepted; an image or audio part is refused with a 400 that names
    it, rather than rendered as a Python repr into the prompt.
    """
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a 'role' string", param="messages")
        msg = dict(m)
        msg["content"] = _message_text(m.get("content"), f"messages[{i}].content")
        calls = m.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
            raise ApiError(400, f"messages[{i}].tool_calls must be a list of objects", param="messages")
        out.append(msg)
    return out


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates render them: tool-call `arguments` as objects, not JSON text.

    OpenAI sends `arguments` as a JSON string; HF templates (`arguments | tojson`) expect a
    dict, as the in-process `ChatClient` passes them.
    """
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if not calls:
            out.append(m)
            continue
        fixed = []
        for c in calls:
            fn = dict(c.get("function") or {})
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    fn["arguments"] = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError:
                    pass  # the template renders it as given
            fixed.append({**c, "function": fn})
        out.append({**m, "tool_calls": fixed})
    return out


def chat_tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, bool]:
    """(tools for the template, whether to parse tool calls out of the reply)."""
    tools = body.get("tools")
    if tools is None or tools == []:
        tools = None
    elif not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ApiError(
            400, "tools must be a list of objects like {'type': 'function', 'function': {...}}", param="tools"
        )
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise ApiError(
            400,
            f"tool_choice={choice!r} is not supported: the model decides (use 'auto' or 'none'); "
            "forcing a call needs guided decoding, which this server does not do",
            param="tool_choice",
        )
    return tools, tools is not None and choice != "none"


# ---- replies -------------------------------------------------------------------------


@dataclass(frozen=True)
class AssistantTurn:
    """An assistant message as OpenAI returns it: content, tool calls, finish reason."""

    content: str | None
    tool_calls: list[dict[str, Any]] | None
    finish_reason: str

    def message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


def assistant_turn(text: str, stop_reason: str, parser: ToolParser | None, call_id: str) -> AssistantTurn:
    """The generated text as an OpenAI assistant message.

    With a parser (the request offered tools) and at least one well-formed call: the
    calls become `tool_calls` (`arguments` as JSON text, ids `{call_id}_{i}`), the
    content is the text without the call markup, and `finish_reason` is `tool_calls`
    (unless the turn was cut by `length`). A malformed call stays in the content as the
    model wrote it, as in the in-process `ChatClient` and vLLM: the agent sees it.
    Without well-formed calls the text is returned untouched.
    """
    if parser is None:
        return AssistantTurn(text, None, stop_reason)
    parsed = parser.parse(text)
    good = [c for c in parsed.calls if c.error is None]
    if not good:
        return AssistantTurn(text, None, stop_reason)
    calls = [
        {
            "id": f"{call_id}_{i}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
        }
        for i, c in enumerate(good)
    ]
    broken = "".join(f"<tool_call>{c.raw}</tool_call>" for c in parsed.calls if c.error is not None)
    content = (parsed.content + broken) or None
    return AssistantTurn(content, calls, "length" if stop_reason == "length" else "tool_calls")


def _lp(value: float) -> float:
    return value if math.isfinite(value) else _LOGPROB_FLOOR


TopLogprobs = list[list[tuple[int, float]]]
"""Per generated token, the k most likely (token id, logprob) pairs."""


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": _lp(logprob), "bytes": list(token.encode("utf-8"))}


def chat_logprobs(
    token_ids: list[int],
    logprobs: list[float],
    top: TopLogprobs | None,
    decode_token: Callable[[int], str],
) -> dict[str, Any]:
    """`choices[].logprobs` of a chat reply: `{content: [{token, logprob, bytes, top_logprobs}]}`.

    `logprob` is the behaviour logprob the engine sampled with (the request's
    temperature), the same number RL trains against.
    """
    content = []
    for i, (t, lp) in enumerate(zip(token_ids, logprobs, strict=True)):
        entry = _entry(decode_token(t), lp)
        entry["top_logprobs"] = [_entry(decode_token(a), b) for a, b in top[i]] if top is not None else []
        content.append(entry)
    return {"content": content}


def completion_logprobs(
    token_ids: list[int],
    logprobs: list[float],
    top: TopLogprobs | None,
    decode_token: Callable[[int], str],
    offset: int = 0,
) -> dict[str, Any]:
    """`choices[].logprobs` of a completion: `tokens`, `token_logprobs`, `top_logprobs`, `text_offset`."""
    tokens = [decode_token(t) for t in token_ids]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": [_lp(x) for x in logprobs],
        "top_logprobs": [{decode_token(a): _lp(b) for a, b in row} for row in top]
        if top is not None
        else None,
        "text_offset": offsets,
    }


def usage_block(prompt_len: int, results: list[GenerateResult]) -> dict[str, int]:
    gen = sum(len(r.token_ids) for r in results)
    return {"prompt_tokens": prompt_len, "completion_tokens": gen, "total_tokens": prompt_len + gen}


def rl_extras(result: GenerateResult) -> dict[str, Any]:
    return {
        "token_ids": result.token_ids,
        "token_logprobs": result.logprobs,
        "versions": result.versions,
        "num_interrupts": result.num_interrupts,
        "stop_token_id": result.stop_token_id,
    }


def completion_response(
    request_id: str,
    model: str,
    prompt_ids: list[int],
    results: list[GenerateResult],
    texts: list[str],
    logprobs: list[dict[str, Any] | None],
) -> dict[str, Any]:
    """The `/v1/completions` reply (OpenAI `text_completion` shape plus RL extras)."""
    choices = [
        {"index": i, "text": text, "finish_reason": r.stop_reason, "logprobs": lp, **rl_extras(r)}
        for i, (r, text, lp) in enumerate(zip(results, texts, logprobs, strict=True))
    ]
    return {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage_block(len(prompt_ids), results),
        "prompt_token_ids": prompt_ids,
    }


def content_ids(result: GenerateResult, stop_ids: set[int]) -> list[int]:
    """The ids of the answer's text: the stop token that ended it (one of `stop_ids`, or the one
    the engine names, e.g. an end-of-turn id among the generation config's eos ids) left out."""
    ids = result.token_ids
    if ids and result.stop_reason == "stop" and (ids[-1] in stop_ids or ids[-1] == result.stop_token_id):
        ids = ids[:-1]
    return ids


def chat_response(
    request_id: str,
    model: str,
    prompt_ids: list[int],
    results: list[GenerateResult],
    turns: list[AssistantTurn],
    logprobs: list[dict[str, Any] | None],
) -> dict[str, Any]:
    """The `/v1/chat/completions` reply (OpenAI `chat.completion` shape plus RL extras)."""
    choices = [
        {
            "index": i,
            "message": turn.message(),
            "finish_reason": turn.finish_reason,
            "logprobs": lp,
            **rl_extras(r),
        }
        for i, (r, turn, lp) in enumerate(zip(results, turns, logprobs, strict=True))
    ]
    return {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage_block(len(prompt_ids), results),
        "prompt_token_ids": prompt_ids,
    }


def model_card(model: str, created: int) -> dict[str, Any]:
    """One entry of `GET /v1/models` (also the body of `GET /v1/models/{id}`)."""
    return {"id": model, "object": "model", "created": created, "owned_by": "areal_like"}

