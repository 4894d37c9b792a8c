"""`AsyncEngine`: one background thread drives a step-based `Engine`; asyncio callers await.

Why a thread and not an asyncio task: a step is a few milliseconds of torch work that
releases the GIL, so the event loop (HTTP server, agent loops, Ray actor methods)
stays responsive while decoding runs; and the engine is only ever touched from one
thread, so it needs no locking of its own. Works the same in-process (tests,
one-machine runs) and inside a Ray async actor (construct it in the actor).

Callers talk to the thread through a command queue. Commands are handled between
steps, in arrival order, which is what makes the weight update protocol hold:

- `update_weights` runs `engine.update_weights` between two steps; generate calls
  that arrive meanwhile sit in the queue and are admitted after it (none is lost);
- a request interrupted by the update keeps its future: `generate` returns once,
  with tokens of both versions;
- a cancelled `generate` (task cancelled, client gone) aborts its request.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from areal_like.core.types import GenerateResult, SamplingParams
from rollout_cluster.engine.base import (
    DuplicateRequestError,
    Engine,
    EngineClosedError,
    InvalidSamplingParamsError,
    NamedTensors,
    RequestOutput,
    coerce_sampling_params,
    validate_request,
)
from rollout_cluster.engine.sampling import mix_seed

__all__ = ["AsyncEngine"]

logger = logging.getLogger(__name__)

_Future = tuple[asyncio.AbstractEventLoop, asyncio.Future]


def _resolve(fut: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


class AsyncEngine:
    """Asyncio face of a step-based engine (implements `AsyncGenerateEngine`)."""

    def __init__(self, engine: Engine, *, name: str = "rollout-engine") -> None:
        self.engine = engine
        self.max_seq_len = engine.max_seq_len
        self.vocab_size = engine.vocab_size
        self._cond = threading.Condition()
        self._commands: deque[tuple[str, tuple[Any, ...], _Future | None]] = deque()
        self._waiters: dict[str, _Future] = {}
        self._snapshot: dict[str, float] = engine.metrics()
        self._updating = False
        self._paused = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- public API -------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def interrupt_mode(self) -> str:
        return self.engine.interrupt_mode

    async def generate(
        self,
        *,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
    ) -> GenerateResult:
        """Generate one response; returns once, even across weight updates.

        Bad requests raise a `RequestError` (a `ValueError`) here, before queueing.
        """
        params = coerce_sampling_params(sampling_params)
        if params.n != 1:
            raise InvalidSamplingParamsError(
                f"request {request_id}: generate returns one sample (n={params.n}); use generate_n"
            )
        ids = validate_request(
            request_id, prompt_ids, params, max_seq_len=self.max_seq_len, vocab_size=self.vocab_size
        )
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        with self._cond:
            if self._closed:
                raise EngineClosedError("the engine is closed")
            if request_id in self._waiters:
                raise DuplicateRequestError(f"request id {request_id!r} is already in flight")
            self._waiters[request_id] = (loop, fut)
            self._commands.append(("add", (request_id, ids, params), None))
            self._cond.notify()
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            self._submit_nowait("abort", ([request_id],))
            raise

    async def generate_n(
        self,
        *,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
    ) -> list[GenerateResult]:
        """`n` samples of one prompt (ids `"{request_id}:{i}"`), sharing the prompt's prefill.

        Sample i uses seed `mix_seed(seed, i + 1)` when a seed is given, so the n
        samples differ but are reproducible.
        """
        params = coerce_sampling_params(sampling_params)
        one = params.model_copy(update={"n": 1})
        calls = []
        for i in range(params.n):
            seed = None if params.seed is None else mix_seed(params.seed, i + 1)
            calls.append(
                self.generate(
                    request_id=f"{request_id}:{i}",
                    prompt_ids=prompt_ids,
                    sampling_params=one.model_copy(update={"seed": seed}),
                )
            )
        return list(await asyncio.gather(*calls))

    async def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Run the engine's interrupt protocol between two steps; returns when loaded.

        Callable while generate calls are in flight; those return later with tokens
        of both versions (or, in `wait` mode, finish on the old version first).
        """
        await self._submit("update", (named_tensors, version))

    async def abort(self, request_ids: Iterable[str]) -> list[GenerateResult]:
        """Abort requests; their `generate` calls return the partial response (`abort`)."""
        return await self._submit("abort", (list(request_ids),))

    async def pause(self) -> None:
        """Stop stepping (state kept); new requests queue up until `resume`."""
        await self._submit("pause", ())

    async def resume(self) -> None:
        await self._submit("resume", ())

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread between steps (tests, admin)."""
        return await self._submit("call", (fn,))

    def metrics(self) -> dict[str, float]:
        """Engine counters and gauges as of the last step boundary.

        A snapshot the engine thread refreshes between steps, so reading it never
        blocks the caller's event loop, not even during a long `wait`-mode update.
        """
        m = dict(self._snapshot)
        m["inflight_calls"] = float(len(self._waiters))
        m["updating_weights"] = float(self._updating)
        return m

    async def close(self) -> None:
        """Stop the thread; calls still in flight fail with `EngineClosedError`."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._commands.append(("stop", (), None))
            self._cond.notify()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    # ---- engine thread ----------------------------------------------------------------

    async def _submit(self, kind: str, args: tuple[Any, ...]) -> Any:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        with self._cond:
            if self._closed:
                raise EngineClosedError("the engine is closed")
            self._commands.append((kind, args, (loop, fut)))
            self._cond.notify()
        return await fut

    def _submit_nowait(self, kind: str, args: tuple[Any, ...]) -> None:
        with self._cond:
            if not self._closed:
                self._commands.append((kind, args, None))
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._commands and (self._paused or not self.engine.has_unfinished()):
                    self._cond.wait()
                commands = list(self._commands)
                self._commands.clear()
            for kind, args, reply in commands:
                if kind == "stop":
                    self._fail_all(EngineClosedError("the engine was closed"))
                    return
                self._handle(kind, args, reply)
            if self._paused or not self.engine.has_unfinished():
                continue
            try:
                outs = self.engine.step()
            except Exception as e:  # a broken step must not hang every caller
                logger.exception("engine step failed; failing all in-flight requests")
                self._fail_all(RuntimeError(f"engine step failed: {e!r}"))
                continue
            self._snapshot = self.engine.metrics()
            self._deliver(outs)

    def _handle(self, kind: str, args: tuple[Any, ...], reply: _Future | None) -> None:
        value: Any = None
        error: BaseException | None = None
        try:
            if kind == "add":
                self.engine.add_request(*args)
            elif kind == "update":
                self._updating = True
                try:
                    self._deliver(self.engine.update_weights(*args))
                finally:
                    self._updating = False
            elif kind == "abort":
                value = self.engine.abort(args[0])
                for res in value:
                    self._finish(res.request_id, res, None)
            elif kind == "pause":
                self._paused = True
            elif kind == "resume":
                self._paused = False
            elif kind == "call":
                value = args[0](self.engine)
            else:
                raise ValueError(f"unknown engine command {kind!r}")
            self._snapshot = self.engine.metrics()
        except Exception as e:
            if kind == "add":
                self._finish(args[0], None, e)
            elif reply is None:
                logger.exception("engine command %s failed", kind)
            error = e
        if reply is not None:
            loop, fut = reply
            loop.call_soon_threadsafe(_resolve, fut, value, error)

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
