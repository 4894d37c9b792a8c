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

Streaming is live on the embedded engine: the role chunk goes out at once and text as
the engine generates it (`RolloutServer.generate(on_tokens=...)`, `LiveReply`), for one
choice without logprobs; a chat reply that may hold tool calls (the request offers
`tools`) is streamed once whole, since a call is only known at the end, and so are
`n > 1`, logprobs, and engines that cannot hand out tokens early (vLLM here): there the
finished response is cut into one chunk per token.

Token continuity (`SessionTokens`, in `rollout_cluster.sessions`): an OpenAI-shaped agent
sends the whole conversation back every turn; per session the server reuses the exact
ids it produced.

This module is the I/O: the aiohttp app, routes, auth, streaming writes. The
request/response translation (and the RL extras every choice carries: `token_ids`,
`token_logprobs`, `versions`) is pure functions in `rollout_cluster.openai_protocol`,
tested without a socket; its public names are re-exported here.

The API binds loopback by default; any other address needs an `api_key`, then
required as `Authorization: Bearer <key>` on every path except `/health`.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from areal_like.core.types import GenerateResult, SamplingParams
from rollout_cluster.engine.base import PromptTooLongError
from rollout_cluster.openai_protocol import (
    ApiError,
    AssistantTurn,
    OutputOptions,
    TopLogprobs,
    assistant_turn,
    chat_logprobs,
    chat_response,
    chat_tools,
    completion_logprobs,
    completion_response,
    content_ids,
    error_body,
    model_card,
    normalize_messages,
    output_options,
    sampling_from_openai,
    template_messages,
)
from rollout_cluster.openai_stream import (
    LiveReply,
    chat_stream_chunks,
    completion_stream_chunks,
    sse_event,
    text_pieces,
)
from rollout_cluster.tool_parser import HermesToolParser, ToolParser

if TYPE_CHECKING:
    from aiohttp import web

    from rollout_cluster.sessions import SessionTokens

__all__ = ["MAX_BODY_BYTES", "HttpServer", "ServedModel", "is_loopback_host", "prometheus_text"]

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024
"""Larger request bodies get a 413."""


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

    `top_logprobs(prompt_ids, token_ids, k, temperature)` refuses with a `RequestError`
    where the engine cannot score (vLLM): requests for `top_logprobs` > 0 then get a 400.
    `can_stream` says whether a reply can be streamed while it is generated.
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

    @property
    def can_stream(self) -> bool: ...

    async def top_logprobs(
        self, prompt_ids: list[int], token_ids: list[int], k: int, temperature: float
    ) -> list[list[tuple[int, float]]]: ...

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
    `tools` (default: hermes, the `agent.tool_parser` default). Every request stops where a
    rollout's answer stops: the engine's eos ids, the tokenizer's eos and `stop_token_ids`
    (a config's `rollout.stop_token_ids`), plus the request's own `stop_token_ids`.
    """

    def __init__(
        self, server: ServedModel, api_key: str | None = None, tool_parser: ToolParser | None = None,
        stop_token_ids: Iterable[int] = (),
    ) -> None:
        self.server = server
        self.api_key = api_key
        self.tool_parser = tool_parser or HermesToolParser()
        self.stop_token_ids = tuple(int(t) for t in stop_token_ids)
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
        except RecursionError:
            raise ApiError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        if _depth(body) > MAX_JSON_DEPTH:  # later steps (templates, hashing) recurse over it
            raise ApiError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels")
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

    def _sampling(self, body: dict[str, Any], chat: bool = False) -> SamplingParams:
        """The request's sampling with the server's stop ids added (the class docstring); a
        chat turn also ends at the token with which the chat template ends a turn."""
        from areal_like.models.fetch import end_of_turn_ids

        params = sampling_from_openai(body)
        tok = self.server.tokenizer
        eos = () if params.ignore_eos or tok is None else (tok.eos_token_id, *(end_of_turn_ids(tok) if chat else ()))
        stop = list(params.stop_token_ids)
        stop += [t for t in dict.fromkeys((*self.stop_token_ids, *eos)) if t is not None and t not in stop]
        return params.model_copy(update={"stop_token_ids": stop}) if stop != params.stop_token_ids else params

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

    async def _run(self, rid: str, ids: list[int], params: SamplingParams,
                   live: LiveReply | None = None) -> list[GenerateResult]:
        if live is not None:
            return [await live.run(self.server, rid, ids, params)]
        if params.n == 1:
            return [await self.server.generate(request_id=rid, prompt_ids=ids, sampling_params=params)]
        return await self.server.generate_n(request_id=rid, prompt_ids=ids, sampling_params=params)

    def _live(self, request: web.Request, opts: OutputOptions, params: SamplingParams, rid: str,
              *, chat: bool, parse_calls: bool = False) -> LiveReply | None:
        """A reply streamed while it is generated, where the engine can (the embedded
        engine), for one choice without logprobs and, in chat, without tool parsing (a
        tool call is only known once the reply is whole): else None, and the stream
        starts when generation ends."""
        if not (opts.stream and params.n == 1 and not opts.logprobs and not opts.top_logprobs
                and not parse_calls and self.server.can_stream):
            return None
        decode, _ = self._decoders()
        return LiveReply(request, decode, chat, rid, self.server.model_name, opts.include_usage)

    async def _top(
        self, ids: list[int], results: list[GenerateResult], k: int, params: SamplingParams
    ) -> list[TopLogprobs | None]:
        """The k most likely tokens at each generated position (None per choice when k=0)."""
        if k == 0:
            return [None] * len(results)
        # An engine that cannot score refuses with a RequestError: a 400, like any refusal.
        return [await self.server.top_logprobs(ids, r.token_ids, k, params.temperature) for r in results]

    async def _stream(self, request: web.Request, chunks: list[dict[str, Any]],
                      live: LiveReply | None = None) -> web.StreamResponse:
        from aiohttp import web

        if live is not None and live.resp is not None:  # the start went out already
            resp = live.resp
        else:
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
        params = self._sampling(body)
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
        live = self._live(request, opts, params, rid, chat=False)
        results = await self._run(rid, ids, params, live)
        decode, decode_token = self._decoders()
        texts = [decode(r.token_ids) for r in results]
        tops = await self._top(ids, results, opts.top_logprobs, params)
        lps = [
            completion_logprobs(r.token_ids, r.logprobs, top, decode_token) if opts.logprobs else None
            for r, top in zip(results, tops, strict=True)
        ]
        model = self.server.model_name
        if opts.stream:
            if live is not None:  # the rest of the text, then the finish chunk
                rest = live.rest(texts[0])
                pieces = [[rest] + [""] * (len(results[0].token_ids) - 1)]
            else:
                pieces = [text_pieces(r.token_ids, decode) for r in results]
            chunks = completion_stream_chunks(
                rid, model, ids, results, pieces, lps, include_usage=opts.include_usage, created=live and live.created
            )
            if live is not None:
                chunks = [c for c in chunks if not c["choices"] or c["choices"][0]["text"]
                          or c["choices"][0]["finish_reason"] is not None]
            return await self._stream(request, chunks, live)
        return web.json_response(completion_response(rid, model, ids, results, texts, lps))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        from aiohttp import web

        body = await self._json(request)
        self._check_model(body)
        params = self._sampling(body, chat=True)
        opts = output_options(body, chat=True)
        messages = normalize_messages(body.get("messages"))
        tools, parse_calls = chat_tools(body)
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
        live = self._live(request, opts, params, rid, chat=True, parse_calls=parse_calls)
        results = await self._run(rid, ids, params, live)
        stop_ids = set(params.stop_token_ids)
        if tok.eos_token_id is not None:
            stop_ids.add(tok.eos_token_id)
        decode, decode_token = self._decoders()
        contents = [decode(content_ids(r, stop_ids)) for r in results]
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
                kept = content_ids(r, stop_ids)
                if live is not None:  # the rest of the content, then the finish chunk
                    pieces.append([live.rest(contents[0])] + [""] * (len(r.token_ids) - 1))
                else:
                    pieces.append(text_pieces(kept, decode) + [""] * (len(r.token_ids) - len(kept)))
            chunks = chat_stream_chunks(
                rid, model, ids, results, turns, pieces, lps, include_usage=opts.include_usage,
                created=live and live.created,
            )
            if live is not None:
                chunks = chunks[1:]  # the role chunk went out first
            return await self._stream(request, chunks, live)
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


MAX_JSON_DEPTH = 64
"""No OpenAI request nests deeper; a deeper body is refused with a 400, never a crash."""


def _depth(value: Any) -> int:
    """Nesting depth of parsed JSON, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if d > MAX_JSON_DEPTH:
            return d
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v)
    return deepest
