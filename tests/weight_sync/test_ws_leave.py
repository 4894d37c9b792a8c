"""A dead server leaves the weight group by its name, and so do its engine's workers
(`{name}-w{rank}`, vLLM's members): the next transfer does not wait `timeout_s` for them."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from areal_like.core.config import DistWeightSyncConfig
from weight_sync.dist import _CTL, DistWeightSender, leave_group


def _join(store_addr: str, receiver_id: str) -> None:
    """Register as a receiver that never becomes ready (a server that died after joining)."""
    host, port = store_addr.rsplit(":", 1)
    ctl = dist.PrefixStore(_CTL, dist.TCPStore(host, int(port), None, False, wait_for_workers=False))
    n = ctl.add("join/n", 1)
    ctl.set(f"join/{n}", receiver_id)


def test_a_servers_workers_leave_with_it(caplog) -> None:
    sender = DistWeightSender(DistWeightSyncConfig(type="dist", timeout_s=20.0, store_addr="127.0.0.1:0"))
    try:
        for rid in ("server-0-w0", "server-0-w1", "server-10-w0"):
            _join(sender.store_addr, rid)
        leave_group(sender.store_addr, "server-0")  # the rollout side saw server-0 die
        leave_group(sender.store_addr, "server-10")
        caplog.set_level(logging.INFO, logger="weight_sync.dist")
        sender.send(1, [("w", torch.ones(4))])
        stats = sender.wait(timeout=60)
        assert stats is not None
        assert "not ready within" not in caplog.text, caplog.text
    finally:
        sender.close()


def test_a_leave_takes_only_that_servers_workers(caplog) -> None:
    """server-1 leaving does not take server-10's or server-1x's workers out."""
    from weight_sync.dist import _worker_of

    assert _worker_of("server-1-w0", "server-1") and _worker_of("server-1-w12", "server-1")
    assert not _worker_of("server-10-w0", "server-1") and not _worker_of("server-1-wx", "server-1")
    assert not _worker_of("server-1", "server-1")


def test_a_receiver_killed_between_taking_a_log_index_and_writing_it_holds_nobody(caplog) -> None:
    """A receiver appends to the join log and to a transfer's ready list in two steps
    (take an index, write it). One SIGKILLed between the two left a hole the sender's
    read waited on for the store's whole timeout, and that version failed (CI, stop 40:
    60 s, `keys: .../x2/ready/1`). The sender reads past holes; the live receiver gets
    the version at once."""
    import threading
    import time

    from weight_sync.dist import DistWeightReceiver

    timeout_s = 3.0
    sender = DistWeightSender(DistWeightSyncConfig(type="dist", timeout_s=timeout_s, store_addr="127.0.0.1:0",
                                                   shared_memory=False))
    a = DistWeightReceiver(DistWeightSyncConfig(type="dist", timeout_s=timeout_s, shared_memory=False), "a")
    try:
        host, port = sender.store_addr.rsplit(":", 1)
        dead = dist.PrefixStore(_CTL, dist.TCPStore(host, int(port), None, False, wait_for_workers=False))
        dead.add("join/n", 1)  # killed before `set("join/1", ...)`
        a.connect(sender.store_addr)
        sender.wait_for_receivers(1)
        dead.add("x1/ready/n", 1)  # and, for the first transfer, before writing its ready line
        t0 = time.monotonic()
        meta = sender.send(1, [("w", torch.full((6,), 3.0))])
        got: dict[str, object] = {}
        th = threading.Thread(target=lambda: got.update(r=a.receive(meta)))
        th.start()
        th.join(4 * timeout_s)
        stats = sender.wait(timeout=4 * timeout_s)
        assert stats is not None and stats.ok and stats.receivers == ["a"], stats
        assert time.monotonic() - t0 < timeout_s, "the sender waited on the hole"
        (_, named), = [got["r"]]
        assert torch.equal(dict(named)["w"], torch.full((6,), 3.0))
    finally:
        a.close()
        sender.close()
