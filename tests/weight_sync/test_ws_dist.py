"""Dist transport across real processes: a gloo group on its own TCPStore.

One scenario, because every receiver process costs seconds of startup on a loaded
2-core box: exact fp32 and bf16 delivery, a receiver killed mid-transfer, a rebuild
without it, a checksum refusal, and a late joiner that is first refused and then in.
The metas reach the receivers only as wire-encoded bytes, as on the control channel;
the receivers are not told the store address for the late joiner (port 0 in their
config), so the meta is all they need.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _ws_workers import receiver_main, tensor_digest
from safetensors.torch import load_file

from areal_like.core import wire
from areal_like.core.config import DistWeightSyncConfig
from areal_like.core.types import WeightUpdateMeta
from weight_sync import DistWeightSender

TIMEOUT_S = 3.0


class _Receivers:
    """Spawned receiver processes and the queues standing in for the control channel."""

    def __init__(self, store_addr: str) -> None:
        self.ctx = mp.get_context("spawn")
        self.store_addr = store_addr
        self.outbox = self.ctx.Queue()
        self.inboxes: dict[str, Any] = {}
        self.procs: dict[str, Any] = {}

    def start(
        self,
        rid: str,
        *,
        connect: bool = True,
        fault: tuple[str, int, int] | None = None,
        expected: list[dict[str, Any]] | None = None,
    ) -> None:
        self.inboxes[rid] = self.ctx.Queue()
        addr = self.store_addr if connect else None
        args = (rid, addr, self.inboxes[rid], self.outbox, TIMEOUT_S, fault, expected)
        self.procs[rid] = self.ctx.Process(target=receiver_main, args=args, daemon=True)
        self.procs[rid].start()

    def collect(self, ids: list[str], timeout: float = 60.0) -> dict[str, dict[str, Any]]:
        got: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while set(got) != set(ids):
            try:
                msg = self.outbox.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"no answer from {sorted(set(ids) - set(got))} within {timeout}s"
                ) from None
            got[msg["id"]] = msg
        return got

    def publish(
        self, meta: WeightUpdateMeta, to: list[str], answers: list[str] | None = None
    ) -> dict[str, Any]:
        frame = wire.encode(meta)
        for rid in to:
            self.inboxes[rid].put(frame)
        return self.collect(to if answers is None else answers, timeout=6 * TIMEOUT_S + 30)

    def stop(self) -> None:
        for rid, proc in self.procs.items():
            if proc.is_alive():
                self.inboxes[rid].put(b"stop")
        for proc in self.procs.values():
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def _version(model: dict[str, torch.Tensor], k: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {name: (t * k).to(dtype) for name, t in model.items()}


def _digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: tensor_digest(t) for name, t in tensors.items()}


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(tiny_model_dir / "model.safetensors"))


def test_group_delivers_exactly_survives_a_dead_receiver_and_rebuilds(model: dict[str, torch.Tensor]) -> None:
    """The broadcast lane (what receivers on other hosts get; the shared-memory lane is off)."""
    cfg = DistWeightSyncConfig(type="dist", bucket_mb=0.25, timeout_s=TIMEOUT_S, store_addr="127.0.0.1:0",
                               shared_memory=False)
    sender = DistWeightSender(cfg)
    receivers = _Receivers(sender.store_addr)
    try:
        receivers.start("A")
        receivers.start("B", fault=("exit", 3, 4))  # header, 2 buckets, then dies instead of the 3rd
        receivers.collect(["A", "B"], timeout=120)
        assert sorted(sender.wait_for_receivers(2, timeout=30)) == ["A", "B"]

        # v1 (fp32) and v2 (bf16): both receivers get every byte.
        for version, dtype in [(1, torch.float32), (2, torch.bfloat16)]:
            tensors = _version(model, version, dtype)
            meta = sender.send(version, tensors.items())
            assert meta.bucket_bytes == 256 * 1024 and len(meta.tensors) == len(tensors)
            for answer in receivers.publish(meta, ["A", "B"]).values():
                assert answer["ok"], answer
                assert answer["version"] == version and answer["gen"] == 1
                assert answer["digests"] == _digests(tensors)
            stats = sender.wait()
            assert stats is not None and stats.ok and stats.accepted == 2 and stats.generation == 1

        # v3: B dies mid-transfer. A must not activate v3 (commit barrier), the sender reports it.
        meta = sender.send(3, _version(model, 3, torch.float32).items())
        answer = receivers.publish(meta, ["A", "B"], answers=["A"])["A"]
        assert not answer["ok"] and answer["kind"] == "WeightSyncError" and answer["version"] == 2
        receivers.procs["B"].join(30)
        assert receivers.procs["B"].exitcode == 17
        stats = sender.wait()
        assert stats is not None and not stats.ok and stats.error

        # v4: the sender waits timeout_s for B, leaves it out, rebuilds generation 2 with A.
        tensors = _version(model, 4, torch.float32)
        meta = sender.send(4, tensors.items())
        answer = receivers.publish(meta, ["A"])["A"]
        assert answer["ok"], answer
        assert answer["version"] == 4 and answer["gen"] == 2 and answer["digests"] == _digests(tensors)
        stats = sender.wait()
        assert stats is not None and stats.ok and stats.receivers == ["A"] and stats.generation == 2

        # v5: the announced checksum does not match the bytes: refused, A keeps v4, no rebuild needed.
        meta = sender.send(5, _version(model, 5, torch.float32).items())
        answer = receivers.publish(meta.model_copy(update={"checksum": "0" * 64}), ["A"])["A"]
        assert not answer["ok"] and "checksum mismatch" in answer["error"] and answer["version"] == 4
        stats = sender.wait()
        assert stats is not None and not stats.ok and stats.accepted == 0 and stats.generation == 2

        # v6: C starts knowing nothing but the meta and is too late for v6's group; v7 includes it.
        receivers.start("C", connect=False)
        receivers.collect(["C"], timeout=120)
        tensors = _version(model, 6, torch.bfloat16)
        meta = sender.send(6, tensors.items())
        assert receivers.publish(meta, ["A"])["A"]["ok"]
        late = receivers.publish(meta, ["C"])["C"]
        assert not late["ok"] and late["kind"] == "NotAMemberError" and late["version"] is None

        tensors = _version(model, 7, torch.float32)
        meta = sender.send(7, tensors.items())
        for answer in receivers.publish(meta, ["A", "C"]).values():
            assert answer["ok"], answer
            assert answer["version"] == 7 and answer["gen"] == 3 and answer["digests"] == _digests(tensors)
        stats = sender.wait()
        assert stats is not None and stats.ok and stats.receivers == ["A", "C"] and stats.accepted == 2
    finally:
        receivers.stop()
        sender.close()


def test_same_host_receivers_read_shared_memory_and_a_dead_one_stops_the_version(
    model: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """Receivers on the sender's host read each version from its shared-memory staging
    file (no bucket broadcast), exactly; one that dies before its commit vote makes the
    other keep its weights, as on the broadcast lane; the files go with the sender, and a
    dead sender's are removed by the next one."""
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    (shm_dir / "areal_ws-999999999-deadbeef-1").write_bytes(b"x" * 10)  # a killed trainer's file
    cfg = DistWeightSyncConfig(type="dist", timeout_s=TIMEOUT_S, store_addr="127.0.0.1:0", shm_dir=str(shm_dir))
    sender = DistWeightSender(cfg)
    assert sorted(p.name for p in shm_dir.iterdir()) == [f"areal_ws-{os.getpid()}-{sender._nonce}.probe"]
    receivers = _Receivers(sender.store_addr)
    try:
        receivers.start("A")
        receivers.start("B", fault=("exit", 3, 2))  # header, then dies at its commit vote
        receivers.collect(["A", "B"], timeout=120)
        sender.wait_for_receivers(2, timeout=30)
        for version, dtype in [(1, torch.float32), (2, torch.bfloat16)]:
            tensors = _version(model, version, dtype)
            for answer in receivers.publish(sender.send(version, tensors.items()), ["A", "B"]).values():
                assert answer["ok"] and answer["digests"] == _digests(tensors), answer
            stats = sender.wait()
            assert stats is not None and stats.ok and stats.accepted == 2 and stats.lane == "shm", stats

        answer = receivers.publish(sender.send(3, _version(model, 3, torch.float32).items()), ["A", "B"],
                                   answers=["A"])["A"]
        assert not answer["ok"] and answer["version"] == 2, answer
        receivers.procs["B"].join(30)
        assert receivers.procs["B"].exitcode == 17
        stats = sender.wait()
        assert stats is not None and not stats.ok

        tensors = _version(model, 4, torch.float32)
        answer = receivers.publish(sender.send(4, tensors.items()), ["A"])["A"]
        assert answer["ok"] and answer["digests"] == _digests(tensors) and answer["gen"] == 2, answer
        stats = sender.wait()
        assert stats is not None and stats.ok and stats.receivers == ["A"] and stats.lane == "shm"
    finally:
        receivers.stop()
        sender.close()
    assert list(shm_dir.iterdir()) == []


@pytest.mark.slow
def test_hung_receiver_times_out_and_a_local_refusal_stays_local(model: dict[str, torch.Tensor]) -> None:
    """B stalls mid-transfer: everyone times out, and the same two rebuild a group. Then
    B's engine expects another shape: B refuses, A activates, the group stays as it is."""
    cfg = DistWeightSyncConfig(type="dist", bucket_mb=0.25, timeout_s=TIMEOUT_S, store_addr="127.0.0.1:0",
                               shared_memory=False)
    sender = DistWeightSender(cfg)
    receivers = _Receivers(sender.store_addr)
    name = next(iter(model))
    spec = [
        {
            "name": n,
            "dtype": "float32",
            "shape": [*t.shape[:-1], t.shape[-1] + 1] if n == name else list(t.shape),
        }
        for n, t in model.items()
    ]
    try:
        receivers.start("A")
        receivers.start("B", fault=("hang", 1, 3), expected=spec)
        receivers.collect(["A", "B"], timeout=120)
        sender.wait_for_receivers(2, timeout=30)

        t0 = time.monotonic()
        meta = sender.send(1, model.items())
        answers = receivers.publish(meta, ["A", "B"])
        assert not answers["A"]["ok"] and answers["A"]["version"] is None
        error = answers["A"]["error"].lower()
        assert "timed out" in error or "closed" in error or "reset" in error, error
        assert not answers["B"]["ok"]
        stats = sender.wait()
        assert stats is not None and not stats.ok and stats.error
        assert stats.seconds < 2 * TIMEOUT_S + 5 and time.monotonic() - t0 < 4 * TIMEOUT_S + 10

        for version in (2, 3):
            tensors = _version(model, version, torch.float32)
            meta = sender.send(version, tensors.items())
            answers = receivers.publish(meta, ["A", "B"])
            assert answers["A"]["ok"] and answers["A"]["digests"] == _digests(tensors)
            assert answers["A"]["gen"] == 2
            assert not answers["B"]["ok"] and f"{name!r} is float32" in answers["B"]["error"]
            assert answers["B"]["version"] is None
            stats = sender.wait()
            assert stats is not None and stats.accepted == 1 and stats.generation == 2
            assert stats.error == "1 of 2 receivers refused the version"
    finally:
        receivers.stop()
        sender.close()
