"""Which pool has work right now, shared by the processes of one machine (docs/design.md §10.16).

A small memory-mapped file (`run.dir/.cores`) holds one slot per process: a rollout
server or a train rank writes `+t` when it starts having work and `-t` when it runs out
(only on changes, so it costs nothing while a pool stays busy). Another pool reads the
slots and, while every process of a pool has had no work for `grace_s` and no process
outside the run holds the core, nor was seen holding it within the last second
(`ThreadLender`), runs its torch ops on that pool's threads too; it gives them back at its
next check once either changes. A trainer counts a lull of the servers that began before
its last version went out only from that moment (`ThreadLender.published`). A pool no process
of this machine has written (the other side runs elsewhere) never lends anything.

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
from collections.abc import Callable
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

    def idle_since(self, pool: str) -> float | None:
        """The wall time since which every process of `pool` has had no work (None while one
        has some, or when none has ever written: a pool we cannot see lends nothing)."""
        base = _BASE[pool]
        values = struct.unpack_from(f"{32}d", self._map, base * 8)
        seen = [v for v in values if v != 0.0]
        if not seen or any(v > 0 for v in seen):
            return None
        return max(-v for v in seen)

    def close(self) -> None:
        try:
            self.working(False)
            self._map.close()
        except (ValueError, OSError):
            pass


class RunnableElsewhere:
    """Threads runnable on this machine right now outside this process: `procs_running` in
    /proc/stat less this process's threads in state R (/proc/self/task), or None where
    /proc/stat cannot be read. Called, it counts.

    This process's own count is read, not assumed: between two units of work its torch
    pool threads sleep after ~50 ms of Python, so taking "all of them" off the machine's
    count hid a neighbour whenever threads were borrowed (measured: 2 runnable on the machine,
    1 of them ours, while a neighbour spun on the other core). Each thread's stat file stays
    open between calls (0.2 ms for 60 threads, against 0.7 ms opening them each time: a
    server checks before every engine step while it may borrow)."""

    def __init__(self) -> None:
        self._stats: dict[str, int] = {}
        self._pid = os.getpid()

    def __call__(self) -> int | None:
        try:
            with open("/proc/stat", "rb") as f:
                machine = next((int(line.split()[1]) for line in f if line.startswith(b"procs_running")), None)
            tasks = set(os.listdir("/proc/self/task"))
        except (OSError, ValueError, IndexError):
            return None
        if machine is None:
            return None
        if os.getpid() != self._pid:  # (a forked child: the open files are its parent's threads)
            self._stats, self._pid = {}, os.getpid()
        for gone in self._stats.keys() - tasks:
            os.close(self._stats.pop(gone))
        own = 0
        for t in tasks:
            try:
                fd = self._stats.get(t)
                if fd is None:
                    fd = self._stats[t] = os.open(f"/proc/self/task/{t}/stat", os.O_RDONLY)
                stat = os.pread(fd, 512, 0)
            except OSError:  # (the thread ended since the listing, or its id was reused): open anew next time
                fd = self._stats.pop(t, None)
                if fd is not None:
                    os.close(fd)
                continue
            end = stat.rfind(b")")
            own += stat[end + 2:end + 3] == b"R"
        return max(0, machine - own)


def _machine_cpus() -> int | None:
    """The CPUs /proc/stat counts, when this process may run on all of them (else its
    `procs_running` is not this process's to judge: None)."""
    try:
        with open("/proc/stat", "rb") as f:
            n = sum(1 for line in f if line.startswith(b"cpu") and line[3:4].isdigit())
        return n if n and n == len(os.sched_getaffinity(0)) else None
    except (OSError, AttributeError):
        return None


class ThreadLender:
    """The torch thread count of one process: its own, plus `borrow` while `other` has
    had no work for `grace_s` and the machine has a core free for them (checked by
    `pick()` before each unit of work).

    The free core is judged by the threads runnable at the pick outside this process
    (`RunnableElsewhere`): a process outside the run (a neighbour) busy on a core would share it
    with a borrowed thread, and torch's threads wait for the slowest at every parallel
    region. Measured on 2 cores with one core busy elsewhere: a train step took 1.25 s on 2
    threads against 0.59 s on 1 (0.36 s on 2 when quiet).

    A neighbour seen at two checks 50 ms to 0.5 s apart (none free between) keeps the threads
    home until `crowded_hold_s` (3 s for a trainer) after its last such sighting: one that comes and goes (busy 0.5 s, idle
    0.5 s) is free at half the checks and back within the borrowed thread's next
    micro-batch. Beside it, borrowing made the trainer spend 0.57-0.62 core-s a step against 0.53-0.55 unborrowed,
    on a machine that had no core-second to spare. One check alone does not hold: the
    run's own processes have threads that run for a moment (a socket, a loop)."""

    def __init__(self, ledger: CoreLedger, own: int, borrow: int, other: str, grace_s: float = 0.1,
                 runnable: Callable[[], int | None] | None = None, cpus: int | None = -1,
                 crowded_hold_s: float = 1.0) -> None:
        import torch

        self.ledger, self.own, self.borrow, self.other, self.grace_s = ledger, own, borrow, other, grace_s
        self.current = torch.get_num_threads()
        self.borrowed_s = 0.0
        """Seconds of work run with borrowed threads (a counter for the metrics)."""
        self._since: float | None = None
        self._runnable = runnable or RunnableElsewhere()
        self._cpus = _machine_cpus() if cpus == -1 else cpus
        self.crowded_hold_s = crowded_hold_s
        self._crowded_at = -float("inf")
        self._first_crowded: float | None = None
        self._lull_after = -float("inf")

    def _core_free(self, now: float) -> bool:
        if self._cpus is None:
            return True
        others = self._runnable()
        if others is None:
            return now - self._crowded_at >= self.crowded_hold_s
        if others + self.own + self.borrow <= self._cpus:
            self._first_crowded = None
            return now - self._crowded_at >= self.crowded_hold_s
        # counted during a hold too: the hold runs from the neighbour's last sighting, so one
        # that comes back every second keeps the threads home instead of meeting a borrowed
        # thread each time a hold from its first sighting ran out
        if self._first_crowded is None or now - self._first_crowded > 0.5:
            self._first_crowded = now
        elif now - self._first_crowded >= 0.05:  # still there: a neighbour, not a moment's thread
            self._crowded_at, self._first_crowded = now, None
        return False

    def pick(self) -> int:
        import torch

        now = time.monotonic()
        since = self.ledger.idle_since(self.other)
        idle = 0.0 if since is None else time.time() - max(since, self._lull_after)
        lend = idle >= self.grace_s and self._core_free(now)
        want = self.own + (self.borrow if lend else 0)
        if self._since is not None:
            self.borrowed_s += now - self._since
            self._since = None
        if want != self.current:
            torch.set_num_threads(want)
            self.current = want
        if want > self.own:
            self._since = now
        return want

    def published(self) -> None:
        """This process just finished what `other` waits for (a trainer's step: its version
        goes out next). A lull of `other` that began before now counts only from now: the
        version may be what ends it. A trainer a version ahead (η ≥ 1) otherwise took the
        servers' wait for that version as a lull and borrowed their threads for the first
        micro-batch of its next step, as they went back to work on it."""
        self._lull_after = time.time()

    def done(self) -> None:
        """The unit of work is over: stop counting borrowed time (keep the threads until the next pick)."""
        if self._since is not None:
            self.borrowed_s += time.monotonic() - self._since
            self._since = None
