"""Trainer → rollout weight transfer: `WeightSender.send` / `WeightReceiver.receive`.

Transports: `dist` (a dedicated gloo/NCCL group, bucketed broadcast) and `disk`
(safetensors plus a commit marker). Imports only the `areal_like` contracts.
"""

import importlib
from typing import TYPE_CHECKING, Any

from weight_sync.base import (
    NamedTensors,
    NotAMemberError,
    TransferStats,
    WeightReceiver,
    WeightSender,
    WeightSyncError,
)

if TYPE_CHECKING:
    from weight_sync.disk import DiskWeightReceiver, DiskWeightSender
    from weight_sync.dist import DistWeightReceiver, DistWeightSender
    from weight_sync.factory import make_receiver, make_sender
    from weight_sync.meta import checksum, spec_of, tensor_digest

_LAZY = {
    "DiskWeightReceiver": "disk", "DiskWeightSender": "disk", "DistWeightReceiver": "dist",
    "DistWeightSender": "dist", "make_receiver": "factory", "make_sender": "factory", "checksum": "meta", "spec_of": "meta", "tensor_digest": "meta",
}
"""The transports import torch: loaded at first use, so that a process that only reads a
`TransferStats` (the trainer's driver) never imports it (docs/design.md §10.34)."""


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"weight_sync.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'weight_sync' has no attribute {name!r}")


__all__ = [
    "WeightSender",
    "WeightReceiver",
    "TransferStats",
    "NamedTensors",
    "DistWeightSender",
    "DistWeightReceiver",
    "DiskWeightSender",
    "DiskWeightReceiver",
    "make_sender",
    "make_receiver",
    "WeightSyncError",
    "NotAMemberError",
    "spec_of",
    "checksum",
    "tensor_digest",
]
