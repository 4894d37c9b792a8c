"""The live dashboard: one page, one JSON endpoint, Prometheus `/metrics`, `/health`.

Why it looks like this. The trainer side owns the run folder and every number that
reaches it (docs/design.md §9.6), so the dashboard reads exactly what `metrics.jsonl`
gets — the `MetricsLog`'s in-memory `recent` records — plus the `MetricsRegistry`
for `/metrics` and for the reward distribution (records carry only the step mean,
the registry's `areal_like_reward` histogram sees every trained sample). It is an
aiohttp app, like the rollout server's API, on an event loop of its own in a daemon
thread: no event loop to share with the (synchronous) caller, and the caller never
blocks. The page is plain
HTML with a small hand-written SVG chart script shipped in the package
(`areal_like/assets/dashboard/`); nothing is fetched at run time (docs/design.md §9.22),
which the page's Content-Security-Policy (`default-src 'self'`) also enforces.

Security. The dashboard shows a run's internals and `/metrics`, so it refuses to
bind beyond loopback without a token. With a token every route except `/health`
and the static assets (package files, identical for every run, carrying no run
data) needs `?token=<token>` or `Authorization: Bearer <token>`; anything else gets
401. `/health` stays open so liveness probes need no secret. The page passes the
token it was opened with (`/?token=...`) to `/api/data` as a bearer header.

Routes:
    GET /                    the page
    GET /static/<file>       its script and stylesheet
    GET /api/data?since=T    JSON below; series hold only points with time > T
    GET /api/pool            the rollout pool: the server count asked for and what the
                             rollout side reports (`elastic.PoolRequest.state`)
    POST /api/pool           {"servers": N}: ask for N rollout servers (docs/design.md
                             §10.24); 400 with {"error": ...} for a bad N, 409 while the
                             run ends. Only `Content-Type: application/json`, which a page
                             of another origin cannot send without the browser asking first
                             (no cross-site form can resize a loopback run's pool)
    GET /metrics             Prometheus text exposition of the registry
    GET /health              {"ok": true}

`/api/data` JSON (all times are UNIX seconds; a series is a list of `[time, value]`
pairs in time order, only the points newer than `since`; the poller passes the
previous reply's `latest_time` as the next `since` and appends):

    run_name          str     the name given to `Dashboard`
    now               float   server time of this reply
    start_time        float   time of the first record seen (the charts' x origin)
    latest_time       float   newest record time in this reply (the next `since`)
    since             float   the `since` this reply answers (0 = everything)
    trainer_version   int     trainer version of the newest record
    rollout_version   int|null  version the rollout side last reported as loaded
    steps             int     train-step records seen (skipped steps included)
    latest            {name: number}  newest value of every series below
    head_lag_hist     {lag: count}    head version lag of trained samples, summed over
                                      non-skipped train steps (string keys)
    token_lag_hist    {lag: count}    the same per generated token
    reward_hist       {"buckets": [{"le": str, "count": int}], "count": int, "sum": float|null}
                      rewards of trained samples from the registry's histogram;
                      counts are per bucket (lower bound excluded), not cumulative
    series            {name: [[time, value], ...]} with names:
        trainer_version, rollout_version                          versions over time
        pool_size, pool_serving, pool_target                      rollout servers in the pool, in
                                                                  rotation, and asked for (§10.24)
        gate_capacity, gate_running, gate_accepted,               staleness gate, in samples:
        gate_consumed, gate_dropped, gate_rejected_at_gate,       accepted = sent_base + sent -
        gate_free                                                 dropped; free = capacity -
                                                                  accepted - running (what the
                                                                  lead L still admits);
                                                                  rejected_at_gate counts refused
                                                                  admissions
        gate_lead                                                 L: versions the rollout side may
                                                                  run ahead (≤ η, §10.50)
        over_stale                                                cumulative over-stale drops
                                                                  (train_step `over_stale`)
        buffer_depth                                              samples waiting to train
        gen_tokens_per_s, train_tokens_per_s                      throughput
        trainer_idle_ratio, rollout_idle_ratio                    fraction of time waiting
        train_cores_used, rollout_cores_used                      CPU cores each pool's processes
                                                                  used (CPU seconds / wall)
        interrupts, interrupted_tokens, recompute_tokens          cumulative
        pause_resume_latency_s_max                                seconds
        vllm_kv_cache_usage, vllm_num_waiting, vllm_preemptions   vLLM's own (vLLM engine only)
        weight_sync_s, weight_sync_bytes                          per synced step
        straggler_wait_s                                          per train step: waited for
                                                                  a group η would otherwise drop
        reward_mean, loss                                         per train step (trained samples)
        reward_mean_all_groups                                    per train step: every finished
                                                                  trajectory, filtered groups too
        eval_accuracy, eval_reward_mean                           per evaluation
        behav_prox_gap                                            mean |behav - prox| logprob
        behav_weight_mean, behav_weight_max,                      importance weights
        behav_capped, behav_masked, clip_frac
    budget            the newest step's time budget (docs/design.md §10.19), once a step
                      recorded one: {"step": int, "time": float, "wall_s": float,
                      "trainer": {phase: s}, "rollout": {phase: s},
                      "labels": {"trainer": {phase: label}, "rollout": {phase: label}},
                      "groups": [{"name", "title", "phases": [phase]}]};
                      the trainer's phases add up to wall_s (seconds since the step
                      before), the rollout side's are seconds of work in that interval,
                      summed over servers and episodes, grouped by where they happen
                      (servers, controller, episodes); phases in drawing order
    summary           the run's `summary` record (outcome counts); present only
                      once it has been written
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import math
import socket
import sys
import threading
import time
from collections.abc import Iterable
from http import HTTPStatus
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlsplit

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from areal_like.core.metrics import MetricsLog, MetricsRegistry
from areal_like.orchestration.step_budget import ROLLOUT_GROUPS, ROLLOUT_PHASES, TRAINER_PHASES, budget_of

__all__ = ["Dashboard", "build_data", "SERIES"]

log = logging.getLogger(__name__)

# (series name, record kind, record field). One table, so the docstring, the page and
# the tests agree on where each number comes from.
SERIES: tuple[tuple[str, str, str], ...] = (
    ("trainer_version", "train_step", "trainer_version"),
    ("trainer_version", "rollout", "trainer_version"),
    ("rollout_version", "rollout", "loaded_version"),
    ("pool_size", "rollout", "pool_size"),
    ("pool_serving", "rollout", "servers"),
    ("pool_target", "rollout", "servers_target"),
    ("gate_capacity", "rollout", "gate_capacity"),
    ("gate_running", "rollout", "gate_running"),
    ("gate_accepted", "rollout", "gate_accepted"),  # derived in _record_value
    ("gate_free", "rollout", "gate_free"),  # derived in _record_value
    ("gate_consumed", "rollout", "gate_consumed"),
    ("gate_dropped", "rollout", "gate_dropped"),
    ("gate_rejected_at_gate", "rollout", "gate_rejected_at_gate"),
    ("gate_lead", "rollout", "gate_lead"),
    ("over_stale", "train_step", "over_stale"),
    ("buffer_depth", "train_step", "buffer_depth"),
    ("gen_tokens_per_s", "rollout", "gen_tokens_per_s"),
    ("train_tokens_per_s", "train_step", "tokens_per_s"),
    ("trainer_idle_ratio", "train_step", "trainer_idle_ratio"),
    ("rollout_idle_ratio", "rollout", "rollout_idle_ratio"),
    ("train_cores_used", "train_step", "train_cores_used"),
    ("rollout_cores_used", "rollout", "rollout_cores_used"),
    ("interrupts", "rollout", "interrupts"),
    ("interrupted_tokens", "rollout", "interrupted_tokens"),
    ("recompute_tokens", "rollout", "recompute_tokens"),
    ("pause_resume_latency_s_max", "rollout", "pause_resume_latency_s_max"),
    ("vllm_kv_cache_usage", "rollout", "vllm_kv_cache_usage"),
    ("vllm_num_waiting", "rollout", "vllm_num_waiting"),
    ("vllm_preemptions", "rollout", "vllm_preemptions"),
    ("weight_sync_s", "train_step", "weight_sync_s"),
    ("straggler_wait_s", "train_step", "straggler_wait_s"),
    ("weight_sync_bytes", "train_step", "weight_sync_bytes"),
    ("reward_mean", "train_step", "reward_mean"),
    ("reward_mean_all_groups", "train_step", "reward_mean_all_groups"),
    ("loss", "train_step", "loss"),
    ("eval_accuracy", "eval", "accuracy"),
    ("eval_reward_mean", "eval", "reward_mean"),
    ("behav_prox_gap", "train_step", "behav_prox_gap"),
    ("behav_weight_mean", "train_step", "behav_weight_mean"),
    ("behav_weight_max", "train_step", "behav_weight_max"),
    ("behav_capped", "train_step", "behav_capped"),
    ("behav_masked", "train_step", "behav_masked"),
    ("clip_frac", "train_step", "clip_frac"),
)

_BY_KIND: dict[str, list[tuple[str, str]]] = {}
for _name, _kind, _field in SERIES:
    _BY_KIND.setdefault(_kind, []).append((_name, _field))

_ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
_PAGE = "index.html"
# The page may load only its own script and style and talk only to its own origin.
_CSP = "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; connect-src 'self'"


def _number(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


def _record_value(rec: dict[str, Any], field: str) -> float | None:
    if field == "servers_target":  # 0: nothing asked (no line at 0 servers)
        return _number(rec.get(field)) or None
    if field in ("gate_accepted", "gate_free"):
        # Mirrors StalenessGate.accepted (samples handed over and not later dropped) and
        # the staleness half of free_slots(): how many more episodes η still allows.
        sent, dropped = _number(rec.get("gate_sent")), _number(rec.get("gate_dropped"))
        if sent is None or dropped is None:
            return None
        accepted = (_number(rec.get("gate_sent_base")) or 0.0) + sent - dropped
        if field == "gate_accepted":
            return accepted
        capacity, running = _number(rec.get("gate_capacity")), _number(rec.get("gate_running"))
        if capacity is None or running is None:
            return None
        return capacity - accepted - running
    return _number(rec.get(field))


def _add_hist(into: dict[int, int], hist: Any) -> None:
    if not isinstance(hist, dict):
        return
    for k, n in hist.items():
        try:
            lag = int(k)
        except (TypeError, ValueError):
            continue
        if isinstance(n, (int, float)) and not isinstance(n, bool):
            into[lag] = into.get(lag, 0) + int(n)


def _reward_hist(registry: MetricsRegistry) -> dict[str, Any]:
    """Per-bucket counts of the registry's `areal_like_reward` histogram."""
    cumulative: list[tuple[str, float]] = []
    count, total = 0, 0.0
    for family in registry.registry.collect():
        if family.name != "areal_like_reward":
            continue
        for s in family.samples:
            if s.name.endswith("_bucket"):
                cumulative.append((s.labels["le"], s.value))
            elif s.name.endswith("_count"):
                count = int(s.value)
            elif s.name.endswith("_sum"):
                total = float(s.value)
    buckets, prev = [], 0.0
    for le, c in cumulative:
        buckets.append({"le": le, "count": int(c - prev)})
        prev = c
    return {"buckets": buckets, "count": count, "sum": total if math.isfinite(total) else None}


def _budget(rec: dict[str, Any]) -> dict[str, Any]:
    """The `budget` field from one `train_step` record (phases in drawing order)."""
    def ordered(parts: dict[str, float], order: list[str]) -> dict[str, float]:
        return {k: parts[k] for k in [*order, *sorted(set(parts) - set(order))] if k in parts}

    trainer, rollout = budget_of(rec), budget_of(rec, "rollout_budget_")
    return {
        "step": rec.get("step"), "time": rec.get("time"), "wall_s": _number(rec.get("budget_wall_s")),
        "trainer": ordered(trainer, [k for k, _ in TRAINER_PHASES]),
        "rollout": ordered(rollout, [k for k, _, _ in ROLLOUT_PHASES]),
        "labels": {"trainer": dict(TRAINER_PHASES), "rollout": {k: label for k, _, label in ROLLOUT_PHASES}},
        "groups": [{"name": name, "title": title, "phases": list(names)} for name, title, names in ROLLOUT_GROUPS],
    }


def build_data(
    records: Iterable[dict[str, Any]],
    registry: MetricsRegistry,
    *,
    since: float = 0.0,
    run_name: str = "",
    start_time: float | None = None,
) -> dict[str, Any]:
    """The `/api/data` reply (fields in the module docstring), pure so tests need no server.

    Histograms, `latest` and the versions are computed over all `records`; only the
    series are cut at `since`, so an incremental poll stays small while the
    aggregates stay whole.
    """
    records = list(records)
    series: dict[str, list[list[float]]] = {name: [] for name, _, _ in SERIES}
    latest: dict[str, float] = {}
    head: dict[int, int] = {}
    token: dict[int, int] = {}
    trainer_version, rollout_version, steps = 0, None, 0
    latest_time, summary, budget = since, None, None
    for rec in records:
        kind, t = rec.get("kind"), _number(rec.get("time"))
        if t is None:
            continue
        if isinstance(rec.get("trainer_version"), int):
            trainer_version = rec["trainer_version"]
        if kind == "train_step":
            steps += 1
            if "budget_wall_s" in rec:
                budget = rec
            if not rec.get("skipped"):
                _add_hist(head, rec.get("head_lag_hist"))
                _add_hist(token, rec.get("token_lag_hist"))
            if rollout_version is None and isinstance(rec.get("rollout_version"), int):
                rollout_version = rec["rollout_version"]
        elif kind == "rollout" and isinstance(rec.get("loaded_version"), int):
            rollout_version = rec["loaded_version"]
        elif kind == "summary":
            summary = rec
        for name, field in _BY_KIND.get(str(kind), ()):
            value = _record_value(rec, field)
            if value is None:
                continue
            latest[name] = value
            if t > since:
                series[name].append([t, value])
                latest_time = max(latest_time, t)
    first = _number(records[0].get("time")) if records else None
    out: dict[str, Any] = {
        "run_name": run_name,
        "now": time.time(),
        "start_time": start_time if start_time is not None else (first if first is not None else time.time()),
        "latest_time": latest_time,
        "since": since,
        "trainer_version": trainer_version,
        "rollout_version": rollout_version,
        "steps": steps,
        "latest": latest,
        "head_lag_hist": {str(k): head[k] for k in sorted(head)},
        "token_lag_hist": {str(k): token[k] for k in sorted(token)},
        "reward_hist": _reward_hist(registry),
        "series": series,
    }
    if budget is not None:
        out["budget"] = _budget(budget)
    if summary is not None:
        out["summary"] = summary
    return out


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere, so it needs a token


_UNAUTHORIZED = b"a token is required: ?token=... or Authorization: Bearer ..."
# What http.server's handler called itself, kept so the headers stay as they were.
_SERVER_HEADER = f"areal_like-dashboard Python/{sys.version.split()[0]}"


def _response(status: HTTPStatus, body: bytes, ctype: str, extra: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=body, headers={
        "Server": _SERVER_HEADER, "Content-Type": ctype, "Cache-Control": "no-store",
        "X-Content-Type-Options": "nosniff", **(extra or {})})


def _json(status: HTTPStatus, body: Any) -> web.Response:
    return _response(status, json.dumps(body, separators=(",", ":")).encode(), "application/json")


def _split(request: web.Request) -> tuple[str, dict[str, list[str]]]:
    """The path as sent, not percent-decoded or dot-normalised, so only exact names match
    (leading slashes collapse to one, as http.server does, so `//x` is no host name), and
    the query."""
    raw = request.raw_path
    url = urlsplit("/" + raw.lstrip("/") if raw.startswith("//") else raw)
    return url.path, parse_qs(url.query)


def _authorized(token: str | None, request: web.Request, query: dict[str, list[str]]) -> bool:
    if token is None:
        return True
    given = query.get("token", [""])[0]
    auth = request.headers.get("Authorization", "")
    if auth.startswith("Bearer "):
        given = auth[len("Bearer "):].strip()
    return hmac.compare_digest(given.encode(), token.encode())


class Dashboard:
    """Serves the live dashboard of one run from a background thread.

    `start()` binds (port 0 picks a free port) and returns the URL; the token, when
    set, is not part of it, so the URL can be logged without leaking the secret.
    """

    def __init__(
        self,
        mlog: MetricsLog,
        registry: MetricsRegistry,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        run_name: str = "",
        pool: Any = None,
    ) -> None:
        if token is not None and not token:
            raise ValueError("dashboard token must be a non-empty string or None")
        if token is None and not _is_loopback(host):
            raise ValueError(
                f"refusing to serve the dashboard on {host!r} without a token: it exposes the run's metrics; "
                "set metrics.dashboard_token or bind to 127.0.0.1"
            )
        self.mlog = mlog
        self.registry = registry
        self.host = host
        self.port = port
        self.token = token
        self.run_name = run_name
        self.pool = pool
        """`elastic.PoolRequest` behind `/api/pool` (None: no such route)."""
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._assets: dict[str, bytes] = {}
        self._start_time: float | None = None

    def data(self, since: float = 0.0) -> dict[str, Any]:
        # list() of a list is one atomic copy under the GIL, so MetricsLog.write's
        # append/trim on another thread cannot tear it.
        records = list(self.mlog.recent)
        if self._start_time is None and records:
            self._start_time = _number(records[0].get("time"))
        return build_data(records, self.registry, since=since, run_name=self.run_name, start_time=self._start_time)

    async def _handle(self, request: web.Request) -> web.Response:
        try:
            if self.pool is not None and _split(request)[0] == "/api/pool":
                return await self._pool_route(request)
            return self._route(request)
        except Exception:
            log.exception("dashboard request from %s failed", request.remote)
            return _response(HTTPStatus.INTERNAL_SERVER_ERROR, b"internal error", "text/plain")

    def _route(self, request: web.Request) -> web.Response:
        if request.method != "GET":
            return _response(HTTPStatus.NOT_IMPLEMENTED, b"only GET is served", "text/plain")
        path, query = _split(request)
        if path == "/health":
            return _response(HTTPStatus.OK, b'{"ok":true}', "application/json")
        if path.startswith("/static/"):
            name = path[len("/static/"):]
            if name not in _ASSETS:
                return _response(HTTPStatus.NOT_FOUND, b"not found", "text/plain")
            return _response(HTTPStatus.OK, self._assets[name], _ASSETS[name] + "; charset=utf-8")
        if not _authorized(self.token, request, query):
            return _response(HTTPStatus.UNAUTHORIZED, _UNAUTHORIZED, "text/plain", extra={"WWW-Authenticate": "Bearer"})
        if path in ("/", "/index.html"):
            return _response(HTTPStatus.OK, self._assets[_PAGE], "text/html; charset=utf-8",
                             extra={"Content-Security-Policy": _CSP})
        if path == "/api/data":
            try:
                since = float(query.get("since", ["0"])[0])
            except ValueError:
                return _response(HTTPStatus.BAD_REQUEST, b"since must be a number (UNIX seconds)", "text/plain")
            body = json.dumps(self.data(since), separators=(",", ":"), allow_nan=False).encode()
            return _response(HTTPStatus.OK, body, "application/json")
        if path == "/metrics":
            return _response(HTTPStatus.OK, self.registry.exposition(), CONTENT_TYPE_LATEST)
        return _response(HTTPStatus.NOT_FOUND, b"not found", "text/plain")

    async def _pool_route(self, request: web.Request) -> web.Response:
        """`/api/pool` (module docstring): the one route that changes the run."""
        from areal_like.orchestration.elastic import PoolError

        if not _authorized(self.token, request, _split(request)[1]):
            return _response(HTTPStatus.UNAUTHORIZED, _UNAUTHORIZED, "text/plain", extra={"WWW-Authenticate": "Bearer"})
        if request.method == "GET":
            return _json(HTTPStatus.OK, self.pool.state())
        if request.method != "POST":
            return _json(HTTPStatus.METHOD_NOT_ALLOWED, {"error": "GET or POST"})
        if request.content_type != "application/json":
            return _json(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, {"error": "send {\"servers\": N} as application/json"})
        try:
            body = json.loads(await request.read())
        except ValueError:
            return _json(HTTPStatus.BAD_REQUEST, {"error": "the body is not JSON; send {\"servers\": N}"})
        if not isinstance(body, dict) or "servers" not in body:
            return _json(HTTPStatus.BAD_REQUEST, {"error": "send {\"servers\": N}"})
        try:
            state = await asyncio.to_thread(self.pool.ask, body["servers"])
        except PoolError as e:
            return _json(HTTPStatus.BAD_REQUEST if e.code == 2 else HTTPStatus.CONFLICT, {"error": str(e)})
        return _json(HTTPStatus.OK, state)

    def start(self) -> str:
        if self._runner is not None:
            return self.url
        folder = resources.files("areal_like") / "assets" / "dashboard"
        self._assets = {name: (folder / name).read_bytes() for name in (_PAGE, *_ASSETS)}
        # Bound here, on the caller's thread, so a port in use raises OSError from start().
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
        except BaseException:
            sock.close()
            raise
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="areal_like-dashboard", daemon=True)
        thread.start()

        async def serve() -> None:
            await runner.setup()
            await web.SockSite(runner, sock).start()

        try:
            asyncio.run_coroutine_threadsafe(serve(), loop).result(timeout=30)
        except BaseException:
            sock.close()
            self._loop, self._runner, self._thread = loop, runner, thread
            self.stop()
            raise
        self._loop, self._runner, self._thread = loop, runner, thread
        self.port = sock.getsockname()[1]
        shown = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{shown}:{self.port}/"
        log.info("dashboard at %s%s", self.url, " (append ?token=...)" if self.token else "")
        return self.url

    def stop(self) -> None:
        if self._runner is None or self._loop is None:
            return
        loop, runner = self._loop, self._runner
        try:
            # closes the listening socket and the open connections
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=5)
        except Exception:
            log.exception("dashboard shutdown failed")
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=5)
            if not self._thread.is_alive():
                loop.close()
        self._runner = None
        self._loop = None
        self._thread = None
