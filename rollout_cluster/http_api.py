"""OpenAI-compatible HTTP API of a `RolloutServer` (aiohttp, JSON only, no pickle).

Endpoints: `POST /v1/completions` (prompt as text or token ids), `POST
/v1/chat/completions` (messages + tools, the tokenizer's chat template applied),
`GET /health`, `GET /version`, `GET /metrics` (Prometheus text; JSON with
`?format=json`). Every choice carries the RL extras the trainer needs, which plain
OpenAI responses lack: `token_ids`, `token_logprobs` (behaviour logprobs) and
`versions`; the response carries `prompt_token_ids`.

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
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from areal_like.core.types import GenerateResult, SamplingParams
from rollout_cluster.engine.base import (
    InvalidSamplingParamsError,
    PromptTooLongError,
    RequestError,
    coerce_sampling_params,
)

if TYPE_CHECKING:
    from aiohttp import web

    from rollout_cluster.sessions import SessionTokens

__all__ = [
    "HttpServer",
    "sampling_from_openai",
    "completion_response",
    "chat_response",
    "prometheus_text",
]

logger = logging.getLogger(__name__)

# OpenAI fields we accept and ignore (they do not change what the engine does).
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
    "stream_options",
    "logit_bias",
    "response_format",
    "suffix",
    "best_of",
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
    "stream",
}


def sampling_from_openai(body: dict[str, Any]) -> SamplingParams:
    """OpenAI request fields -> `SamplingParams` (vLLM's `top_k` / `stop_token_ids` too).

    Refuses what we cannot honour instead of silently ignoring it: streaming, stop
    strings (decode-time string matching would break token continuity; use
    `stop_token_ids`), and unknown fields.
    """
    unknown = sorted(set(body) - _IGNORED - _MAPPED)
    if unknown:
        raise InvalidSamplingParamsError(f"unsupported request fields: {unknown}")
    if body.get("stream"):
        raise InvalidSamplingParamsError("stream=true is not supported; responses are returned whole")
    if body.get("stop"):
        raise InvalidSamplingParamsError("stop strings are not supported; use stop_token_ids")
    params: dict[str, Any] = {}
    for key in ("temperature", "top_p", "top_k", "seed", "n", "stop_token_ids"):
        if body.get(key) is not None:
            params[key] = body[key]
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    return coerce_sampling_params(params)


def _finish_reason(result: GenerateResult) -> str:
    return result.stop_reason


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
    decode: Callable[[list[int]], str] | None,
) -> dict[str, Any]:
    """The `/v1/completions` reply (OpenAI `text_completion` shape plus RL extras)."""
    choices = []
    for i, r in enumerate(results):
        tokens = [decode([t]) for t in r.token_ids] if decode else [str(t) for t in r.token_ids]
        choices.append(
            {
                "index": i,
                "text": decode(r.token_ids) if decode else "",
                "finish_reason": _finish_reason(r),
                "logprobs": {"tokens": tokens, "token_logprobs": r.logprobs},
                **_extras(r),
            }
        )
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
    ids = result.token_ids
    if ids and result.stop_reason == "stop" and ids[-1] in stop_ids:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=False)


def chat_response(
    request_id: str,
    model: str,
    prompt_ids: list[int],
    results: list[GenerateResult],
    contents: list[str],
    decode_token: Callable[[int], str],
) -> dict[str, Any]:
    """The `/v1/chat/completions` reply (OpenAI `chat.completion` shape plus RL extras)."""
    choices = []
    for i, (r, text) in enumerate(zip(results, contents, strict=True)):
        content = [
            {"token": decode_token(t), "logprob": lp, "top_logprobs": []}
            for t, lp in zip(r.token_ids, r.logprobs, strict=True)
        ]
        choices.append(
            {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "finish_reason": _finish_reason(r),
                "logprobs": {"content": content},
                **_extras(r),
            }
        )
    return {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage(len(prompt_ids), results),
        "prompt_token_ids": prompt_ids,
    }


def prometheus_text(metrics: dict[str, float], prefix: str = "areal_rollout_") -> str:
    """Metrics dict -> Prometheus exposition format (all gauges; names sanitised)."""
    lines = []
    for name, value in sorted(metrics.items()):
        clean = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
        lines.append(f"# TYPE {prefix}{clean} gauge")
        lines.append(f"{prefix}{clean} {float(value)!r}")
    return "\n".join(lines) + "\n"


class ServedModel(Protocol):
    """What the HTTP API needs of the server behind it (a `RolloutServer`)."""

    tokenizer: Any
    model_name: str
    sessions: SessionTokens
    counters: dict[str, float]

    @property
    def version(self) -> int: ...

    async def generate(self, *, request_id: str, prompt_ids: list[int],
                       sampling_params: SamplingParams) -> GenerateResult: ...

    async def generate_n(self, *, request_id: str, prompt_ids: list[int],
                         sampling_params: SamplingParams) -> list[GenerateResult]: ...

    def health(self) -> dict[str, Any]: ...

    def metrics(self) -> dict[str, float]: ...


def _is_loopback_host(host: str) -> bool:
    h = host.strip("[]")
    return h in ("localhost", "::1") or h.startswith("127.")


def _error(status: int, message: str, code: str | None = None) -> web.Response:
    from aiohttp import web

    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    return web.json_response(body, status=status)


class HttpServer:
    """The aiohttp application around one `RolloutServer`."""

    def __init__(self, server: ServedModel, api_key: str | None = None) -> None:
        self.server = server
        self.api_key = api_key
        self.url: str | None = None
        self._runner: Any = None

    def app(self) -> web.Application:
        from aiohttp import web

        app = web.Application(middlewares=[self._auth, self._errors], client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/health", self._health)
        app.router.add_get("/version", self._version)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        return app

    async def start(self, host: str, port: int) -> str:
        """Bind and serve. A host beyond loopback needs an `api_key` (docs/design.md §9.7)."""
        from aiohttp import web

        if not _is_loopback_host(host) and not self.api_key:
            raise PermissionError(
                f"refusing to serve the rollout HTTP API on {host!r} without an api_key "
                "(only 127.0.0.1 / localhost / ::1 may go without one)"
            )
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        sock = site._server.sockets[0]  # type: ignore[union-attr]
        bound_host, bound_port = sock.getsockname()[:2]
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
                return _error(401, "missing or wrong bearer token", "unauthorized")
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
            except web.HTTPException:
                raise
            except PromptTooLongError as e:
                counters["http_errors"] += 1
                return _error(400, str(e), "context_length_exceeded")
            except ValueError as e:  # RequestError and JSON problems
                counters["http_errors"] += 1
                return _error(400, str(e))

        return errors

    # ---- handlers ---------------------------------------------------------------------

    @staticmethod
    async def _json(request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            raise RequestError(f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        return body

    def _tokenizer(self) -> Any:
        tok = self.server.tokenizer
        if tok is None:
            raise RequestError("this server has no tokenizer: send prompts as token ids")
        return tok

    async def _run(self, rid: str, ids: list[int], params: SamplingParams) -> list[GenerateResult]:
        if params.n == 1:
            return [await self.server.generate(request_id=rid, prompt_ids=ids, sampling_params=params)]
        return await self.server.generate_n(request_id=rid, prompt_ids=ids, sampling_params=params)

    async def _completions(self, request: web.Request) -> web.Response:
        from aiohttp import web

        body = await self._json(request)
        params = sampling_from_openai(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # OpenAI allows a batch of one
        if isinstance(prompt, str):
            ids = self._tokenizer().encode(prompt, add_special_tokens=False)
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            raise RequestError("prompt must be a string or a list of token ids")
        rid = uuid.uuid4().hex
        results = await self._run(rid, ids, params)
        decode = self.server.tokenizer.decode if self.server.tokenizer is not None else None
        return web.json_response(completion_response(rid, self.server.model_name, ids, results, decode))

    async def _chat(self, request: web.Request) -> web.Response:
        from aiohttp import web

        body = await self._json(request)
        params = sampling_from_openai(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list")
        tools = body.get("tools") or None
        tok = self._tokenizer()
        session_id = body.get("session_id") or request.headers.get("X-Session-Id")

        def render(msgs: list[dict[str, Any]], add_generation_prompt: bool) -> str:
            try:
                return tok.apply_chat_template(
                    msgs, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
                )
            except Exception as e:  # template errors are the client's message shape
                raise RequestError(f"chat template failed on these messages: {e}") from None

        def encode(text: str) -> list[int]:
            return tok.encode(text, add_special_tokens=False)

        ids = self.server.sessions.prompt_ids(session_id, messages, render, encode)
        rid = uuid.uuid4().hex
        results = await self._run(rid, ids, params)
        stop_ids = set(params.stop_token_ids)
        if tok.eos_token_id is not None:
            stop_ids.add(tok.eos_token_id)
        contents = [assistant_content(r, tok, stop_ids) for r in results]
        if session_id and len(results) == 1:
            self._remember(session_id, messages, ids, results[0], contents[0], render, encode)
        reply = chat_response(rid, self.server.model_name, ids, results, contents, lambda t: tok.decode([t]))
        return web.json_response(reply)

    def _remember(
        self,
        session_id: str,
        messages: list[dict[str, Any]],
        prompt_ids: list[int],
        result: GenerateResult,
        content: str,
        render: Callable[[list[dict[str, Any]], bool], str],
        encode: Callable[[str], list[int]],
    ) -> None:
        """Remember this turn's exact ids, closed the way the template closes a turn."""
        convo = [*messages, {"role": "assistant", "content": content}]
        ids = prompt_ids + result.token_ids
        if result.stop_reason != "stop":
            # Not closed by a generated stop token: append what the template renders
            # after the content (e.g. `<|im_end|>`), if the template places it plainly.
            before = render(messages, True) + content
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
            {
                "object": "list",
                "data": [{"id": self.server.model_name, "object": "model", "owned_by": "areal_like"}],
            }
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        from aiohttp import web

        metrics = self.server.metrics()
        if request.query.get("format") == "json":
            return web.json_response(metrics)
        return web.Response(text=prometheus_text(metrics), content_type="text/plain")
