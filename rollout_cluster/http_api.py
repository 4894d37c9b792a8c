"""OpenAI-compatible HTTP API of a `RolloutServer` (aiohttp, JSON only, no pickle).

Endpoints: `POST /v1/completions` (prompt as text or token ids), `POST
/v1/chat/completions` (messages + tools, the tokenizer's chat template applied),
`GET /v1/models`, `GET /v1/models/{id}`, `GET /health`, `GET /version`, `GET /metrics`
(Prometheus text; JSON with `?format=json`).

What a client written against OpenAI's API gets (docs/design.md §10.14): `tool_calls`
parsed with the run's tool parser when the request offers `tools` (the same parser the
in-process `ChatClient` uses, so HTTP and in-process agents see the same calls);
content given as a list of text parts; `logprobs` / `top_logprobs`; streaming (SSE,
`stream: true`, OpenAI's chunk format, `stream_options.include_usage`); errors in
OpenAI's error shape (`{"error": {"message", "type", "param", "code"}}`) with the
status codes the SDKs map to exceptions (400, 401, 404, 413; 500 only for our bugs).

Every choice also carries the RL extras the trainer needs, which plain OpenAI
responses lack: `token_ids`, `token_logprobs` (behaviour logprobs) and `versions`;
the response carries `prompt_token_ids`. They are additive fields; SDKs ignore them.

Streaming sends the finished response cut into one chunk per token: the engine API
returns whole responses (`generate`), so the stream starts when generation ends.
Clients that need the format (agent SDKs, eval harnesses) work; time-to-first-token
is the whole generation.

Token continuity (`SessionTokens`, in `rollout_cluster.sessions`): an OpenAI-shaped agent
sends the whole conversation back every turn; per session the server reuses the exact
ids it produced.

The request/response translation is pure functions, tested without a socket.
The API binds loopback by default; any other address needs an `api_key`, then
required as `Authorization: Bearer <key>` on every path except `/health`.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from areal_like.core.types import GenerateResult, SamplingParams
from rollout_cluster.engine.base import (
    InvalidSamplingParamsError,
    PromptTooLongError,
    coerce_sampling_params,
)
from rollout_cluster.tool_parser import HermesToolParser, ToolParser

if TYPE_CHECKING:
    from aiohttp import web

    from rollout_cluster.sessions import SessionTokens

__all__ = [
    "ApiError",
    "AssistantTurn",
    "HttpServer",
    "OutputOptions",
    "assistant_turn",
    "chat_logprobs",
    "chat_response",
    "chat_stream_chunks",
    "completion_logprobs",
    "completion_response",
    "completion_stream_chunks",
    "error_body",
    "is_loopback_host",
    "model_card",
    "normalize_messages",
    "output_options",
    "prometheus_text",
    "sampling_from_openai",
    "sse_event",
    "template_messages",
    "text_pieces",
]

logger = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20
"""OpenAI's limit for chat `top_logprobs` (we allow the same for completions' `logprobs`)."""

MAX_BODY_BYTES = 64 * 1024 * 1024
"""Larger request bodies get a 413."""

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


def _check_tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, bool]:
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


def _usage(prompt_len: int, results: list[GenerateResult]) -> dict[str, int]:
    gen = sum(len(r.token_ids) for r in results)
    return {"prompt_tokens": prompt_len, "completion_tokens": gen, "total_tokens": prompt_len + gen}


def _extras(result: GenerateResult) -> dict[str, Any]:
    return {
        "token_ids": result.token_ids,
        "token_logprobs": result.logprobs,
        "versions": result.versions,
        "num_interrupts": result.num_interrupts,
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
        {"index": i, "text": text, "finish_reason": r.stop_reason, "logprobs": lp, **_extras(r)}
        for i, (r, text, lp) in enumerate(zip(results, texts, logprobs, strict=True))
    ]
    return {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage(len(prompt_ids), results),
        "prompt_token_ids": prompt_ids,
    }


def assistant_content(result: GenerateResult, tokenizer: Any, stop_ids: set[int]) -> str:
    """The text of an assistant turn: generated ids decoded, the final stop token left out."""
    return tokenizer.decode(_content_ids(result, stop_ids), skip_special_tokens=False)


def _content_ids(result: GenerateResult, stop_ids: set[int]) -> list[int]:
    ids = result.token_ids
    if ids and result.stop_reason == "stop" and ids[-1] in stop_ids:
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
            **_extras(r),
        }
        for i, (r, turn, lp) in enumerate(zip(results, turns, logprobs, strict=True))
    ]
    return {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage(len(prompt_ids), results),
        "prompt_token_ids": prompt_ids,
    }


# ---- streaming -----------------------------------------------------------------------


def text_pieces(token_ids: list[int], decode: Callable[[list[int]], str]) -> list[str]:
    """One text piece per token whose concatenation is exactly `decode(token_ids)`.

    A token that ends inside a multi-byte character decodes to U+FFFD; its piece stays
    empty until the character is complete, so no chunk ever carries a broken character.
    """
    pieces: list[str] = []
    emitted = ""
    for i in range(len(token_ids)):
        text = decode(token_ids[: i + 1])
        if text.startswith(emitted) and not text.endswith("\ufffd"):
            pieces.append(text[len(emitted) :])
            emitted = text
        else:
            pieces.append("")
    full = decode(token_ids)
    if not full.startswith(emitted):  # decoding is not prefix-stable here: send it whole
        return [full] + [""] * (len(token_ids) - 1) if token_ids else []
    if pieces:
        pieces[-1] += full[len(emitted) :]
    return pieces


def _chunk_base(kind: str, request_id: str, model: str, created: int, include_usage: bool) -> dict[str, Any]:
    base: dict[str, Any] = {"id": request_id, "object": kind, "created": created, "model": model}
    if include_usage:
        base["usage"] = None
    return base


def chat_stream_chunks(
    request_id: str,
    model: str,
    prompt_ids: list[int],
    results: list[GenerateResult],
    turns: list[AssistantTurn],
    pieces: list[list[str]],
    logprobs: list[dict[str, Any] | None],
    *,
    include_usage: bool = False,
    created: int | None = None,
) -> list[dict[str, Any]]:
    """`chat.completion.chunk` objects for a finished reply, in order (without `[DONE]`).

    Per choice: a role chunk; then one content chunk per token (`pieces[i]`, the
    token's piece of the content) with that token's logprobs, or, when the turn has
    tool calls, one content chunk (the text around the calls) and one `tool_calls`
    chunk; then a chunk with `finish_reason` and the RL extras. With
    `include_usage`, every chunk has `usage: null` and a last chunk with no choices
    carries the usage, as OpenAI does.
    """
    created = int(time.time()) if created is None else created
    base = _chunk_base("chat.completion.chunk", f"chatcmpl-{request_id}", model, created, include_usage)

    def chunk(
        index: int,
        delta: dict[str, Any],
        lp: dict[str, Any] | None = None,
        finish: str | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish, **extra}
        return {**base, "choices": [choice]}

    out: list[dict[str, Any]] = []
    for i, (r, turn, texts, lp) in enumerate(zip(results, turns, pieces, logprobs, strict=True)):
        out.append(chunk(i, {"role": "assistant", "content": ""}))
        entries = lp["content"] if lp is not None else None
        if turn.tool_calls:
            if turn.content or entries:
                out.append(chunk(i, {"content": turn.content or ""}, lp))
            calls = [{"index": j, **call} for j, call in enumerate(turn.tool_calls)]
            out.append(chunk(i, {"tool_calls": calls}))
        else:
            for j, text in enumerate(texts):
                if text or entries is not None:
                    out.append(
                        chunk(i, {"content": text}, {"content": entries[j : j + 1]} if entries else None)
                    )
        out.append(chunk(i, {}, None, turn.finish_reason, **_extras(r)))
    if include_usage:
        out.append({**base, "choices": [], "usage": _usage(len(prompt_ids), results)})
    return out


def completion_stream_chunks(
    request_id: str,
    model: str,
    prompt_ids: list[int],
    results: list[GenerateResult],
    pieces: list[list[str]],
    logprobs: list[dict[str, Any] | None],
    *,
    include_usage: bool = False,
    created: int | None = None,
) -> list[dict[str, Any]]:
    """`text_completion` chunks for a finished reply: one per token, then the finish chunk."""
    created = int(time.time()) if created is None else created
    base = _chunk_base("text_completion", f"cmpl-{request_id}", model, created, include_usage)
    out: list[dict[str, Any]] = []
    for i, (r, texts, lp) in enumerate(zip(results, pieces, logprobs, strict=True)):
        for j, text in enumerate(texts):
            piece_lp = None
            if lp is not None:
                piece_lp = {
                    "tokens": lp["tokens"][j : j + 1],
                    "token_logprobs": lp["token_logprobs"][j : j + 1],
                    "top_logprobs": lp["top_logprobs"][j : j + 1] if lp["top_logprobs"] is not None else None,
                    "text_offset": lp["text_offset"][j : j + 1],
                }
            choice = {"index": i, "text": text, "logprobs": piece_lp, "finish_reason": None}
            out.append({**base, "choices": [choice]})
        final = {"index": i, "text": "", "logprobs": None, "finish_reason": r.stop_reason, **_extras(r)}
        out.append({**base, "choices": [final]})
    if include_usage:
        out.append({**base, "choices": [], "usage": _usage(len(prompt_ids), results)})
    return out


def sse_event(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>\\n\\n` (or the literal `[DONE]`)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, allow_nan=False)
    return f"data: {text}\n\n".encode()


def model_card(model: str, created: int) -> dict[str, Any]:
    """One entry of `GET /v1/models` (also the body of `GET /v1/models/{id}`)."""
    return {"id": model, "object": "model", "created": created, "owned_by": "areal_like"}


def prometheus_text(metrics: dict[str, float], prefix: str = "areal_rollout_") -> str:
    """Metrics dict -> Prometheus exposition format (all gauges; names sanitised)."""
    lines = []
    for name, value in sorted(metrics.items()):
        clean = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
        lines.append(f"# TYPE {prefix}{clean} gauge")
        lines.append(f"{prefix}{clean} {float(value)!r}")
    return "\n".join(lines) + "\n"


class ServedModel(Protocol):
    """What the HTTP API needs of the server behind it (a `RolloutServer`).

    `top_logprobs(prompt_ids, token_ids, k, temperature)` is optional: without it,
    requests for `top_logprobs` > 0 are refused with a 400.
    """

    tokenizer: Any
    model_name: str
    sessions: SessionTokens
    counters: dict[str, float]

    @property
    def version(self) -> int: ...

    async def generate(
        self, *, request_id: str, prompt_ids: list[int], sampling_params: SamplingParams
    ) -> GenerateResult: ...

    async def generate_n(
        self, *, request_id: str, prompt_ids: list[int], sampling_params: SamplingParams
    ) -> list[GenerateResult]: ...

    def health(self) -> dict[str, Any]: ...

    def metrics(self) -> dict[str, float]: ...


def is_loopback_host(host: str) -> bool:
    """True for addresses only this machine can reach (no api_key needed there)."""
    h = host.strip("[]")
    return h in ("localhost", "::1") or h.startswith("127.")


def _error(status: int, message: str, code: str | None = None, param: str | None = None) -> web.Response:
    from aiohttp import web

    return web.json_response(error_body(message, status=status, param=param, code=code), status=status)


_HTTP_MESSAGES = {
    404: "no such path: {method} {path} (see /v1/models, /v1/completions, /v1/chat/completions)",
    405: "method {method} is not allowed on {path}",
    413: "request body too large: the limit is {limit}",
}


def _size(n: int) -> str:
    return f"{n / 2**20:g} MiB" if n >= 2**20 else f"{n} bytes"


class HttpServer:
    """The aiohttp application around one `RolloutServer`.

    `tool_parser` reads tool calls out of chat replies when the request offers
    `tools` (default: hermes, the `agent.tool_parser` default).
    """

    def __init__(
        self, server: ServedModel, api_key: str | None = None, tool_parser: ToolParser | None = None
    ) -> None:
        self.server = server
        self.api_key = api_key
        self.tool_parser = tool_parser or HermesToolParser()
        self.url: str | None = None
        self._runner: Any = None
        self._created = int(time.time())

    def app(self) -> web.Application:
        from aiohttp import web

        app = web.Application(middlewares=[self._auth, self._errors], client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/health", self._health)
        app.router.add_get("/version", self._version)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model_id:.+}", self._model)
        return app

    async def start(self, host: str, port: int) -> str:
        """Bind and serve. A host beyond loopback needs an `api_key` (docs/design.md §9.7)."""
        from aiohttp import web

        if not is_loopback_host(host) and not self.api_key:
            raise PermissionError(
                f"refusing to serve the rollout HTTP API on {host!r} without an api_key "
                "(only 127.0.0.1 / localhost / ::1 may go without one)"
            )
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        try:
            await site.start()
        except BaseException:
            await self._runner.cleanup()
            self._runner = None
            raise
        sock = site._server.sockets[0]  # type: ignore[union-attr]
        bound_host, bound_port = sock.getsockname()[:2]
        if ":" in bound_host:
            bound_host = f"[{bound_host}]"
        self.url = f"http://{bound_host}:{bound_port}"
        logger.info("rollout HTTP API at %s", self.url)
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- middleware -------------------------------------------------------------------

    def _authorized(self, request: web.Request) -> bool:
        if self.api_key is None or request.path == "/health":
            return True
        got = request.headers.get("Authorization", "")
        return hmac.compare_digest(got.encode(), f"Bearer {self.api_key}".encode())

    @property
    def _auth(self) -> Any:
        from aiohttp import web

        @web.middleware
        async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
            if not self._authorized(request):
                return _error(
                    401, "missing or wrong bearer token (Authorization: Bearer <api key>)", "invalid_api_key"
                )
            return await handler(request)

        return auth

    @property
    def _errors(self) -> Any:
        from aiohttp import web

        @web.middleware
        async def errors(request: web.Request, handler: Any) -> web.StreamResponse:
            counters = self.server.counters
            counters["http_requests"] += 1
            try:
                return await handler(request)
            except web.HTTPException as e:
                if e.status < 400:
                    raise
                counters["http_errors"] += 1
                template = _HTTP_MESSAGES.get(e.status, "{reason}")
                message = template.format(
                    method=request.method, path=request.path, reason=e.reason, limit=_size(MAX_BODY_BYTES)
                )
                return _error(e.status, message)
            except ApiError as e:
                counters["http_errors"] += 1
                return web.json_response(
                    error_body(e.message, status=e.status, param=e.param, code=e.code, type=e.type),
                    status=e.status,
                )
            except PromptTooLongError as e:
                counters["http_errors"] += 1
                return _error(400, str(e), "context_length_exceeded")
            except ValueError as e:  # RequestError, bad sampling parameters, JSON problems
                counters["http_errors"] += 1
                return _error(400, str(e))
            except Exception:
                counters["http_errors"] += 1
                logger.exception("%s %s failed", request.method, request.path)
                return _error(500, "internal server error (logged on the server)")

        return errors

    # ---- handlers ---------------------------------------------------------------------

    @staticmethod
    async def _json(request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            raise ApiError(400, f"request body is not valid JSON: {e}") from None
        except UnicodeDecodeError:
            raise ApiError(400, "request body is not UTF-8 text") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        return body

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != self.server.model_name:
            raise ApiError(
                404,
                f"the model {model!r} does not exist; this server serves {self.server.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def _tokenizer(self) -> Any:
        tok = self.server.tokenizer
        if tok is None:
            raise ApiError(400, "this server has no tokenizer: send prompts as token ids")
        return tok

    def _decoders(self) -> tuple[Callable[[list[int]], str], Callable[[int], str]]:
        tok = self.server.tokenizer
        if tok is None:
            return (lambda ids: ""), str
        return (lambda ids: tok.decode(ids, skip_special_tokens=False)), (lambda t: tok.decode([t]))

    async def _run(self, rid: str, ids: list[int], params: SamplingParams) -> list[GenerateResult]:
        if params.n == 1:
            return [await self.server.generate(request_id=rid, prompt_ids=ids, sampling_params=params)]
        return await self.server.generate_n(request_id=rid, prompt_ids=ids, sampling_params=params)

    async def _top(
        self, ids: list[int], results: list[GenerateResult], k: int, params: SamplingParams
    ) -> list[TopLogprobs | None]:
        """The k most likely tokens at each generated position (None per choice when k=0)."""
        if k == 0:
            return [None] * len(results)
        score = getattr(self.server, "top_logprobs", None)
        if score is None:
            raise ApiError(
                400,
                "top_logprobs is not available from this server's engine; ask for logprobs only",
                param="top_logprobs",
            )
        return [await score(ids, r.token_ids, k, params.temperature) for r in results]

    async def _stream(self, request: web.Request, chunks: list[dict[str, Any]]) -> web.StreamResponse:
        from aiohttp import web

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for c in chunks:
            await resp.write(sse_event(c))
        await resp.write(sse_event("[DONE]"))
        await resp.write_eof()
        return resp

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        from aiohttp import web

        body = await self._json(request)
        self._check_model(body)
        params = sampling_from_openai(body)
        opts = output_options(body, chat=False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # OpenAI allows a batch of one
        if isinstance(prompt, str):
            ids = self._tokenizer().encode(prompt, add_special_tokens=False)
        elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            ids = list(prompt)
        else:
            raise ApiError(
                400,
                "prompt must be a string or a non-empty list of token ids (one prompt per request)",
                param="prompt",
            )
        rid = uuid.uuid4().hex
        results = await self._run(rid, ids, params)
        decode, decode_token = self._decoders()
        texts = [decode(r.token_ids) for r in results]
        tops = await self._top(ids, results, opts.top_logprobs, params)
        lps = [
            completion_logprobs(r.token_ids, r.logprobs, top, decode_token) if opts.logprobs else None
            for r, top in zip(results, tops, strict=True)
        ]
        model = self.server.model_name
        if opts.stream:
            pieces = [text_pieces(r.token_ids, decode) for r in results]
            chunks = completion_stream_chunks(
                rid, model, ids, results, pieces, lps, include_usage=opts.include_usage
            )
            return await self._stream(request, chunks)
        return web.json_response(completion_response(rid, model, ids, results, texts, lps))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        from aiohttp import web

        body = await self._json(request)
        self._check_model(body)
        params = sampling_from_openai(body)
        opts = output_options(body, chat=True)
        messages = normalize_messages(body.get("messages"))
        tools, parse_calls = _check_tools(body)
        tok = self._tokenizer()
        session_id = body.get("session_id") or request.headers.get("X-Session-Id")
        if session_id is not None and not isinstance(session_id, str):
            raise ApiError(400, "session_id must be a string", param="session_id")

        def render(msgs: list[dict[str, Any]], add_generation_prompt: bool) -> str:
            try:
                return tok.apply_chat_template(
                    template_messages(msgs),
                    tools=tools,
                    add_generation_prompt=add_generation_prompt,
                    tokenize=False,
                )
            except Exception as e:  # template errors are the client's message shape
                raise ApiError(
                    400, f"chat template failed on these messages: {e}", param="messages"
                ) from None

        def encode(text: str) -> list[int]:
            return tok.encode(text, add_special_tokens=False)

        ids = self.server.sessions.prompt_ids(session_id, messages, render, encode)
        rid = uuid.uuid4().hex
        results = await self._run(rid, ids, params)
        stop_ids = set(params.stop_token_ids)
        if tok.eos_token_id is not None:
            stop_ids.add(tok.eos_token_id)
        decode, decode_token = self._decoders()
        contents = [decode(_content_ids(r, stop_ids)) for r in results]
        parser = self.tool_parser if parse_calls else None
        turns = [
            assistant_turn(text, r.stop_reason, parser, f"call_{rid[:16]}_{i}")
            for i, (r, text) in enumerate(zip(results, contents, strict=True))
        ]
        if session_id and len(results) == 1:
            self._remember(session_id, messages, ids, results[0], contents[0], turns[0], render, encode)
        tops = await self._top(ids, results, opts.top_logprobs, params)
        lps = [
            chat_logprobs(r.token_ids, r.logprobs, top, decode_token) if opts.logprobs else None
            for r, top in zip(results, tops, strict=True)
        ]
        model = self.server.model_name
        if opts.stream:
            pieces = []
            for r in results:
                content_ids = _content_ids(r, stop_ids)
                pieces.append(text_pieces(content_ids, decode) + [""] * (len(r.token_ids) - len(content_ids)))
            chunks = chat_stream_chunks(
                rid, model, ids, results, turns, pieces, lps, include_usage=opts.include_usage
            )
            return await self._stream(request, chunks)
        return web.json_response(chat_response(rid, model, ids, results, turns, lps))

    def _remember(
        self,
        session_id: str,
        messages: list[dict[str, Any]],
        prompt_ids: list[int],
        result: GenerateResult,
        text: str,
        turn: AssistantTurn,
        render: Callable[[list[dict[str, Any]], bool], str],
        encode: Callable[[str], list[int]],
    ) -> None:
        """Remember this turn's exact ids next to the message we returned (tool calls
        included, so the client echoing it back matches), closed the way the template
        closes a turn."""
        convo = [*messages, turn.message()]
        ids = prompt_ids + result.token_ids
        if result.stop_reason != "stop":
            # Not closed by a generated stop token: append what the template renders
            # after the text (e.g. `<|im_end|>`), if the template places it plainly.
            before = render(messages, True) + text
            after = render(convo, False)
            if not after.startswith(before):
                return
            ids = ids + encode(after[len(before) :])
        self.server.sessions.remember(session_id, convo, ids)

    async def _health(self, request: web.Request) -> web.Response:
        from aiohttp import web

        return web.json_response(self.server.health())

    async def _version(self, request: web.Request) -> web.Response:
        from aiohttp import web

        return web.json_response({"version": self.server.version})

    async def _models(self, request: web.Request) -> web.Response:
        from aiohttp import web

        return web.json_response(
            {"object": "list", "data": [model_card(self.server.model_name, self._created)]}
        )

    async def _model(self, request: web.Request) -> web.Response:
        from aiohttp import web

        model_id = request.match_info["model_id"]
        if model_id != self.server.model_name:
            raise ApiError(
                404,
                f"the model {model_id!r} does not exist; this server serves {self.server.model_name!r}",
                param="model",
                code="model_not_found",
            )
        return web.json_response(model_card(model_id, self._created))

    async def _metrics(self, request: web.Request) -> web.Response:
        from aiohttp import web

        metrics = self.server.metrics()
        if request.query.get("format") == "json":
            return web.json_response(metrics)
        return web.Response(text=prometheus_text(metrics), content_type="text/plain")
