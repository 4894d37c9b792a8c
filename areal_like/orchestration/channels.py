"""ZMQ channels between the two clusters (docs/design.md §9.6): typed msgpack frames only.

- data: rollout PUSH → trainer PULL. Trajectory groups and rollout stats. PUSH
  blocks when the trainer's receive queue (`hwm` frames) is full, which is the
  back-pressure we want: the gate already bounds how much can be in flight, so a
  full queue only means the trainer is momentarily busy.
  The channel is acknowledged (docs/design.md §10.7): the pusher numbers every frame
  of a trainer epoch (`Origin.seq`, from 1) and keeps it until the trainer
  acknowledges it; the puller takes frames off the socket in its own thread, drops
  duplicates by (sender, epoch, seq) and acknowledges by receipt; the trainer
  publishes the acknowledgements (`VersionAnnouncement.acked`: the highest seq
  below which everything arrived, and what arrived past a gap) on the control
  channel. A frame lost on a connection reset — written to a socket whose peer never
  read it — is sent again as soon as ZMQ reconnects, and again after
  `resend_after_s` without an acknowledgement while the trainer is heard; after
  `max_resends` such tries it is given up, counted and logged. `Origin.low` tells the
  puller below which seq nothing will come again, so a given-up frame never stalls
  the acknowledgements.
- control: trainer PUB → rollout SUB. Version announcements (with weight metadata).
  The subscriber is asyncio-native (`zmq.asyncio`): the rollout side awaits it on the
  event loop its controller runs on.
  PUB/SUB drops messages sent before a subscriber connects ("slow joiner"), so the
  trainer re-publishes its latest announcement periodically; announcements carry
  cumulative counts, so repeats are harmless.

The trainer side binds both sockets (it owns the run); the rollout side connects,
so the two can start in either order. Port 0 picks a free port (one machine).
With a `secret`, every frame is prefixed by an HMAC-SHA256 of its payload, and
frames without a valid one are refused and counted; without a secret, binding
beyond loopback is refused.

Refused frames (junk, a bad HMAC, a message that does not belong on the channel) are
counted by reason (`refused_frames`, which the trainer's summary reports) and said on
the console without flooding it (`RefusalNotes`: the first of each reason at once,
then at most one line per 30 s with how many more).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from pydantic import BaseModel

from areal_like.core.types import RolloutStats, TrajectoryGroup, VersionAnnouncement
from areal_like.core.wire import WireError, decode, encode

__all__ = ["DataPusher", "DataPuller", "ControlPublisher", "ControlSubscriber", "ChannelError", "RefusalNotes"]

_MAX_SENDERS = 16
"""Acknowledgement state kept for at most this many (sender, epoch) pairs (newest first)."""
_MAX_SELECTIVE = 1024
"""Seqs received past a gap that one acknowledgement lists at most."""

log = logging.getLogger(__name__)


class ChannelError(RuntimeError):
    """A channel could not be set up (bad address, refused exposure)."""


class RefusalNotes:
    """Refused frames, counted by reason and said without flooding the console: the
    first frame of each reason at once (with its details), then at most one line per
    `every_s` with how many more were refused since (`tick` says a due line while no
    frame comes, `flush` what is left unsaid). `counts()` is for the run's summary.
    Thread-safe: a receiver thread adds, the trainer reads."""

    def __init__(self, what: str, *, every_s: float = 30.0, level: int = logging.WARNING,
                 logger: logging.Logger | None = None) -> None:
        self.what = what
        self.every_s = every_s
        self.level = level
        self.log = logger or log
        self._counts: dict[str, int] = {}
        self._unsaid: dict[str, int] = {}
        self._said_at = time.monotonic()
        self._lock = threading.Lock()

    def add(self, reason: str, detail: str | None = None) -> None:
        """One refused frame; `reason` is its summary key, `detail` the first line's text."""
        with self._lock:
            first = reason not in self._counts
            self._counts[reason] = self._counts.get(reason, 0) + 1
            if first:
                line: str | None = (f"refused {detail or f'a frame on {self.what}: {reason}'}; dropped, counted in "
                                    f"the summary's refused_frames (more are summed up here at most every "
                                    f"{self.every_s:.0f}s)")
            else:
                self._unsaid[reason] = self._unsaid.get(reason, 0) + 1
                line = self._due(time.monotonic(), force=False)
        if line is not None:
            self.log.log(self.level, "%s", line)

    def tick(self) -> None:
        """Say the refusals not said yet, if the last line is `every_s` old."""
        with self._lock:
            line = self._due(time.monotonic(), force=False) if self._unsaid else None
        if line is not None:
            self.log.log(self.level, "%s", line)

    def flush(self) -> None:
        """Say whatever is not said yet (at close)."""
        with self._lock:
            line = self._due(time.monotonic(), force=True) if self._unsaid else None
        if line is not None:
            self.log.log(self.level, "%s", line)

    def _due(self, now: float, force: bool) -> str | None:
        if not self._unsaid or (not force and now - self._said_at < self.every_s):
            return None
        n = sum(self._unsaid.values())
        parts = ", ".join(f"{k}: {v}" for k, v in sorted(self._unsaid.items()))
        since = now - self._said_at
        self._unsaid.clear()
        self._said_at = now
        return (f"refused {n} more frame{'s' if n != 1 else ''} on {self.what} in the last {since:.0f}s ({parts}); "
                f"{sum(self._counts.values())} in all")

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


def _refusal_key(error: str) -> str:
    """The summary's name for why `_parse` refused a frame (its message has the details)."""
    if "HMAC" in error:
        return "a frame without a valid HMAC for transport.secret"
    if "exceeds the limit" in error:
        return "a frame over transport.max_frame_mb"
    return "junk: not a frame of this protocol"


def _is_loopback(addr: str) -> bool:
    host = addr.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


class _Channel:
    sock: zmq.Socket

    accepts: tuple[type, ...] | None = None
    """The message types that belong on this channel (None: any wire message)."""

    def __init__(self, secret: str | None, max_bytes: int, what: str = "a channel") -> None:
        self._key = secret.encode() if secret else None
        self.max_bytes = max_bytes
        self.refused = 0
        self.last_error: str | None = None
        self.notes = RefusalNotes(what)

    @property
    def refused_frames(self) -> dict[str, int]:
        """Refused frames by reason (for the run's summary)."""
        return self.notes.counts()

    def _refuse(self, reason: str, detail: str) -> None:
        self.refused += 1
        self.last_error = detail
        self.notes.add(reason, detail)

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
            msg = decode(payload, max_bytes=self.max_bytes)
        except WireError as e:
            self._refuse(_refusal_key(str(e)), f"a frame on {self.notes.what}: {e}")
            return None
        if self.accepts is not None and not isinstance(msg, self.accepts):
            self._refuse("a message that does not belong on this channel",
                         f"a {type(msg).__name__} on {self.notes.what}, where it does not belong")
            return None
        return msg

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


@dataclass
class _Mark:
    upto: int = 0
    """Every seq up to this one has arrived (or will never come again)."""
    above: set[int] = field(default_factory=set)
    """Seqs above `upto` that arrived out of order (a lost frame in between)."""

    def first_time(self, seq: int, low: int) -> bool:
        if low - 1 > self.upto:  # the sender will never send anything below `low` again
            self.upto = low - 1
            self.above = {s for s in self.above if s > self.upto}
        if seq <= self.upto or seq in self.above:
            return False
        self.above.add(seq)
        while self.upto + 1 in self.above:
            self.upto += 1
            self.above.discard(self.upto)
        return True


def _keepalive(sock: zmq.Socket, heartbeat_s: float | None, dead_s: float | None) -> None:
    """ZMTP heartbeats: a connection whose peer stopped answering (a black-holed link, a
    half-open TCP connection) is closed and reconnected instead of swallowing frames."""
    if heartbeat_s:
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int((dead_s or 5 * heartbeat_s) * 1000))


class DataPuller(_Channel):
    """Trainer side of the data channel (binds).

    A receiver thread takes every frame off the socket as it arrives, also while the
    trainer is busy in a step: it refuses bad frames (counted), drops duplicates
    (`duplicates`) and records receipt for `acks`. `recv` hands out what it took, in
    order. `epoch` is the trainer's epoch: only frames of it are acknowledged.
    """

    accepts = (TrajectoryGroup, RolloutStats)

    def __init__(self, addr: str, secret: str | None = None, max_bytes: int = 256 << 20, hwm: int = 1000,
                 epoch: int = 0, heartbeat_s: float | None = None, dead_s: float | None = None,
                 queue_max: int = 2_000) -> None:
        super().__init__(secret, max_bytes, what="the data channel")
        self._ctx = zmq.Context.instance()
        self.sock = self._ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_bytes + 64)
        _keepalive(self.sock, heartbeat_s, dead_s)
        self.addr = _bind(self.sock, addr, secret)
        self.notes.what = f"the data channel ({self.addr})"
        self.epoch = epoch
        self.duplicates = 0
        self._marks: dict[tuple[str, int], _Mark] = {}
        self._marks_lock = threading.Lock()
        self._q: queue.Queue[Any] = queue.Queue(maxsize=queue_max)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._pump, name="data-pull", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        while not self._closing.is_set():
            try:
                if not self.sock.poll(100):
                    self.notes.tick()
                    continue
                frames = self.sock.recv_multipart()
            except zmq.ZMQError as e:
                if not self._closing.is_set():
                    log.warning("data channel receive failed: %s", e)
                    time.sleep(0.1)
                continue
            msg = self._parse(frames)
            if msg is None or not self._first_time(msg):
                continue
            while not self._closing.is_set():  # a full queue back-pressures the sender
                try:
                    self._q.put(msg, timeout=0.2)
                    break
                except queue.Full:
                    continue

    def _first_time(self, msg: Any) -> bool:
        o = getattr(msg, "origin", None)
        if o is None or not o.seq:
            return True  # not numbered: nothing to deduplicate or acknowledge
        key = (o.sender, o.epoch)
        with self._marks_lock:
            mark = self._marks.pop(key, None) or _Mark()
            self._marks[key] = mark  # most recent last
            while len(self._marks) > _MAX_SENDERS:
                self._marks.pop(next(iter(self._marks)))
            fresh = mark.first_time(o.seq, o.low)
        if not fresh:
            self.duplicates += 1
            log.debug("dropped a duplicate frame %s/e%d/#%d", o.sender, o.epoch, o.seq)
        return fresh

    def acks(self, epoch: int | None = None) -> dict[str, list[int]]:
        """Sender → `[upto, *more]`: every seq up to `upto` has arrived, and so have the
        seqs in `more` (received past a gap), for frames of trainer `epoch` (this one's)."""
        epoch = self.epoch if epoch is None else epoch
        with self._marks_lock:
            return {sender: [m.upto, *sorted(m.above)[:_MAX_SELECTIVE]]
                    for (sender, e), m in self._marks.items() if e == epoch}

    def recv(self, timeout_s: float) -> Any | None:
        """The next message taken off the socket, or None after `timeout_s`."""
        try:
            return self._q.get(timeout=timeout_s) if timeout_s > 0 else self._q.get_nowait()
        except queue.Empty:
            return None

    def close(self) -> None:
        self._closing.set()
        self._thread.join(timeout=2.0)
        self.notes.flush()
        if self._thread.is_alive():  # never close a socket another thread still uses
            log.warning("data channel receiver did not stop within 2s; leaving its socket open")
            return
        self.sock.close(0)


@dataclass
class _Unacked:
    seq: int
    frames: list[bytes]
    sent_at: float
    tries: int = 0
    timer_tries: int = 0


class DataPusher(_Channel):
    """Rollout side of the data channel (connects).

    Numbers every frame that carries an `Origin` and keeps it until `ack` says the
    trainer has it. `maintain` (called often, from any thread) resends what is still
    unacknowledged once ZMQ has reconnected *and* the trainer has acknowledged
    something since (that acknowledgement first releases what it already has, and a
    restarted trainer's releases the old epoch's frames), and a frame that has waited
    `resend_after_s` while a later one was acknowledged (a gap: it was lost). `flush`
    waits for everything to be acknowledged.
    """

    def __init__(self, addr: str, secret: str | None = None, max_bytes: int = 256 << 20, hwm: int = 1000,
                 heartbeat_s: float | None = None, dead_s: float | None = None,
                 resend_after_s: float = 10.0, max_resends: int = 5) -> None:
        super().__init__(secret, max_bytes, what="the data channel")
        self._ctx = zmq.Context.instance()
        self.sock = self._ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.setsockopt(zmq.LINGER, 5000)
        _keepalive(self.sock, heartbeat_s, dead_s)
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.sock.connect(addr)
        self.addr = addr
        self._lock = threading.Lock()
        """Guards the socket (and the monitor socket)."""
        self._box_lock = threading.Lock()
        """Guards the outbox and the counters."""
        self._outbox: dict[int, dict[int, _Unacked]] = {}
        """epoch → seq → a frame not acknowledged yet."""
        self._next: dict[int, int] = {}
        self._acked_at = 0.0
        self._reconnected_at: float | None = None
        """Set by a reconnect; cleared once everything unacknowledged went out again."""
        self._max_acked: dict[int, int] = {}
        """epoch → the highest seq acknowledged (frames below it that are not were lost)."""
        self._connected_once = False
        self._down = False
        self.resend_after_s = resend_after_s
        self.max_resends = max_resends
        self.resent = 0
        self.given_up = 0
        self.reconnects = 0

    @property
    def unacked(self) -> int:
        with self._box_lock:
            return sum(len(b) for b in self._outbox.values())

    def send(self, msg: BaseModel, timeout_s: float = 60.0) -> None:
        """Send one message; raises TimeoutError if the trainer side does not take it."""
        with self._lock:
            if not self.sock.poll(int(timeout_s * 1000), zmq.POLLOUT):
                raise TimeoutError(f"data channel: trainer did not accept a frame within {timeout_s}s")
            origin = getattr(msg, "origin", None)
            if origin is None:
                self.sock.send_multipart(self._frames(msg))
                return
            with self._box_lock:
                box = self._outbox.setdefault(origin.epoch, {})
                seq = self._next.get(origin.epoch, 0) + 1
                low = min(box, default=seq)
                msg.origin = origin.model_copy(update={"seq": seq, "low": low})  # type: ignore[attr-defined]
                frames = self._frames(msg)
                if len(frames[-1]) > self.max_bytes:  # the trainer would drop the connection over it
                    raise ChannelError(f"a {type(msg).__name__} frame of {len(frames[-1]) >> 20} MiB is over "
                                       f"transport.max_frame_mb ({self.max_bytes >> 20} MiB)")
                self._next[origin.epoch] = seq
                box[seq] = _Unacked(seq, frames, time.monotonic())
            self.sock.send_multipart(frames)

    def ack(self, epoch: int, acked: list[int]) -> None:
        """The trainer of `epoch` has every frame of this sender up to `acked[0]` and those
        in `acked[1:]`; frames of older epochs will never be taken (a restarted trainer
        refuses them)."""
        upto, more = (acked[0], set(acked[1:])) if acked else (0, set())
        with self._box_lock:
            self._acked_at = time.monotonic()
            for e in [e for e in self._outbox if e < epoch]:
                del self._outbox[e]
            for e in [e for e in self._max_acked if e < epoch]:
                del self._max_acked[e]
            self._max_acked[epoch] = max(self._max_acked.get(epoch, 0), upto, *more)
            box = self._outbox.get(epoch)
            if box:
                for s in [s for s in box if s <= upto or s in more]:
                    del box[s]

    def maintain(self) -> None:
        """Resend after a reconnect (once the trainer has acknowledged something since),
        or a frame a later acknowledged one overtook `resend_after_s` ago. Never blocks:
        skipped while a send holds the socket."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            now = time.monotonic()
            if self._events():
                self._reconnected_at = now
            with self._box_lock:
                after_reconnect = self._reconnected_at is not None and self._acked_at > self._reconnected_at
                due: list[tuple[_Unacked, bool]] = []
                for epoch, box in self._outbox.items():
                    top = self._max_acked.get(epoch, 0)
                    for u in sorted(box.values(), key=lambda u: u.seq):
                        gap = u.seq < top and now - u.sent_at > self.resend_after_s
                        if not (after_reconnect or gap):
                            continue
                        timer = gap and not after_reconnect
                        # resent `max_resends` times although later frames arrive, or (a frame that
                        # breaks the connection each time) 3 × that over reconnects
                        if (timer and u.timer_tries >= self.max_resends) or u.tries >= 3 * self.max_resends:
                            del box[u.seq]
                            self.given_up += 1
                            log.error("data frame #%d was never acknowledged after %d resends: given up "
                                      "(the run's counts will not add up)", u.seq, u.tries)
                            continue
                        due.append((u, timer))
            if after_reconnect and due:
                log.warning("data channel reconnected: resending %d unacknowledged frames", len(due))
            for u, timer in due:
                try:
                    self.sock.send_multipart(u.frames, flags=zmq.NOBLOCK)
                except zmq.Again:
                    return  # the queue is full: what is left goes at a later call
                u.tries += 1
                u.timer_tries += int(timer)
                u.sent_at = now
                self.resent += 1
            if after_reconnect:
                self._reconnected_at = None
        finally:
            self._lock.release()

    def _events(self) -> bool:
        """Whether the link came back since the last call (a connect after a disconnect)."""
        from zmq.utils.monitor import recv_monitor_message

        back = False
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                if not self._down:
                    log.warning("data channel: the connection to %s dropped; reconnecting", self.addr)
                self._down = True
            elif event == zmq.EVENT_CONNECTED:
                if self._connected_once:
                    self.reconnects += 1
                    back = True
                self._connected_once = True
                self._down = False
        return back

    def flush(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for every frame to be acknowledged (resending as
        needed); returns how many were not."""
        deadline = time.monotonic() + timeout_s
        while self.unacked and time.monotonic() < deadline:
            self.maintain()
            time.sleep(0.05)
        return self.unacked

    def close(self) -> None:
        with self._lock:
            try:
                self.sock.disable_monitor()  # libzmq would go on writing events nobody reads
            except zmq.ZMQError:
                pass
            self._monitor.close(0)
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
    """Rollout side of the control channel (connects), asyncio-native (`zmq.asyncio`):
    `await recv(...)` on the rollout side's event loop, beside the controller, with no
    thread in between (`rollout_controller.TrainerLink`)."""

    accepts = (VersionAnnouncement,)
    sock: zmq.asyncio.Socket

    def __init__(self, addr: str, secret: str | None = None) -> None:
        super().__init__(secret, 64 << 20, what=f"the control channel ({addr})")
        self._ctx = zmq.asyncio.Context.instance()
        self.sock = self._ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(addr)

    async def recv(self, timeout_s: float) -> VersionAnnouncement | None:
        """One valid announcement, or None on timeout or for a refused frame (counted)."""
        if not await self.sock.poll(int(timeout_s * 1000)):
            self.notes.tick()
            return None
        return self._parse(await self.sock.recv_multipart())
