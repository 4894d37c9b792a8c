"""The rollout controller's view of its inference servers: one actor each.

`ServerPool` starts one `ServerActor` per bundle of the rollout pool's placement group
(docs/design.md §10.2) through the launcher (`areal_like.launcher`), each with its own
device, and keeps their handles; it hands the server manager `ActorServer` adapters for
routing, tells every server to join the weight
group and to receive each version (the bytes go from the trainer's rank 0 straight into
each server, never through this process), restarts a dead server in its own bundle, adds a server to the running pool and
retires one drained out of it (docs/design.md §10.24), and polls metrics in the
background so the controller's counters never wait on an actor. `ServerWeights` loads
each version onto the pool, handles the servers that fail it, and brings a server in or
out between two versions.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_like.core.config import ExperimentConfig
from areal_like.core.logs import run_log_path
from areal_like.core.types import ServerCounters, WeightUpdateMeta

__all__ = ["RETIRED_COUNTERS", "ServerPool", "ServerWeights"]

log = logging.getLogger(__name__)

RETIRED_COUNTERS = frozenset({
    "generated_tokens", "engine_step_seconds_total", "engine_idle_seconds_total", "weight_update_seconds_total",
    "weight_reprefill_seconds_total", "held_seconds_total", "process_cpu_s", "borrowed_thread_s", "interrupts", "interrupted_tokens",
    "recompute_tokens"})
"""A server's cumulative counters: a drained server's are kept (`ServerPool.retired`), so
the rollout side's totals never go back when the pool shrinks."""


@dataclass
class _Seat:
    """Where a server runs: its number (seed, core-ledger slot), its placement, and the
    placement group made for it alone (a server added to the running pool under Ray)."""

    index: int
    placement: Any
    own_group: Any = None


class ServerPool:
    def __init__(self, cfg: ExperimentConfig, model_path: Path, placement_group: Any, launcher: Any = None) -> None:
        from areal_like.launcher import connect

        self.cfg = cfg
        self.model_path = model_path
        self.placement_group = placement_group
        self.launcher = launcher if launcher is not None else connect("ray")
        """Who starts the servers (`areal_like.launcher`; none given: the Ray this process is in)."""
        self.names = [f"server-{i}" for i in range(cfg.rollout.num_servers)]
        """The pool's servers (dead ones awaiting a restart included; drained ones leave it)."""
        self.seats = {n: _Seat(i, None) for i, n in enumerate(self.names)}
        self._added = len(self.names)
        """Servers ever started under a name of their own: the next one's number."""
        self.actors: dict[str, Any] = {}
        self.info: dict[str, dict[str, Any]] = {}
        self.versions: dict[str, int] = {}
        self.metrics: dict[str, dict[str, float]] = {}
        self._alive: set[str] = set()
        self._rendezvous: str | None = None
        self._poller: asyncio.Task[None] | None = None
        self._loaded = asyncio.Event()
        self.on_death: Any = None
        """`on_death(name, error)`: a server found dead outside a call (the metrics poll)."""
        self.waiting: set[str] = set()
        """Restarted servers waiting for the trainer to send the served version again."""
        self._missed: dict[str, BaseException] = {}
        """Why each server failed the last version sent to it (read by a waiting restart)."""
        self.held = False
        """`cluster.colocate`: the servers are paused for the trainer's step."""
        self.retired: dict[str, float] = {}
        """The cumulative counters of servers drained out of the pool (they still count)."""

    # ---- starting ---------------------------------------------------------------------
    async def _spawn(self, name: str) -> Any:
        from areal_like.launcher import Placement
        from areal_like.orchestration.pools import rollout_bundles, server_gpu_request
        from rollout_cluster.server_actor import ServerActor

        cfg = self.cfg
        seat = self.seats[name]
        i = seat.index
        args, kwargs = self._server_args(name, i)
        return await self.launcher.aspawn(
            ServerActor, args, kwargs, name=name, cpus=rollout_bundles(cfg)[0]["CPU"], gpus=server_gpu_request(cfg),
            threads=cfg.rollout.server_threads, env={"TOKENIZERS_PARALLELISM": "false"},
            stdio=None if cfg.run.verbose else str(run_log_path(cfg.run.dir)),
            placement=seat.placement or Placement(self.placement_group, i),
            concurrency=10_000, record_calls=False)  # every generate call and metrics poll is a call

    def _server_args(self, name: str, i: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        from areal_like.core.cores import ROLLOUT_SLOTS
        from areal_like.orchestration.pools import thread_lending

        cfg = self.cfg
        lending = thread_lending(cfg) if i < ROLLOUT_SLOTS else None  # the ledger has a slot per server number
        lend = {"path": lending["path"], "index": i, "borrow": lending["rollout_borrow"]} if lending else None
        return (name, str(self.model_path), cfg.rollout.engine.model_dump(mode="json")), dict(
            lend=lend, dtype=cfg.model.dtype,
            interrupt_mode=cfg.rollout.interrupt_mode, seed=cfg.run.seed + 17 * i,
            threads=cfg.rollout.server_threads, weight_sync=cfg.weight_sync.model_dump(mode="json"),
            default_disk_path=str(Path(cfg.run.dir) / "weight_sync"), log_level=cfg.run.log_level,
            log_file=str(run_log_path(cfg.run.dir)), console=cfg.run.verbose)

    async def _start_one(self, name: str) -> Any:
        handle = await self._spawn(name)
        try:
            info = await handle.start.remote()
        except BaseException:
            self.launcher.kill(handle)
            raise
        self.actors[name], self.info[name] = handle, info
        self.versions[name] = int(info.get("version", 0))
        if self._rendezvous:  # a restart: a member again from the next version on
            await handle.join_weights.remote(self._rendezvous)
        if self.held:  # a restart during the trainer's step waits for it like the others
            await handle.hold.remote(True)
        self._alive.add(name)
        log.info("rollout server %s: pid %s on node %s (%s), %s", name, info["pid"], info["node_ip"],
                 info["node_id"][:8], info["device"])
        return handle

    async def start(self) -> dict[str, Any]:
        """Start every server; the first that fails stops the start with its own line
        (`ServerStartError`: the server and its device), the others are killed."""
        from areal_like.core.config import ConfigError

        t0 = time.time()
        results = await asyncio.gather(*(self._start_one(n) for n in self.names), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.close()
            cause = getattr(errors[0], "cause", None) or errors[0]  # an `ActorCallError`'s original
            raise ConfigError(_first_line(cause)) from None
        log.info("%d rollout server actor(s) started in %.1fs", len(self.names), time.time() - t0)
        self._poller = asyncio.get_running_loop().create_task(self._poll_metrics(), name="server-metrics")
        return {n: self._adapter(n) for n in self.names}

    def _adapter(self, name: str) -> Any:
        from rollout_cluster.server_manager import ActorServer

        return ActorServer(self.actors[name], name)

    async def restart(self, name: str, error: BaseException, loaded_version: int) -> Any:
        """A fresh actor for a dead server, in its bundle, serving the version the others
        serve before it takes a call: copied from a live sibling, or (none left) received
        with the next version the trainer sends."""
        self._alive.discard(name)
        old = self.actors.pop(name, None)
        if old is not None:
            self.launcher.kill(old)
        handle = await self._start_one(name)
        await self._catch_up(name, handle, loaded_version)
        return self._adapter(name)

    async def add(self) -> str:
        """Start one more server (the pool grows while the run goes, docs/design.md §10.24)
        under a name never used before, in a placement of its own (under Ray a placement
        group of one bundle shaped like the pool's: a pending one is what Ray's autoscaler
        adds nodes for). It joins the weight group; the caller brings it to the served
        version (`catch_up`) before it takes a call. A server that cannot start is not
        left behind (`ConfigError`, its one line)."""
        from areal_like.core.config import ConfigError
        from areal_like.launcher import Placement
        from areal_like.orchestration.pools import rollout_bundles

        name = f"server-{self._added}"
        self._added += 1
        group = None
        if self.placement_group is not None:  # a launcher that places (Ray): a group of its own
            cfg = self.cfg
            group = await asyncio.to_thread(self.launcher.place, "rollout_pool", rollout_bundles(cfg)[:1],
                                            cfg.cluster.rollout_pool.strategy)
        self.seats[name] = _Seat(self._added - 1, Placement(group, 0) if group is not None else None, group)
        self.names.append(name)
        try:
            await self._start_one(name)
        except BaseException as e:
            if name in self.actors:  # started, then failed to join: stopped with the rest of it
                self.launcher.kill(self.actors[name])
            self._forget(name)
            if isinstance(e, Exception):
                cause = getattr(e, "cause", None) or e
                raise ConfigError(_first_line(cause)) from None
            raise
        return name

    async def retire(self, name: str) -> None:
        """A drained server leaves the pool: no more versions for it, out of the weight
        group by its name (the trainer's next transfer does not wait for it, and nothing
        counts it as failed), closed and stopped, its placement given back."""
        self._alive.discard(name)
        if self._rendezvous and self.cfg.weight_sync.type == "dist":
            await self._leave(name, self._rendezvous)
        handle = self.actors.get(name)
        if handle is not None:
            try:
                await asyncio.wait_for(handle.close.remote(), timeout=10)
            except Exception as e:  # gone already, or stuck: it is killed either way
                log.info("rollout server %s did not close cleanly: %s", name, _first_line(e))
            self.launcher.kill(handle)
        for key, value in self.metrics.get(name, {}).items():
            if key in RETIRED_COUNTERS:
                self.retired[key] = self.retired.get(key, 0.0) + value
        self._forget(name)

    def _forget(self, name: str) -> None:
        self._alive.discard(name)
        self.actors.pop(name, None)
        self.info.pop(name, None)
        self.versions.pop(name, None)
        self.metrics.pop(name, None)
        if name in self.names:
            self.names.remove(name)
        seat = self.seats.pop(name, None)
        if seat is not None and seat.own_group is not None:
            self.launcher.remove(seat.own_group)

    async def copy_version(self, name: str, loaded_version: int) -> bool:
        """Copy the served version into a fresh server from a live sibling (through this
        process: a restart or an added server, not the sync path); whether it now serves it."""
        if loaded_version > self.versions[name]:
            donor = next((n for n in self.names if n in self._alive and n != name
                          and self.versions.get(n, -1) >= loaded_version), None)
            if donor is not None:
                try:
                    exported = await self.actors[donor].export_weights.remote()
                    loaded = await self.actors[name].load_weights.remote(exported)
                    self.versions[name] = max(self.versions[name], loaded)
                    log.info("rollout server %s: v%d copied from %s", name, self.versions[name], donor)
                except Exception as e:  # vLLM cannot export; a donor may die meanwhile
                    log.info("rollout server %s: copying from %s failed (%s)", name, donor, _first_line(e))
        return self.versions[name] >= loaded_version

    async def _catch_up(self, name: str, handle: Any, loaded_version: int) -> None:
        """Load the served version into a restarted server before it takes a call: copied
        from a live sibling, or (none can give it) received with the trainer's next send."""
        if not await self.copy_version(name, loaded_version):
                log.warning("rollout server %s: no live server to copy v%d from; it asks the trainer for it",
                            name, loaded_version)
                self.waiting.add(name)
                try:
                    while self.versions[name] < loaded_version:
                        self._loaded.clear()
                        await self._loaded.wait()
                        missed = self._missed.pop(name, None)
                        if missed is not None and (_is_server_death(missed) or await self.gone(name) is not None):
                            # died again while it waited (during the resend itself, say): this
                            # restart failed, and the manager counts it; waiting on, the trainer
                            # sent a dead server the version every few seconds for ever
                            self.mark_dead(name)
                            raise missed
                finally:
                    self.waiting.discard(name)

    async def gone(self, name: str, timeout_s: float = 5.0) -> BaseException | None:
        """Whether a server that failed a call is gone, asked directly: a metrics call
        that fails (not one that is only slow) says its process is dead, whatever error
        type the launcher gave the first failure (Ray's memory monitor's `OutOfMemoryError`
        was read as a failed update, and the dead server was sent every version again).
        Returns that call's error, or None while it answers."""
        handle = self.actors.get(name)
        if handle is None:
            return None
        try:
            await asyncio.wait_for(handle.metrics.remote(), timeout=timeout_s)
        except TimeoutError:
            return None  # busy, not dead: a later call tells
        except Exception as e:
            return e
        return None

    def explain(self, error: BaseException) -> str:
        """What to change when a server died of memory (Ray's memory monitor, or an
        engine's own out-of-memory error), else ""."""
        text = str(getattr(error, "cause", None) or error)
        if "OutOfMemoryError" not in text and "out of memory" not in text.lower():
            return ""
        engine = self.cfg.rollout.engine
        if engine.type == "vllm":
            from areal_like.orchestration.pools import vllm_is_cpu_build

            keys = ("rollout.engine.kv_cache_gb" if vllm_is_cpu_build()
                    else "rollout.engine.gpu_memory_utilization or rollout.engine.max_num_seqs")
        else:
            keys = "rollout.engine.max_batch_size or rollout.engine.max_seq_len"
        return (f"each rollout server needs less memory: lower {keys}, or run fewer servers per node "
                f"(rollout.num_servers={self.cfg.rollout.num_servers})")

    def is_alive(self, name: str) -> bool:
        """Started and not found dead (a server being restarted is not, until it is back)."""
        return name in self._alive

    def mark_dead(self, name: str) -> None:
        """A server died: out of the weight group at once, so the trainer's next transfer
        does not wait `weight_sync.timeout_s` for a receiver that is gone."""
        self._alive.discard(name)
        if self._rendezvous and self.cfg.weight_sync.type == "dist":
            asyncio.get_running_loop().create_task(self._leave(name, self._rendezvous))

    async def _leave(self, name: str, rendezvous: str) -> None:
        def leave() -> None:  # the import (torch) happens here too, off the event loop
            from weight_sync.dist import leave_group

            leave_group(rendezvous, name)

        try:
            await asyncio.to_thread(leave)
            log.info("rollout server %s left the weight group", name)
        except Exception as e:  # the trainer may be gone too; its timeout still applies
            log.warning("could not record that %s left the weight group: %s", name, e)

    # ---- weights ----------------------------------------------------------------------
    async def join(self, rendezvous: str) -> None:
        """Every live server registers in the trainer's weight group at `rendezvous`."""
        self._rendezvous = rendezvous
        await asyncio.gather(*(self.actors[n].join_weights.remote(rendezvous) for n in list(self._alive)),
                             return_exceptions=True)

    async def receive(self, meta: WeightUpdateMeta) -> tuple[dict[str, int], dict[str, BaseException]]:
        """Every live server receives `meta.version` itself; returns who loaded it and who
        failed (a failed server keeps its old version and goes on serving)."""
        names = [n for n in self.names if n in self._alive]
        payload = meta.model_dump(mode="json")
        results = await asyncio.gather(
            *(self.actors[n].receive_weights.remote(payload, self._rendezvous) for n in names),
            return_exceptions=True)
        ok: dict[str, int] = {}
        failed: dict[str, BaseException] = {}
        for n, r in zip(names, results, strict=True):
            if isinstance(r, BaseException):
                failed[n] = self._missed[n] = r
            else:
                ok[n] = self.versions[n] = int(r)
                self._missed.pop(n, None)
        self._loaded.set()
        return ok, failed

    async def hold(self, on: bool) -> None:
        """`cluster.colocate`: pause every live server for the trainer's step, or let them
        run again; returns once each has done so (a dead one is left to the restart path)."""
        self.held = on
        names = [n for n in self.names if n in self._alive]
        results = await asyncio.gather(*(self.actors[n].hold.remote(on) for n in names), return_exceptions=True)
        for n, r in zip(names, results, strict=True):
            if isinstance(r, BaseException):
                log.warning("rollout server %s did not %s: %s", n, "hold" if on else "resume", _first_line(r))

    # ---- metrics ----------------------------------------------------------------------
    async def _poll_metrics(self, every_s: float = 0.5) -> None:
        from areal_like.launcher import is_actor_death

        while True:
            names = [n for n in self.names if n in self._alive]
            refs = [self.actors[n].metrics.remote() for n in names]
            for n, ref in zip(names, refs, strict=True):
                try:
                    self.metrics[n] = await asyncio.wait_for(ref, timeout=5.0)
                except Exception as e:  # busy: next round; dead: noticed now, not at its next call
                    if is_actor_death(e) and n in self._alive and self.on_death is not None:
                        self.on_death(n, e)
            await asyncio.sleep(every_s)

    def per_server(self) -> dict[str, ServerCounters]:
        out = {}
        for n in self.names:
            m, info = self.metrics.get(n, {}), self.info.get(n, {})
            out[n] = ServerCounters(node=str(info.get("node_id", "")), device=str(info.get("device", "")),
                                    pid=int(info.get("pid", 0)), alive=n in self._alive,
                                    version=self.versions.get(n, 0),
                                    generated_tokens=float(m.get("generated_tokens", 0.0)),
                                    requests_running=float(m.get("running", 0.0)))
        return out

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        handles = list(self.actors.values())
        if handles:
            try:
                await asyncio.wait_for(asyncio.gather(*(h.close.remote() for h in handles),
                                                      return_exceptions=True), timeout=30)
            except Exception as e:
                log.warning("closing rollout servers: %s", e)
        for h in handles:
            self.launcher.kill(h)
        for seat in self.seats.values():  # the groups of added servers, once those are gone
            if seat.own_group is not None:
                self.launcher.remove(seat.own_group)
                seat.own_group = None
        self.actors.clear()
        self._alive.clear()


class ServerWeights:
    """Weights onto the pool, and what a failed update means for each server (the
    rollout side's server-failure handling at a weight update): `apply` returns the
    version once at least one server serves it; a server that missed it leaves rotation
    until it receives a later one (it must not start episodes on older weights); a dead
    one is restarted by the server manager (`restart`: in its bundle, with the version
    the others serve). `manager` is the `ServerManager` routing over the pool, set once
    it is built (its restart hook is `restart`)."""

    def __init__(self, pool: ServerPool) -> None:
        self.pool = pool
        self.manager: Any = None
        self.version = 0
        """The version the pool serves (what a restarted server must load before serving)."""
        self._epoch = 0
        """The trainer epoch of `version` (a newer one's lower numbers replace it)."""
        self._lock = asyncio.Lock()
        self._lagging: set[str] = set()
        """Servers that missed the version the others serve: out of rotation until they
        receive a later one."""
        self._joining: set[str] = set()
        """Of those, added servers that had no sibling to copy the served version from."""

    async def apply(self, meta: WeightUpdateMeta) -> int:
        """Every server receives version `meta.version` from the trainer itself (each
        interrupts, drops its KV, loads, re-prefills and resumes by itself)."""
        from weight_sync.base import WeightSyncError  # torch-free: this runs on the rollout side's event loop

        manager = self.manager
        async with self._lock:
            ok, failed = await self.pool.receive(meta)
            for name, e in failed.items():
                # its process, or its engine (vLLM's engine core) died; an error of another kind
                # is asked about: a server that no longer answers is dead, not behind
                if _is_server_death(e) or await self.pool.gone(name) is not None:
                    manager.mark_failed(name, e)
                elif ok and name in manager.server_names:
                    log.warning("rollout server %s missed v%d (%s); out of rotation until it receives a later "
                                "version", name, meta.version, _headline(e))
                    manager.remove_server(name)
                    self._lagging.add(name)
            if not ok:
                first = next(iter(failed.values()), None)
                none_left = manager.none_left()
                if none_left is not None:  # dead, and its restarts are spent: nothing can serve
                    raise none_left
                raise WeightSyncError(f"no rollout server loaded v{meta.version}: "
                                      f"{_headline(first) if first else 'no server is alive'}")
            for name in list(self._lagging):
                if name in ok:  # caught up: back into rotation
                    self._lagging.discard(name)
                    if name in self._joining:  # an added server that had no sibling to copy from
                        self._joining.discard(name)
                        self.pool.waiting.discard(name)
                    if name not in manager.server_names:
                        manager.add_server(self.pool._adapter(name), name=name)
            if meta.epoch != self._epoch:  # a resumed trainer: its numbers start again
                self._epoch, self.version = meta.epoch, -1
            self.version = max(self.version, *ok.values())
        return self.version

    async def restart(self, name: str, error: BaseException) -> Any:
        """The server manager's restart hook: a fresh server actor in the dead one's bundle,
        serving the version the others serve before it takes any call."""
        self._lagging.discard(name)
        server = await self.pool.restart(name, error, self.version)
        # A version may have loaded on the others while it started and copied (seen: v1 copied
        # while v3 loaded): it must not go into rotation behind them, where every group it
        # touches is over-stale and the trainer never gets a batch to send a newer version with.
        async with self._lock:  # between two versions
            behind = (self.pool.versions.get(name, -1) < self.version
                      and not await self.pool.copy_version(name, self.version))
        if behind:  # nothing to copy from: the trainer's next send brings it
            await self.pool._catch_up(name, self.pool.actors[name], self.version)
        return server

    async def add(self) -> str:
        """One more server (docs/design.md §10.24): started outside the lock (a start takes
        seconds; versions keep loading meanwhile), then, between two versions, brought to
        the served one and put into rotation: copied from a sibling, or (none can give it)
        with the trainer's next send. Returns its name."""
        name = await self.pool.add()
        try:
            async with self._lock:
                if await self.pool.copy_version(name, self.version):
                    self.manager.add_server(self.pool._adapter(name), name=name)
                else:  # into rotation once it receives a later version (`apply`); the trainer resends
                    log.warning("rollout server %s: no live server to copy v%d from; it joins with the trainer's "
                                "next send", name, self.version)
                    self._lagging.add(name)
                    self._joining.add(name)
                    self.pool.waiting.add(name)
        except BaseException:
            await self.retire(name)
            raise
        return name

    async def retire(self, name: str) -> None:
        """A drained server leaves between two versions: never in the middle of a transfer,
        whose commit would fail for every server if one member vanished."""
        async with self._lock:
            self._lagging.discard(name)
            self._joining.discard(name)
            self.pool.waiting.discard(name)
            await self.pool.retire(name)


def _is_server_death(error: BaseException) -> bool:
    """The server is gone (its actor) or can serve nothing again (its engine is dead):
    restart it, as a failed `generate` would, rather than wait for a later version."""
    from areal_like.launcher import is_actor_death
    from rollout_cluster.engine.base import EngineDeadError

    cause = getattr(error, "cause", None)  # an `ActorCallError` carries what the actor raised
    return is_actor_death(error) or isinstance(error, EngineDeadError) or isinstance(cause, EngineDeadError)


def _headline(error: BaseException) -> str:
    from rollout_cluster.server_manager import error_headline

    cause = getattr(error, "cause", None)
    return error_headline(cause if isinstance(cause, BaseException) else error)


def _first_line(error: BaseException) -> str:
    """The server's own `ServerStartError` line (out of whatever text surrounds it)."""
    text = str(error).strip()
    for line in text.splitlines():
        if "could not start" in line:
            return line.strip().split("ServerStartError: ", 1)[-1]
    lines = [x for x in text.splitlines() if x.strip() and not x.startswith("ray::")]
    return lines[-1].strip() if lines else type(error).__name__
