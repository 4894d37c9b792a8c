"""What every transport agrees on: dtype names, the tensor list, the checksum, the flat layout.

The sender describes one version as a `WeightUpdateMeta` (names, dtypes, shapes,
checksum) and the orchestrator carries it on the control channel. Everything a
receiver needs to preallocate and verify is derived from that meta by the pure
functions here, so sender and receivers compute the same layout without another
message.

The checksum is defined over tensors, not over any transport's framing, so a
version has the same checksum whether it travelled by broadcast or by disk:

    sha256("areal_like.weight_sync/1\\n" + for each tensor in order:
           "{name}\\t{dtype}\\t{shape}\\t{crc32 of its raw bytes:08x}\\n")

crc32 (zlib, ~6 GB/s on one core, GIL released) over *raw bytes* makes bf16 and
every other dtype work the same way and keeps verification far cheaper than the
transfer; sha256 over the per-tensor lines binds names, dtypes, shapes and order.
It guards against partial, stale, misaligned or corrupted transfers, not against an
adversary (the weight group is a trusted, internal channel).
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from areal_like.types import TensorMeta

__all__ = [
    "WeightSyncError",
    "NotAMemberError",
    "DTYPES",
    "dtype_name",
    "torch_dtype",
    "spec_of",
    "tensor_crc",
    "checksum",
    "check_spec",
    "Slot",
    "FlatLayout",
]

_CHECKSUM_TAG = b"areal_like.weight_sync/1\n"
_ALIGN = 64
"""Byte alignment of every tensor in a flat buffer: a multiple of every itemsize, so a
uint8 slice can be viewed as any dtype, and a cache line, so copies stay fast."""

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in DTYPES.items()}


class WeightSyncError(RuntimeError):
    """A version could not be delivered; the caller keeps (and keeps serving) its old weights."""


class NotAMemberError(WeightSyncError):
    """This receiver is not in the weight group that carries this version (it joined late
    or was dropped). It has re-registered and will be included in the next version's
    group; until then the caller keeps its weights or loads the version from disk."""


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise WeightSyncError(f"dtype {dtype} cannot be synced (allowed: {sorted(DTYPES)})") from None


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise WeightSyncError(f"unknown dtype {name!r} in weight meta (allowed: {sorted(DTYPES)})") from None


def spec_of(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[TensorMeta]:
    """The (name, dtype, shape) list of some tensors: what a receiver expects to load."""
    return [TensorMeta(name=n, dtype=dtype_name(t.dtype), shape=list(t.shape)) for n, t in named_tensors]


def tensor_crc(t: torch.Tensor) -> int:
    """crc32 of a tensor's raw bytes in row-major order (any dtype, bf16 included)."""
    t = t.detach()
    if t.device.type != "cpu":
        # Hashing needs host memory; on GPU this costs one device-to-host copy per tensor.
        t = t.cpu()
    flat = t.contiguous().reshape(-1)
    if flat.numel() == 0:
        return zlib.crc32(b"")
    return zlib.crc32(flat.view(torch.uint8).numpy())


def checksum(metas: Sequence[TensorMeta], crcs: Sequence[int]) -> str:
    """Hex digest binding names, dtypes, shapes, order and per-tensor crc32 (module docstring)."""
    if len(metas) != len(crcs):
        raise ValueError(f"{len(metas)} tensors but {len(crcs)} crcs")
    h = hashlib.sha256(_CHECKSUM_TAG)
    for m, crc in zip(metas, crcs, strict=True):
        shape = ",".join(str(d) for d in m.shape)
        h.update(f"{m.name}\t{m.dtype}\t{shape}\t{crc:08x}\n".encode())
    return h.hexdigest()


def check_spec(metas: Sequence[TensorMeta], expected: Sequence[TensorMeta] | None) -> None:
    """Refuse a version whose names, dtypes or shapes differ from what the engine expects.

    Order does not matter (loaders look tensors up by name); the set must be equal,
    because a version missing a tensor would leave the engine with a mix of versions.
    """
    if expected is None:
        return
    got = {m.name: (m.dtype, tuple(m.shape)) for m in metas}
    want = {m.name: (m.dtype, tuple(m.shape)) for m in expected}
    if len(got) != len(metas):
        raise WeightSyncError("weight meta names a tensor twice")
    problems: list[str] = []
    problems += [f"unexpected tensor {n!r}" for n in sorted(got.keys() - want.keys())]
    problems += [f"missing tensor {n!r}" for n in sorted(want.keys() - got.keys())]
    for n in sorted(got.keys() & want.keys()):
        if got[n] != want[n]:
            problems.append(f"{n!r} is {got[n][0]}{list(got[n][1])}, expected {want[n][0]}{list(want[n][1])}")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise WeightSyncError(
            "weights refused, they do not match the engine: " + "; ".join(problems[:5]) + more
        )


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives in a flat uint8 buffer."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class FlatLayout:
    """All tensors of a version packed into one uint8 buffer at aligned offsets.

    A broadcast moves byte ranges of this buffer (buckets), so a tensor may straddle
    buckets and no tensor needs a bucket of its own; receivers keep one buffer per
    layout and reuse it for every version with the same layout (no allocation in the
    steady state).
    """

    slots: tuple[Slot, ...]
    total_bytes: int

    @classmethod
    def from_metas(cls, metas: Sequence[TensorMeta]) -> FlatLayout:
        slots: list[Slot] = []
        offset = 0
        for m in metas:
            dtype = torch_dtype(m.dtype)
            if any(d < 0 for d in m.shape):
                raise WeightSyncError(f"tensor {m.name!r} has a negative dimension {m.shape}")
            numel = 1
            for d in m.shape:
                numel *= d
            nbytes = numel * dtype.itemsize
            slots.append(Slot(m.name, dtype, tuple(m.shape), offset, nbytes))
            offset = -(-(offset + nbytes) // _ALIGN) * _ALIGN
        return cls(tuple(slots), offset)

    def buckets(self, bucket_bytes: int) -> list[tuple[int, int]]:
        """Byte ranges [start, end) of at most `bucket_bytes` each, covering the buffer."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        return [
            (s, min(s + bucket_bytes, self.total_bytes)) for s in range(0, self.total_bytes, bucket_bytes)
        ]

    def view(self, flat: torch.Tensor, slot: Slot) -> torch.Tensor:
        """The tensor of `slot` as a view into `flat` (no copy)."""
        if slot.nbytes == 0:
            return torch.empty(slot.shape, dtype=slot.dtype, device=flat.device)
        return flat[slot.offset : slot.end].view(slot.dtype).view(slot.shape)

    def slot_crc(self, flat: torch.Tensor, slot: Slot) -> int:
        """crc32 of one slot's bytes, read straight from the flat buffer."""
        return tensor_crc(flat[slot.offset : slot.end])
