"""The rollout side's link to the trainer, on the controller's event loop.

The controller is pure asyncio and knows no sockets. `TrainerLink.listen` is a task
beside it: it awaits the asyncio-native control subscriber (`zmq.asyncio`, no thread),
hands each announcement to the controller, passes the acknowledgements it carries to
the data pusher (which then resends what a reconnect may have lost) and judges the
trainer's silence. Sends go through `asyncio.to_thread` (`make_sender`) so a slow
trainer back-pressures one group, never the event loop. `drive_rollout` runs the two
together until the trainer says goodbye.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from pydantic import BaseModel

from areal_like.core.types import VersionAnnouncement
from areal_like.orchestration.channels import ControlSubscriber, DataPusher
from areal_like.orchestration.rollout_controller import RolloutController

__all__ = ["make_sender", "drive_rollout", "TrainerLink", "TrainerLostError"]

log = logging.getLogger(__name__)


def make_sender(pusher: DataPusher, timeout_s: float = 120.0) -> Any:
    async def send(msg: BaseModel) -> None:
        await asyncio.to_thread(pusher.send, msg, timeout_s)

    return send


class TrainerLostError(RuntimeError):
    """The trainer went silent past `transport.peer_timeout_s`."""


class TrainerLink:
    """The control channel's listener (a task on the controller's loop): announcements
    into `controller.announcements`, their acknowledgements to `pusher`, and the verdict
    on the trainer's silence (`lost`, the reason it gave up, once it has)."""

    def __init__(self, controller: RolloutController, subscriber: ControlSubscriber, *,
                 peer_timeout_s: float | None, peer_dead_s: float | None, address: str,
                 pusher: DataPusher | None, started_at: float | None) -> None:
        self.controller = controller
        self.subscriber = subscriber
        self.peer_timeout_s = peer_timeout_s
        self.peer_dead_s = peer_dead_s
        self.address = address
        self.pusher = pusher
        self.started = time.monotonic() if started_at is None else started_at  # (a time.monotonic() value)
        self.lost: str | None = None

    async def listen(self) -> str | None:
        """Until the trainer is lost (returns why) or the task is cancelled."""
        ctl, pusher = self.controller, self.pusher
        last: float | None = None
        gone = False
        next_note = self.started + 10.0
        while True:
            msg = await self.subscriber.recv(0.2)
            now = time.monotonic()
            if pusher is not None:
                if isinstance(msg, VersionAnnouncement) and msg.run_id == ctl.follow.run_id:
                    pusher.ack(msg.epoch, msg.acked.get(ctl.follow.sender, []))
                pusher.maintain()
            if isinstance(msg, VersionAnnouncement):
                if gone:
                    log.warning("the trainer is back after %.0fs of silence", now - (last or now))
                    gone = False
                last = now
                ctl.announcements.put_nowait(msg)
                continue
            if msg is not None:
                log.warning("unexpected message on the control channel: %s", type(msg).__name__)
                continue
            if last is None:
                if now >= next_note:
                    next_note = now + 10.0
                    log.warning("no trainer has answered at %s for %.0fs (is `areal-like train` running there?); "
                                "waiting up to transport.peer_timeout_s", self.address, now - self.started)
                if self.peer_timeout_s is not None and now - self.started > self.peer_timeout_s:
                    self.lost = (f"no trainer answered at {self.address} within {now - self.started:.0f}s "
                                 "(transport.peer_timeout_s): check transport.control_addr and that the trainer runs")
                    return self.lost
                continue
            silent = now - last
            if self.peer_dead_s is not None and not gone and silent > self.peer_dead_s:
                gone = True
                log.error("the trainer has been silent for %.0fs (transport.peer_dead_s): declared gone; "
                          "waiting up to transport.peer_timeout_s for it to come back", silent)
            if self.peer_timeout_s is not None and silent > self.peer_timeout_s:
                log.error("no announcement from the trainer for %.0fs (transport.peer_timeout_s): stopping", silent)
                self.lost = _lost_message(silent)
                return self.lost


async def drive_rollout(controller: RolloutController, subscriber: ControlSubscriber,
                        peer_timeout_s: float | None = None, peer_dead_s: float | None = None,
                        address: str = "the control address", pusher: DataPusher | None = None,
                        flush_s: float = 7.0, started_at: float | None = None) -> None:
    """Run the controller until the trainer says goodbye (or the task is cancelled).

    The trainer heartbeats every couple of seconds. Silence longer than `peer_dead_s`
    is logged at once (the trainer is declared gone); the controller keeps its state
    and goes on if the trainer comes back (a restarted trainer re-bases it through a
    newer epoch). Silence longer than `peer_timeout_s` — or no trainer ever heard at
    `address` for that long, counted from `started_at` (a `time.monotonic()` value; the
    rollout side's start, default now) — stops the controller and raises `TrainerLostError`.

    With the data channel's `pusher`, the announcements' acknowledgements release its
    frames, it resends what a reconnect may have lost, and a normal stop waits up to
    `flush_s` for the last frames (the final report) to be acknowledged.

    Giving up stops the controller; one that has not begun its schedule yet (still
    waiting for its first announcement, or for the weights that one named: a queue `get`
    that `stop()` does not wake) is cancelled instead, as it has nothing to wind down.
    """
    gave_up = False
    run_task: asyncio.Future[None] = asyncio.ensure_future(controller.run())
    link = TrainerLink(controller, subscriber, peer_timeout_s=peer_timeout_s, peer_dead_s=peer_dead_s,
                       address=address, pusher=pusher, started_at=started_at)

    def give_up(task: asyncio.Task[str | None]) -> None:
        nonlocal gave_up
        if task.cancelled() or task.exception() is not None or task.result() is None:
            if not task.cancelled() and task.exception() is not None:  # a bug in the listener: stop, say why
                log.error("the control channel's listener failed: %r", task.exception())
                controller.stop()
            return
        controller.stop()
        if not run_task.done() and not _schedule_running():
            gave_up = True
            run_task.cancel()

    listener = asyncio.create_task(link.listen(), name="control-sub")
    listener.add_done_callback(give_up)
    try:
        try:
            await run_task
        except asyncio.CancelledError:
            if gave_up and link.lost:  # we cancelled it (not a Ctrl-C): the trainer is lost
                raise TrainerLostError(link.lost) from None
            raise
        if pusher is not None and not link.lost:
            left = await asyncio.to_thread(pusher.flush, flush_s)
            if left:
                log.warning("%d data frames were not acknowledged by the trainer within %.0fs of stopping", left, flush_s)
    except TrainerLostError:
        raise
    except Exception as e:
        if link.lost:
            raise TrainerLostError(link.lost) from e
        raise
    finally:
        if not run_task.done():  # drive_rollout itself was cancelled before the controller began
            run_task.cancel()
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
    if link.lost:
        raise TrainerLostError(link.lost)
    if not listener.cancelled() and listener.exception() is not None:
        raise listener.exception()  # type: ignore[misc]


def _schedule_running() -> bool:
    """Whether the controller has begun its schedule: its control task exists once the
    first announcement (and the weights it names) are through (`RolloutController.run`)."""
    return any(t.get_name() == "rollout-control" and not t.done() for t in asyncio.all_tasks())


def _lost_message(silent_s: float) -> str:
    return (f"the trainer has announced nothing for {silent_s:.0f}s (transport.peer_timeout_s); it is gone or "
            "stuck, so the rollout side stopped. Restart both sides with --resume.")
