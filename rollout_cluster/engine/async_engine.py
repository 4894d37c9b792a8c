"""`AsyncEngine`: one background thread drives a step-based `Engine`; asyncio callers await.

Why a thread and not an asyncio task: a step is a few milliseconds of torch work that
releases the GIL, so the event loop (HTTP server, agent loops, Ray actor methods)
stays responsive while decoding runs; and the engine is only ever touched from one
thread, so it needs no locking of its own. Works the same in-process (tests,
one-machine runs) and inside a Ray async actor (construct it in the actor).

Callers talk to the thread through a command queue of `EngineCommand`s. Commands
are handled between steps, in arrival order, which is what makes the weight update
protocol hold:

- `update_weights` runs `engine.update_weights` between two steps; generate calls
  that arrive meanwhile sit in the queue and are admitted after it (none is lost);
- a request interrupted by the update keeps its future: `generate` returns once,
  with tokens of both versions;
- a cancelled `generate` (task cancelled, client gone) aborts its request.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from areal_like.core.types import GenerateResult, SamplingParams
from rollout_cluster.engine.base import (
    AsyncGenerateEngine,
    DuplicateRequestError,
    Engine,
    EngineClosedError,
    EngineRequest,
    NamedTensors,
    RequestError,
    RequestOutput,
    validate_request,
)

__all__ = ["AsyncEngine", "EngineCommand"]

logger = logging.getLogger(__name__)

_Future = tuple[asyncio.AbstractEventLoop, asyncio.Future]


class EngineCommand(enum.Enum):
    """What a caller asks of the engine thread; the payload each one carries."""

    ADD = enum.auto()
    """`EngineRequest`: queue it (its future is the caller's waiter, not the reply)."""
    UPDATE_WEIGHTS = enum.auto()
    """`(NamedTensors, version)`: run the engine's interrupt protocol."""
    ABORT = enum.auto()
    """`list[str]` of request ids; replies with their partial results."""
    PAUSE = enum.auto()
    """No payload: stop stepping (state kept)."""
    RESUME = enum.auto()
    """No payload: undo `PAUSE`."""
    CALL = enum.auto()
    """`Callable[[Engine], Any]`, run on the engine thread; replies with its value."""
    STOP = enum.auto()
    """No payload: fail every waiter and end the thread (`close`)."""


class _Command(NamedTuple):
    kind: EngineCommand
    payload: Any
    reply: _Future | None


def _resolve(fut: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


class AsyncEngine(AsyncGenerateEngine):
    """Asyncio face of a step-based engine (implements `AsyncGenerateEngine`)."""

    streams_tokens = True
    lends_threads = True
    loads_in_place = True

    def __init__(self, engine: Engine, *, name: str = "rollout-engine") -> None:
        self.engine = engine
        self.max_seq_len = engine.max_seq_len
        self.vocab_size = engine.vocab_size
        self._cond = threading.Condition()
        self._commands: deque[_Command] = deque()
        self._waiters: dict[str, _Future] = {}
        self._watchers: dict[str, list[Any]] = {}
        """request id -> [caller's loop, on_tokens, tokens handed so far] (streaming)."""
        self._snapshot: dict[str, float] = engine.metrics()
        self._updating = False
        self._paused = False
        self._closed = False
        self._step_s = 0.0
        self._idle_s = 0.0
        """Seconds in `engine.step()` and waiting with nothing to step (not paused): the
        server's part of the step's time budget (docs/design.md §10.19)."""
        self.lender: Any = None
        """A `core.cores.ThreadLender` (set by the server actor on a shared machine): the
        engine says when it has work, and picks its thread count before each step."""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- public API -------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def interrupt_mode(self) -> str:
        return self.engine.interrupt_mode

    async def submit(self, request: EngineRequest,
                     on_tokens: Callable[[list[int]], None] | None = None) -> GenerateResult:
        """Generate one response for a validated request; returns once, even across
        weight updates. Raises `DuplicateRequestError` if its id is in flight.

        `on_tokens(new_ids)` (optional) is called on the caller's loop after each engine
        step with the tokens generated since the last call (for streaming); the returned
        result is still the whole response."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        rid = request.request_id
        with self._cond:
            if self._closed:
                raise EngineClosedError("the engine is closed")
            if rid in self._waiters:
                raise DuplicateRequestError(f"request id {rid!r} is already in flight")
            self._waiters[rid] = (loop, fut)
            if on_tokens is not None:
                self._watchers[rid] = [loop, on_tokens, 0]
            self._commands.append(_Command(EngineCommand.ADD, request, None))
            self._cond.notify()
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            self._submit_nowait(EngineCommand.ABORT, [rid])
            raise
        finally:
            with self._cond:
                self._watchers.pop(rid, None)

    async def generate(
        self,
        *,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
    ) -> GenerateResult:
        """`submit` from raw arguments, validated here (callers without a server).

        Bad requests raise a `RequestError` (a `ValueError`) here, before queueing.
        """
        request = validate_request(
            request_id, prompt_ids, sampling_params, max_seq_len=self.max_seq_len, vocab_size=self.vocab_size
        )
        return await self.submit(request)

    async def generate_n(
        self,
        *,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
    ) -> list[GenerateResult]:
        """`n` samples of one prompt (ids `"{request_id}:{i}"`), sharing the prompt's prefill.

        Sample i uses seed `mix_seed(seed, i + 1)` when a seed is given, so the n
        samples differ but are reproducible (`EngineRequest.samples`).
        """
        request = validate_request(
            request_id,
            prompt_ids,
            sampling_params,
            max_seq_len=self.max_seq_len,
            vocab_size=self.vocab_size,
            allow_n=True,
        )
        return list(await asyncio.gather(*(self.submit(r) for r in request.samples())))

    async def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Run the engine's interrupt protocol between two steps; returns when loaded.

        Callable while generate calls are in flight; those return later with tokens
        of both versions (or, in `wait` mode, finish on the old version first).
        """
        await self._submit(EngineCommand.UPDATE_WEIGHTS, (named_tensors, version))

    async def abort(self, request_ids: Iterable[str]) -> list[GenerateResult]:
        """Abort requests; their `generate` calls return the partial response (`abort`)."""
        return await self._submit(EngineCommand.ABORT, list(request_ids))

    async def pause(self) -> None:
        """Stop stepping (state kept); new requests queue up until `resume`."""
        await self._submit(EngineCommand.PAUSE, None)

    async def resume(self) -> None:
        await self._submit(EngineCommand.RESUME, None)

    async def hold(self, on: bool) -> None:
        """`cluster.colocate`: stop stepping while the trainer trains (`True`), requests
        kept; run again (`False`). The engine thread then waits, so its threads are free."""
        await (self.pause() if on else self.resume())

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread between steps (tests, admin)."""
        return await self._submit(EngineCommand.CALL, fn)

    async def top_logprobs(
        self, prompt_ids: list[int], token_ids: list[int], k: int, temperature: float
    ) -> list[list[tuple[int, float]]]:
        """The `k` most likely tokens and their logprobs at each position of `token_ids`,
        scored once with the engine's own model (`Engine.model`) on the engine thread
        between steps (as costly as one prefill). Same distribution as the behaviour
        logprobs: `log_softmax(logits / T)`, T = 1 for greedy requests. An engine that
        exposes no model refuses with a `RequestError`."""
        if self.engine.model is None:
            raise RequestError(
                f"top_logprobs needs the embedded engine; {type(self.engine).__name__} returns sampled-token "
                "logprobs only (ask for logprobs without top_logprobs)"
            )
        if not token_ids or k <= 0:
            return [[] for _ in token_ids]
        temp = temperature if temperature > 0 else 1.0
        seq = list(prompt_ids) + list(token_ids[:-1])
        start = len(prompt_ids) - 1

        def score(engine: Engine) -> list[list[tuple[int, float]]]:
            import torch

            model = engine.model
            assert model is not None
            device = next(model.parameters()).device
            with torch.inference_mode():
                logits = model(torch.tensor([seq], device=device)).logits[0, start:].float()
                logp = torch.log_softmax(logits / temp, dim=-1)
                values, indices = logp.topk(min(k, logp.shape[-1]), dim=-1)
            return [
                list(zip(row_i, row_v, strict=True))
                for row_i, row_v in zip(indices.tolist(), values.tolist(), strict=True)
            ]

        return await self.call(score)

    async def export_weights(self) -> list[tuple[str, Any]]:
        """The served weights by HF name (CPU copies, taken between steps)."""
        if self.engine.model is None:
            raise RuntimeError(f"{type(self.engine).__name__} cannot export its weights")

        def grab(engine: Engine) -> list[tuple[str, Any]]:
            model = engine.model
            assert model is not None
            return [(n, t.detach().to("cpu", copy=True)) for n, t in model.state_dict().items()]

        return await self.call(grab)

    def metrics(self) -> dict[str, float]:
        """Engine counters and gauges as of the last step boundary.

        A snapshot the engine thread refreshes between steps, so reading it never
        blocks the caller's event loop, not even during a long `wait`-mode update.
        """
        m = dict(self._snapshot)
        m["inflight_calls"] = float(len(self._waiters))
        m["updating_weights"] = float(self._updating)
        m["engine_step_seconds_total"] = self._step_s
        m["engine_idle_seconds_total"] = self._idle_s
        return m

    async def close(self) -> None:
        """Stop the thread; calls still in flight fail with `EngineClosedError`."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._commands.append(_Command(EngineCommand.STOP, None, None))
            self._cond.notify()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    # ---- engine thread ----------------------------------------------------------------

    async def _submit(self, kind: EngineCommand, payload: Any) -> Any:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        with self._cond:
            if self._closed:
                raise EngineClosedError("the engine is closed")
            self._commands.append(_Command(kind, payload, (loop, fut)))
            self._cond.notify()
        return await fut

    def _submit_nowait(self, kind: EngineCommand, payload: Any) -> None:
        with self._cond:
            if not self._closed:
                self._commands.append(_Command(kind, payload, None))
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._commands and (self._paused or not self.engine.has_unfinished()):
                    if self.lender is not None:
                        self.lender.done()
                        self.lender.ledger.working(False)
                    idle, t = not self._paused, time.perf_counter()
                    self._cond.wait()
                    if idle:
                        self._idle_s += time.perf_counter() - t
                commands = list(self._commands)
                self._commands.clear()
            for command in commands:
                if command.kind is EngineCommand.STOP:
                    self._fail_all(EngineClosedError("the engine was closed"))
                    return
                self._handle(command)
            if self._paused or not self.engine.has_unfinished():
                continue
            if self.lender is not None:
                self.lender.ledger.working(True)
                self.lender.pick()
            t = time.perf_counter()
            try:
                outs = self.engine.step()
            except Exception as e:  # a broken step must not hang every caller
                logger.exception("engine step failed; failing all in-flight requests")
                self._fail_all(RuntimeError(f"engine step failed: {e!r}"))
                continue
            finally:
                self._step_s += time.perf_counter() - t
            self._snapshot = self.engine.metrics()
            if self._watchers:
                self._stream_tokens()
            self._deliver(outs)

    def _stream_tokens(self) -> None:
        """Hand each watched request the tokens it generated in this step (its sequence
        keeps every sampled token across interrupts, so the count only grows)."""
        running = {seq.request_id: seq for seq in getattr(getattr(self.engine, "scheduler", None), "running", ())}
        with self._cond:
            watched = list(self._watchers.items())
        for rid, w in watched:
            seq = running.get(rid)
            if seq is None:
                continue
            out = seq.out_ids
            if len(out) > w[2]:
                new, w[2] = list(out[w[2]:]), len(out)
                try:
                    w[0].call_soon_threadsafe(w[1], new)
                except RuntimeError:  # the caller's loop is gone
                    pass

    def _handle(self, command: _Command) -> None:
        """Run one command on the engine thread and answer its reply future, if any."""
        value: Any = None
        error: BaseException | None = None
        try:
            value = self._dispatch(command.kind, command.payload)
            self._snapshot = self.engine.metrics()
        except Exception as e:
            if command.kind is EngineCommand.ADD:
                self._finish(command.payload.request_id, None, e)
            elif command.reply is None:
                logger.exception("engine command %s failed", command.kind.name)
            error = e
        if command.reply is not None:
            loop, fut = command.reply
            loop.call_soon_threadsafe(_resolve, fut, value, error)

    def _dispatch(self, kind: EngineCommand, payload: Any) -> Any:
        """One handler per `EngineCommand`; returns the reply value."""
        match kind:
            case EngineCommand.ADD:
                self.engine.enqueue(payload)
            case EngineCommand.UPDATE_WEIGHTS:
                named_tensors, version = payload
                self._updating = True
                try:
                    self._deliver(self.engine.update_weights(named_tensors, version))
                finally:
                    self._updating = False
            case EngineCommand.ABORT:
                results = self.engine.abort(payload)
                for res in results:
                    self._finish(res.request_id, res, None)
                return results
            case EngineCommand.PAUSE:
                self._paused = True
                if self.lender is not None:  # free before the caller hears back (colocated trainers take them)
                    self.lender.done()
                    self.lender.ledger.working(False)
            case EngineCommand.RESUME:
                self._paused = False
            case EngineCommand.CALL:
                return payload(self.engine)
            case EngineCommand.STOP:  # `_run` ends the thread on it before dispatching
                raise AssertionError("STOP is handled by the engine loop")
        return None

    def _deliver(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            if out.result is not None:
                self._finish(out.request_id, out.result, None)

    def _finish(self, request_id: str, result: GenerateResult | None, error: BaseException | None) -> None:
        with self._cond:
            waiter = self._waiters.pop(request_id, None)
        if waiter is None:
            return
        loop, fut = waiter
        try:
            loop.call_soon_threadsafe(_resolve, fut, result, error)
        except RuntimeError:  # the caller's loop is gone
            logger.warning("request %s finished after its event loop closed", request_id)

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            ids = list(self._waiters)
        if ids and not isinstance(error, EngineClosedError):
            try:
                self.engine.abort(ids)
            except Exception:
                logger.exception("abort after a failed step also failed")
        for rid in ids:
            self._finish(rid, None, error)
