"""OpenAI's streamed replies (server-sent events): the chunks of a chat or completion
reply, for one generated while it streams (`live_chunk`) or a finished one cut into a
chunk per token (`chat_stream_chunks`, `completion_stream_chunks`), the text piece of
each token and the SSE framing, all sans-IO; and `LiveReply`, which writes one reply to
an aiohttp response while the engine generates it. `rollout_cluster.http_api` serves
them; the whole (non-streamed) replies are in `rollout_cluster.openai_protocol`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from areal_like.core.types import GenerateResult, SamplingParams
from rollout_cluster.openai_protocol import AssistantTurn, rl_extras, usage_block

if TYPE_CHECKING:
    from aiohttp import web

__all__ = ["LiveReply", "chat_stream_chunks", "completion_stream_chunks", "live_chunk", "sse_event", "text_pieces"]

logger = logging.getLogger(__name__)


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


def live_chunk(chat: bool, request_id: str, model: str, created: int, include_usage: bool,
               piece: str | None) -> dict[str, Any]:
    """One chunk of a reply streamed while it is generated: the assistant role (`piece`
    None, chat only) or a piece of text, in the shape `chat_stream_chunks` /
    `completion_stream_chunks` use for the same position."""
    if chat:
        base = _chunk_base("chat.completion.chunk", f"chatcmpl-{request_id}", model, created, include_usage)
        delta = {"role": "assistant", "content": ""} if piece is None else {"content": piece}
        return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}
    base = _chunk_base("text_completion", f"cmpl-{request_id}", model, created, include_usage)
    return {**base, "choices": [{"index": 0, "text": piece or "", "logprobs": None, "finish_reason": None}]}


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
        out.append(chunk(i, {}, None, turn.finish_reason, **rl_extras(r)))
    if include_usage:
        out.append({**base, "choices": [], "usage": usage_block(len(prompt_ids), results)})
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
        final = {"index": i, "text": "", "logprobs": None, "finish_reason": r.stop_reason, **rl_extras(r)}
        out.append({**base, "choices": [final]})
    if include_usage:
        out.append({**base, "choices": [], "usage": usage_block(len(prompt_ids), results)})
    return out


def sse_event(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>\\n\\n` (or the literal `[DONE]`)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, allow_nan=False)
    return f"data: {text}\n\n".encode()


class LiveReply:
    """One reply streamed while it is generated: the role chunk at once, then each new
    piece of text as the engine hands out tokens (`on_tokens`). The newest token is held
    back until the next one comes (it may be the stop token, which is not content) and a
    piece that ends inside a multi-byte character waits for the rest of it; `rest()`
    gives what is left once the reply is whole."""

    def __init__(self, request: web.Request, decode: Callable[[list[int]], str], chat: bool, rid: str,
                 model: str, include_usage: bool) -> None:
        self.request, self.decode, self.chat = request, decode, chat
        self.rid, self.model, self.include_usage = rid, model, include_usage
        self.created = int(time.time())
        self.resp: Any = None
        self.tokens: list[int] = []
        self.emitted = ""

    def _chunk(self, piece: str | None) -> bytes:
        return sse_event(live_chunk(self.chat, self.rid, self.model, self.created, self.include_usage, piece))

    async def run(self, server: Any, rid: str, ids: list[int], params: SamplingParams) -> GenerateResult:
        from aiohttp import web

        queue: asyncio.Queue[list[int]] = asyncio.Queue()
        task = asyncio.ensure_future(server.generate(request_id=rid, prompt_ids=ids, sampling_params=params,
                                                     on_tokens=queue.put_nowait))
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(self.request)
            self.resp = resp
            if self.chat:
                await resp.write(self._chunk(None))
            while not (task.done() and queue.empty()):
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    continue
                self.tokens += getter.result()
                text = self.decode(self.tokens[:-1])
                if len(text) > len(self.emitted) and text.startswith(self.emitted) and not text.endswith("\ufffd"):
                    await resp.write(self._chunk(text[len(self.emitted):]))
                    self.emitted = text
            return task.result()
        except BaseException:
            task.cancel()  # the client went away: stop generating for it
            raise

    def rest(self, full: str) -> str:
        if full.startswith(self.emitted):
            return full[len(self.emitted):]
        logger.warning("streamed text is not a prefix of the final text (decoding is not prefix-stable here)")
        return ""
