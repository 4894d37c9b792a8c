"""The rollout side's control listener (`TrainerLink`, a task on the controller's event
loop): a trainer that goes silent (killed without a word) stops the rollout side with a
clear error instead of leaving it running forever."""

from __future__ import annotations

import asyncio
import queue
import time

import pytest

from areal_like.core.types import Goodbye, TrainerId, VersionAnnouncement
from areal_like.orchestration.rollout_controller import TrainerLostError, drive_rollout


class FakeSubscriber:
    """An asyncio-native subscriber, as `ControlSubscriber` is: `await recv(timeout_s)`."""

    def __init__(self) -> None:
        self.q: queue.Queue = queue.Queue()

    async def recv(self, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.q.get_nowait()
            except queue.Empty:
                if time.monotonic() >= deadline:
                    return None
            await asyncio.sleep(0.01)


class FakeController:
    """What drive_rollout needs: an announcements queue, stop(), run()."""

    def __init__(self) -> None:
        self.announcements: asyncio.Queue = asyncio.Queue()
        self.seen: list[int] = []
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        while not self._stop.is_set():
            try:
                ann = await asyncio.wait_for(self.announcements.get(), 0.05)
            except TimeoutError:
                continue
            self.seen.append(ann.version)
            if ann.stop:
                self.stop()


def test_silent_trainer_stops_the_rollout_side_with_a_clear_error() -> None:
    async def main() -> FakeController:
        sub, ctl = FakeSubscriber(), FakeController()
        sub.q.put(VersionAnnouncement(version=0))
        sub.q.put(VersionAnnouncement(version=1))
        await drive_rollout(ctl, sub, peer_timeout_s=0.5)
        return ctl

    t0 = time.monotonic()
    with pytest.raises(TrainerLostError, match="peer_timeout_s"):
        asyncio.run(main())
    assert time.monotonic() - t0 < 30


def test_a_late_trainer_is_waited_for_and_stop_ends_cleanly() -> None:
    async def main() -> FakeController:
        sub, ctl = FakeSubscriber(), FakeController()

        async def late_trainer() -> None:  # starts after the rollout side, as in split mode
            await asyncio.sleep(1.0)
            sub.q.put(VersionAnnouncement(version=0))
            await asyncio.sleep(0.1)
            sub.q.put(VersionAnnouncement(version=1, end=Goodbye()))

        task = asyncio.create_task(late_trainer())
        await drive_rollout(ctl, sub, peer_timeout_s=5.0)
        await task
        return ctl

    assert asyncio.run(main()).seen == [0, 1]


def test_a_trainer_that_never_answers_stops_the_rollout_side_with_its_address() -> None:
    """Pointed at an address where nothing listens, the rollout side used to wait forever
    without a word."""
    async def main() -> None:
        await drive_rollout(FakeController(), FakeSubscriber(), peer_timeout_s=1.0, address="tcp://10.9.9.9:5555")

    t0 = time.monotonic()
    with pytest.raises(TrainerLostError, match=r"no trainer answered at tcp://10.9.9.9:5555 within \d+s"):
        asyncio.run(main())
    assert time.monotonic() - t0 < 30


def _real_controller(sent: list):
    from areal_like.core.staleness import StalenessGate
    from areal_like.core.types import SamplingParams
    from areal_like.orchestration.dataset import PromptSource
    from areal_like.orchestration.rollout_controller import RolloutController

    async def never(*_a, **_k):
        raise AssertionError("nothing runs before the trainer has spoken")

    async def send(msg) -> None:
        sent.append(msg)

    return RolloutController(gate=StalenessGate(8, 2, max_concurrent=8),
                             source=PromptSource([{"prompt": "1+1", "answer": "2"}], seed=0), group_size=4,
                             sampling=SamplingParams(max_tokens=4), run_episode=never, score=never, send=send,
                             apply_weights=never)


def test_no_trainer_ever_stops_the_real_controller_waiting_for_its_first_announcement() -> None:
    """`RolloutController.run` waits on its announcements queue, which `stop()` does not wake:
    the bridge ends that wait itself (issue #31 item 3), over a real control socket nobody
    publishes on."""
    import socket

    from areal_like.orchestration.channels import ControlSubscriber

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sent: list = []
    sub = ControlSubscriber(f"tcp://127.0.0.1:{port}")

    async def main() -> None:
        await drive_rollout(_real_controller(sent), sub, peer_timeout_s=1.0, peer_dead_s=0.5,
                            address=f"tcp://127.0.0.1:{port}")

    t0 = time.monotonic()
    try:
        with pytest.raises(TrainerLostError, match=f"no trainer answered at tcp://127.0.0.1:{port}"):
            asyncio.run(main())
    finally:
        sub.close()
    assert time.monotonic() - t0 < 5 and sent == []


def test_a_trainer_gone_while_its_first_weights_are_awaited_stops_the_real_controller() -> None:
    """The trainer spoke once (version 2: this side must load its weights before it admits
    anything) and went silent: the controller waits on the queue for the weights, and is
    ended too."""
    sent: list = []
    sub = FakeSubscriber()
    sub.q.put(VersionAnnouncement(version=2, trainer=TrainerId(run_id="r", epoch=0)))

    async def main() -> None:
        await drive_rollout(_real_controller(sent), sub, peer_timeout_s=1.0, peer_dead_s=0.5)

    t0 = time.monotonic()
    with pytest.raises(TrainerLostError, match="announced nothing"):
        asyncio.run(main())
    assert time.monotonic() - t0 < 5
    assert [m.kind for m in sent] == ["stats"]  # its hello, nothing after
