"""Glue between the rollout controller's event loop and the ZMQ channels.

The controller is pure asyncio and knows no sockets; ZMQ sockets are not
thread-safe and block. A small thread polls the control SUB socket and hands each
announcement to the event loop; sends go through `asyncio.to_thread` so a slow
trainer back-pressures one group, never the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from pydantic import BaseModel

from areal_like.core.types import VersionAnnouncement
from areal_like.orchestration.channels import ControlSubscriber, DataPusher
from areal_like.orchestration.rollout_controller import RolloutController

__all__ = ["make_sender", "drive_rollout", "TrainerLostError"]

log = logging.getLogger(__name__)


def make_sender(pusher: DataPusher, timeout_s: float = 120.0) -> Any:
    async def send(msg: BaseModel) -> None:
        await asyncio.to_thread(pusher.send, msg, timeout_s)

    return send


class TrainerLostError(RuntimeError):
    """The trainer went silent past `transport.peer_timeout_s`."""


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
    loop = asyncio.get_running_loop()
    stop = threading.Event()
    lost: list[str] = []
    gave_up: list[bool] = []
    run_task: asyncio.Future[None] = asyncio.ensure_future(controller.run())

    def give_up() -> None:
        controller.stop()
        if not run_task.done() and not _schedule_running(loop):
            gave_up.append(True)
            run_task.cancel()

    def listen() -> None:
        started = time.monotonic() if started_at is None else started_at  # (a time.monotonic() value)
        last: float | None = None
        gone = False
        next_note = started + 10.0
        while not stop.is_set():
            msg = subscriber.recv(0.2)
            now = time.monotonic()
            if pusher is not None:
                if isinstance(msg, VersionAnnouncement) and msg.run_id == controller.run_id:
                    pusher.ack(msg.epoch, msg.acked.get(controller.sender, []))
                pusher.maintain()
            if isinstance(msg, VersionAnnouncement):
                if gone:
                    log.warning("the trainer is back after %.0fs of silence", now - (last or now))
                    gone = False
                last = now
                loop.call_soon_threadsafe(controller.announcements.put_nowait, msg)
                continue
            if msg is not None:
                log.warning("unexpected message on the control channel: %s", type(msg).__name__)
                continue
            if last is None:
                if now >= next_note:
                    next_note = now + 10.0
                    log.warning("no trainer has answered at %s for %.0fs (is `areal-like train` running there?); "
                                "waiting up to transport.peer_timeout_s", address, now - started)
                if peer_timeout_s is not None and now - started > peer_timeout_s:
                    lost.append(f"no trainer answered at {address} within {now - started:.0f}s "
                                "(transport.peer_timeout_s): check transport.control_addr and that the trainer runs")
                    loop.call_soon_threadsafe(give_up)
                    return
                continue
            silent = now - last
            if peer_dead_s is not None and not gone and silent > peer_dead_s:
                gone = True
                log.error("the trainer has been silent for %.0fs (transport.peer_dead_s): declared gone; "
                          "waiting up to transport.peer_timeout_s for it to come back", silent)
            if peer_timeout_s is not None and silent > peer_timeout_s:
                lost.append(_lost_message(silent))
                log.error("no announcement from the trainer for %.0fs (transport.peer_timeout_s): stopping", silent)
                loop.call_soon_threadsafe(give_up)
                return

    t = threading.Thread(target=listen, name="control-sub", daemon=True)
    t.start()
    try:
        try:
            await run_task
        except asyncio.CancelledError:
            if gave_up and lost:  # we cancelled it (not a Ctrl-C): the trainer is lost
                raise TrainerLostError(lost[0]) from None
            raise
        if pusher is not None and not lost:
            left = await asyncio.to_thread(pusher.flush, flush_s)
            if left:
                log.warning("%d data frames were not acknowledged by the trainer within %.0fs of stopping", left, flush_s)
    except TrainerLostError:
        raise
    except Exception as e:
        if lost:
            raise TrainerLostError(lost[0]) from e
        raise
    finally:
        stop.set()
        if not run_task.done():  # drive_rollout itself was cancelled before the controller began
            run_task.cancel()
        await asyncio.to_thread(t.join, 2.0)
    if lost:
        raise TrainerLostError(lost[0])


def _schedule_running(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether the controller has begun its schedule: its control task exists once the
    first announcement (and the weights it names) are through (`RolloutController.run`)."""
    return any(t.get_name() == "rollout-control" and not t.done() for t in asyncio.all_tasks(loop))


def _lost_message(silent_s: float) -> str:
    return (f"the trainer has announced nothing for {silent_s:.0f}s (transport.peer_timeout_s); it is gone or "
            "stuck, so the rollout side stopped. Restart both sides with --resume.")
