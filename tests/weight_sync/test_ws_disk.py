"""Disk transport: exact round trip, never a half-written version, cleanup, refusals."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from areal_like.core.config import DiskWeightSyncConfig
from weight_sync import DiskWeightReceiver, DiskWeightSender, WeightSyncError, spec_of
from weight_sync import disk as disk_mod


def _cfg(tmp_path: Path, **kw: object) -> DiskWeightSyncConfig:
    return DiskWeightSyncConfig(type="disk", disk_path=str(tmp_path / "ws"), timeout_s=0.5, **kw)


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


@pytest.fixture(scope="module")
def model_tensors(tiny_model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(tiny_model_dir / "model.safetensors"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bitwise(
    tmp_path: Path, model_tensors: dict[str, torch.Tensor], dtype: torch.dtype
) -> None:
    tensors = {k: v.to(dtype) for k, v in model_tensors.items()}
    cfg = _cfg(tmp_path)
    meta = DiskWeightSender(cfg).send(1, tensors.items())
    version, it = DiskWeightReceiver(cfg, expected=spec_of(tensors.items())).receive(meta)
    got = dict(it)
    assert version == 1 and list(got) == list(tensors)
    assert all(_bitwise_equal(got[k], tensors[k]) for k in tensors)


def test_tied_weights_are_written(tmp_path: Path) -> None:
    w = torch.randn(4, 3)
    cfg = _cfg(tmp_path)
    meta = DiskWeightSender(cfg).send(0, [("embed.weight", w), ("lm_head.weight", w)])
    got = dict(DiskWeightReceiver(cfg).receive(meta)[1])
    assert torch.equal(got["embed.weight"], w) and torch.equal(got["lm_head.weight"], w)


def test_crash_before_marker_is_never_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _cfg(tmp_path)
    sender = DiskWeightSender(cfg)
    good = sender.send(1, [("w", torch.ones(8))])

    def crash(self: DiskWeightSender, folder: Path, meta: object) -> None:
        raise OSError("simulated crash before the marker")

    monkeypatch.setattr(DiskWeightSender, "_write_marker", crash)
    with pytest.raises(OSError, match="simulated crash"):
        sender.send(2, [("w", torch.full((8,), 2.0))])
    assert (tmp_path / "ws" / "v2" / disk_mod.WEIGHTS_FILE).exists()  # the data is there, unmarked

    receiver = DiskWeightReceiver(cfg)
    assert receiver.latest() == good
    bad = good.model_copy(update={"version": 2, "path": str(tmp_path / "ws" / "v2")})
    with pytest.raises(WeightSyncError, match="not complete"):
        receiver.receive(bad)
    assert receiver.last_transfer is not None and not receiver.last_transfer.ok

    monkeypatch.undo()
    DiskWeightSender(cfg)  # a restarted writer removes the leftover
    assert not (tmp_path / "ws" / "v2").exists()


def test_keeps_only_the_newest_versions(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, keep_versions=2)
    sender = DiskWeightSender(cfg)
    for v in range(5):
        sender.send(v, [("w", torch.full((4,), float(v)))])
    assert sorted(p.name for p in (tmp_path / "ws").iterdir()) == ["v3", "v4"]
    meta = DiskWeightReceiver(cfg).latest()
    assert meta is not None and meta.version == 4


def test_corrupted_bytes_are_refused(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    meta = DiskWeightSender(cfg).send(1, [("w", torch.arange(64, dtype=torch.float32))])
    path = Path(meta.path) / disk_mod.WEIGHTS_FILE
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF  # a byte inside the tensor data, header intact
    path.write_bytes(bytes(raw))
    with pytest.raises(WeightSyncError, match="checksum mismatch"):
        DiskWeightReceiver(cfg).receive(meta)


def test_announced_checksum_must_match(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    meta = DiskWeightSender(cfg).send(1, [("w", torch.ones(3))])
    with pytest.raises(WeightSyncError, match="was announced"):
        DiskWeightReceiver(cfg).receive(meta.model_copy(update={"checksum": "0" * 64}))


def test_spec_mismatch_is_refused_before_loading(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    meta = DiskWeightSender(cfg).send(1, [("w", torch.ones(3))])
    receiver = DiskWeightReceiver(cfg, expected=spec_of([("w", torch.ones(4))]))
    with pytest.raises(WeightSyncError, match=r"'w' is float32\[3\], expected float32\[4\]"):
        receiver.receive(meta)


def test_concurrent_reader_only_sees_complete_versions(tmp_path: Path) -> None:
    """A reader polling `latest()` while a writer publishes never gets a mixed or partial set."""
    cfg = _cfg(tmp_path, keep_versions=2)
    sender = DiskWeightSender(cfg)
    sender.send(0, [("a", torch.zeros(20_000)), ("b", torch.zeros(20_000))])
    stop = threading.Event()
    seen: list[int] = []
    errors: list[str] = []
    wrong: list[str] = []

    def read() -> None:
        receiver = DiskWeightReceiver(cfg)
        while not stop.is_set():
            meta = receiver.latest()
            if meta is None:
                wrong.append("no complete version visible")
                return
            try:
                version, it = receiver.receive(meta)
            except WeightSyncError as e:  # removed by cleanup while we read: a clear error, never partial
                errors.append(str(e))
                continue
            got = dict(it)
            if not (torch.all(got["a"] == version) and torch.all(got["b"] == version)):
                wrong.append(f"v{version} loaded with other values")
            seen.append(version)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for v in range(1, 30):
            sender.send(v, [("a", torch.full((20_000,), float(v))), ("b", torch.full((20_000,), float(v)))])
    finally:
        stop.set()
        reader.join(10)
    assert not reader.is_alive()
    assert not wrong
    assert seen, "the reader never loaded a version"
    assert seen == sorted(seen)
    assert all("removed" in e or "not complete" in e for e in errors)
