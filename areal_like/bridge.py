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
from typing import Any

from pydantic import BaseModel

from areal_like.channels import ControlSubscriber, DataPusher
from areal_like.rollout_controller import RolloutController
from areal_like.types import VersionAnnouncement

__all__ = ["make_sender", "drive_rollout"]

log = logging.getLogger(__name__)


def make_sender(pusher: DataPusher, timeout_s: float = 120.0) -> Any:
    async def send(msg: BaseModel) -> None:
        await asyncio.to_thread(pusher.send, msg, timeout_s)

    return send


async def drive_rollout(controller: RolloutController, subscriber: ControlSubscriber) -> None:
    """Run the controller until the trainer announces the end (or the task is cancelled)."""
    loop = asyncio.get_running_loop()
    stop = threading.Event()

    def listen() -> None:
        while not stop.is_set():
            msg = subscriber.recv(0.2)
            if isinstance(msg, VersionAnnouncement):
                loop.call_soon_threadsafe(controller.announcements.put_nowait, msg)
            elif msg is not None:
                log.warning("unexpected message on the control channel: %s", type(msg).__name__)

    t = threading.Thread(target=listen, name="control-sub", daemon=True)
    t.start()
    try:
        await controller.run()
    finally:
        stop.set()
        await asyncio.to_thread(t.join, 2.0)
