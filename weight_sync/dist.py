"""Dist transport: a dedicated torch.distributed group (trainer rank 0 + every rollout engine).

Why this file is long: about 1,000 lines hold the sender, the receiver and the
membership/rendezvous protocol they share (store keys and their append-only logs, the plan, the 6-int header,
the bucket layout, the commit allreduce) change together; split apart, each half would restate the wire
format the other must match. The log writers (`_register`, the ready line, `leave_group`)
and their reader (`_AppendLog`) must agree on the two-step append, which is why they
stay side by side (docs/design.md §10.35).

Why a group built by hand: the trainer already has a default process group (DDP/FSDP)
and `init_process_group` can run once per process; `ray.util.collective` reuses the
default group and hangs (docs/design.md §8). So the sender hosts its own `TCPStore`
(`weight_sync.store_addr`, port 0 = pick) and every group generation is a
`ProcessGroupGloo` (CPU) or `ProcessGroupNCCL` (GPU) constructed directly on a
`PrefixStore("gen{g}/")` of it. Nothing here touches the default group.

What travels where:
- The meta (names, dtypes, shapes, checksum) goes on the orchestrator's control
  channel. Its `path` is this transfer's address, `tcp://host:port/<sender nonce>/<seq>`,
  so a receiver needs no configuration beyond the meta: it connects to the store
  the meta names (a restarted trainer has a new nonce, and receivers reconnect).
- Per transfer `seq`, the store carries a rendezvous: each receiver announces
  `x{seq}/ready`, the sender publishes `x{seq}/plan` = {generation, members} and then
  `latest` = seq. A receiver that comes to a transfer after the sender finished a later
  one (its plan already deleted) learns so from `latest` at once and re-registers.
- The bytes go by broadcast from rank 0: a 6-int64 header (magic, seq, version,
  generation, total bytes, tensor count) that proves both sides talk about the same
  transfer, then the flat layout of `meta.FlatLayout` in `bucket_mb` byte ranges,
  two in flight, so receivers checksum one bucket while the next arrives.
- On one host the buckets are not broadcast at all: when every member can read the
  sender's shared-memory files, the plan names the staging file and each receiver
  copies it into its buffer and checksums it there (`weight_sync/shm.py`,
  docs/design.md §10.31) or, for an engine that loads in place, checksums it in the
  file and has the engine read it from there before voting (§10.44).
- Last, a one-int allreduce: each receiver votes 1 if it verified the version. It
  doubles as a commit barrier: it succeeds only if every member received every byte,
  so a transfer either reaches the whole group or none of it (a receiver dying
  mid-transfer makes every other receiver keep its old weights too), and it tells the
  sender how many receivers accepted. A receiver's own refusal (its expected spec or
  the checksum) stays local: the others activate the version.

Membership is fixed per generation (docs/design.md §9.15). The sender waits up to
`timeout_s` for the receivers it knows to be ready; a known receiver that does not
show up is dropped, a ready receiver it did not know is added, and any change (or
any failed collective, on either side) starts generation g+1 with a fresh group on a
fresh store prefix. Receivers follow the plan lazily, inside `receive`. A receiver
left out gets `NotAMemberError`, re-registers itself, and is in the next version's
group (meanwhile its caller keeps its weights or reads the disk transport).

Failure: every store wait and collective has `timeout_s`. A receiver receives the
whole version into its preallocated buffer, verifies the checksum, and only then
returns the iterator; any error raises `WeightSyncError`, so the engine keeps its old
weights. The sender never raises for a failed delivery (the trainer must not stop
training because an engine died): it logs, records it in `last_transfer`, and the next
`send` rebuilds the group.

`send` snapshots the weights into a staging buffer, computes the checksum and returns
the meta at once; the broadcast runs on a background thread while the trainer goes on
training (the broadcast cannot start before receivers have the meta anyway). The next
`send` first waits for the previous transfer to end.
"""

from __future__ import annotations

import datetime
import json
import logging
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from areal_like.core.config import DistWeightSyncConfig
from areal_like.core.types import TensorMeta, WeightUpdateMeta
from weight_sync import shm
from weight_sync.base import NamedTensors, TransferStats, WeightReceiver, WeightSender
from weight_sync.meta import (
    FlatLayout,
    NotAMemberError,
    WeightSyncError,
    check_spec,
    checksum,
    spec_of,
)

__all__ = ["DistWeightSender", "DistWeightReceiver", "leave_group", "parse_address"]

log = logging.getLogger(__name__)

_CTL = "areal_ws/"
_MAGIC = 0x41574653  # "AWFS"
_HEADER_LEN = 6
_WINDOW = 2
"""Buckets in flight: one on the wire while the previous one is checksummed."""
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def parse_address(addr: str) -> tuple[str, int]:
    """`host:port` or `tcp://host:port` → (host, port)."""
    rest = addr.removeprefix("tcp://")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise WeightSyncError(f"bad weight-group store address {addr!r}; expected host:port")
    return host.strip("[]"), int(port)


def _parse_path(path: str | None) -> tuple[str, str, int]:
    """A dist meta's `path`, `tcp://host:port/nonce/seq` → (host:port, nonce, seq)."""
    if not path or not path.startswith("tcp://"):
        raise WeightSyncError(f"dist meta has no transfer address (path={path!r})")
    parts = path.removeprefix("tcp://").split("/")
    if len(parts) != 3 or not parts[2].isdigit():
        raise WeightSyncError(f"bad dist transfer address {path!r}; expected tcp://host:port/nonce/seq")
    return parts[0], parts[1], int(parts[2])


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _make_group(
    store: dist.Store,
    generation: int,
    rank: int,
    size: int,
    host: str,
    device: torch.device,
    timeout_s: float,
) -> Any:
    """A fresh process group of one generation; blocks until all `size` ranks construct it."""
    prefixed = dist.PrefixStore(f"gen{generation}/", store)
    if device.type == "cuda":
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = _timedelta(timeout_s)
        return dist.ProcessGroupNCCL(prefixed, rank, size, nccl_opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = _timedelta(timeout_s)
    # On one machine bind to loopback; across machines use the interface gloo picks
    # (the hostname's address, or GLOO_SOCKET_IFNAME).
    gloo_device = (
        dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
        if host in _LOOPBACK
        else dist.ProcessGroupGloo.create_default_device()
    )
    opts._devices = [gloo_device]
    return dist.ProcessGroupGloo(prefixed, rank, size, opts)


def _abort(group: Any) -> None:
    """Tear a group down without waiting on peers that may be dead."""
    try:
        group.abort()
    except Exception as e:  # a broken group may refuse even this; it is dropped either way
        log.debug("weight group abort: %s", e)


def _commit(group: Any, vote: int, device: torch.device, timeout_s: float) -> int:
    """Sum of the receivers' votes (1 = verified); fails unless every member got here."""
    ballot = torch.tensor([vote], dtype=torch.int64, device=device)
    group.allreduce(ballot, dist.ReduceOp.SUM, _timedelta(timeout_s)).wait(_timedelta(timeout_s))
    return int(ballot.item())


def _header(seq: int, version: int, generation: int, total_bytes: int, n_tensors: int) -> list[int]:
    return [_MAGIC, seq, version, generation, total_bytes, n_tensors]


def _poll(check: Any, deadline: float) -> bool:
    """Poll `check()` with backoff until true or the deadline (store waits log noisily on timeout)."""
    delay = 0.002
    while not check():
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.05)
    return True


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket bound to `host` only (IPv4 or IPv6), for the store to serve on."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(512)
    except OSError as e:
        sock.close()
        raise WeightSyncError(f"weight_sync.store_addr={host}:{port}: cannot listen there: {e}") from e
    return sock


class _AppendLog:
    """Reader of an append-only log on the store (joins, leaves, one transfer's ready list).

    A writer takes an index with `add("{prefix}/n", 1)` and then sets `{prefix}/{i}`: two
    operations, microseconds apart. One killed between them leaves a hole, and `get` on it
    waited the store's whole timeout and then failed the transfer (a server SIGKILLed as it
    announced readiness held a trainer 60 s and lost that version). The reader waits at
    most `grace_s` for a new index's key, as a writer that is alive sets it at once: a
    receiver in the middle of joining is still waited for. A key still missing after that
    is a dead writer's hole, looked at again on each later read without waiting.
    """

    def __init__(self, ctl: dist.Store, prefix: str, grace_s: float = 1.0) -> None:
        self.ctl = ctl
        self.prefix = prefix
        self.grace_s = grace_s
        self.seen = 0
        self.holes: list[int] = []

    def read_new(self) -> list[str]:
        n = self.ctl.add(f"{self.prefix}/n", 0)
        out: list[str] = []
        for i in range(self.seen + 1, n + 1):
            key = f"{self.prefix}/{i}"
            if _poll(lambda key=key: self.ctl.check([key]), time.monotonic() + self.grace_s):
                out.append(self.ctl.get(key).decode())
            else:
                self.holes.append(i)
        self.seen = max(self.seen, n)
        for i in list(self.holes):  # a dead writer's hole (or one that came back to life)
            key = f"{self.prefix}/{i}"
            if self.ctl.check([key]):
                self.holes.remove(i)
                out.append(self.ctl.get(key).decode())
        return out


class _Membership:
    """The sender's view of who is in the weight group, and the rules that decide it.

    It reads the join and leave logs receivers append to on the store and each transfer's
    ready list, and decides the members of the next transfer (docs/design.md §9.15):
    known receivers that are not ready in time are left out, ready newcomers are taken,
    ranks stay stable, a member whose incarnation changed has restarted. It changes with
    the membership protocol; how the bytes travel is `DistWeightSender`'s.
    """

    def __init__(self, ctl: dist.Store, timeout_s: float) -> None:
        self.ctl: dist.Store | None = ctl
        """The store's control prefix (None once the sender is closed)."""
        self.timeout_s = timeout_s
        self.members: list[str] = []
        """The current generation's members, in rank order."""
        self.known: list[str] = []
        """Receivers expected at the next transfer: current members and new registrations."""
        self.incarnations: dict[str, str] = {}
        """Member id -> the receiver object's random id; a change means the engine restarted."""
        self.had_receivers = False
        self.forget_now = threading.Event()
        """Set by `forget_receivers`: the current wait for receivers ends at once."""
        self.first_receivers_s = min(5.0, self.timeout_s)
        """How long a sender that never had a receiver waits for the first ones to join
        and be ready (a resumed trainer's first version), instead of sending to nobody."""
        self.settle_s = min(0.2, self.timeout_s / 10)
        """A first transfer is planned once no receiver has joined for this long."""
        self.joins = _AppendLog(ctl, "join")
        self.leaves = _AppendLog(ctl, "leave")
        self.shm_ready: set[str] = set()
        """Members of the last gathered transfer that said they read the sender's
        shared-memory files (`weight_sync/shm.py`)."""
        self.last_join_at = time.monotonic()
        """When the join log was last seen to grow."""
        self._reading = threading.Lock()
        self._first_gather = threading.Event()
        self._watcher = threading.Thread(target=self._watch_joins, name="weight-sync-joins", daemon=True)
        self._watcher.start()

    def _watch_joins(self, every_s: float = 0.05) -> None:
        """Until the first transfer, read the join log as it grows, so that the settle
        counts from the last join and not from the moment the first transfer asks. A
        rollout side registers its servers before it says hello, so a fresh run's first
        version (after a whole batch) finds them settled and goes at once; it waited
        `settle_s` (0.2 s) before, once per run."""
        while not self._first_gather.wait(every_s):
            try:
                self.read_registrations()
            except Exception as e:  # the store is going away with the sender
                log.debug("weight group join watcher: %s", e)
                return

    def close(self) -> None:
        self._first_gather.set()
        if self._watcher is not threading.current_thread():
            self._watcher.join()
        self.ctl = None

    def gather(self, seq: int) -> tuple[list[str], list[str]]:
        """Wait (≤ timeout_s) for the known receivers to be ready; decide who is in.
        Returns the members and those of them that restarted (the group must be rebuilt).

        Known receivers (current members and earlier registrations) that are not ready
        by the deadline are dropped: dead, or too slow (they get NotAMemberError and
        re-register). Receivers that registered during the wait are not waited for
        (they may have connected after this meta went out) but are taken if ready.
        New members come after existing ones, so ranks stay stable.
        """
        assert self.ctl is not None
        ctl = self.ctl
        deadline = time.monotonic() + self.timeout_s
        self._first_gather.set()
        self.read_registrations()
        ready: dict[str, str] = {}  # receiver id -> incarnation
        shm_ready: set[str] = set()
        ready_log = _AppendLog(ctl, f"x{seq}/ready")

        def read_ready() -> None:
            for line in ready_log.read_new():
                rid, incarnation, *flags = line.split(" ")
                ready[rid] = incarnation
                if "shm" in flags:
                    shm_ready.add(rid)

        if not self.had_receivers and self.known:
            self._settle_joins(deadline)
        first = not self.known and not self.had_receivers
        if first:
            # A sender that never had a receiver (a trainer just started or resumed, whose
            # store the rollout side learns from this very announcement): give receivers a
            # moment to join and be ready, rather than send to nobody and leave them
            # waiting, NotAMemberError, for the next version.
            def joined_and_ready() -> bool:
                self.read_registrations()
                read_ready()
                return (bool(self.known) and set(self.known) <= ready.keys()
                        and time.monotonic() - self.last_join_at >= self.settle_s)

            _poll(lambda: joined_and_ready() or self.forget_now.is_set(),
                  min(deadline, time.monotonic() + self.first_receivers_s))
        # After that grace, a first transfer goes to whoever is ready: one that joined but
        # missed this announcement (a subscriber that connected late) is fed the next
        # version; waiting timeout_s for it held the trainer's next send for that long.
        waited_for = set(ready) if first else set(self.known)

        def all_known_ready() -> bool:
            waited_for.difference_update(self.read_registrations())  # one that left is not waited for
            read_ready()
            return waited_for <= ready.keys()

        if not _poll(lambda: all_known_ready() or self.forget_now.is_set(), deadline) \
                or self.forget_now.is_set():
            missing = sorted(waited_for - ready.keys())
            if missing and not self.forget_now.is_set():
                log.warning(
                    "weight receivers %s not ready within %.1fs; leaving them out", missing, self.timeout_s
                )
            self.known = [r for r in self.known if r not in missing]
            self.forget_now.clear()
        members = [r for r in self.members if r in ready]
        members += [r for r in ready if r not in members]
        restarted = [r for r in members if self.incarnations.get(r, ready[r]) != ready[r]]
        self.incarnations = {r: ready[r] for r in members}
        self.had_receivers |= bool(members)
        self.shm_ready = shm_ready & set(members)
        return members, restarted

    def _settle_joins(self, deadline: float) -> None:
        """A sender that never had a receiver (a trainer just started or resumed): its
        receivers learn its store from one announcement and join within moments of each
        other. Wait (≤ `first_receivers_s`) until no join has come for `settle_s`, so the
        first transfer waits for all of them, not only for the first to have joined (the
        others got NotAMemberError and missed the resumed trainer's first version)."""

        def settled() -> bool:
            self.read_registrations()
            return time.monotonic() - self.last_join_at >= self.settle_s

        _poll(lambda: settled() or self.forget_now.is_set(), min(deadline, time.monotonic() + self.first_receivers_s))

    def read_registrations(self) -> set[str]:
        """Apply the join and leave logs receivers append to (the store cannot list keys);
        returns who left since the last read."""
        with self._reading:
            return self._read_registrations()

    def _read_registrations(self) -> set[str]:
        assert self.ctl is not None
        left: set[str] = set()
        for rid in self.joins.read_new():
            self.last_join_at = time.monotonic()
            if rid not in self.known:
                self.known.append(rid)
        for server in self.leaves.read_new():
            # A server leaves by its name; a vLLM server's workers are members of their
            # own, `{name}-w{rank}`: they leave with it.
            gone = {r for r in self.known if r == server or _worker_of(r, server)} | {server}
            left |= gone
            self.known = [r for r in self.known if r not in gone]
        return left


class DistWeightSender(WeightSender):
    """Trainer rank 0. Hosts the store and broadcasts each version to the current group.

    Construct it once per run on the trainer's rank 0 (and only there). `store_addr`
    is the bound `host:port` (useful when the config said port 0); receivers do not
    need it, since every meta carries it.
    """

    def __init__(self, cfg: DistWeightSyncConfig, *, device: str | torch.device = "cpu") -> None:
        host, port = parse_address(cfg.store_addr)
        self.timeout_s = cfg.timeout_s
        self.bucket_bytes = max(1, int(cfg.bucket_mb * 1024 * 1024))
        self.device = torch.device(device)
        self._host = host
        # TCPStore's own server listens on every interface whatever host it is given:
        # hand it a socket bound to exactly `host` instead (docs/design.md §10.10).
        listener = _listen(host, port)
        try:
            self._store = dist.TCPStore(
                host, listener.getsockname()[1], None, True, timeout=_timedelta(cfg.timeout_s),
                wait_for_workers=False, master_listen_fd=listener.fileno(), use_libuv=True,
            )
        except Exception:
            listener.close()
            raise
        listener.detach()  # the store owns the descriptor now and closes it with itself
        self.store_addr = f"{host}:{self._store.port}"
        """host:port of the group's TCPStore (the real port when the config said 0)."""
        self._ctl = dist.PrefixStore(_CTL, self._store)
        self._nonce = uuid.uuid4().hex[:12]
        self._seq = 0
        self._generation = 0
        self._group: Any = None
        self._membership = _Membership(self._ctl, self.timeout_s)
        self._layout: FlatLayout | None = None
        self._staging: torch.Tensor | None = None
        self._thread: threading.Thread | None = None
        self._last: TransferStats | None = None
        self._closed = False
        self._shm = shm.SenderLane(cfg.shm_dir if cfg.shared_memory and self.device.type == "cpu" else None,
                                   self._nonce, lambda value: self._ctl.set(shm.PROBE_KEY, value))
        """Same-host receivers read `_staging` from this lane's file (design §10.31)."""
        log.info("weight group store listening on %s", self.store_addr)

    @property
    def last_transfer(self) -> TransferStats | None:
        return self._last

    @property
    def generation(self) -> int:
        return self._generation

    def send(self, version: int, named_tensors: NamedTensors) -> WeightUpdateMeta:
        if self._closed:
            raise WeightSyncError("send on a closed weight sender")
        self._join_previous()
        items = [(name, t.detach()) for name, t in named_tensors]
        metas = spec_of(items)
        if len({m.name for m in metas}) != len(metas):
            raise WeightSyncError("a tensor name is given twice")
        layout = FlatLayout.from_metas(metas)
        if layout != self._layout or self._staging is None:
            self._staging = (self._shm.staging(layout.total_bytes) if self.device.type == "cpu"
                             else torch.empty(layout.total_bytes, dtype=torch.uint8, device=self.device))
            self._layout = layout
        digests = []
        for slot, (_, t) in zip(layout.slots, items, strict=True):
            layout.view(self._staging, slot).copy_(t)
            digests.append(layout.slot_digest(self._staging, slot))
        del items
        self._seq += 1
        meta = WeightUpdateMeta(
            version=version,
            transport="dist",
            tensors=metas,
            checksum=checksum(metas, digests),
            bucket_bytes=self.bucket_bytes,
            path=f"tcp://{self.store_addr}/{self._nonce}/{self._seq}",
        )
        self._thread = threading.Thread(
            target=self._transfer, args=(meta, self._seq), name=f"weight-sync-v{version}", daemon=True
        )
        self._thread.start()
        return meta

    def wait(self, timeout: float | None = None) -> TransferStats | None:
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise WeightSyncError(f"weight transfer still running after {timeout}s")
        return self._last

    def wait_for_receivers(self, n: int, timeout: float | None = None) -> list[str]:
        """Block until at least `n` receivers have registered (called `connect`).

        For startup: a receiver that first connects when its first meta arrives misses
        that version (NotAMemberError) and is in the next one; an orchestrator that
        knows how many engines to expect calls this before the first `send` instead.
        """
        deadline = time.monotonic() + (self.timeout_s if timeout is None else timeout)

        membership = self._membership

        def enough() -> bool:
            membership.read_registrations()
            return len(membership.known) >= n

        if not _poll(enough, deadline):
            raise WeightSyncError(
                f"only {len(membership.known)} of {n} weight receivers registered: {membership.known}"
            )
        return list(membership.known)

    def _join_previous(self) -> None:
        """The staging buffer and the group are reused: the previous transfer must be over.

        Every step of a transfer is bounded by timeout_s; the bound here only guards
        against a transport that ignores its own timeouts.
        """
        if self._thread is None:
            return
        n_buckets = len(self._layout.buckets(self.bucket_bytes)) if self._layout else 0
        self.wait(self.timeout_s * (4 + n_buckets))

    def _transfer(self, meta: WeightUpdateMeta, seq: int) -> None:
        t0 = time.perf_counter()
        stats = TransferStats(version=meta.version)
        try:
            members = self._gather_members(seq)
            if not members:
                self._drop_group()
                self._membership.members = []
                self._publish_plan(seq, {"generation": self._generation, "members": []})
                stats.ok = True
                log.info("weights v%d: no receiver in the weight group, nothing sent", meta.version)
                return
            broken = self._group is not None and self._ctl.add(f"gen{self._generation}/broken", 0) > 0
            if members != self._membership.members or self._group is None or broken:
                self._drop_group()
                self._generation += 1
                self._membership.members = members
            stats.generation, stats.receivers = self._generation, list(members)
            plan: dict[str, Any] = {"generation": self._generation, "members": members, "device": self.device.type}
            if self._shm.path is not None and set(members) <= self._membership.shm_ready:
                plan["shm"] = self._shm.path  # every member reads the staging file itself
            stats.lane = "shm" if "shm" in plan else ("nccl" if self.device.type == "cuda" else "gloo")
            self._publish_plan(seq, plan)
            if self._group is None:
                t_build = time.perf_counter()
                self._group = _make_group(
                    self._store,
                    self._generation,
                    0,
                    len(members) + 1,
                    self._host,
                    self.device,
                    self.timeout_s,
                )
                log.info(
                    "weight group generation %d formed with %s in %.2fs",
                    self._generation,
                    members,
                    time.perf_counter() - t_build,
                )
            stats.rendezvous_s = time.perf_counter() - t0
            stats.accepted = self._broadcast(meta, seq, buckets="shm" not in plan)
            stats.bytes = self._layout.total_bytes if self._layout else 0
            stats.ok = stats.accepted == len(members)
            if not stats.ok:
                stats.error = (
                    f"{len(members) - stats.accepted} of {len(members)} receivers refused the version"
                )
                log.error("weights v%d: %s (see their logs)", meta.version, stats.error)
        except Exception as e:  # delivery failed; the trainer goes on, the next send rebuilds
            stats.error = f"{type(e).__name__}: {e}"
            log.error(
                "weights v%d not delivered (generation %d): %s", meta.version, self._generation, stats.error
            )
            self._drop_group()
        finally:
            stats.seconds = time.perf_counter() - t0
            self._last = stats
            self._forget(seq - 2)
            if stats.ok and stats.receivers:
                log.info(
                    "weights v%d sent to %d receivers: %.1f MB in %.3fs (%.3fs waiting for them, %.2f GB/s)",
                    meta.version,
                    len(stats.receivers),
                    stats.bytes / 1e6,
                    stats.seconds,
                    stats.rendezvous_s,
                    stats.gb_per_s,
                )

    def forget_receivers(self) -> None:
        """End the current wait for receivers at once (they are gone); the transfer goes
        to whoever is ready, and the ones left out re-register if they come back."""
        self._membership.forget_now.set()

    def _publish_plan(self, seq: int, plan: dict[str, Any]) -> None:
        """The plan of transfer `seq`, then `latest` = seq: a receiver still waiting on an
        older transfer (whose plan `_forget` may have deleted) sees that it is over."""
        self._ctl.set(f"x{seq}/plan", json.dumps(plan))
        self._ctl.set("latest", str(seq))

    def _gather_members(self, seq: int) -> list[str]:
        """The members of transfer `seq` (`_Membership.gather`); a restarted member's
        group is torn down, to be rebuilt."""
        members, restarted = self._membership.gather(seq)
        if restarted:
            log.info("weight receivers %s restarted; the group will be rebuilt", restarted)
            self._drop_group()
        return members

    def _broadcast(self, meta: WeightUpdateMeta, seq: int, buckets: bool = True) -> int:
        """Send header and buckets (none on the shared-memory lane: the members read the
        staging file); return how many receivers accepted the version."""
        assert self._layout is not None and self._staging is not None
        timeout = _timedelta(self.timeout_s)
        header = torch.tensor(
            _header(seq, meta.version, self._generation, self._layout.total_bytes, len(meta.tensors)),
            dtype=torch.int64,
            device=self.device,
        )
        self._group.broadcast(header, 0, timeout).wait(timeout)
        in_flight: deque[Any] = deque()
        for start, end in self._layout.buckets(self.bucket_bytes) if buckets else ():
            in_flight.append(self._group.broadcast(self._staging[start:end], 0, timeout))
            if len(in_flight) >= _WINDOW:
                in_flight.popleft().wait(timeout)
        while in_flight:
            in_flight.popleft().wait(timeout)
        return _commit(self._group, 0, self.device, self.timeout_s)

    def _drop_group(self) -> None:
        if self._group is not None:
            _abort(self._group)
            self._group = None

    def _forget(self, seq: int) -> None:
        """Delete an old transfer's rendezvous keys so the store does not grow with the run."""
        if seq < 1:
            return
        n = self._ctl.add(f"x{seq}/ready/n", 0)
        for key in [f"x{seq}/plan", f"x{seq}/ready/n"] + [f"x{seq}/ready/{i}" for i in range(1, n + 1)]:
            self._ctl.delete_key(key)

    @property
    def rendezvous(self) -> str:
        return self.store_addr

    def close(self) -> None:
        """Finish the running transfer, drop the group and stop the store (receivers see it go)."""
        try:
            self._join_previous()
        finally:
            self._drop_group()
            self._closed = True
            self._membership.close()
            self._ctl = self._store = None  # type: ignore[assignment]
            self._staging = None
            self._shm.close()


class _ShmUnreadable(Exception):
    """The plan names a staging file this receiver cannot read (`_receive_buckets`)."""


def _worker_of(receiver_id: str, server: str) -> bool:
    """Whether `receiver_id` is one of `server`'s engine workers (`{server}-w{rank}`)."""
    head, sep, rank = receiver_id.rpartition("-w")
    return bool(sep) and head == server and rank.isdigit()


def leave_group(rendezvous: str, receiver_id: str, timeout_s: float = 10.0) -> None:
    """Record that `receiver_id` left the group at `rendezvous`, on its behalf: whoever
    saw it die (its server's controller) says so, so the sender stops waiting for it now,
    not after `timeout_s` (a restarted receiver of the same name registers again)."""
    host, port = parse_address(rendezvous)
    store = dist.TCPStore(host, port, None, False, timeout=_timedelta(timeout_s), wait_for_workers=False)
    ctl = dist.PrefixStore(_CTL, store)
    n = ctl.add("leave/n", 1)
    ctl.set(f"leave/{n}", receiver_id)


class DistWeightReceiver(WeightReceiver):
    """One rollout engine's end of the weight group.

    `receiver_id` must be unique among the engines and stable across restarts of the
    same engine (e.g. its server name). The receiver connects to the store named by the
    first meta it receives (or `connect()` may be called earlier, so that the sender
    waits for it from the next version on).
    """

    def __init__(
        self,
        cfg: DistWeightSyncConfig,
        receiver_id: str,
        *,
        expected: list[TensorMeta] | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        if not receiver_id or "/" in receiver_id or any(c.isspace() for c in receiver_id):
            raise ValueError(
                f"receiver_id must be a non-empty name without '/' or spaces, got {receiver_id!r}"
            )
        self.receiver_id = receiver_id
        self._incarnation = uuid.uuid4().hex[:12]
        self.timeout_s = cfg.timeout_s
        self.expected = expected
        self.device = torch.device(device)
        self._default_addr = cfg.store_addr
        self._store: dist.TCPStore | None = None
        self._ctl: dist.PrefixStore | None = None
        self._addr: str | None = None
        self._nonce: str | None = None
        self._group: Any = None
        self._generation: int | None = None
        self._layout: FlatLayout | None = None
        self._flat: torch.Tensor | None = None
        self._wire = torch.device("cpu")
        """The device the current group runs on (the sender's: see `_receive_into_buffer`)."""
        self._last: TransferStats | None = None
        self._shared_memory = cfg.shared_memory
        self._sees_shm: bool | None = None
        """Whether this process reads the current sender's shared-memory files (probed once per store)."""
        self._shm = shm.ShmReader()

    @property
    def last_transfer(self) -> TransferStats | None:
        return self._last

    @property
    def generation(self) -> int | None:
        return self._generation

    def join(self, rendezvous: str) -> None:
        self.connect(rendezvous)

    def connect(self, addr: str | None = None) -> None:
        """Connect to the sender's store and register, so the next version includes us."""
        addr = addr or self._default_addr
        host, port = parse_address(addr)
        if port == 0:
            raise WeightSyncError("store_addr has port 0; connect from a meta's address instead")
        self._disconnect()
        try:
            self._store = dist.TCPStore(
                host, port, None, False, timeout=_timedelta(self.timeout_s), wait_for_workers=False
            )
        except Exception as e:
            raise WeightSyncError(f"cannot reach the weight-group store at {addr}: {e}") from e
        self._ctl = dist.PrefixStore(_CTL, self._store)
        self._addr = f"{host}:{port}"
        self._sees_shm = None
        self._register()

    def _register(self) -> None:
        assert self._ctl is not None
        n = self._ctl.add("join/n", 1)
        self._ctl.set(f"join/{n}", self.receiver_id)

    loads_in_place = True
    """`receive` takes a `load` (below)."""

    def receive(self, meta: WeightUpdateMeta,
                load: Callable[[list[tuple[str, Any]]], Future[Any] | None] | None = None,
                ) -> tuple[int, Iterator[tuple[str, Any]]]:
        """`WeightReceiver.receive`; `load`: an engine that writes tensors itself
        (`shm.FileSlice.into`). On the shared-memory lane it is called with the version's
        (name, FileSlice) pairs once they are verified and before this receiver votes, so
        the sender keeps the file as it is while the engine reads it, no buffer here holds
        the version, and the returned iterator is empty; an error it raises is this
        receiver's refusal. It may return a future of a load that goes on: the vote then
        waits until every slice was read (or the future failed first: the refusal). On the
        broadcast lane it is not called: the version arrives in the buffer as before and
        the caller loads the iterator."""
        t0 = time.perf_counter()
        self._last = stats = TransferStats(version=meta.version)
        try:
            if meta.transport != "dist":
                raise WeightSyncError(f"dist receiver got a {meta.transport!r} meta")
            layout = FlatLayout.from_metas(meta.tensors)
            addr, nonce, seq = _parse_path(meta.path)
            if self._store is None or addr != self._addr or nonce != self._nonce:
                self.connect(addr)  # first transfer, or the trainer restarted
                self._nonce = nonce
            spec_error: WeightSyncError | None = None
            try:
                check_spec(meta.tensors, self.expected)
            except WeightSyncError as e:
                spec_error = e  # still take part, so the others' transfer is not disturbed
            plan = self._rendezvous(seq)
            stats.generation = plan["generation"]
            if self.receiver_id not in plan["members"]:
                self._register()
                raise NotAMemberError(
                    f"receiver {self.receiver_id!r} is not in weight group generation {plan['generation']} "
                    f"carrying v{meta.version}; re-registered for the next version"
                )
            refusal, loaded = self._receive_into_buffer(meta, layout, seq, plan, spec_error, stats, t0, load)
            if refusal is not None:
                raise refusal
        except WeightSyncError as e:
            stats.error = str(e)
            log.error("receiver %s keeps its weights: %s", self.receiver_id, e)
            raise
        except Exception as e:  # store/socket errors of every kind become one clear error
            # A group kept open after a failure holds the other members' collectives until
            # their timeout (a ring waits on this member): tear it down now, marked broken
            # for a sender that is still there (it rebuilds the group at its next transfer).
            self._abandon_group()
            stats.error = f"{type(e).__name__}: {e}"
            log.error(
                "receiver %s keeps its weights: v%d not received: %s", self.receiver_id, meta.version, e
            )
            raise WeightSyncError(f"weights v{meta.version} not received: {stats.error}") from e
        stats.ok = True
        stats.bytes = layout.total_bytes
        stats.seconds = time.perf_counter() - t0
        return meta.version, (iter(()) if loaded else self._iterate(layout))

    def _rendezvous(self, seq: int) -> dict[str, Any]:
        """Announce readiness for transfer `seq` and wait for the sender's plan.

        The sender may itself wait timeout_s for a slow peer before it decides, so the
        wait here is twice as long.
        """
        assert self._ctl is not None
        ctl = self._ctl
        n = ctl.add(f"x{seq}/ready/n", 1)
        ctl.set(f"x{seq}/ready/{n}", f"{self.receiver_id} {self._incarnation}" + (" shm" if self._reads_shm() else ""))
        key = f"x{seq}/plan"

        def moved_on() -> int:
            """The sender's latest transfer, when it is past `seq` (0 otherwise)."""
            latest = int(ctl.get("latest").decode()) if ctl.check(["latest"]) else 0
            return latest if latest > seq else 0

        if not _poll(lambda: ctl.check([key]) or moved_on() > 0, time.monotonic() + 2 * self.timeout_s):
            self._register()  # whatever held the sender up, be waited for next time
            raise WeightSyncError(
                f"no plan from the weight sender for transfer {seq} within {2 * self.timeout_s:.1f}s; "
                f"re-registered for the next version"
            )
        if not ctl.check([key]):
            # This receiver came late (its caller was busy, or this meta waited in a queue):
            # the sender left it out and has finished later transfers since.
            self._register()
            raise NotAMemberError(
                f"receiver {self.receiver_id!r} came to transfer {seq} after the sender moved on to transfer "
                f"{moved_on()}; re-registered for the next version"
            )
        return json.loads(ctl.get(key).decode())

    def _reads_shm(self) -> bool:
        """Whether to offer the shared-memory lane: on, and the sender's probe file reads
        back its token here (same host, same user)."""
        if self._sees_shm is None:
            assert self._ctl is not None
            self._sees_shm = (self._shared_memory and self._ctl.check([shm.PROBE_KEY])
                              and shm.sees(self._ctl.get(shm.PROBE_KEY).decode()))
            if self._sees_shm:
                log.info("weight receiver %s reads the sender's shared memory: no broadcast needed", self.receiver_id)
        return bool(self._sees_shm)

    def _receive_into_buffer(
        self,
        meta: WeightUpdateMeta,
        layout: FlatLayout,
        seq: int,
        plan: dict[str, Any],
        spec_error: WeightSyncError | None,
        stats: TransferStats,
        t0: float,
        load: Callable[[list[tuple[str, Any]]], Future[Any] | None] | None = None,
    ) -> tuple[WeightSyncError | None, bool]:
        """Receive every byte into the preallocated buffer (or, loading in place, only
        verify it in the sender's file and `load` it from there), verify, vote; return
        this receiver's own refusal (spec, checksum, or the load's error), if any, and
        whether the version was loaded in place.

        A refusal is local: the other members still activate the version (one
        misconfigured engine must not freeze the fleet; the sender logs the count).
        A failure of the collectives leaves the group unusable: abort it and flag its
        generation broken, so the sender starts a new one.
        """
        assert self._ctl is not None
        generation = plan["generation"]
        try:
            # The sender's device decides the group: NCCL between GPUs; gloo (CPU staging)
            # whenever the sender is on CPU, e.g. a trainer sharing one GPU with its server.
            wire = torch.device("cpu") if plan.get("device", "cpu") == "cpu" else self.device
            if wire.type != plan.get("device", "cpu"):
                raise WeightSyncError(f"the weight group runs on {plan['device']} and this receiver is on "
                                      f"{self.device}: set weight_sync.device=cpu, or give the server a GPU")
            if self._group is None or self._generation != generation or self._wire != wire:
                self._drop_group()
                self._wire = wire
                rank = plan["members"].index(self.receiver_id) + 1
                self._group = _make_group(
                    self._store,
                    generation,
                    rank,
                    len(plan["members"]) + 1,
                    self._addr.rpartition(":")[0],
                    wire,
                    self.timeout_s,
                )
                self._generation = generation
            stats.rendezvous_s = time.perf_counter() - t0
            in_place = load is not None and bool(plan.get("shm"))
            if in_place:
                self._flat = self._layout = None  # nothing holds a version between transfers
            elif layout != self._layout or self._flat is None or self._flat.device != wire:
                self._flat = torch.empty(layout.total_bytes, dtype=torch.uint8, device=wire)
                self._layout = layout
            refusal = spec_error
            try:
                digests = self._receive_buckets(meta, layout, seq, generation, plan.get("shm"), in_place)
            except _ShmUnreadable as e:  # a local refusal: the others still activate the version
                digests, refusal = [], refusal or WeightSyncError(str(e))
            stats.lane = "shm" if plan.get("shm") else ("nccl" if wire.type == "cuda" else "gloo")
            got = checksum(meta.tensors, digests) if refusal is None else ""
            if refusal is None and got != meta.checksum:
                refusal = WeightSyncError(
                    f"checksum mismatch for v{meta.version}: received {got[:12]}, announced {meta.checksum[:12]}; "
                    f"keeping the old weights"
                )
            loaded = False
            if in_place and refusal is None:
                assert load is not None
                try:  # before the vote: the sender keeps the file as it is until then
                    with open(plan["shm"], "rb", buffering=0) as f:
                        slices = self._shm.slices(f, layout)
                        going = load(slices)
                        # A load that goes on after reading (re-prefilling interrupted requests)
                        # holds the vote only until every slice is read, or until it ends.
                        while going is not None and not slices.read.wait(0.005) and not going.done():
                            pass
                        if going is not None and not slices.read.is_set():
                            going.result()  # it ended without reading everything: its error, if any
                    loaded = True
                except Exception as e:  # the engine refused it (and keeps its weights)
                    refusal = e if isinstance(e, WeightSyncError) else WeightSyncError(
                        f"v{meta.version} verified but not loaded: {type(e).__name__}: {e}")
            _commit(self._group, int(refusal is None), wire, self.timeout_s)
            return refusal, loaded
        except Exception:
            self._ctl.add(f"gen{generation}/broken", 1)
            self._drop_group()
            raise

    def _receive_buckets(
        self, meta: WeightUpdateMeta, layout: FlatLayout, seq: int, generation: int, shm_path: str | None = None,
        in_place: bool = False,
    ) -> list[bytes]:
        timeout = _timedelta(self.timeout_s)
        header = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=self._wire)
        self._group.broadcast(header, 0, timeout).wait(timeout)
        want = _header(seq, meta.version, generation, layout.total_bytes, len(meta.tensors))
        if header.tolist() != want:
            raise WeightSyncError(f"weight stream header {header.tolist()} does not match the meta {want}")
        slots = layout.slots
        if shm_path is not None:  # the sender's staging file holds this version until the vote
            try:
                if in_place:
                    return self._shm.digests(shm_path, layout)
                assert self._flat is not None
                self._shm.read_into(shm_path, layout.total_bytes, self._flat)
            except OSError as e:  # gone (another host's cleanup, a full tmpfs): take the broadcast from now on
                self._sees_shm = False
                raise _ShmUnreadable(f"cannot read the weight sender's staging file ({e}); keeping the old "
                                     f"weights, and taking the broadcast from the next version") from e
            return [layout.slot_digest(self._flat, slot) for slot in slots]
        assert self._flat is not None
        digests: list[bytes] = []
        in_flight: deque[tuple[Any, int]] = deque()

        def finish_oldest() -> None:
            work, end = in_flight.popleft()
            work.wait(timeout)
            while len(digests) < len(slots) and slots[len(digests)].end <= end:
                digests.append(layout.slot_digest(self._flat, slots[len(digests)]))

        for start, end in layout.buckets(meta.bucket_bytes or layout.total_bytes or 1):
            in_flight.append((self._group.broadcast(self._flat[start:end], 0, timeout), end))
            if len(in_flight) >= _WINDOW:
                finish_oldest()
        while in_flight:
            finish_oldest()
        while len(digests) < len(slots):  # zero-byte tensors at the very end
            digests.append(layout.slot_digest(self._flat, slots[len(digests)]))
        return digests

    def _iterate(self, layout: FlatLayout) -> Iterator[tuple[str, torch.Tensor]]:
        flat = self._flat
        assert flat is not None
        for slot in layout.slots:
            t = layout.view(flat, slot)
            yield slot.name, (t if flat.device == self.device else t.to(self.device))

    def _drop_group(self) -> None:
        if self._group is not None:
            _abort(self._group)
            self._group = None
            self._generation = None

    def _abandon_group(self) -> None:
        if self._group is not None and self._ctl is not None:
            try:
                self._ctl.add(f"gen{self._generation}/broken", 1)
            except Exception as e:  # the sender (and its store) may be gone: nothing to tell
                log.debug("weight receiver %s: broken group not recorded: %s", self.receiver_id, e)
        self._drop_group()

    def _disconnect(self) -> None:
        self._drop_group()
        self._shm.close()
        self._store = self._ctl = None
        self._addr = self._nonce = None

    def close(self) -> None:
        """Leave the group: the sender stops waiting for this receiver from the next version."""
        if self._ctl is not None:
            try:
                n = self._ctl.add("leave/n", 1)
                self._ctl.set(f"leave/{n}", self.receiver_id)
            except Exception as e:  # the trainer may already be gone
                log.debug("weight receiver %s: leave not recorded: %s", self.receiver_id, e)
        self._disconnect()
