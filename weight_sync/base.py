"""The two roles every transport plays, verl/prime-rl style: weights move as `(name, tensor)`.

The trainer's rank 0 owns a `WeightSender`; each rollout engine owns a
`WeightReceiver`. The sender turns one version into a `WeightUpdateMeta` that the
orchestrator publishes on the control channel; a receiver turns that meta back into
an iterator of `(name, tensor)` that `engine.update_weights(named_tensors, version)`
consumes directly. The meta is the only message the transports need besides the
tensors themselves.

A receiver verifies everything (layout against the engine's expected spec, every
byte against the checksum) before it returns the iterator, so a failed or partial
transfer raises `WeightSyncError` and the engine keeps serving its old weights.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from areal_like.core.types import WeightUpdateMeta

if TYPE_CHECKING:  # a driver unpickles `TransferStats` from a train worker without torch (design §10.34)
    import torch

__all__ = ["WeightSender", "WeightReceiver", "TransferStats", "NamedTensors", "WeightSyncError", "NotAMemberError"]

NamedTensors = Iterable[tuple[str, "torch.Tensor"]]


class WeightSyncError(RuntimeError):
    """A version could not be delivered; the caller keeps (and keeps serving) its old weights."""


class NotAMemberError(WeightSyncError):
    """This receiver is not in the weight group that carries this version (it joined late
    or was dropped). It has re-registered and will be included in the next version's
    group; until then the caller keeps its weights or loads the version from disk."""


@dataclass
class TransferStats:
    """One transfer as one side saw it; the numbers behind the weight-sync metrics."""

    version: int
    bytes: int = 0
    seconds: float = 0.0
    """Whole transfer, waiting for peers included."""
    rendezvous_s: float = 0.0
    """Dist only: part of `seconds` spent waiting for peers and forming the group, not moving bytes."""
    ok: bool = False
    error: str | None = None
    receivers: list[str] = field(default_factory=list)
    """Dist sender only: the receiver ids of the group that carried this version."""
    generation: int | None = None
    """Dist only: the group generation (bumped whenever membership changes or a transfer fails)."""
    accepted: int | None = None
    """Dist sender only: how many receivers verified and accepted the version."""
    lane: str | None = None
    """Dist only: how the bytes went: `gloo` or `nccl` (the broadcast) or `shm` (every
    receiver on the sender's host read the shared-memory staging file)."""

    @property
    def gb_per_s(self) -> float:
        """Throughput of the bytes on the wire (rendezvous excluded)."""
        moving = self.seconds - self.rendezvous_s
        return self.bytes / moving / 1e9 if moving > 0 else 0.0


class WeightSender(abc.ABC):
    """Trainer rank 0: publishes versions. One instance per run, used from one thread."""

    @abc.abstractmethod
    def send(self, version: int, named_tensors: NamedTensors) -> WeightUpdateMeta:
        """Take a snapshot of `named_tensors` as `version` and return the meta to publish.

        When `send` returns, the trainer may modify its weights: the transport holds
        its own copy (a staging buffer or files).
        """

    def wait(self, timeout: float | None = None) -> TransferStats | None:
        """Block until the last version has been delivered (or failed); None if nothing was sent."""
        return self.last_transfer

    @property
    @abc.abstractmethod
    def last_transfer(self) -> TransferStats | None:
        """The most recent finished transfer."""

    @property
    def rendezvous(self) -> str | None:
        """Where receivers join before the first version (announced by the trainer), or
        None for transports that need no membership (disk)."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook; transports without resources keep it
        """Release sockets, groups and threads."""

    def forget_receivers(self) -> None:  # noqa: B027 - optional: transports without membership ignore it
        """The receivers this sender waits for are gone (their rollout side was declared
        lost): stop waiting for them now, rather than for `timeout_s`."""

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class WeightReceiver(abc.ABC):
    """One rollout engine: turns a published meta into verified `(name, tensor)` pairs."""

    loads_in_place: bool = False
    """`receive(meta, load)` can hand the engine the version to read itself (the dist
    receiver on the shared-memory lane); otherwise the caller loads the returned pairs."""

    @abc.abstractmethod
    def receive(self, meta: WeightUpdateMeta) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
        """Fetch and verify version `meta.version`; raise `WeightSyncError` on any failure.

        The tensors may be views into a buffer that the next `receive` overwrites:
        consume the iterator (copy into the model, as `load_weights` does) before the
        next call.
        """

    @property
    @abc.abstractmethod
    def last_transfer(self) -> TransferStats | None:
        """The most recent transfer attempt, failed or not."""

    def join(self, rendezvous: str) -> None:  # noqa: B027 - transports without membership keep it
        """Become a member at the sender's `rendezvous` before the first version, so the
        next transfer includes this receiver (a no-op for transports without membership)."""

    def close(self) -> None:  # noqa: B027 - optional hook; transports without resources keep it
        """Release sockets and groups."""

    def __enter__(self) -> WeightReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
