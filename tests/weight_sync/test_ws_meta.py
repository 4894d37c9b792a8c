"""The meta, checksum and layout every transport relies on (no processes, no sockets)."""

from __future__ import annotations

import pytest
import torch

from areal_like.core import wire
from areal_like.core.types import TensorMeta, WeightUpdateMeta
from weight_sync.meta import (
    FlatLayout,
    WeightSyncError,
    check_spec,
    checksum,
    spec_of,
    tensor_digest,
)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(7, 5, generator=g),
        "norm.weight": torch.randn(5, generator=g).to(torch.bfloat16),
        "step": torch.tensor(3),
        "empty": torch.empty(0, 4),
        "mask": torch.tensor([True, False, True]),
    }


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    return checksum(spec_of(tensors.items()), [tensor_digest(t) for t in tensors.values()])


def test_meta_round_trips_through_the_wire_codec() -> None:
    tensors = _tensors()
    meta = WeightUpdateMeta(
        version=3,
        transport="dist",
        tensors=spec_of(tensors.items()),
        checksum=_checksum(tensors),
        bucket_bytes=1 << 20,
        path="tcp://127.0.0.1:1234/abc/7",
    )
    back = wire.decode(wire.encode(meta), expect=WeightUpdateMeta)
    assert back == meta
    assert [m.dtype for m in back.tensors] == ["float32", "bfloat16", "int64", "float32", "bool"]


def test_checksum_sees_every_byte_name_shape_and_dtype() -> None:
    base = _tensors()
    ref = _checksum(base)
    assert ref == _checksum(_tensors())  # deterministic

    flipped = dict(base)
    raw = base["norm.weight"].clone()
    raw.view(torch.int16)[2] ^= 1  # one bit of a bf16 value
    flipped["norm.weight"] = raw
    assert _checksum(flipped) != ref

    renamed = {("lm_head.weight" if k == "embed.weight" else k): v for k, v in base.items()}
    assert _checksum(renamed) != ref
    reshaped = {**base, "embed.weight": base["embed.weight"].reshape(5, 7)}
    assert _checksum(reshaped) != ref
    retyped = {**base, "step": base["step"].to(torch.int32)}
    assert _checksum(retyped) != ref
    reordered = dict(reversed(list(base.items())))
    assert _checksum(reordered) != ref


def test_digest_is_over_raw_bytes_for_noncontiguous_tensors() -> None:
    t = torch.randn(4, 6).to(torch.bfloat16)
    assert tensor_digest(t.t()) == tensor_digest(t.t().contiguous())
    assert tensor_digest(t) != tensor_digest(t.t().contiguous())
    odd = torch.randn(10).to(torch.bfloat16)[1:]  # storage offset of 2 bytes: not 8-aligned
    assert tensor_digest(odd) == tensor_digest(odd.clone())


@pytest.mark.parametrize("nbytes", [6, 128, 1000, 64 * 1024, 3 * 64 * 1024 + 200])
def test_digest_detects_any_flipped_bit(nbytes: int) -> None:
    """Every position class: inside a full chunk, a partial chunk's rows and the sub-row tail."""
    g = torch.Generator().manual_seed(nbytes)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    ref = tensor_digest(raw)
    for pos in sorted(
        p for p in {0, 7, nbytes // 2, nbytes - 129, nbytes - 3, nbytes - 1} if 0 <= p < nbytes
    ):
        changed = raw.clone()
        changed[pos] ^= 0x10
        assert tensor_digest(changed) != ref, pos
    assert tensor_digest(raw[:-1]) != ref  # truncated


def test_digest_detects_swapped_and_shifted_chunks() -> None:
    """A desynchronised stream moves whole buckets; the per-chunk sums see it."""
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (4 * 64 * 1024,), dtype=torch.uint8, generator=g)
    ref = tensor_digest(raw)
    swapped = torch.cat([raw[64 * 1024 : 128 * 1024], raw[: 64 * 1024], raw[128 * 1024 :]])
    assert tensor_digest(swapped) != ref
    shifted = torch.cat([raw[8:], raw[:8]])
    assert tensor_digest(shifted) != ref
    stale = raw.clone()
    stale[64 * 1024 : 128 * 1024] = 0  # one bucket never arrived
    assert tensor_digest(stale) != ref


def test_spec_mismatch_is_refused_with_the_reason() -> None:
    spec = spec_of(_tensors().items())
    check_spec(spec, spec)
    check_spec(list(reversed(spec)), spec)  # order does not matter
    check_spec(spec, None)
    wrong_shape = [
        m if m.name != "embed.weight" else TensorMeta(name=m.name, dtype=m.dtype, shape=[5, 7]) for m in spec
    ]
    with pytest.raises(WeightSyncError, match=r"'embed.weight' is float32\[5, 7\], expected float32\[7, 5\]"):
        check_spec(wrong_shape, spec)
    wrong_dtype = [
        m if m.name != "norm.weight" else TensorMeta(name=m.name, dtype="float32", shape=m.shape)
        for m in spec
    ]
    with pytest.raises(WeightSyncError, match="'norm.weight' is float32"):
        check_spec(wrong_dtype, spec)
    with pytest.raises(WeightSyncError, match="missing tensor 'mask'"):
        check_spec(spec[:-1], spec)
    with pytest.raises(WeightSyncError, match="unexpected tensor 'extra'"):
        check_spec([*spec, TensorMeta(name="extra", dtype="float32", shape=[1])], spec)


def test_layout_aligns_views_and_covers_the_buffer_with_buckets() -> None:
    tensors = _tensors()
    layout = FlatLayout.from_metas(spec_of(tensors.items()))
    assert all(s.offset % 64 == 0 for s in layout.slots)
    assert layout.total_bytes % 64 == 0
    flat = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    for slot, t in zip(layout.slots, tensors.values(), strict=True):
        layout.view(flat, slot).copy_(t)
    for slot, (name, t) in zip(layout.slots, tensors.items(), strict=True):
        view = layout.view(flat, slot)
        assert slot.name == name and view.dtype == t.dtype and view.shape == t.shape
        assert torch.equal(view, t)
        assert layout.slot_digest(flat, slot) == tensor_digest(t)
    buckets = layout.buckets(100)
    assert buckets[0][0] == 0 and buckets[-1][1] == layout.total_bytes
    assert all(a[1] == b[0] for a, b in zip(buckets, buckets[1:], strict=False))
    assert all(0 < e - s <= 100 for s, e in buckets)


def test_unknown_dtype_is_refused() -> None:
    with pytest.raises(WeightSyncError, match="unknown dtype 'float8'"):
        FlatLayout.from_metas([TensorMeta(name="x", dtype="float8", shape=[2])])
    with pytest.raises(WeightSyncError, match="cannot be synced"):
        spec_of([("c", torch.zeros(2, dtype=torch.complex64))])
