"""Pick the transport named by `weight_sync.type`; callers never name a transport class."""

from __future__ import annotations

import os

import torch

from areal_like.core.config import DistWeightSyncConfig, WeightSyncConfig
from areal_like.core.types import TensorMeta
from weight_sync.base import WeightReceiver, WeightSender
from weight_sync.disk import DiskWeightReceiver, DiskWeightSender
from weight_sync.dist import DistWeightReceiver, DistWeightSender

__all__ = ["make_sender", "make_receiver"]


def make_sender(
    cfg: WeightSyncConfig,
    *,
    device: str | torch.device = "cpu",
    default_disk_path: str | os.PathLike[str] | None = None,
) -> WeightSender:
    """The trainer rank 0's sender. The disk transport writes to `weight_sync.disk_path`,
    or to `default_disk_path` (the run folder's `weight_sync/`) when that is unset."""
    if isinstance(cfg, DistWeightSyncConfig):
        return DistWeightSender(cfg, device=device)
    return DiskWeightSender(cfg, cfg.disk_path or default_disk_path)


def make_receiver(
    cfg: WeightSyncConfig,
    receiver_id: str,
    *,
    expected: list[TensorMeta] | None = None,
    device: str | torch.device = "cpu",
    default_disk_path: str | os.PathLike[str] | None = None,
) -> WeightReceiver:
    """One engine's receiver; `expected` (see `spec_of`) refuses weights of another shape."""
    if isinstance(cfg, DistWeightSyncConfig):
        return DistWeightReceiver(cfg, receiver_id, expected=expected, device=device)
    return DiskWeightReceiver(cfg, cfg.disk_path or default_disk_path, expected=expected, device=device)
