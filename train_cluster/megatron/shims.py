"""Three small CPU shims that let megatron-core 0.16.1 run forward/backward without CUDA.

megatron-core is a GPU library; a few of its code paths call CUDA unconditionally
even when nothing else needs it. On CPU (tests, the 2-core CI box) we replace
exactly those paths, in this process only, and nothing else:

1. `RotaryEmbedding.get_emb` moves `inv_freq` to `torch.cuda.current_device()` on
   first use. `cpu_rotary` rebinds `get_emb` on the model's rotary module to the
   same computation without the move (non-interleaved RoPE, as Qwen2 uses).
2. The core attention's scratch buffer comes from `parallel_state`'s global memory
   buffer, allocated on CUDA. `_CpuMemoryBuffer` hands out CPU tensors instead
   (they are only the `beta=0` input of `baddbmm`, never read).
3. Attention dropout runs inside `get_cuda_rng_tracker().fork()`, which needs a
   CUDA RNG state registered by `model_parallel_cuda_manual_seed`. `_CpuRngTracker`
   forks the CPU generator instead, seeded per tracker name like Megatron's.

Megatron's optimizer and pipeline schedules also hard-code CUDA; we do not shim
them — the engine drives its own loop with torch AdamW instead.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["install_cpu_shims", "cpu_rotary"]


class _CpuMemoryBuffer:
    def get_tensor(self, shape: Any, dtype: torch.dtype, name: str, mem_alloc_context: Any = None) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype)


class _CpuRngTracker:
    """The subset of `CudaRNGStatesTracker` that model code uses, on the CPU generator."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        self.states_ = {}

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()

    def is_initialized(self) -> bool:
        return True

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            self.add(name, 2718 + hash(name) % 1000)
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()


def install_cpu_shims(seed: int) -> None:
    """Shims 2 and 3 (process-wide, idempotent). Call after `initialize_model_parallel`."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    parallel_state._GLOBAL_MEMORY_BUFFER = _CpuMemoryBuffer()
    tracker = _CpuRngTracker()
    # Megatron seeds its model-parallel stream with seed + 2718 + tp_rank; dropout differs per TP rank.
    tracker.add("model-parallel-rng", seed + 2718 + parallel_state.get_tensor_model_parallel_rank())
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _cpu_get_emb(self: Any, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :]


def cpu_rotary(model: torch.nn.Module) -> None:
    """Shim 1 on one GPTModel instance."""
    rope = model.rotary_pos_emb
    if getattr(rope, "rotary_interleaved", False):
        raise ValueError("the CPU rotary shim supports non-interleaved RoPE only")
    rope.get_emb = types.MethodType(_cpu_get_emb, rope)
