"""The launcher package (areal_like/launcher/): one face for both launchers.

The local launcher's processes are tested in tests/test_local_actors.py. Here: what the
Ray launcher asks Ray for (against a stand-in `ray` module, so it runs where Ray is not
installed), how Ray's errors become the launcher's (with Ray, when it is installed), and
the pieces every caller uses.
"""

from __future__ import annotations

import asyncio
import sys
import types
from typing import Any

import pytest

from areal_like.launcher import ActorCallError, ActorDied, Placement, choose_launcher, connect, here
from areal_like.launcher.ray_launcher import RayActor, RayLauncher, RayRef


class _FakeRay(types.ModuleType):
    """Records `ray.remote(cls).options(**options).remote(*args, **kwargs)` and `ray.kill`."""

    def __init__(self) -> None:
        super().__init__("ray")
        self.spawned: list[dict[str, Any]] = []
        self.killed: list[Any] = []

    def remote(self, cls: type) -> Any:
        ray = self

        class _Options:
            def options(self, **options: Any) -> Any:
                class _Remote:
                    def remote(self, *args: Any, **kwargs: Any) -> Any:
                        ray.spawned.append({"cls": cls, "options": options, "args": args, "kwargs": kwargs})
                        return types.SimpleNamespace(ping=types.SimpleNamespace(remote=lambda *a: ("ref", a)))

                return _Remote()

        return _Options()

    def kill(self, handle: Any, no_restart: bool = True) -> None:
        self.killed.append((handle, no_restart))

    def is_initialized(self) -> bool:
        return True


class _Strategy:
    def __init__(self, placement_group: Any, placement_group_bundle_index: int) -> None:
        self.group, self.bundle = placement_group, placement_group_bundle_index

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Strategy) and (self.group, self.bundle) == (other.group, other.bundle)


@pytest.fixture()
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> _FakeRay:
    ray = _FakeRay()
    strategies = types.ModuleType("ray.util.scheduling_strategies")
    strategies.PlacementGroupSchedulingStrategy = _Strategy  # type: ignore[attr-defined]
    util = types.ModuleType("ray.util")
    util.scheduling_strategies = strategies  # type: ignore[attr-defined]
    ray.util = util  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setitem(sys.modules, "ray.util", util)
    monkeypatch.setitem(sys.modules, "ray.util.scheduling_strategies", strategies)
    return ray


class _Body:
    pass


def test_the_ray_launcher_asks_ray_for_what_each_actor_asked_before(fake_ray: _FakeRay) -> None:
    """The options the rollout controller, a server and a train worker got from Ray before
    the launcher package (launch.py, server_pool.py, worker_group.py), unchanged."""
    launcher = RayLauncher()
    pg = types.SimpleNamespace(bundle_specs=[{"CPU": 1.0}, {"CPU": 1.0}])
    # the rollout controller: no resources, beside server 0
    launcher.spawn(_Body, name="rollout", cpus=0, gpus=0, placement=Placement(pg, 0), stdio="/x/run.log")
    # a server: its bundle's CPUs, its threads, many concurrent calls, no task events
    launcher.spawn(_Body, ("server-1",), {"seed": 1}, name="server-1", cpus=0.5, gpus=0.0, threads=2,
                   env={"TOKENIZERS_PARALLELISM": "false"}, placement=Placement(pg, 1), concurrency=10_000,
                   record_calls=False)
    # a train worker: its own bundle when the group has one per rank; no group: no strategy
    launcher.spawn(_Body, (0, 2), name="train-0", cpus=3, gpus=0, threads=3, env={"TOKENIZERS_PARALLELISM": "false"},
                   placement=Placement.of_rank(pg, 1, 2), zero_copy_tensors=True)
    launcher.spawn(_Body, (0, 1), name="train-0", cpus=3, gpus=1, threads=3, env={"TOKENIZERS_PARALLELISM": "false"},
                   placement=Placement.of_rank(None, 0, 1), zero_copy_tensors=True)
    base = {"name": None, "max_restarts": 0, "max_task_retries": 0}
    controller, server, worker, lone = (s["options"] for s in fake_ray.spawned)
    assert controller == {**base, "num_cpus": 0, "num_gpus": 0, "scheduling_strategy": _Strategy(pg, 0)}
    assert server == {**base, "num_cpus": 0.5, "num_gpus": 0.0, "max_concurrency": 10_000, "enable_task_events": False,
                      "runtime_env": {"env_vars": {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2",
                                                   "TOKENIZERS_PARALLELISM": "false"}},
                      "scheduling_strategy": _Strategy(pg, 1)}
    env3 = {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3", "TOKENIZERS_PARALLELISM": "false",
            "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}
    assert worker == {**base, "num_cpus": 3, "num_gpus": 0, "runtime_env": {"env_vars": env3},
                      "scheduling_strategy": _Strategy(pg, 1)}
    assert lone == {**base, "num_cpus": 3, "num_gpus": 1, "runtime_env": {"env_vars": env3}}
    assert fake_ray.spawned[1]["args"] == ("server-1",) and fake_ray.spawned[1]["kwargs"] == {"seed": 1}
    assert Placement.of_rank(types.SimpleNamespace(bundle_specs=[{"CPU": 4.0}]), 1, 2).bundle == -1


def test_a_ray_handle_has_the_launchers_face(fake_ray: _FakeRay) -> None:
    handle = RayLauncher().spawn(_Body, name="x")
    assert isinstance(handle, RayActor) and handle.actor_name == "x"
    ref = handle.ping.remote(1)
    assert isinstance(ref, RayRef) and ref.ref == ("ref", (1,))
    RayLauncher().kill(handle)
    assert fake_ray.killed and fake_ray.killed[0][1] is True
    with pytest.raises(AttributeError):
        handle._private  # noqa: B018


def test_connect_names_the_launcher_of_another_process(fake_ray: _FakeRay) -> None:
    assert isinstance(connect("ray"), RayLauncher)
    assert connect("areal-like-zygote-1-ab").address == "areal-like-zygote-1-ab"  # a zygote's name: no process started
    assert RayLauncher().address == "ray"


def test_without_ray_a_process_is_the_local_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    assert here() == {"node_id": "local", "node_ip": "127.0.0.1", "gpu_ids": []}
    with pytest.raises(RuntimeError, match="no Ray in this process"):
        connect("ray")


def test_choose_launcher_is_the_configs() -> None:
    from areal_like.core.config import ConfigError, ExperimentConfig

    cfg = ExperimentConfig()
    assert choose_launcher(cfg) == ("local" if cfg.cluster.launcher in ("auto", "local") else "ray")
    cfg.cluster.ray_address = "10.0.0.1:6379"
    assert choose_launcher(cfg) == "ray" or cfg.cluster.launcher == "local"
    cfg.cluster.launcher = "local"
    with pytest.raises(ConfigError, match="cannot join"):
        choose_launcher(cfg)


# ---- with Ray --------------------------------------------------------------------------
def test_rays_errors_become_the_launchers() -> None:
    pytest.importorskip("ray")
    from ray import exceptions as rx

    from areal_like.launcher.ray_launcher import _convert

    refused = _convert(rx.RayTaskError("generate", "Traceback: in the actor", ValueError("too long"), pid=7))
    assert type(refused) is ValueError and str(refused) == "too long"
    assert any("in actor process 7" in n and "in the actor" in n for n in refused.__notes__)
    assert isinstance(_convert(rx.ActorDiedError()), ActorDied)
    assert isinstance(_convert(rx.GetTimeoutError("late")), TimeoutError)
    lost = _convert(rx.RayTaskError("f", "tb", rx.RayError("Exception x.Y isn't serializable"), pid=1))
    assert isinstance(lost, ActorCallError) and "isn't serializable" in str(lost)
    assert _convert(KeyError("not Ray's")) is None


def test_a_process_rays_memory_monitor_killed_is_a_dead_actor_with_its_memory() -> None:
    """Ray's memory monitor raises `OutOfMemoryError` (not a `RayActorError`) for the call
    that was running and every later one: read as a failed call, a server it killed was
    sent every version again and never restarted (issue #46). It is a death, and its line
    says the memory the process and the node had."""
    pytest.importorskip("ray")
    from ray import exceptions as rx

    from areal_like.launcher.ray_launcher import _convert

    text = ("Task was killed due to the node running low on memory.\nMemory on the node (IP: 10.0.0.5, ID: ab12) "
            "where the task (actor ID: 01, name=ServerActor.__init__, pid=4242, memory used=12.30GB) was running "
            "was 60.10GB / 62.00GB (0.969355), which exceeds the memory usage threshold of 0.95. Ray killed this "
            "worker (ID: cd34) because it was the most recently scheduled task.")
    oom = _convert(rx.OutOfMemoryError(text))
    assert isinstance(oom, ActorDied), oom
    assert str(oom) == ("OutOfMemoryError: Ray's memory monitor killed the process (the node ran low on memory); "
                        "it had 12.30GB; the node had 60.10GB of 62.00GB in use (0.969355 > Ray's threshold 0.95)")
    for gone in (rx.WorkerCrashedError(), rx.NodeDiedError("node 10.0.0.5 died"), rx.LocalRayletDiedError()):
        assert isinstance(_convert(gone), ActorDied), gone


def test_a_ray_ref_raises_the_launchers_error_when_awaited() -> None:
    pytest.importorskip("ray")
    from ray import exceptions as rx

    class _Ref:
        def __init__(self, error: BaseException) -> None:
            self.error = error

        def __await__(self) -> Any:
            raise self.error
            yield  # noqa: B901 - a generator, as an awaitable's __await__ is

    async def result(error: BaseException) -> Any:
        return await RayRef(_Ref(error))

    with pytest.raises(ValueError, match="too long"):
        asyncio.run(result(rx.RayTaskError("generate", "tb", ValueError("too long"), pid=1)))
    with pytest.raises(ActorDied):
        asyncio.run(result(rx.ActorDiedError()))


@pytest.mark.timeout(600)
def test_train_and_rollout_in_two_shells_follow_cluster_launcher(tiny_model_dir, tmp_path) -> None:
    """`areal-like train` and `areal-like rollout`, started in two shells, use the launcher
    `cluster.launcher` picks, as `run` and the API do (#32): for the quickstart on CPU that
    is `local` (plain processes, no Ray), so the servers report the local node and the
    trainer passes no `ray` start-up phase."""
    import json
    import os
    import socket
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    socks = [socket.socket() for _ in range(3)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    data, control, store = (s.getsockname()[1] for s in socks)
    for s in socks:
        s.close()
    run_dir = tmp_path / "run"
    sets = [f"model.path={tiny_model_dir}", f"run.dir={run_dir}", "train.total_steps=2", "train.batch_size=2",
            "rollout.group_size=4", "rollout.response_length=16", "staleness.filter_uniform_groups=false",
            "eval.every_n_steps=0", f"transport.data_addr=tcp://127.0.0.1:{data}",
            f"transport.control_addr=tcp://127.0.0.1:{control}", f"weight_sync.store_addr=127.0.0.1:{store}"]
    args = ["configs/quickstart.yaml", *[x for s in sets for x in ("--set", s)]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    cli = [sys.executable, "-m", "areal_like.orchestration.cli"]
    with open(tmp_path / "train.log", "w") as tlog, open(tmp_path / "rollout.log", "w") as rlog:
        trainer = subprocess.Popen([*cli, "train", *args], cwd=root, env=env, stdout=tlog, stderr=subprocess.STDOUT)
        rollout = subprocess.Popen([*cli, "rollout", *args], cwd=root, env=env, stdout=rlog, stderr=subprocess.STDOUT)
        try:
            assert rollout.wait(timeout=480) == 0, (tmp_path / "rollout.log").read_text()[-3000:]
            assert trainer.wait(timeout=120) == 0, (tmp_path / "train.log").read_text()[-3000:]
        finally:
            for p in (trainer, rollout):
                if p.poll() is None:
                    p.kill()
    stopped = [ln for ln in (tmp_path / "rollout.log").read_text().splitlines() if "rollout side stopped" in ln]
    assert stopped and "'node': 'local'" in stopped[-1]
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    phases = {k for r in records if r.get("kind") == "startup" for k in r}
    assert "train_workers" in phases and "ray" not in phases
