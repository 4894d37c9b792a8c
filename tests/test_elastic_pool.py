"""The elastic rollout pool (issue #33 item 2, docs/design.md §10.24), without real servers:
the real `ServerPool`, `ServerWeights`, `ServerManager`, `PoolSizer` and gate over a fake
launcher whose actors answer at once. A pool asked to go 1 → 3 → 2 gets there, the added
servers load the served version before they take a call, a drained server's calls finish
there or are handed back (never a failure), it leaves the weight group and stops, and the
gate's `max_concurrent` follows the size. Then the request's edges: the trainer's
`PoolRequest`, the dashboard's `/api/pool`, the announcer, and the command's errors.

The real run grown and drained by the real command is
`tests/test_elastic_run.py` (slow suite).
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from areal_like.core.config import load_config
from areal_like.core.staleness import StalenessGate
from areal_like.core.types import GenerateResult, RolloutCounters, RolloutStats, ServerPoolCounters

pytestmark = pytest.mark.timeout(60)


# ---- a launcher whose actors answer at once ----------------------------------------------
class _Method:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class FakeActor:
    def __init__(self, name: str, version: int = 0) -> None:
        self.name, self.version = name, version
        self.calls: list[str] = []
        self.release = asyncio.Event()
        """Set: a generate call returns; clear: it hangs until set (or the actor is killed)."""
        self.release.set()
        self.killed = asyncio.Event()
        self.in_generate = 0
        for m in ("start", "join_weights", "hold", "export_weights", "load_weights", "receive_weights",
                  "generate", "metrics", "close"):
            setattr(self, m, _Method(getattr(self, "_" + m)))

    async def _start(self) -> dict[str, Any]:
        self.calls.append("start")
        return {"name": self.name, "node_id": "local", "node_ip": "127.0.0.1", "pid": 1, "device": "cpu",
                "version": 0}

    async def _join_weights(self, rendezvous: str) -> None:
        self.calls.append(f"join {rendezvous}")

    async def _hold(self, on: bool) -> None:
        self.calls.append(f"hold {on}")

    async def _export_weights(self) -> tuple[int, list[Any]]:
        return self.version, []

    async def _load_weights(self, exported: tuple[int, list[Any]]) -> int:
        self.calls.append(f"load v{exported[0]}")
        self.version = max(self.version, exported[0])
        return self.version

    async def _receive_weights(self, meta: dict[str, Any], rendezvous: str | None = None) -> int:
        self.version = meta["version"]
        return self.version

    async def _generate(self, **kw: Any) -> GenerateResult:
        from areal_like.launcher import ActorDied

        self.calls.append("generate")
        self.in_generate += 1
        try:
            release, killed = asyncio.ensure_future(self.release.wait()), asyncio.ensure_future(self.killed.wait())
            await asyncio.wait([release, killed], return_when=asyncio.FIRST_COMPLETED)
            release.cancel(), killed.cancel()
            if self.killed.is_set():
                raise ActorDied(f"{self.name} was killed")
            return GenerateResult(request_id=kw["request_id"], token_ids=[1], logprobs=[-0.5], versions=[self.version],
                                  stop_reason="stop")
        finally:
            self.in_generate -= 1

    async def _metrics(self) -> dict[str, float]:
        return {"generated_tokens": 10.0, "running": float(self.in_generate)}

    async def _close(self) -> None:
        self.calls.append("close")


class FakeLauncher:
    def __init__(self) -> None:
        self.actors: dict[str, FakeActor] = {}
        self.placed: list[Any] = []

        self.placements: dict[str, Any] = {}
        self.removed: list[Any] = []
        self.places = False
        """True: a launcher that places (Ray): `place` makes a group."""

    async def aspawn(self, cls: type, args: tuple[Any, ...], kwargs: dict[str, Any], *, name: str,
                     placement: Any = None, **_: Any) -> FakeActor:
        self.actors[name] = FakeActor(name)
        self.placements[name] = placement
        return self.actors[name]

    def kill(self, handle: FakeActor) -> None:
        handle.killed.set()

    def place(self, name: str, bundles: list[dict[str, float]], strategy: str = "PACK") -> Any:
        if self.places:
            self.placed.append((name, bundles, strategy))
            return f"group-{len(self.placed)}"
        return None

    def remove(self, group: Any) -> None:
        self.removed.append(group)


def _cfg(tmp_path: Path, *sets: str) -> Any:
    return load_config("configs/quickstart.yaml", [f"run.dir={tmp_path / 'run'}", "rollout.num_servers=1",
                                                   "staleness.max_concurrent=32", "rollout.group_size=8",
                                                   "cluster.lend_idle_threads=false", *sets])


async def _rollout_side(cfg: Any, launcher: FakeLauncher) -> tuple[Any, Any, Any, Any, StalenessGate]:
    """What `RolloutSide._build_servers_and_runner` and `main` build, over the fakes."""
    from areal_like.orchestration.elastic import PoolSizer
    from areal_like.orchestration.server_pool import ServerPool, ServerWeights
    from rollout_cluster.server_manager import ServerManager

    pool = ServerPool(cfg, Path("/nonexistent"), None, launcher=launcher)
    servers = await pool.start()
    weights = ServerWeights(pool)
    manager = weights.manager = ServerManager(servers, restart=weights.restart, max_restarts=1,
                                              on_server_failure=lambda name, _e: pool.mark_dead(name))
    gate = StalenessGate(cfg.samples_per_step, cfg.staleness.max_staleness, cfg.staleness.max_concurrent)
    return pool, weights, manager, PoolSizer(cfg, pool, weights, manager, gate), gate


async def _settle(sizer: Any, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if sizer._task is None or sizer._task.done():
            if sizer._task is not None:
                sizer._task.result()
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the pool did not settle")


def test_a_pool_grows_to_three_and_drains_to_two(tmp_path, monkeypatch) -> None:
    import weight_sync.dist

    left: list[str] = []
    monkeypatch.setattr(weight_sync.dist, "leave_group", lambda rendezvous, name, *a: left.append(name))
    cfg = _cfg(tmp_path)

    async def main() -> None:
        launcher = FakeLauncher()
        pool, weights, manager, sizer, gate = await _rollout_side(cfg, launcher)
        await pool.join("127.0.0.1:9")  # the weight group's store (leaving it is recorded above)
        from areal_like.core.types import WeightUpdateMeta

        await weights.apply(WeightUpdateMeta(version=3, transport="dist", tensors=[], checksum="x"))
        assert weights.version == 3 and gate.max_concurrent == 32

        sizer.request(3)
        await _settle(sizer)
        assert pool.names == ["server-0", "server-1", "server-2"] == manager.server_names
        for name in ("server-1", "server-2"):  # each joined the group and copied v3 before it took a call
            calls = launcher.actors[name].calls
            assert calls[:3] == ["start", "join 127.0.0.1:9", "load v3"], calls
            assert pool.versions[name] == 3
        assert gate.max_concurrent == 96  # 32 per server, as configured for 1
        assert sizer.counters()["pool_size"] == 3 and sizer.counters()["servers_added"] == 2

        # the drained server is the least busy, the newest among equals: busy server-1 and server-2
        # equally, so server-2 (newest) goes; its call is held there past the drain timeout
        sizer.drain_timeout_s = 0.2
        for a in launcher.actors.values():
            a.release.clear()
        calls = [asyncio.ensure_future(manager.generate(request_id=f"r{i}", prompt_ids=[1],
                                                        sampling_params=_sampling())) for i in range(3)]
        await asyncio.sleep(0.05)
        assert manager.in_flight() == {"server-0": 1, "server-1": 1, "server-2": 1}
        launcher.actors["server-0"].release.set()
        launcher.actors["server-1"].release.set()
        sizer.request(2)
        await asyncio.sleep(0.05)
        assert "server-2" not in manager.server_names and sizer.counters()["servers_draining"] == 1
        assert gate.max_concurrent == 64  # fewer episodes start as soon as the drain begins
        await _settle(sizer)
        results = await asyncio.gather(*calls)
        assert all(r.stop_reason == "stop" for r in results)  # the held call was handed back and finished
        assert pool.names == ["server-0", "server-1"] == manager.server_names
        assert launcher.actors["server-2"].killed.is_set() and "close" in launcher.actors["server-2"].calls
        assert left == ["server-2"]  # out of the weight group by name: the next transfer does not wait for it
        m = manager.metrics()
        assert m["server_failures"] == 0 and m["generate_retries"] == 1  # handed back, never a failure
        c = sizer.counters()
        assert (c["pool_size"], c["servers_drained"], c["servers_draining"], c["resize_error"]) == (2, 1, 0, "")
        # the next version goes to the two left only
        await weights.apply(WeightUpdateMeta(version=4, transport="dist", tensors=[], checksum="x"))
        assert pool.versions == {"server-0": 4, "server-1": 4}
        await sizer.stop()
        sizer.request(5)  # after the goodbye: nothing more is resized
        assert sizer._task.done() and len(pool.names) == 2
        await pool.close()

    asyncio.run(main())


def test_an_idle_server_drains_at_once_and_a_failed_start_is_said_once(tmp_path) -> None:
    cfg = _cfg(tmp_path)

    async def main() -> None:
        launcher = FakeLauncher()
        pool, weights, manager, sizer, gate = await _rollout_side(cfg, launcher)
        sizer.request(2)
        await _settle(sizer)
        sizer.request(1)
        await _settle(sizer, timeout_s=1.0)  # nothing in flight: no wait for drain_timeout_s (60 s)
        assert pool.names == ["server-0"] and gate.max_concurrent == 32

        async def broken(*a: Any, **kw: Any) -> Any:
            raise RuntimeError("rollout server server-2 on cpu could not start: OSError: out of memory")

        launcher.aspawn = broken  # type: ignore[method-assign]
        sizer.request(2)
        await _settle(sizer)
        assert "could not start" in sizer.counters()["resize_error"] and pool.names == ["server-0"]
        sizer.request(2)  # the same count again (every heartbeat): not tried again
        assert sizer._task.done()
        assert gate.max_concurrent == 32
        await pool.close()

    asyncio.run(main())


def test_an_added_server_with_no_sibling_to_copy_from_waits_for_the_next_version(tmp_path) -> None:
    """vLLM cannot export its weights: the new server stays out of rotation, asking the
    trainer for the served version (`servers_waiting_for_weights`), until it receives one."""
    from areal_like.core.types import WeightUpdateMeta

    cfg = _cfg(tmp_path)

    async def main() -> None:
        launcher = FakeLauncher()
        pool, weights, manager, sizer, gate = await _rollout_side(cfg, launcher)
        await weights.apply(WeightUpdateMeta(version=2, transport="disk", tensors=[], checksum="x"))

        async def cannot_export() -> Any:
            raise NotImplementedError("vLLM cannot export its weights")

        launcher.actors["server-0"].export_weights = _Method(cannot_export)
        sizer.request(2)
        await _settle(sizer)
        assert pool.names == ["server-0", "server-1"] and manager.server_names == ["server-0"]
        assert pool.waiting == {"server-1"} and sizer.counters()["pool_size"] == 2
        await weights.apply(WeightUpdateMeta(version=2, transport="disk", tensors=[], checksum="x"))  # resent
        assert manager.server_names == ["server-0", "server-1"] and pool.waiting == set()
        await pool.close()

    asyncio.run(main())


def _sampling() -> Any:
    from areal_like.core.types import SamplingParams

    return SamplingParams(max_tokens=4)


# ---- the trainer's side of the request ----------------------------------------------------
def _report(**pool: float) -> RolloutStats:
    return RolloutStats(time=1.0, loaded_version=0, started=0, running=0,
                        counters=RolloutCounters(pool=ServerPoolCounters(**pool)))


def test_the_request_refuses_bad_counts_and_a_run_that_ends(tmp_path) -> None:
    from areal_like.core.metrics import MetricsLog, read_jsonl
    from areal_like.orchestration.elastic import PoolError, PoolRequest

    mlog = MetricsLog(tmp_path / "metrics.jsonl")
    req = PoolRequest(_cfg(tmp_path, "rollout.max_servers=4"), mlog)
    stopping = False
    req.follow(lambda: _report(pool_size=1, servers=1), lambda: stopping, lambda: 7)
    for bad, words in ((0, "at least 1"), (-2, "at least 1"), (5, "rollout.max_servers=4"), ("3", "whole number"),
                       (True, "whole number"), (2.5, "whole number")):
        with pytest.raises(PoolError, match=words) as e:
            req.ask(bad)
        assert e.value.code == 2
    assert req.target == 0
    state = req.ask(3)
    assert state["target"] == 3 and state["pool_size"] == 1 and state["max_servers"] == 4
    stopping = True
    with pytest.raises(PoolError, match="ending") as e:
        req.ask(2)
    assert e.value.code == 1 and req.target == 3
    mlog.close()
    assert [(r["kind"], r["target"], r["trainer_version"]) for r in read_jsonl(tmp_path / "metrics.jsonl")] == [
        ("pool", 3, 7)]


def test_the_announcer_carries_the_count_in_announcements_and_heartbeats() -> None:
    import threading
    import time

    from areal_like.core.types import VersionAnnouncement
    from areal_like.orchestration.trainer_policies import Announcer

    sent: list[VersionAnnouncement] = []

    class Pub:
        def publish(self, ann: VersionAnnouncement) -> None:
            sent.append(ann)

    target = {"n": 0}
    a = Announcer(Pub(), acks=dict, heartbeat_s=0.02, servers=lambda: target["n"])
    a.publish(VersionAnnouncement(version=1))
    target["n"] = 3
    beat = threading.Thread(target=a.heartbeat)
    beat.start()
    deadline = time.monotonic() + 10
    while len(sent) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    a.stop()
    beat.join()
    assert sent[0].servers == 0 and sent[-1].servers == 3 and sent[-1].version == 1


def test_the_dashboard_route_asks_with_the_token_and_json_only(tmp_path) -> None:
    from areal_like.core.metrics import MetricsLog, MetricsRegistry
    from areal_like.orchestration.dashboard import Dashboard
    from areal_like.orchestration.elastic import PoolRequest

    mlog = MetricsLog(tmp_path / "metrics.jsonl")
    req = PoolRequest(_cfg(tmp_path))
    req.follow(lambda: _report(pool_size=2, servers=2, servers_target=2), lambda: False, lambda: 0)
    dash = Dashboard(mlog, MetricsRegistry(), token="s3cret", pool=req)
    url = dash.start() + "api/pool"

    def call(body: bytes | None, ctype: str = "application/json", token: str | None = "s3cret") -> tuple[int, Any]:
        headers = {"Content-Type": ctype} if body is not None else {}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        r = urllib.request.Request(url, data=body, headers=headers, method="POST" if body is not None else "GET")
        try:
            with urllib.request.urlopen(r, timeout=10) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            text = e.read()
            return e.code, json.loads(text) if text.startswith(b"{") else text

    try:
        assert call(b'{"servers": 2}', token=None)[0] == 401
        assert call(b'{"servers": 2}', token="wrong")[0] == 401
        assert call(b"servers=2", ctype="application/x-www-form-urlencoded")[0] == 415  # no cross-site form
        status, body = call(b'{"servers": 0}')
        assert status == 400 and "at least 1" in body["error"]
        assert call(b"{not json")[0] == 400 and call(b'{"n": 2}')[0] == 400
        status, body = call(b'{"servers": 2}')
        assert status == 200 and body["target"] == 2 and body["pool_size"] == 2 and req.target == 2
        status, body = call(None)
        assert status == 200 and body["rollout_target"] == 2
        assert call(None, token=None)[0] == 401
    finally:
        dash.stop()
        mlog.close()


def test_the_command_says_when_there_is_no_run_or_it_is_not_running(tmp_path) -> None:
    from areal_like.orchestration.cli import app

    runner = CliRunner()
    nothing = runner.invoke(app, ["pool", str(tmp_path), "--servers", "2"])
    assert nothing.exit_code == 1 and "no run in" in nothing.output
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "x", "epoch": 0}))
    ended = runner.invoke(app, ["pool", str(tmp_path), "--servers", "2"])
    assert ended.exit_code == 1 and "is not running" in ended.output
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "x", "epoch": 0,
                                                   "dashboard": f"http://127.0.0.1:{port}/"}))
    gone = runner.invoke(app, ["pool", str(tmp_path), "--servers", "2"])
    assert gone.exit_code == 1 and "is not running: nothing answers" in gone.output
    zero = runner.invoke(app, ["pool", str(tmp_path), "--servers", "0"])
    assert zero.exit_code == 2 and "at least 1" in zero.output


def test_the_report_says_how_the_pool_changed(tmp_path) -> None:
    from areal_like.core.metrics import MetricsLog
    from areal_like.orchestration.report import make_report

    mlog = MetricsLog(tmp_path / "metrics.jsonl")
    for size, added, drained in ((1, 0, 0), (1, 0, 0), (3, 2, 0), (3, 2, 0), (2, 2, 1)):
        mlog.write("rollout", 0, pool_size=float(size), servers_added=float(added), servers_drained=float(drained))
    mlog.close()
    _png, text = make_report(tmp_path, tmp_path / "report")
    assert "rollout servers: 1 -> 3 -> 2 (2 added, 1 drained)" in text


def test_under_a_launcher_that_places_an_added_server_gets_a_group_of_its_own(tmp_path) -> None:
    """Ray: the pool's placement group has `num_servers` bundles; an added server asks for
    one more bundle of the same shape (the demand Ray's autoscaler sees), given back when
    it is drained."""
    from areal_like.orchestration.elastic import PoolSizer
    from areal_like.orchestration.server_pool import ServerPool, ServerWeights
    from rollout_cluster.server_manager import ServerManager

    cfg = _cfg(tmp_path, "cluster.rollout_pool.num_cpus=2")

    async def main() -> None:
        launcher = FakeLauncher()
        launcher.places = True
        pool = ServerPool(cfg, Path("/nonexistent"), "the-pool-group", launcher=launcher)
        weights = ServerWeights(pool)
        weights.manager = manager = ServerManager(await pool.start())
        gate = StalenessGate(cfg.samples_per_step, cfg.staleness.max_staleness, cfg.staleness.max_concurrent)
        sizer = PoolSizer(cfg, pool, weights, manager, gate)
        sizer.request(2)
        await _settle(sizer)
        assert launcher.placed == [("rollout_pool", [{"CPU": 2.0}], "PACK")]
        assert (launcher.placements["server-0"].group, launcher.placements["server-0"].bundle) == ("the-pool-group", 0)
        assert (launcher.placements["server-1"].group, launcher.placements["server-1"].bundle) == ("group-1", 0)
        sizer.request(1)
        await _settle(sizer)
        assert launcher.removed == ["group-1"] and pool.names == ["server-0"]
        await pool.close()

    asyncio.run(main())


def test_each_new_target_asks_the_autoscaler_for_the_whole_pool_and_the_end_withdraws_it(tmp_path) -> None:
    """Ray's autoscaling hook: a new target asks the launcher for room for that many
    bundles of the pool's shape (the last request replaces the earlier ones); the same
    count asked again is not re-sent; the run's end withdraws the request."""
    from areal_like.orchestration.elastic import PoolSizer

    cfg = _cfg(tmp_path, "cluster.rollout_pool.num_cpus=2", "rollout.num_servers=2")
    asked: list[list[dict[str, float]]] = []

    async def main() -> None:
        pool, weights, manager, _, gate = await _rollout_side(cfg, FakeLauncher())
        sizer = PoolSizer(cfg, pool, weights, manager, gate, request_capacity=asked.append)
        sizer.request(2)
        sizer.request(3)
        await _settle(sizer)
        sizer.request(3)
        sizer.request(1)
        await _settle(sizer)
        await sizer.stop()
        await pool.close()

    asyncio.run(main())
    assert asked == [[{"CPU": 1.0}] * 2, [{"CPU": 1.0}] * 3, [{"CPU": 1.0}], []], asked


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_ray_launcher_puts_the_request_where_the_autoscaler_reads_it() -> None:
    """On a real (local) Ray: `request_capacity` lands in the channel Ray's autoscaler
    reads (`request_resources`' KV entry), and `[]` empties it."""
    ray = pytest.importorskip("ray")
    from ray.autoscaler._private.constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.autoscaler.v2.utils import is_autoscaler_v2
    from ray.experimental.internal_kv import _internal_kv_get

    from areal_like.launcher.ray_launcher import RayLauncher

    ray.init(num_cpus=1, include_dashboard=False, address="local", log_to_driver=False)
    try:
        if is_autoscaler_v2():
            pytest.skip("this Ray sends the request to the v2 autoscaler over RPC: nothing to read back here")
        launcher = RayLauncher()
        launcher.request_capacity([{"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 1.0}])
        assert json.loads(_internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)) == [{"CPU": 1.0}] * 3
        launcher.request_capacity([])
        assert json.loads(_internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)) == []
    finally:
        ray.shutdown()
