"""ZMQ channels: typed frames flow, bad frames are refused and counted, secrets enforced."""

from __future__ import annotations

import time

import pytest
import zmq

from areal_like.core.types import RolloutStats, VersionAnnouncement
from areal_like.orchestration.channels import (
    ChannelError,
    ControlPublisher,
    ControlSubscriber,
    DataPuller,
    DataPusher,
)


def _recv(ch, timeout=5.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = ch.recv(0.1)
        if m is not None:
            return m
    return None


def _free_port_below_ephemeral() -> int:
    import random
    import socket

    for _ in range(100):
        port = random.randint(20000, 30000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


def test_data_channel_round_trip_either_start_order() -> None:
    pull = DataPuller("tcp://127.0.0.1:0")
    push = DataPusher(pull.addr)
    msg = RolloutStats(time=1.0, loaded_version=2, started=8, running=4)
    push.send(msg)
    assert _recv(pull) == msg
    push.close(), pull.close()
    # connect first, bind later: ZMQ reconnects
    # a port below the ephemeral range, so the early connects cannot self-connect to it
    real = _free_port_below_ephemeral()
    push = DataPusher(f"tcp://127.0.0.1:{real}")
    pull = DataPuller(f"tcp://127.0.0.1:{real}")
    push.send(msg)
    assert _recv(pull) == msg
    push.close(), pull.close()


def test_garbage_is_refused_and_receiver_keeps_running() -> None:
    pull = DataPuller("tcp://127.0.0.1:0")
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.connect(pull.addr)
    raw.send(b"not msgpack")
    push = DataPusher(pull.addr)
    msg = RolloutStats(time=1.0, loaded_version=0, started=0, running=0)
    time.sleep(0.1)
    push.send(msg)
    assert _recv(pull) == msg
    deadline = time.time() + 5  # two sockets: the frames may arrive in either order
    while pull.refused == 0 and time.time() < deadline:
        assert pull.recv(0.1) is None
    assert pull.refused == 1 and "msgpack" in pull.last_error
    raw.close(0), push.close(), pull.close()


def test_secret_required_and_checked() -> None:
    with pytest.raises(ChannelError, match="beyond loopback"):
        DataPuller("tcp://0.0.0.0:0")
    pull = DataPuller("tcp://127.0.0.1:0", secret="s3")
    bad = DataPusher(pull.addr, secret="wrong")
    good = DataPusher(pull.addr, secret="s3")
    msg = RolloutStats(time=1.0, loaded_version=0, started=0, running=0)
    bad.send(msg)
    good.send(msg)
    assert _recv(pull) == msg
    deadline = time.time() + 5  # the two senders' frames may arrive in either order
    while pull.refused == 0 and time.time() < deadline:
        assert pull.recv(0.1) is None  # the only other frame is the forged one
    assert pull.refused == 1 and "HMAC" in pull.last_error
    bad.close(), good.close(), pull.close()


def test_control_channel_publishes_announcements() -> None:
    pub = ControlPublisher("tcp://127.0.0.1:0")
    sub = ControlSubscriber(pub.addr)
    ann = VersionAnnouncement(version=3, consumed=24, dropped=2)
    got = None
    for _ in range(50):  # slow joiner: the trainer re-publishes until seen
        pub.publish(ann)
        got = sub.recv(0.1)
        if got is not None:
            break
    assert got == ann
    pub.close(), sub.close()
