"""ZMQ channels between the two clusters (docs/design.md §9.6): typed msgpack frames only.

- data: rollout PUSH → trainer PULL. Trajectory groups and rollout stats. PUSH
  blocks when the trainer's receive queue (`hwm` frames) is full, which is the
  back-pressure we want: the gate already bounds how much can be in flight, so a
  full queue only means the trainer is momentarily busy.
- control: trainer PUB → rollout SUB. Version announcements (with weight metadata).
  PUB/SUB drops messages sent before a subscriber connects ("slow joiner"), so the
  trainer re-publishes its latest announcement periodically; announcements carry
  cumulative counts, so repeats are harmless.

The trainer side binds both sockets (it owns the run); the rollout side connects,
so the two can start in either order. Port 0 picks a free port (one machine).
With a `secret`, every frame is prefixed by an HMAC-SHA256 of its payload, and
frames without a valid one are refused and counted; without a secret, binding
beyond loopback is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
from typing import Any

import zmq
from pydantic import BaseModel

from areal_like.core.wire import WireError, decode, encode

__all__ = ["DataPusher", "DataPuller", "ControlPublisher", "ControlSubscriber", "ChannelError"]

log = logging.getLogger(__name__)


class ChannelError(RuntimeError):
    """A channel could not be set up (bad address, refused exposure)."""


def _is_loopback(addr: str) -> bool:
    host = addr.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


class _Channel:
    sock: zmq.Socket

    def __init__(self, secret: str | None, max_bytes: int) -> None:
        self._key = secret.encode() if secret else None
        self.max_bytes = max_bytes
        self.refused = 0
        self.last_error: str | None = None

    def _frames(self, msg: BaseModel) -> list[bytes]:
        payload = encode(msg)
        if self._key is None:
            return [payload]
        return [hmac.new(self._key, payload, hashlib.sha256).digest(), payload]

    def _parse(self, frames: list[bytes]) -> Any | None:
        try:
            if self._key is not None:
                if len(frames) != 2 or not hmac.compare_digest(
                    frames[0], hmac.new(self._key, frames[1], hashlib.sha256).digest()
                ):
                    raise WireError("frame without a valid HMAC for the shared secret")
                payload = frames[1]
            else:
                if len(frames) != 1:
                    raise WireError(f"expected 1 frame part, got {len(frames)}")
                payload = frames[0]
            return decode(payload, max_bytes=self.max_bytes)
        except WireError as e:
            self.refused += 1
            self.last_error = str(e)
            log.warning("refused a frame: %s", e)
            return None

    def recv(self, timeout_s: float) -> Any | None:
        """One valid message, or None on timeout or for a refused frame (counted)."""
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return self._parse(self.sock.recv_multipart())

    def close(self) -> None:
        self.sock.close(0)


def _bind(sock: zmq.Socket, addr: str, secret: str | None) -> str:
    if not _is_loopback(addr) and not secret:
        raise ChannelError(f"refusing to bind {addr} beyond loopback without transport.secret")
    base, _, port = addr.rpartition(":")
    try:
        if port == "0":
            real = sock.bind_to_random_port(base)
            return f"{base}:{real}"
        sock.bind(addr)
    except zmq.ZMQError as e:
        raise ChannelError(f"cannot bind {addr}: {e}") from None
    return addr


class DataPuller(_Channel):
    """Trainer side of the data channel (binds)."""

    def __init__(self, addr: str, secret: str | None = None, max_bytes: int = 256 << 20, hwm: int = 1000) -> None:
        super().__init__(secret, max_bytes)
        self._ctx = zmq.Context.instance()
        self.sock = self._ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_bytes + 64)
        self.addr = _bind(self.sock, addr, secret)


class DataPusher(_Channel):
    """Rollout side of the data channel (connects)."""

    def __init__(self, addr: str, secret: str | None = None, max_bytes: int = 256 << 20, hwm: int = 1000) -> None:
        super().__init__(secret, max_bytes)
        self._ctx = zmq.Context.instance()
        self.sock = self._ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.setsockopt(zmq.LINGER, 5000)
        self.sock.connect(addr)
        self._lock = threading.Lock()

    def send(self, msg: BaseModel, timeout_s: float = 60.0) -> None:
        """Send one message; raises TimeoutError if the trainer side does not take it."""
        frames = self._frames(msg)
        with self._lock:
            if not self.sock.poll(int(timeout_s * 1000), zmq.POLLOUT):
                raise TimeoutError(f"data channel: trainer did not accept a frame within {timeout_s}s")
            self.sock.send_multipart(frames)

    def close(self) -> None:
        self.sock.close()


class ControlPublisher(_Channel):
    """Trainer side of the control channel (binds)."""

    def __init__(self, addr: str, secret: str | None = None) -> None:
        super().__init__(secret, 64 << 20)
        self._ctx = zmq.Context.instance()
        self.sock = self._ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.addr = _bind(self.sock, addr, secret)
        self._lock = threading.Lock()

    def publish(self, msg: BaseModel) -> None:
        with self._lock:
            self.sock.send_multipart(self._frames(msg))


class ControlSubscriber(_Channel):
    """Rollout side of the control channel (connects)."""

    def __init__(self, addr: str, secret: str | None = None) -> None:
        super().__init__(secret, 64 << 20)
        self._ctx = zmq.Context.instance()
        self.sock = self._ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(addr)
