"""Which pool has work right now, shared by the processes of one machine (docs/design.md §10.16).

A small memory-mapped file (`run.dir/.cores`) holds one slot per process: a rollout
server or a train rank writes `+t` when it starts having work and `-t` when it runs out
(only on changes, so it costs nothing while a pool stays busy). Another pool reads the
slots and, while every process of a pool has had no work for `grace_s`, runs its torch
ops on that pool's threads too; it gives them back at its next check once the pool has
work again. A pool no process of this machine has written (the other side runs
elsewhere) never lends anything.

The file lives in the trainer's run folder; a process started where that folder does not
exist gets no ledger from `pools.thread_lending` (nothing of the run to lend to on this
machine), and one that cannot open the file keeps a private ledger and lends nothing.

Slots: rollout servers 0..31, train ranks 32..63. Eight bytes each, written whole (an
aligned double), read without locks: a torn read is impossible on the machines we run on,
and a stale one costs one check's worth of lending.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import time
from pathlib import Path

__all__ = ["ROLLOUT_SLOTS", "CoreLedger", "ThreadLender"]

log = logging.getLogger(__name__)

_SLOTS = 64
_BASE = {"rollout": 0, "train": 32}
ROLLOUT_SLOTS = 32
"""Servers numbered past this (a pool grown far while the run goes) lend nothing."""


class CoreLedger:
    def __init__(self, path: str | Path, pool: str, index: int) -> None:
        if pool not in _BASE or not 0 <= index < 32:
            raise ValueError(f"no ledger slot for {pool} {index}")
        self.path = Path(path)
        self.slot = _BASE[pool] + index
        self.pool = pool
        self.shared = True
        """False when the file could not be opened: this process keeps a private ledger,
        which no other process sees (it lends and borrows nothing)."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:  # (its folder is gone or read-only): lending is a speed-up, never a reason to fail
            log.warning("thread lending off for %s %d: cannot open the core ledger %s (%s)", pool, index, self.path,
                        e.strerror or e)
            self.shared = False
            self._map = mmap.mmap(-1, _SLOTS * 8)
        else:
            try:
                if os.fstat(fd).st_size < _SLOTS * 8:
                    os.ftruncate(fd, _SLOTS * 8)
                self._map = mmap.mmap(fd, _SLOTS * 8)
            finally:
                os.close(fd)
        self._state: bool | None = None

    def working(self, busy: bool) -> None:
        """This process has work (`True`) or has run out of it (`False`)."""
        if busy == self._state:
            return
        self._state = busy
        now = time.time()
        struct.pack_into("d", self._map, self.slot * 8, now if busy else -now)

    def idle_for(self, pool: str) -> float:
        """Seconds every process of `pool` has had no work (0 while one has some, or when
        none has ever written: a pool we cannot see lends nothing)."""
        base = _BASE[pool]
        values = struct.unpack_from(f"{32}d", self._map, base * 8)
        seen = [v for v in values if v != 0.0]
        if not seen or any(v > 0 for v in seen):
            return 0.0
        return max(0.0, time.time() - max(-v for v in seen))

    def close(self) -> None:
        try:
            self.working(False)
            self._map.close()
        except (ValueError, OSError):
            pass


class ThreadLender:
    """The torch thread count of one process: its own, plus `borrow` while `other` has
    had no work for `grace_s` (checked by `pick()` before each unit of work)."""

    def __init__(self, ledger: CoreLedger, own: int, borrow: int, other: str, grace_s: float = 0.1) -> None:
        import torch

        self.ledger, self.own, self.borrow, self.other, self.grace_s = ledger, own, borrow, other, grace_s
        self.current = torch.get_num_threads()
        self.borrowed_s = 0.0
        """Seconds of work run with borrowed threads (a counter for the metrics)."""
        self._since: float | None = None

    def pick(self) -> int:
        import torch

        want = self.own + (self.borrow if self.ledger.idle_for(self.other) >= self.grace_s else 0)
        now = time.monotonic()
        if self._since is not None:
            self.borrowed_s += now - self._since
            self._since = None
        if want != self.current:
            torch.set_num_threads(want)
            self.current = want
        if want > self.own:
            self._since = now
        return want

    def done(self) -> None:
        """The unit of work is over: stop counting borrowed time (keep the threads until the next pick)."""
        if self._since is not None:
            self.borrowed_s += time.monotonic() - self._since
            self._since = None
