"""Trainer → rollout weight transfer: `WeightSender.send` / `WeightReceiver.receive`.

Transports: `dist` (a dedicated gloo/NCCL group, bucketed broadcast) and `disk`
(safetensors plus a commit marker). Imports only the `areal_like` contracts.
"""

from weight_sync.base import NamedTensors, TransferStats, WeightReceiver, WeightSender
from weight_sync.disk import DiskWeightReceiver, DiskWeightSender
from weight_sync.dist import DistWeightReceiver, DistWeightSender
from weight_sync.factory import make_receiver, make_sender
from weight_sync.meta import NotAMemberError, WeightSyncError, checksum, spec_of, tensor_digest

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
