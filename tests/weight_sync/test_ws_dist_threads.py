"""Dist transport with sender and receivers as threads of one process (fast, no spawn).

Gloo groups work between threads as between processes; these tests pin behaviour
that needs no process death: buffer reuse, leaving, a restarted engine, addresses.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from areal_like.core.config import DiskWeightSyncConfig, DistWeightSyncConfig
from areal_like.core.types import WeightUpdateMeta
from tests.weight_sync.conftest import TIMEOUT_S
from weight_sync import (
    DiskWeightReceiver,
    DiskWeightSender,
    DistWeightReceiver,
    DistWeightSender,
    WeightSyncError,
    make_receiver,
    make_sender,
)
from weight_sync.dist import parse_address


def _receiver(rid: str, shared_memory: bool = True) -> DistWeightReceiver:
    return DistWeightReceiver(DistWeightSyncConfig(type="dist", timeout_s=TIMEOUT_S, shared_memory=shared_memory), rid)


def _deliver(meta: WeightUpdateMeta, receivers: list[DistWeightReceiver]) -> dict[str, Any]:
    """Each receiver receives on its own thread; returns {id: list of (name, tensor, data_ptr)} or the error."""
    out: dict[str, Any] = {}

    def run(r: DistWeightReceiver) -> None:
        try:
            _, named = r.receive(meta)
            out[r.receiver_id] = [(n, t.clone(), t.data_ptr()) for n, t in named]
        except WeightSyncError as e:
            out[r.receiver_id] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in receivers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(6 * TIMEOUT_S)
    return out


def _tensors(k: float, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {"w": torch.full((300, 7), k, dtype=dtype), "b": torch.arange(5, dtype=dtype) * k}


def test_buffers_are_reused_and_layout_changes_reallocate(sender: DistWeightSender) -> None:
    r = _receiver("r0")
    r.connect(sender.store_addr)
    sender.wait_for_receivers(1)
    ptrs = []
    for version, dtype in [(1, torch.float32), (2, torch.float32), (3, torch.bfloat16)]:
        tensors = _tensors(version, dtype)
        got = _deliver(sender.send(version, tensors.items()), [r])["r0"]
        assert [(n, t.dtype) for n, t, _ in got] == [(n, t.dtype) for n, t in tensors.items()]
        assert all(torch.equal(t, tensors[n]) for n, t, _ in got)
        ptrs.append([p for _, _, p in got])
        stats = sender.wait()
        assert stats is not None and stats.ok and stats.generation == 1
    assert ptrs[0] == ptrs[1]  # same layout: received into the same memory, no allocation
    assert ptrs[2] != ptrs[1]
    r.close()


def test_receivers_that_joined_well_before_the_first_version_get_it_without_the_settle(
    sender: DistWeightSender,
) -> None:
    """A rollout side registers its servers before it says hello, and a run's first version
    comes a whole batch later: the sender does not wait `settle_s` for more joins then (it
    did, 0.2 s at every run's start). The settle counts from the last join."""
    sender._membership.settle_s = 2.0  # long enough to see, were it waited
    a, b = _receiver("a"), _receiver("b")
    a.connect(sender.store_addr)
    b.connect(sender.store_addr)
    time.sleep(2.2)  # the joins are older than the settle
    got = _deliver(sender.send(1, _tensors(1).items()), [a, b])
    assert all(not isinstance(v, Exception) for v in got.values()), got
    stats = sender.wait()
    assert stats is not None and stats.ok and stats.accepted == 2
    assert stats.rendezvous_s < 1.0, stats  # 2.0 s and more when the settle counted from the send
    a.close()
    b.close()


def test_one_receiver_without_the_shared_memory_lane_puts_the_whole_group_on_the_broadcast(
    sender: DistWeightSender,
) -> None:
    """The lane is per transfer: all members read the staging file, or all take the
    broadcast (a receiver on another host, here one with the lane off)."""
    a, b = _receiver("a"), _receiver("b", shared_memory=False)
    a.connect(sender.store_addr)
    sender.wait_for_receivers(1)
    got = _deliver(sender.send(1, _tensors(1).items()), [a])
    assert all(torch.equal(t, _tensors(1)[n]) for n, t, _ in got["a"])
    stats = sender.wait()
    assert stats is not None and stats.ok and stats.lane == "shm" and a.last_transfer.lane == "shm"
    b.connect(sender.store_addr)
    sender.wait_for_receivers(2)
    got = _deliver(sender.send(2, _tensors(2).items()), [a, b])
    for rid in ("a", "b"):
        assert all(torch.equal(t, _tensors(2)[n]) for n, t, _ in got[rid]), got[rid]
    stats = sender.wait()
    assert stats is not None and stats.ok and stats.accepted == 2 and stats.lane == "gloo", stats
    assert a.last_transfer.lane == b.last_transfer.lane == "gloo"
    a.close()
    b.close()


def test_bytes_changed_in_the_shared_memory_file_are_refused_by_the_checksum(sender: DistWeightSender) -> None:
    r = _receiver("r")
    r.connect(sender.store_addr)
    sender.wait_for_receivers(1)
    assert not isinstance(_deliver(sender.send(1, _tensors(1).items()), [r])["r"], Exception)
    sender.wait()
    meta = sender.send(2, _tensors(2).items())
    assert sender._shm.path is not None
    with open(sender._shm.path, "r+b") as f:  # another process scribbles on the file before it is read
        f.seek(100)
        f.write(b"\xff\xfe")
    got = _deliver(meta, [r])["r"]
    assert isinstance(got, WeightSyncError) and "checksum mismatch" in str(got)
    stats = sender.wait()
    assert stats is not None and stats.lane == "shm" and stats.accepted == 0
    r.close()


def test_a_staging_file_that_vanished_is_refused_and_the_broadcast_takes_over(sender: DistWeightSender) -> None:
    """Another process removed the sender's file (a cleanup that took the sender for dead):
    the receiver keeps its weights that version, says so, and stops offering the lane, so
    the next version comes by the broadcast."""
    r = _receiver("r")
    r.connect(sender.store_addr)
    sender.wait_for_receivers(1)
    meta = sender.send(1, _tensors(1).items())
    assert sender._shm.path is not None
    Path(sender._shm.path).unlink()
    got = _deliver(meta, [r])["r"]
    assert isinstance(got, WeightSyncError) and "staging file" in str(got), got
    stats = sender.wait()
    assert stats is not None and stats.lane == "shm" and stats.accepted == 0 and stats.receivers == ["r"]
    got = _deliver(sender.send(2, _tensors(2).items()), [r])["r"]
    assert all(torch.equal(t, _tensors(2)[n]) for n, t, _ in got), got
    stats = sender.wait()
    assert stats is not None and stats.ok and stats.lane == "gloo" and stats.generation == 1
    r.close()


def test_a_receiver_that_leaves_is_not_waited_for(sender: DistWeightSender) -> None:
    a, b = _receiver("a"), _receiver("b")
    for r in (a, b):
        r.connect(sender.store_addr)
    sender.wait_for_receivers(2)
    assert all(
        not isinstance(v, Exception) for v in _deliver(sender.send(1, _tensors(1).items()), [a, b]).values()
    )
    b.close()
    t0 = time.monotonic()
    got = _deliver(sender.send(2, _tensors(2).items()), [a])
    stats = sender.wait()
    assert not isinstance(got["a"], Exception)
    assert stats is not None and stats.ok and stats.receivers == ["a"] and stats.generation == 2
    assert time.monotonic() - t0 < TIMEOUT_S  # no wait for the one that left
    a.close()


def test_a_restarted_engine_with_the_same_id_gets_a_new_group(sender: DistWeightSender) -> None:
    old = _receiver("engine-0")
    old.connect(sender.store_addr)
    sender.wait_for_receivers(1)
    assert not isinstance(_deliver(sender.send(1, _tensors(1).items()), [old])["engine-0"], Exception)
    new = _receiver("engine-0")  # the engine restarted; the old object is gone without a word
    got = _deliver(sender.send(2, _tensors(2).items()), [new])
    assert not isinstance(got["engine-0"], Exception), got
    stats = sender.wait()
    assert stats is not None and stats.ok and stats.generation == 2


def test_a_receiver_that_comes_late_learns_it_at_once_and_is_in_the_next_version(sender: DistWeightSender) -> None:
    """A receiver busy elsewhere while the sender went through several transfers (their
    plans deleted since) must not wait out a timeout per stale meta, which kept a rollout
    side behind forever (CI: "no plan ... within 8.0s" for every resend). It is told at
    once, re-registers, and the next version reaches it."""
    r = _receiver("late")
    r.connect(sender.store_addr)
    sender.wait_for_receivers(1)
    stale = sender.send(1, _tensors(1).items())  # r never shows up: left out after TIMEOUT_S
    sender.wait()
    for v in (2, 3, 4):  # nobody registered: each published at once, older plans forgotten
        sender.send(v, _tensors(v).items())
        sender.wait()
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="after the sender moved on"):
        r.receive(stale)
    assert time.monotonic() - t0 < TIMEOUT_S
    got = _deliver(sender.send(5, _tensors(5).items()), [r])["late"]
    assert not isinstance(got, Exception), got
    assert all(torch.equal(t, _tensors(5)[n]) for n, t, _ in got)
    stats = sender.wait()
    assert stats is not None and stats.ok and stats.receivers == ["late"]
    r.close()


def test_meta_from_another_transport_or_address_is_refused(sender: DistWeightSender, tmp_path: Any) -> None:
    disk_cfg = DiskWeightSyncConfig(type="disk", disk_path=str(tmp_path))
    disk_meta = DiskWeightSender(disk_cfg).send(1, _tensors(1).items())
    with pytest.raises(WeightSyncError, match="dist receiver got a 'disk' meta"):
        _receiver("x").receive(disk_meta)
    dist_meta = sender.send(1, _tensors(1).items())
    with pytest.raises(WeightSyncError, match="disk receiver got a 'dist' meta"):
        DiskWeightReceiver(disk_cfg).receive(dist_meta)
    with pytest.raises(WeightSyncError, match="bad dist transfer address"):
        _receiver("x").receive(dist_meta.model_copy(update={"path": "tcp://127.0.0.1:1/x"}))
    assert sender.wait() is not None  # nobody was registered: nothing to send, no error


def test_factory_and_addresses(tmp_path: Any) -> None:
    disk_cfg = DiskWeightSyncConfig(type="disk", disk_path=str(tmp_path))
    assert isinstance(make_sender(disk_cfg), DiskWeightSender)
    assert isinstance(make_receiver(disk_cfg, "r"), DiskWeightReceiver)
    assert isinstance(make_receiver(DistWeightSyncConfig(type="dist"), "r"), DistWeightReceiver)
    assert parse_address("tcp://10.0.0.2:29500") == ("10.0.0.2", 29500)
    assert parse_address("[::1]:80") == ("::1", 80)
    with pytest.raises(WeightSyncError, match="bad weight-group store address"):
        parse_address("localhost")
    with pytest.raises(ValueError, match="receiver_id"):
        _receiver("a b")
