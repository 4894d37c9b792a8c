"""ZMQ channels: typed frames flow, bad frames are refused and counted, secrets enforced."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq

from areal_like.core.types import GateCounts, Origin, RolloutStats, VersionAnnouncement
from areal_like.orchestration.channels import (
    ChannelError,
    ControlPublisher,
    ControlSubscriber,
    DataPuller,
    DataPusher,
)
from tests.fault_proxy import Proxy


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
    ann = VersionAnnouncement(version=3, counts=GateCounts(consumed=24, dropped=2))

    async def listen() -> VersionAnnouncement | None:  # the subscriber is asyncio-native
        for _ in range(50):  # slow joiner: the trainer re-publishes until seen
            pub.publish(ann)
            got = await sub.recv(0.1)
            if got is not None:
                return got
        return None

    assert asyncio.run(listen()) == ann
    pub.close(), sub.close()


# ---- the acknowledged data channel (docs/design.md §10.7) ----------------------------------
def _stats(i: int, epoch: int = 0, sender: str = "ro-1") -> RolloutStats:
    return RolloutStats(time=float(i), loaded_version=0, started=i, running=0,
                        origin=Origin(run_id="run", epoch=epoch, sender=sender))


class _Acker:
    """The control channel's part, in a thread: the trainer's acknowledgements reach the
    pusher (as the heartbeat would) and the pusher maintains itself (as the rollout
    side's listener thread does)."""

    def __init__(self, pull: DataPuller, push: DataPusher, epoch: int = 0, sender: str = "ro-1") -> None:
        self.stop = threading.Event()

        def loop() -> None:
            while not self.stop.wait(0.05):
                push.ack(epoch, pull.acks().get(sender, []))
                push.maintain()

        self.t = threading.Thread(target=loop, daemon=True)
        self.t.start()

    def close(self) -> None:
        self.stop.set()
        self.t.join()


def _drain(pull: DataPuller, want: int, timeout: float = 20.0) -> list:
    got: list = []
    deadline = time.time() + timeout
    while len(got) < want and time.time() < deadline:
        m = pull.recv(0.1)
        if m is not None:
            got.append(m)
    extra = pull.recv(0.5)  # nothing more may come (no duplicate gets through)
    assert extra is None, extra
    return got


def test_frames_lost_in_a_connection_reset_are_resent_and_arrive_once() -> None:
    """Frames written into a link that then resets (the bytes were taken and never
    delivered) reach the trainer after ZMQ reconnects, each exactly once."""
    pull = DataPuller("tcp://127.0.0.1:0")
    proxy = Proxy(0, int(pull.addr.rsplit(":", 1)[1]))
    push = DataPusher(f"tcp://127.0.0.1:{proxy.listen}")
    acker = _Acker(pull, push)
    try:
        for i in range(1, 6):
            push.send(_stats(i))
        assert [m.started for m in _drain(pull, 5)] == [1, 2, 3, 4, 5]
        proxy.swallow()  # the link dies with data in flight
        for i in range(6, 11):
            push.send(_stats(i))
        deadline = time.time() + 5
        while proxy.swallowed == 0 and time.time() < deadline:
            time.sleep(0.05)
        assert proxy.swallowed > 0 and pull.recv(0.3) is None  # taken by the link, never delivered
        proxy.reset(down_s=1.0)  # RST, and the link stays cut for a second
        got = _drain(pull, 5)
        assert sorted(m.started for m in got) == [6, 7, 8, 9, 10]
        assert push.reconnects >= 1 and push.resent >= 5
        assert push.flush(10.0) == 0  # every frame acknowledged in the end
        assert pull.acks() == {"ro-1": [10]}
    finally:
        acker.close(), push.close(), proxy.close(), pull.close()


def test_duplicates_are_dropped_by_sender_epoch_and_seq() -> None:
    pull = DataPuller("tcp://127.0.0.1:0")
    push = DataPusher(pull.addr)
    try:
        for i in range(1, 4):
            push.send(_stats(i))
        assert len(_drain(pull, 3)) == 3
        # a reconnect resends everything not yet acknowledged: here all three again (the
        # trainer's acknowledgement that would have released them was lost)
        events = iter([True])
        push._events = lambda: next(events, False)  # type: ignore[method-assign]  # as after one reconnect
        push.maintain()
        push.ack(0, [0])  # the trainer speaks again (a stale acknowledgement: nothing yet)
        push.maintain()
        assert pull.recv(1.0) is None
        assert pull.duplicates == 3 and push.resent == 3
        # the same seq from another sender, or of another epoch, is not a duplicate
        other = DataPusher(pull.addr)
        other.send(_stats(1, sender="ro-2"))
        push.send(_stats(4, epoch=1))
        assert sorted((m.origin.sender, m.origin.epoch, m.origin.seq) for m in _drain(pull, 2)) == \
            [("ro-1", 1, 1), ("ro-2", 0, 1)]
        other.close()
    finally:
        push.close(), pull.close()


class _Corrupting(DataPusher):
    """A sender whose frame #2 is damaged on the way, every time it is sent."""

    def _frames(self, msg):  # noqa: ANN001, ANN202
        frames = super()._frames(msg)
        return [b"\xc1damaged"] if msg.origin.seq == 2 else frames


def test_a_frame_the_trainer_never_takes_is_given_up_and_does_not_stall_the_acks() -> None:
    """A frame refused at every try is resent `max_resends` times while later frames are
    acknowledged, then given up and counted; the frames after it are still acknowledged,
    so nothing else is resent forever."""
    pull = DataPuller("tcp://127.0.0.1:0")
    push = _Corrupting(pull.addr, resend_after_s=0.3, max_resends=2)
    acker = _Acker(pull, push)
    try:
        for i in range(1, 6):
            push.send(_stats(i))
        assert [m.started for m in _drain(pull, 4)] == [1, 3, 4, 5]
        deadline = time.time() + 15
        while push.given_up == 0 and time.time() < deadline:
            time.sleep(0.1)
        assert push.given_up == 1 and pull.refused == 3  # sent, resent twice, given up
        push.send(_stats(6))  # carries `low`: nothing below it comes again
        assert [m.started for m in _drain(pull, 1)] == [6]
        assert push.flush(5.0) == 0 and pull.acks() == {"ro-1": [6]}
    finally:
        acker.close(), push.close(), pull.close()


def test_a_frame_over_the_size_limit_is_refused_at_the_sender() -> None:
    pull = DataPuller("tcp://127.0.0.1:0")
    push = DataPusher(pull.addr, max_bytes=4096)
    try:
        big = _stats(1)
        big.data_position = {f"k{i}": i for i in range(2000)}
        with pytest.raises(ChannelError, match="over transport.max_frame_mb"):
            push.send(big)
        assert push.unacked == 0
    finally:
        push.close(), pull.close()


def test_a_newer_trainer_epoch_releases_the_older_epochs_frames() -> None:
    pull = DataPuller("tcp://127.0.0.1:0", epoch=1)
    push = DataPusher(pull.addr)
    try:
        push.send(_stats(1, epoch=0))
        push.send(_stats(2, epoch=1))
        assert len(_drain(pull, 2)) == 2
        assert pull.acks() == {"ro-1": [1]}  # only this trainer epoch's frames are acknowledged
        push.ack(1, pull.acks()["ro-1"])
        assert push.unacked == 0  # the old epoch's frame will never be taken: not kept
    finally:
        push.close(), pull.close()


def test_a_storm_of_refused_frames_is_counted_whole_and_said_once_then_summed(caplog) -> None:
    """Issue #31 item 4: each junk frame used to print its own WARNING. Now the first of each
    reason is said at once, the rest are summed up at most every `every_s`, and every one
    is in `refused_frames` (the summary's)."""
    import logging

    from areal_like.core.wire import encode

    pull = DataPuller("tcp://127.0.0.1:0")
    pull.notes.every_s = 1.0
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.connect(pull.addr)
    with caplog.at_level(logging.WARNING, logger="areal_like.orchestration.channels"):
        for i in range(40):
            raw.send(b"junk %d" % i)
        raw.send_multipart([b"a", b"b"])  # two parts: junk as well
        raw.send(encode(VersionAnnouncement(version=0)))  # a valid message of the control channel
        deadline = time.time() + 5
        while pull.refused < 42 and time.time() < deadline:
            pull.recv(0.05)
        said_at_once = [r.getMessage() for r in caplog.records]
        time.sleep(1.3)  # the receiver thread's idle poll says what is due
        summed = [r.getMessage() for r in caplog.records][len(said_at_once):]
    raw.close(0), pull.close()
    assert pull.refused_frames == {"junk: not a frame of this protocol": 41,
                                   "a message that does not belong on this channel": 1}, pull.refused_frames
    assert len(said_at_once) == 2, said_at_once  # one per reason
    assert "junk 0" not in said_at_once[0] and "refused_frames" in said_at_once[0]
    assert "VersionAnnouncement" in said_at_once[1]
    assert len(summed) == 1 and "refused 40 more frames" in summed[0] and "42 in all" in summed[0], summed
