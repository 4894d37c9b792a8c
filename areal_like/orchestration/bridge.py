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
                        peer_timeout_s: float | None = None) -> None:
    """Run the controller until the trainer announces the end (or the task is cancelled).

    Once the trainer has been heard, silence longer than `peer_timeout_s` stops the
    controller and raises `TrainerLostError`: a trainer killed without announcing the
    end must not leave the rollout side running forever.
    """
    loop = asyncio.get_running_loop()
    stop = threading.Event()
    lost: list[float] = []

    def listen() -> None:
        last: float | None = None
        while not stop.is_set():
            msg = subscriber.recv(0.2)
            now = time.monotonic()
            if isinstance(msg, VersionAnnouncement):
                last = now
                loop.call_soon_threadsafe(controller.announcements.put_nowait, msg)
            elif msg is not None:
                log.warning("unexpected message on the control channel: %s", type(msg).__name__)
            elif peer_timeout_s is not None and last is not None and now - last > peer_timeout_s:
                lost.append(now - last)
                log.error("no announcement from the trainer for %.0fs (transport.peer_timeout_s): stopping",
                          now - last)
                loop.call_soon_threadsafe(controller.stop)
                return

    t = threading.Thread(target=listen, name="control-sub", daemon=True)
    t.start()
    try:
        await controller.run()
    except Exception as e:
        if lost:
            raise TrainerLostError(_lost_message(lost[0])) from e
        raise
    finally:
        stop.set()
        await asyncio.to_thread(t.join, 2.0)
    if lost:
        raise TrainerLostError(_lost_message(lost[0]))


def _lost_message(silent_s: float) -> str:
    return (f"the trainer has announced nothing for {silent_s:.0f}s (transport.peer_timeout_s); it is gone or "
            "stuck, so the rollout side stopped. Restart both sides with --resume.")
