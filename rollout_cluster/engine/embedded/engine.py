"""`EmbeddedEngine`: the `Engine` interface over a scheduler, a model runner and KV caches.

The split follows vLLM v1's `EngineCore.step`: the `Scheduler` decides what runs
(queues, admission, prefill plans, retirement), the `ModelRunner` runs it (the
decoder over the HF weights, sampling), `KVSlots` / `PrefixCache` hold KV. This
class composes them and owns what spans all three: the weight version, pause /
resume, and the interrupt protocol of docs/design.md §9.1 (`update_weights`).

A step: decode every running sequence (one token each), retire finished ones,
admit waiting ones within a padded-token budget, prefill them in one batch
(sampling their first token), retire.

Requests arrive validated (`enqueue` takes an `EngineRequest`; `add_request`, in
the `Engine` base, validates raw arguments first).
"""

from __future__ import annotations

import ctypes
import logging
import random
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from areal_like.core.config import EmbeddedEngineConfig
from areal_like.core.types import GenerateResult
from rollout_cluster.engine.base import (
    INTERRUPT_MODES,
    DuplicateRequestError,
    Engine,
    EngineCounters,
    EngineRequest,
    InterruptMode,
    NamedTensors,
    RequestOutput,
)
from rollout_cluster.engine.embedded.cache import PrefixCache
from rollout_cluster.engine.embedded.runner import ModelRunner
from rollout_cluster.engine.embedded.scheduler import Scheduler, Seq
from rollout_cluster.engine.sampling import mix_seed

__all__ = ["EmbeddedEngine"]

logger = logging.getLogger(__name__)


class EmbeddedEngine(Engine):
    """Continuous-batching engine over a local HF causal LM (fp32 on CPU by default).

    Construct from a model folder and an `EmbeddedEngineConfig`:
    `EmbeddedEngine(path, config, interrupt_mode="recompute", seed=0)`.
    `eos_token_ids=[]` disables the model's eos (benchmarks force response lengths).
    """

    def __init__(
        self,
        model: str | Path | torch.nn.Module,
        config: EmbeddedEngineConfig | None = None,
        *,
        interrupt_mode: InterruptMode = "recompute",
        seed: int = 0,
        eos_token_ids: Iterable[int] | None = None,
        prefix_cache_max_tokens: int | None = None,
        max_prefill_tokens: int = 4096,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if interrupt_mode not in INTERRUPT_MODES:
            raise ValueError(f"interrupt_mode must be one of {INTERRUPT_MODES}, got {interrupt_mode!r}")
        self.config = config or EmbeddedEngineConfig()
        self.interrupt_mode: InterruptMode = interrupt_mode
        self.device = torch.device(self.config.device)
        self.max_seq_len = self.config.max_seq_len
        self.runner = ModelRunner(model, max_seq_len=self.max_seq_len, device=self.device, dtype=dtype,
                                  model_impl=self.config.model_impl)
        self.vocab_size = self.runner.vocab_size
        if eos_token_ids is None:
            eos_token_ids = self.runner.eos_token_ids()
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.kv = self.runner.new_kv(self.config.max_batch_size, self.max_seq_len)
        self.prefix = PrefixCache(
            # Default: half the slot cache again, enough for every running episode's last turn.
            prefix_cache_max_tokens
            if prefix_cache_max_tokens is not None
            else self.kv.capacity_tokens // 2
        )
        self.scheduler = Scheduler(
            self.kv,
            self.prefix if self.config.prefix_cache else None,
            max_slots=self.config.max_batch_size,
            max_prefill_tokens=max_prefill_tokens,
        )
        self._version = 0
        self._paused = False
        self._admission_closed = False
        self._rng = random.Random(seed)
        self.counters = EngineCounters()

    # ---- Engine interface -------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def model(self) -> torch.nn.Module:
        """The HF module whose parameters the engine runs (read-only use, e.g. tests)."""
        return self.runner.model

    def enqueue(self, request: EngineRequest) -> None:
        params = request.params
        assert params.n == 1 and len(request.prompt_ids) < self.max_seq_len, "not validated at the edge"
        if request.request_id in self.scheduler:
            raise DuplicateRequestError(f"request id {request.request_id!r} is already in flight")
        ids = list(request.prompt_ids)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        self.scheduler.add(
            Seq(
                request_id=request.request_id,
                ids=ids,
                prompt_len=len(ids),
                params=params,
                stream=mix_seed(seed, 0),
                max_len=min(len(ids) + params.max_tokens, self.max_seq_len),
                stop_ids=(frozenset() if params.ignore_eos else self.eos_token_ids)
                | frozenset(params.stop_token_ids),
            )
        )
        self.counters.prompt_tokens += len(ids)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        if self._paused:
            return []
        sched = self.scheduler
        outs: list[RequestOutput] = []
        with torch.inference_mode():
            if sched.running:
                outs += self._decode()
                sched.retire(self._version)
            if sched.waiting and not self._admission_closed:
                admitted = sched.admit()
                if admitted:
                    outs += self._prefill(admitted)
                    sched.retire(self._version)
        return outs

    def abort(self, request_ids: Iterable[str]) -> list[GenerateResult]:
        results = []
        for rid in request_ids:
            seq = self.scheduler.abort(rid)
            if seq is None:
                continue
            results.append(seq.result())
            self.counters.requests_aborted += 1
        self.scheduler.retire(self._version)
        return results

    def pause(self) -> None:
        self._paused = True

    def resume(self) -> None:
        self._paused = False

    def load_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Copy `(HF name, tensor)` pairs into the model, then re-pack and set the version.

        Everything is checked and staged before anything is copied, so a wrong name
        or shape leaves the engine on its old weights and version.
        """
        self.runner.apply(self.runner.stage(named_tensors))
        self._set_version(version)
        _trim_heap()

    def update_weights(self, named_tensors: NamedTensors, version: int) -> list[RequestOutput]:
        """Load new weights mid-generation, per `interrupt_mode`:

        - `recompute`: stop at this step boundary; keep every sampled token, logprob
          and version; drop all KV (slots and prefix cache); load; set the version;
          re-prefill prompt + partial with the new weights for every in-flight
          request (inside this call, so pause→resume latency includes it); continue.
        - `keep` (ablation; breaks invariant 3): load, keep the stale KV, continue.
        - `wait`: stop admitting; decode in-flight requests to completion with the
          old weights (no call mixes versions); load; admit the waiting ones.

        Requests that arrive meanwhile wait: the driver (`AsyncEngine`) only enqueues
        between calls, and they are queued behind the interrupted ones.
        """
        t0 = time.perf_counter()
        self._paused = True
        outs: list[RequestOutput] = []
        try:
            # Receive and check everything first: a failed transfer leaves in-flight
            # requests untouched, on the old weights and version.
            staged = self.runner.stage(named_tensors)
            if self.interrupt_mode == "wait":
                outs += self._drain()
            inflight = list(self.scheduler.running)
            if inflight:
                self.counters.interrupts += 1
                self.counters.interrupted_requests += len(inflight)
                self.counters.interrupted_tokens += sum(len(s.ids) - s.prompt_len for s in inflight)
                for s in inflight:
                    s.num_interrupts += 1
            self.prefix.clear()  # KV computed with old weights is never reused (invariant 3c)
            if self.interrupt_mode == "recompute":
                self.scheduler.preempt_all()  # keeps tokens, drops their KV, queues them first
            self.runner.apply(staged)
            self._set_version(version)
            _trim_heap()  # the dropped KV and the load's buffers go back to the OS
            if self.interrupt_mode == "recompute" and inflight:
                t1 = time.perf_counter()
                outs += self._reprefill(inflight)
                self.counters.reprefill_s_total += time.perf_counter() - t1
        finally:
            self._paused = False
        self.counters.record_pause(time.perf_counter() - t0)
        return outs

    def metrics(self) -> dict[str, float]:
        m = self.counters.as_dict()
        used = sum(s.num_computed for s in self.scheduler.running)
        capacity = float(self.kv.capacity_tokens)
        m.update(
            version=float(self._version),
            queue_depth=float(len(self.scheduler.waiting)),
            running=float(len(self.scheduler.running)),
            kv_used_tokens=float(used),
            kv_capacity_tokens=capacity,
            kv_usage=used / capacity,
            prefix_cache_tokens=float(self.prefix.tokens),
            prefix_cache_entries=float(len(self.prefix)),
        )
        return m

    # ---- interrupt helpers --------------------------------------------------------------

    def _set_version(self, version: int) -> None:
        self._version = int(version)
        self.counters.weight_updates += 1

    def _drain(self) -> list[RequestOutput]:
        """`wait` mode: step the running batch to completion without admitting anyone."""
        outs: list[RequestOutput] = []
        self._admission_closed = True
        self._paused = False
        try:
            while self.scheduler.running:
                outs += self.step()
        finally:
            self._admission_closed = False
            self._paused = True
        return outs

    def _reprefill(self, inflight: list[Seq]) -> list[RequestOutput]:
        """Admit and prefill the interrupted requests (now at the head of the queue)."""
        sched = self.scheduler
        outs: list[RequestOutput] = []
        pending = set(map(id, inflight))
        with torch.inference_mode():
            while pending and sched.waiting and id(sched.waiting[0]) in pending:
                admitted = sched.admit(only=pending)
                for s in admitted:
                    pending.discard(id(s))
                    self.counters.recompute_tokens += len(s.ids)
                outs += self._prefill(admitted)
                sched.retire(self._version)
        return outs

    # ---- one step's work ----------------------------------------------------------------

    def _decode(self) -> list[RequestOutput]:
        running = self.scheduler.running
        logits = self.runner.decode(self.kv, running)
        for s in running:
            s.num_computed += 1
        return self._sample(running, logits)

    def _prefill(self, admitted: list[Seq]) -> list[RequestOutput]:
        """Prefill newly admitted (or resumed) sequences, one padded batch per stage.

        Identical sequences are computed once and copied; prefix-cache hits start
        from the cached KV (exact hits with logits skip the model entirely); a prefix
        several share is computed in an earlier stage and found there (`prefill_stages`).
        """
        outs: list[RequestOutput] = []
        for stage in self.scheduler.prefill_stages(admitted, self._version):
            plan = self.scheduler.plan_prefill(stage, self._version)
            logits = self.runner.prefill(self.kv, plan)
            self.scheduler.finish_prefill(plan, logits, self._version)
            self.counters.prefill_tokens += plan.computed_tokens
            self.counters.prefix_cache_hit_tokens += plan.hit_tokens
            outs += self._sample(plan.order, logits)
        return outs

    def _sample(self, seqs: list[Seq], logits: torch.Tensor) -> list[RequestOutput]:
        tokens, logprobs = self.runner.sample(seqs, logits)
        outs = self.scheduler.append(seqs, tokens, logprobs, self._version)
        self.counters.generated_tokens += len(seqs)
        self.counters.requests_finished += sum(o.finished for o in outs)
        return outs


def _trim_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's `malloc_trim`; elsewhere a no-op).

    glibc keeps what a process frees for its next allocations, in as many arenas as it had
    threads allocating: after a version, the prefix cache, the old KV and the load's
    buffers would stay in the server's resident memory for good (about 130 MB at 135M).
    A weight update is the one moment the engine is paused anyway; this takes ~ms."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        pass
