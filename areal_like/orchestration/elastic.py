"""An elastic rollout pool: servers added to a running run and drained out of it
(docs/design.md §10.24).

The three parts of one request, kept together so each is read beside the others:

- `PoolRequest` (trainer side): the server count asked for through the dashboard's
  `POST /api/pool` (the endpoint, its binding and its token are the dashboard's). It
  refuses a count below 1 or above `rollout.max_servers`, and one made while the run
  ends. The count rides every announcement (`VersionAnnouncement.servers`, heartbeats
  included, so a rollout side that connects later follows it too) and each request is a
  `pool` record in metrics.jsonl. `state()` is what the rollout side reports back.
- `PoolSizer` (rollout side): brings its pool to the count asked for. It adds servers
  through its launcher (each loads the served version from a sibling, or with the
  trainer's next send, before it takes a call), and drains servers: no new episode or
  turn goes to one, the calls on it finish there for up to `rollout.drain_timeout_s`
  and the rest are handed back and generated again on the others, then it leaves the
  weight group by name and stops. A drained server is never counted as failed. The
  gate's `max_concurrent` follows the pool's size; η's bound does not depend on it.
- `ask_pool` (`areal-like pool RUN_DIR --servers N`): finds the run's dashboard in
  `run.json`, asks, and waits until the rollout side reports the pool at N.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from areal_like.core.config import ExperimentConfig

__all__ = ["PoolError", "PoolRequest", "PoolSizer", "ask_pool", "max_servers"]

log = logging.getLogger(__name__)


def max_servers(cfg: ExperimentConfig) -> int:
    """The most servers a run's pool may have: `rollout.max_servers`, or `num_servers`
    when that is larger."""
    return max(cfg.rollout.max_servers, cfg.rollout.num_servers)


class PoolError(RuntimeError):
    """A pool request that cannot be made or did not succeed; `code` is the exit code
    (2: bad input, 1: the run is not running, refused it, or did not get there)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


# ---- trainer side ------------------------------------------------------------------------
class PoolRequest:
    """The server count asked for; set from the dashboard's thread, read by the
    announcer's (module docstring)."""

    def __init__(self, cfg: ExperimentConfig, mlog: Any = None) -> None:
        self.max = max_servers(cfg)
        self.num_servers = cfg.rollout.num_servers
        self.target = 0
        """0 until someone asks: announcements then say nothing of the pool."""
        self.mlog = mlog
        self._lock = threading.Lock()
        self._report: Callable[[], Any] = lambda: None
        self._stopping: Callable[[], bool] = lambda: False
        self._version: Callable[[], int] = lambda: 0

    def follow(self, report: Callable[[], Any], stopping: Callable[[], bool], version: Callable[[], int]) -> None:
        """The trainer controller's view: the newest rollout report, whether the run
        ends, the trainer version (for the records)."""
        self._report, self._stopping, self._version = report, stopping, version

    def ask(self, servers: Any) -> dict[str, Any]:
        """Ask for `servers` servers; returns `state()`. Raises `PoolError` (code 2 for a
        bad count, 1 when the run is ending)."""
        if isinstance(servers, bool) or not isinstance(servers, int):
            raise PoolError(f"servers must be a whole number, got {servers!r}", code=2)
        if servers < 1:
            raise PoolError(f"servers={servers}: a run needs at least 1 rollout server", code=2)
        if servers > self.max:
            raise PoolError(f"servers={servers} is over rollout.max_servers={self.max} (set it higher when starting "
                            "the run to grow further)", code=2)
        if self._stopping():
            raise PoolError("the run is ending: its pool is no longer resized")
        with self._lock:
            before, self.target = self.target, servers
        state = self.state()
        log.info("rollout pool: %d server(s) asked for (was %s; %s in the pool now)", servers,
                 before or "not asked", state["pool_size"] if state["pool_size"] is not None else "unknown")
        if self.mlog is not None:
            self.mlog.write("pool", self._version(), target=servers, pool_size=state["pool_size"])
        return state

    def state(self) -> dict[str, Any]:
        """What was asked and what the rollout side last reported (None: no report yet)."""
        r = self._report()
        pool = r.counters.pool if r is not None else None
        return {
            "target": self.target or None, "max_servers": self.max, "num_servers": self.num_servers,
            "stopping": self._stopping(),
            "pool_size": int(pool.pool_size) if pool is not None else None,
            "serving": int(pool.servers) if pool is not None else None,
            "rollout_target": int(pool.servers_target) if pool is not None else None,
            "starting": int(pool.servers_starting) if pool is not None else None,
            "draining": int(pool.servers_draining) if pool is not None else None,
            "added": int(pool.servers_added) if pool is not None else None,
            "drained": int(pool.servers_drained) if pool is not None else None,
            "max_concurrent": int(pool.max_concurrent) if pool is not None else None,
            "error": pool.resize_error if pool is not None else "",
            "reported_at": r.time if r is not None else None,
        }


# ---- rollout side ------------------------------------------------------------------------
class PoolSizer:
    """Brings the rollout side's pool to the count the trainer announces (module
    docstring). Everything runs on the rollout side's event loop: `request` is called
    for every announcement that carries a count and returns at once; the work is one
    task at a time."""

    def __init__(self, cfg: ExperimentConfig, pool: Any, weights: Any, manager: Any, gate: Any,
                 request_capacity: Callable[[list[dict[str, float]]], None] | None = None) -> None:
        from areal_like.orchestration.pools import rollout_bundles

        self.pool, self.weights, self.manager, self.gate = pool, weights, manager, gate
        self.request_capacity = request_capacity
        """The launcher's autoscaler hook: asked for the pool's whole shape at each new target."""
        self.bundle = rollout_bundles(cfg)[0]
        self.asked = 0
        """Servers' worth of room asked of the autoscaler (0: nothing asked)."""
        self.max = max_servers(cfg)
        self.per_server = cfg.staleness.max_concurrent / cfg.rollout.num_servers
        self.min_concurrent = cfg.rollout.group_size
        self.drain_timeout_s = cfg.rollout.drain_timeout_s
        self.target = 0
        self.draining: set[str] = set()
        self.starting = 0
        self.added = 0
        self.drained = 0
        self.error = ""
        """Why the last target could not be reached; it is not tried again until another comes."""
        self._task: asyncio.Task[None] | None = None
        self._stopped = False

    def request(self, servers: int) -> None:
        """The trainer's announcement asks for `servers` (0: nothing asked)."""
        if self._stopped or servers < 1:
            return
        servers = min(servers, self.max)
        if servers != self.target:
            log.info("rollout pool: %d -> %d server(s) asked for", len(self.members()), servers)
            self.target, self.error = servers, ""
            self._ask_capacity(servers)
        if (self._task is None or self._task.done()) and not self.error and len(self.members()) != self.target:
            self._task = asyncio.get_running_loop().create_task(self._reconcile(), name="pool-resize")

    def members(self) -> list[str]:
        """The servers that make the pool's size: alive or being restarted, not draining
        (a dead one whose restarts are spent is not; a target replaces it)."""
        restarting = set(self.manager.restarting)
        return [n for n in self.pool.names
                if n not in self.draining and (self.pool.is_alive(n) or n in restarting)]

    async def _reconcile(self) -> None:
        try:
            while not self._stopped:
                have = self.members()
                if len(have) < self.target:
                    _raise_first(await asyncio.gather(*(self._add() for _ in range(self.target - len(have))),
                                                      return_exceptions=True))
                elif len(have) > self.target:
                    names = self._pick_drained(have, len(have) - self.target)
                    if not names:  # all out of rotation (restarting): look again soon
                        await asyncio.sleep(1.0)
                        continue
                    _raise_first(await asyncio.gather(*(self._drain(n) for n in names), return_exceptions=True))
                else:
                    log.info("rollout pool: %d server(s) (%d added, %d drained so far)", len(have), self.added,
                             self.drained)
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:
            from rollout_cluster.server_manager import error_headline

            self.error = error_headline(e)
            log.error("rollout pool: could not reach %d server(s): %s (the pool stays at %d)", self.target,
                      self.error, len(self.members()))
        finally:
            self._set_concurrency()

    async def _add(self) -> None:
        self.starting += 1
        try:
            name = await self.weights.add()
            self.added += 1
            log.info("rollout server %s added to the pool", name)
        finally:
            self.starting -= 1
            self._set_concurrency()

    def _pick_drained(self, have: list[str], k: int) -> list[str]:
        """Which `k` servers leave: first those not in rotation (waiting for a version),
        then those with the fewest calls running, the newest first among equals."""
        rotation = self.manager.in_flight()
        restarting = set(self.manager.restarting)
        candidates = [n for n in have if n not in restarting]
        order = sorted(candidates, key=lambda n: (n in rotation, rotation.get(n, 0), -self.pool.seats[n].index))
        return order[:k]

    async def _drain(self, name: str) -> None:
        self.draining.add(name)
        self._set_concurrency()  # fewer episodes may start now
        try:
            if name in self.manager.server_names:
                left = await self.manager.drain(name, self.drain_timeout_s)
                if left:
                    log.info("rollout server %s: %d call(s) still running after rollout.drain_timeout_s=%gs are "
                             "handed back to the other servers", name, left, self.drain_timeout_s)
            await self.weights.retire(name)
            self.drained += 1
            log.info("rollout server %s drained out of the pool", name)
        finally:
            self.draining.discard(name)

    def _set_concurrency(self) -> None:
        """The gate's `max_concurrent` for the pool's size now (at least one group)."""
        n = max(1, len(self.members()))
        self.gate.set_max_concurrent(max(self.min_concurrent, math.ceil(self.per_server * n - 1e-9)))

    def counters(self) -> dict[str, Any]:
        """This side's part of `ServerPoolCounters`."""
        return {"pool_size": float(len(self.members())), "servers_target": float(self.target),
                "servers_starting": float(self.starting), "servers_draining": float(len(self.draining)),
                "servers_added": float(self.added), "servers_drained": float(self.drained),
                "max_concurrent": float(self.gate.max_concurrent), "resize_error": self.error}

    def _ask_capacity(self, servers: int) -> None:
        """Room for `servers` bundles, asked of an autoscaling cluster at each new target,
        before its servers are placed (Ray: `request_resources`, which keeps the last
        request; `stop` withdraws it with `[]`)."""
        if self.request_capacity is None or servers == self.asked:
            return
        self.asked = servers
        self.request_capacity([dict(self.bundle) for _ in range(servers)])

    async def stop(self) -> None:
        """The run ends: nothing more is resized (a server half-started is stopped with
        the pool), and a request for room is withdrawn."""
        if self.asked and self.request_capacity is not None:
            self.asked = 0
            self.request_capacity([])
        self._stopped = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def _raise_first(results: list[Any]) -> None:
    """Every add or drain ran to its end; the first that failed says why."""
    for r in results:
        if isinstance(r, BaseException):
            raise r


# ---- the command -------------------------------------------------------------------------
def _endpoint(run_dir: Path, url: str | None, token: str | None) -> tuple[str, str | None]:
    """The run's dashboard and its token: given, else from the run folder (`run.json`
    names the dashboard of the trainer running there; config.yaml holds the token)."""
    if url is None:
        identity = run_dir / "run.json"
        if not identity.is_file():
            raise PoolError(f"no run in {run_dir}: it has no run.json (start one with `areal-like run` or "
                            "`areal-like train`)")
        url = json.loads(identity.read_text()).get("dashboard")
        if not url:
            raise PoolError(f"the run in {run_dir} is not running (its run.json names no dashboard)")
    if token is None:
        token = os.environ.get("AREAL_LIKE_DASHBOARD_TOKEN") or None
    if token is None and (run_dir / "config.yaml").is_file():
        import yaml

        cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
        token = (cfg.get("metrics") or {}).get("dashboard_token")
    return url.rstrip("/") + "/api/pool", token


def _call(endpoint: str, token: str | None, body: dict[str, Any] | None, run_dir: Path) -> dict[str, Any]:
    headers = {"Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(endpoint, data=data, headers=headers, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return dict(json.loads(resp.read()))
    except urllib.error.HTTPError as e:
        text = e.read().decode(errors="replace")
        try:
            text = json.loads(text).get("error", text)
        except ValueError:
            pass
        if e.code == 401:
            raise PoolError(f"the run's dashboard refused the request: {text} (pass --token or set "
                            "AREAL_LIKE_DASHBOARD_TOKEN)") from None
        raise PoolError(text, code=2 if e.code == 400 else 1) from None
    except (urllib.error.URLError, OSError) as e:
        why = getattr(e, "reason", e)
        raise PoolError(f"the run in {run_dir} is not running: nothing answers at {endpoint} ({why})") from None


def _reached(state: dict[str, Any], servers: int) -> bool:
    return (state.get("rollout_target") == servers and state.get("pool_size") == servers
            and not state.get("starting") and not state.get("draining"))


def ask_pool(run_dir: str | Path, servers: int | None, *, url: str | None = None, token: str | None = None,
             wait: bool = True, timeout_s: float = 300.0, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Ask the run in `run_dir` for `servers` rollout servers (None: only report) and,
    with `wait`, return once its rollout side reports the pool at that size. Raises
    `PoolError` with the reason and an exit code."""
    run_dir = Path(run_dir)
    if servers is not None and servers < 1:
        raise PoolError(f"--servers {servers}: a run needs at least 1 rollout server", code=2)
    endpoint, token = _endpoint(run_dir, url, token)
    if servers is None:
        return _call(endpoint, token, None, run_dir)
    state = _call(endpoint, token, {"servers": servers}, run_dir)
    say(f"asked the run for {servers} rollout server(s); the pool has {_size(state)}")
    if not wait:
        return state
    deadline = time.monotonic() + timeout_s
    shown = None
    while True:
        if _reached(state, servers):
            say(f"the pool has {servers} server(s) ({state['serving']} serving; {state['added']} added and "
                f"{state['drained']} drained since the run started)")
            return state
        if state.get("error") and state.get("rollout_target") == servers:
            raise PoolError(f"the rollout side could not reach {servers} server(s): {state['error']} (it has "
                            f"{_size(state)})")
        if time.monotonic() > deadline:
            raise PoolError(f"the pool did not reach {servers} server(s) within {timeout_s:.0f}s (it has "
                            f"{_size(state)}; starting {state.get('starting')}, draining {state.get('draining')})")
        now = (state.get("pool_size"), state.get("starting"), state.get("draining"))
        if now != shown and state.get("rollout_target") == servers:
            shown = now
            say(f"  pool: {_size(state)}, starting {state.get('starting')}, draining {state.get('draining')}")
        time.sleep(0.5)
        state = _call(endpoint, token, None, run_dir)


def _size(state: dict[str, Any]) -> str:
    n = state.get("pool_size")
    return "no report from the rollout side yet" if n is None else f"{n} server(s)"
