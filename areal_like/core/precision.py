"""`model.dtype: auto`: bfloat16 where the device multiplies bf16 natively, float32 elsewhere.

On a CPU with AVX512-BF16 or AMX, oneDNN's bf16 matmuls run several times faster than
fp32 (a 1024×576×1536 matmul on one core of this project's 2-core AMD EPYC machine:
489 against 104 GFLOPS); on an AVX2-only CPU they are emulated and 2.6–3.3× *slower*
(docs/design.md §8). CUDA GPUs from Ampere on have bf16 tensor cores. So the choice is the
hardware's, made where the weights live: each train worker and each rollout server
resolves `auto` for its own device (docs/design.md §10.48).

Training keeps fp32 master weights whatever the dtype (`train_cluster/torch_engine.py`);
the embedded engine holds its weights in the resolved dtype.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPES", "ONEDNN_CACHE", "bound_onednn_cache", "cpu_bf16_flags", "resolve_dtype", "torch_dtype"]

log = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16")
"""What `model.dtype` takes (float16 would need loss scaling, which no trainer here does)."""

_NATIVE_BF16 = ("amx_bf16", "avx512_bf16")

ONEDNN_CACHE = "64"
"""oneDNN primitives a process keeps (its own default: 1024)."""


@functools.cache
def cpu_bf16_flags(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, ...]:
    """The CPU flags that make bf16 matmuls native here (empty where none, or not Linux)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return ()
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
            break
    return tuple(f for f in _NATIVE_BF16 if f in flags)


def resolve_dtype(name: str, device: str) -> str:
    """`float32` or `bfloat16` for `model.dtype` = `name` on `device` (`cpu`, `cuda`, `cuda:1`)."""
    if name not in DTYPES:
        raise ValueError(f"model.dtype={name!r} is not supported: use one of {', '.join(DTYPES)}")
    if name != "auto":
        log.info("model.dtype %s: %s on %s (as set)", name, name, device)
        return name
    if device.startswith("cuda"):
        import torch

        native = torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
        why = "the GPU has bf16 tensor cores" if native else "the GPU has no native bf16"
    else:
        flags = cpu_bf16_flags()
        native = bool(flags)
        why = f"this CPU has {'/'.join(flags)}" if native else "this CPU has no AVX512-BF16 or AMX"
    chosen = "bfloat16" if native else "float32"
    log.info("model.dtype auto: %s on %s (%s)", chosen, device, why)
    return chosen


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a resolved `model.dtype` (`float32` or `bfloat16`)."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def bound_onednn_cache() -> None:
    """Keep at most `ONEDNN_CACHE` oneDNN primitives in this process (a user's own
    `ONEDNN_PRIMITIVE_CACHE_CAPACITY` wins). Call it before the process's first bf16 matmul:
    oneDNN reads the variable when it makes its first primitive.

    It keeps one primitive per matmul shape, and a server's shapes change with every step
    (the tokens of each prefill, the sequences of each decode). At the default of 1024 the
    SmolLM2 recipe's server grew from 789 MB after its first version to 1154 MB by step 12
    and 1340-1360 MB by step 20-40; at 64 it stayed under its load's 952 MB peak, with steps
    no slower (docs/design.md §10.48)."""
    import os

    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_CACHE)
