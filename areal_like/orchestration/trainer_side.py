"""The train cluster's driver: run folder, train workers, weight sender, channels.

`TrainerSide.run()` starts the train workers in the train pool — rank 0 also hosts the
weight sender, so versions go from the workers straight to the servers — and hands
everything to the `TrainerController`, whose schedule is the trainer side's whole loop.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from areal_like.core.config import ExperimentConfig
from areal_like.core.logs import run_log_path
from areal_like.orchestration.preflight import resolve_model_path

__all__ = ["TrainerSide"]

log = logging.getLogger(__name__)


class TrainerSide:
    """The train cluster's driver: run folder, workers, sender, channels, controller."""

    def __init__(self, cfg: ExperimentConfig, *, resume: bool = False, overwrite: bool = False,
                 placement_group: Any = None, on_step: Any = None, check_peers: Any = None,
                 launcher: Any = None, reward_name: str | None = None) -> None:
        from areal_like.core.metrics import MetricsLog, MetricsRegistry
        from areal_like.orchestration.channels import ControlPublisher, DataPuller
        from areal_like.orchestration.run_dir import RunDir

        self.cfg = cfg
        self.model_path = resolve_model_path(cfg)
        self.run_dir = RunDir(cfg.run.dir)
        self.run_dir.prepare(cfg, resume=resume, overwrite=overwrite)
        from areal_like.orchestration.console import attach_run_log

        self.log_file = attach_run_log(self.run_dir.path)  # the workers append there too
        self.run_id, self.epoch = self.run_dir.start_epoch()
        self.registry = MetricsRegistry()
        tb = self.run_dir.path / "tensorboard" if cfg.metrics.tensorboard else None
        self.mlog = MetricsLog(self.run_dir.metrics, tb, cfg.metrics.wandb_project)
        from areal_like.orchestration.dashboard import Dashboard
        from areal_like.orchestration.elastic import PoolRequest

        # refuses a non-loopback bind without a token before anything else starts
        self.dashboard = Dashboard(self.mlog, self.registry, host=cfg.metrics.dashboard_host,
                                   port=cfg.metrics.dashboard_port, token=cfg.metrics.dashboard_token,
                                   run_name=Path(cfg.run.dir).name, pool=PoolRequest(cfg, self.mlog))
        self.dashboard.start()
        self.run_dir.note_dashboard(self.dashboard.url)  # where `areal-like pool RUN_DIR` asks (§10.24)
        from areal_like.orchestration import startup

        startup.mark("imports")  # `areal-like train`: the first phase it passes
        runtime = "ray" if launcher is None else launcher.runtime  # none given: the Ray this process is in
        if runtime:
            startup.mark(runtime)
        log.info("dashboard: %s", self.dashboard_url)
        self.puller = DataPuller(cfg.transport.data_addr, cfg.transport.secret, int(cfg.transport.max_frame_mb * 2**20),
                                 epoch=self.epoch, heartbeat_s=cfg.transport.heartbeat_s,
                                 dead_s=cfg.transport.peer_dead_s)
        self.publisher = ControlPublisher(cfg.transport.control_addr, cfg.transport.secret)
        self.sender: Any = None
        """Rank 0's weight sender (made with the workers in `run`)."""
        self.resume = resume
        self.placement_group = placement_group
        self.launcher = launcher
        self.on_step = on_step
        self.check_peers = check_peers
        self.reward_name = reward_name or cfg.agent.reward
        """How the console names the reward (a callable's name from the API, else `agent.reward`)."""
        self.group: Any = None
        self.controller: Any = None
        startup.mark("trainer_side")

    @property
    def dashboard_url(self) -> str:
        """Where the dashboard serves (the dashboard's own record of it)."""
        return self.dashboard.url

    @property
    def addresses(self) -> tuple[str, str]:
        return self.puller.addr, self.publisher.addr

    def run(self) -> dict[str, int]:
        from areal_like.orchestration.trainer_controller import TrainerController
        from train_cluster.worker_group import TrainWorkerGroup

        cfg = self.cfg
        # torch (DDP/FSDP) or megatron (TP × DP): one actor per rank either way
        from areal_like.orchestration.pools import thread_lending

        lending = thread_lending(cfg)
        lend = ({"path": lending["path"], "borrow": lending["train_borrow"], "grace_s": lending["train_grace_s"],
                 "crowded_hold_s": lending["train_crowded_hold_s"]}
                if lending else None)
        self.group = TrainWorkerGroup(self.model_path, cfg.train_for_workers(), dtype=cfg.model.dtype,
                                      seed=cfg.run.seed, lend=lend,
                                      placement_group=self.placement_group, launcher=self.launcher,
                                      colocate=cfg.cluster.colocate, lora=cfg.model.lora,
                                      log_level=cfg.run.log_level,
                                      log_file=run_log_path(cfg.run.dir), console=cfg.run.verbose)
        trainer = self.group
        from areal_like.orchestration import startup

        startup.mark("train_workers")
        self.sender = self.group.weight_sender(cfg.weight_sync, weight_sync_device(cfg),
                                               self.run_dir.path / "weight_sync")
        startup.mark("weight_group")
        self.controller = TrainerController(
            cfg, trainer=trainer, weights=self.sender, puller=self.puller, publisher=self.publisher,
            run_dir=self.run_dir, mlog=self.mlog, registry=self.registry, model_path=self.model_path,
            on_step=self.on_step, check_peers=self.check_peers, run_id=self.run_id, epoch=self.epoch,
            vocab_size=_vocab_size(self.model_path), reward_name=self.reward_name,
            on_wait=getattr(self.on_step, "waiting", None), pool=self.dashboard.pool,
        )
        if self.resume:
            self.controller.resume()
        summary = self.controller.run()
        self.export_final(trainer)
        return summary

    def export_final(self, trainer: Any) -> None:
        """`final/`, an HF folder, written whole or not at all, by the train workers (rank 0,
        tensor by tensor: `TrainWorkerGroup.export_weights`). A full disk here leaves the
        run finished (summary and final checkpoint written): `--resume` then writes
        `final/` from that checkpoint."""
        from areal_like.orchestration.run_dir import save_hf_folder
        from areal_like.orchestration.trainer_controller import RunAborted, _disk_full

        try:
            # the train ranks write the weights; this process hands them the path only
            save_hf_folder(self.run_dir.final, trainer, self.model_path)
        except Exception as e:  # the worker's OSError, as itself or as the launcher carried it
            if not _disk_full(e):
                raise
            raise RunAborted(f"no space left on device writing the final model to {self.run_dir.final}: training "
                             f"finished at v{trainer.version} (summary and final checkpoint written). Free some "
                             f"space, then run the same command with --resume: it writes {self.run_dir.final.name}/ "
                             "from the final checkpoint") from e
        log.info("final model exported to %s", self.run_dir.final)

    def close(self) -> None:
        from areal_like.orchestration.console import detach_run_log

        detach_run_log(self.log_file)
        self.dashboard.stop()
        try:
            self.run_dir.note_dashboard(None)
        except OSError as e:  # the folder went away meanwhile: nothing to un-name
            log.debug("run.json not updated: %s", e)
        if self.sender is not None:
            self.sender.close()
        self.puller.close()
        self.publisher.close()
        self.mlog.close()
        if self.group is not None:
            self.group.shutdown()


def weight_sync_device(cfg: ExperimentConfig) -> str:
    """Where the weight broadcast runs (`weight_sync.device`; docs/design.md §10.5): NCCL
    only between GPUs of their own (the trainer on CUDA and every server with its own
    GPU); gloo with CPU staging otherwise, which also works for a trainer and a server
    sharing one GPU (`cluster.colocate`: NCCL refuses two ranks on one device)."""
    from areal_like.orchestration.pools import gpus_per_server

    ws = cfg.weight_sync
    if ws.type != "dist":
        return "cpu"
    if ws.device != "auto":
        return ws.device
    pools = cfg.cluster
    separate_gpus = pools.train_pool.num_gpus > 0 and pools.rollout_pool.num_gpus > 0 and not pools.colocate
    return "cuda" if cfg.train.backend.device == "cuda" and gpus_per_server(cfg) > 0 and separate_gpus else "cpu"


def _vocab_size(model_path: Path) -> int | None:
    import json

    cfg = json.loads((model_path / "config.json").read_text())
    return int(cfg["vocab_size"]) if "vocab_size" in cfg else None
