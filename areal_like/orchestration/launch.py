"""Starting the clusters: checks before anything starts, Ray, pools, and `run_both`.

- `rollout_side.RolloutSide`: the rollout cluster's process (servers, agent runner,
  data, gate, controller);
- `trainer_side.TrainerSide`: the train cluster's driver (run folder, workers, weight
  sender, channels, trainer controller);
- `run_both` (here): both sides through one launcher (`areal_like.launcher`: plain
  processes from a zygote, or an embedded Ray or the cluster at `cluster.ray_address`
  with one placement group per pool, `pools`): the rollout side (its own actor, a
  `RolloutSide`) runs beside server 0 in the rollout pool, every inference
  server in its own bundle of it, the train workers in the train pool, the trainer
  controller in the driver.

`areal-like rollout` / `areal-like train` run one side each and meet at
`transport.data_addr`, `transport.control_addr` (docs/design.md §9.6); the weights
travel on the dist group whose store address the announcements carry, or on disk.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from areal_like.core.config import ExperimentConfig
from areal_like.launcher import Placement, choose_launcher, open_launcher
from areal_like.launcher.ray_launcher import init_ray, ray_env

__all__ = ["run_both", "ray_env", "init_ray", "choose_launcher"]

log = logging.getLogger(__name__)


def _rollout_death_message(error: BaseException) -> str:
    """Why the rollout side died, its root cause on the first line (the line the CLI
    prints after `error:`), then its own account (a `RolloutFailedError` carries why it
    stopped and the first error's traceback). The launcher hands over what the actor
    raised as itself; an `ActorCallError`'s `cause` is the original when it travelled."""
    from rollout_cluster.server_manager import error_headline

    cause = getattr(error, "cause", None)
    root = cause if isinstance(cause, BaseException) else error
    headline = error_headline(root)
    rest = str(root).strip().split("\n", 1)[1] if "\n" in str(root).strip() else ""
    return f"{headline}\n" + (f"{rest}\n" if rest else "") + f"the rollout side died ({type(root).__name__})"


def _failed_episodes(error: BaseException) -> BaseException | None:
    """A `RunFailed` for a rollout side that stopped because its episodes kept failing
    (the same account its final report gives the trainer), else None."""
    from areal_like.orchestration.fail_fast import RolloutFailedError
    from areal_like.orchestration.trainer_controller import RunFailed

    cause = getattr(error, "cause", None)  # an `ActorCallError` carries what the actor raised
    e = cause if isinstance(cause, RolloutFailedError) else error
    if not isinstance(e, RolloutFailedError):
        return None
    tb = f"\n{e.first.user_traceback.rstrip()}" if e.first.user_traceback else ""
    return RunFailed(f"{e.first.headline}{tb}\n{e.reason}")


def run_both(cfg: ExperimentConfig, *, resume: bool = False, overwrite: bool = False, on_step: Any = None,
             on_start: Any = None, user: dict[str, Any] | None = None, launcher: Any = None,
             reward_name: str | None = None) -> dict[str, int]:
    """Both clusters on this machine, through `launcher` (else `open_launcher(cfg, user)`:
    plain processes from a zygote, which the CLI starts before its own imports, or an
    embedded Ray with one placement group per pool). The launcher is shut down when this
    returns."""
    if launcher is None:  # the local launcher's zygote imports torch & co. while this process checks the config
        launcher = open_launcher(cfg, user, num_cpus=cfg.cluster.rollout_pool.num_cpus + cfg.cluster.train_pool.num_cpus)
    from areal_like.orchestration.preflight import preflight

    try:
        preflight(cfg, "run", resume=resume, overwrite=overwrite)  # refuse before starting anything
    except BaseException:
        launcher.shutdown()
        raise
    from areal_like.core.logs import run_log_path
    from areal_like.orchestration import startup

    startup.mark("imports")
    pg_roll = pg_train = None
    try:
        launcher.up()
        if launcher.runtime:
            startup.mark(launcher.runtime)
        from areal_like.orchestration.pools import rollout_bundles, train_bundles

        pg_roll = launcher.place("rollout_pool", rollout_bundles(cfg), cfg.cluster.rollout_pool.strategy)
        pg_train = launcher.place("train_pool", train_bundles(cfg), cfg.cluster.train_pool.strategy)
    except BaseException:
        launcher.remove(pg_roll)
        launcher.shutdown()
        raise
    if pg_roll is not None or pg_train is not None:
        startup.mark("pools")
    from areal_like.orchestration.rollout_side import RolloutSide
    from areal_like.orchestration.trainer_side import TrainerSide

    def cleanup() -> None:
        for pg in (pg_roll, pg_train):
            launcher.remove(pg)
        launcher.shutdown()

    try:
        trainer = TrainerSide(cfg, resume=resume, overwrite=overwrite, placement_group=pg_train, on_step=on_step,
                              launcher=launcher, reward_name=reward_name)
    except BaseException:
        cleanup()
        raise
    data_addr, control_addr = trainer.addresses
    # The rollout controller takes no resources of its own: it lives beside server 0,
    # and every server is its own actor in its own bundle of the pool (docs/design.md §10.2).
    # It never restarts: a restart would start from the base weights and a fresh count
    # while the trainer goes on; a dead rollout side stops the run instead (checkpoint,
    # then --resume).
    try:
        controller = launcher.spawn(RolloutSide, (cfg.model_dump(mode="json"), data_addr, control_addr, user, pg_roll,
                                                  launcher.address), name="rollout", cpus=0, gpus=0,
                                    placement=Placement(pg_roll, 0),
                                    stdio=None if cfg.run.verbose else str(run_log_path(cfg.run.dir)))
    except BaseException:
        trainer.close()
        cleanup()
        raise
    if on_start is not None:
        on_start(trainer)
    ref = controller.serve.remote()
    return _drive(trainer, controller, ref, cleanup=cleanup)


def _drive(trainer: Any, controller: Any, ref: Any, cleanup: Any) -> dict[str, int]:
    """Run the trainer side here while the rollout side runs in its actor; either one's
    end or death ends the run, and both sides are gone when this returns."""
    from areal_like import launcher as actors

    last_check = [0.0]

    def check_rollout() -> None:
        if time.time() - last_check[0] < 1.0:
            return
        last_check[0] = time.time()
        done, _ = actors.wait([ref], timeout=0)
        if done:
            try:
                out = actors.get(ref)
            except Exception as e:
                failed = _failed_episodes(e)
                if failed is not None:  # user code or the servers: --resume would not help
                    raise failed from None
                raise RuntimeError(_rollout_death_message(e)) from e
            raise RuntimeError(f"the rollout side stopped before the trainer finished: {out}")

    trainer.check_peers = check_rollout
    try:
        summary = trainer.run()
        ready, _ = actors.wait([ref], timeout=60)
        if ready:
            log.info("rollout side finished: %s", actors.get(ref))
        return summary
    finally:
        # Finished or not, the controller's process goes now (its server actors with it):
        # a handle kept alive in a long-lived caller (a notebook, a script that trains
        # twice, pytest) kept an idle rollout process per run until that caller exited.
        actors.kill(controller)
        trainer.close()
        cleanup()
