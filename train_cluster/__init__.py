"""train_cluster: the trainer side — decoupled PPO on torch (DDP/FSDP2) or Megatron-core.

Public surface for the orchestrator:
- `build_batch(trajectories, train_cfg.loss)` → `TrainBatch` (GRPO advantages per group);
- `create_engine(model_path, train_cfg, dtype=..., seed=...)` → a `TrainEngine`
  (or `TrainWorkerGroup` when the torch backend asks for several workers);
- `engine.train_step(batch)` → stats dict (keys `STAT_KEYS`), `engine.version`,
  `engine.named_weights()`, `engine.save(path, extra)`, `engine.load(path)` → extra.

Heavy modules (torch, transformers, Ray, megatron-core) are imported only when used.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from train_cluster.batch import TrainBatch, build_batch, pack_sequences, shard_batch, split_mini_batches
    from train_cluster.engine import STAT_KEYS, TrainEngine
    from train_cluster.losses import aggregate, decoupled_ppo_loss, group_advantages, kl_k3

_LAZY = {
    "TrainBatch": "batch", "build_batch": "batch", "pack_sequences": "batch", "shard_batch": "batch",
    "split_mini_batches": "batch", "STAT_KEYS": "engine", "TrainEngine": "engine", "aggregate": "losses",
    "decoupled_ppo_loss": "losses", "group_advantages": "losses", "kl_k3": "losses",
}
"""Imported at first use, so that importing a submodule (the driver's `worker_group`) does
not import torch (docs/design.md §10.34)."""


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"train_cluster.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'train_cluster' has no attribute {name!r}")

__all__ = [
    "STAT_KEYS",
    "TrainBatch",
    "TrainEngine",
    "aggregate",
    "build_batch",
    "create_engine",
    "decoupled_ppo_loss",
    "group_advantages",
    "kl_k3",
    "pack_sequences",
    "shard_batch",
    "split_mini_batches",
]


def create_engine(model_path: str | Path, train_cfg: Any, *, dtype: str = "float32", seed: int = 0,
                  placement_group: Any = None, lora: Any = None) -> Any:
    """The trainer `train_cfg.backend` asks for, with the same five calls whichever it is.

    torch, 1 worker: a `TorchTrainEngine` in this process. torch, N > 1 workers: a
    `TrainWorkerGroup` of Ray actors (call `ray.init` first). megatron: a
    `MegatronTrainEngine` in this process for TP = DP = 1, else a `TrainWorkerGroup`
    with one actor per rank.
    """
    b = train_cfg.backend
    if b.type == "megatron" and b.tensor_parallel_size * b.data_parallel_size == 1:
        from train_cluster.megatron.engine import MegatronTrainEngine

        return MegatronTrainEngine(model_path, train_cfg, dtype=dtype, seed=seed)
    if b.type == "megatron" or b.world_size > 1:
        from train_cluster.worker_group import TrainWorkerGroup

        return TrainWorkerGroup(model_path, train_cfg, dtype=dtype, seed=seed, placement_group=placement_group,
                                lora=lora)
    from train_cluster.torch_engine import TorchTrainEngine

    return TorchTrainEngine(model_path, train_cfg, dtype=dtype, seed=seed, lora=lora)
