"""The launcher: who starts the actors (train workers, rollout controller, inference
servers), calls them, kills them and notices that they died (docs/design.md §10.15).

One protocol (`base.Launcher`), two launchers behind it:

- `local` (`local.LocalLauncher`): plain processes forked from a zygote that imported
  torch & co. once; the single-machine default;
- `ray` (`ray_launcher.RayLauncher`): Ray actors in the pools' placement groups, on an
  embedded Ray or the cluster at `cluster.ray_address`.

The rest of the project writes `launcher.spawn(...)`, `handle.method.remote(...)`,
`get`/`wait`/`await`, `launcher.kill(...)`, and catches `ActorDied` (the actor is gone)
or the actor's own exception; it never asks which launcher runs, never imports Ray's
error types and never starts Ray (`tests/test_layers.py` checks so). This package may
import `areal_like.core` only, and nothing heavy on import.
"""

from __future__ import annotations

import sys
from typing import Any

from areal_like.launcher.base import (
    ActorCallError,
    ActorDied,
    ActorDiedError,
    Launcher,
    Placement,
    Ref,
    get,
    is_actor_death,
    kill,
    wait,
)

__all__ = ["ActorCallError", "ActorDied", "ActorDiedError", "Launcher", "Placement", "Ref", "choose_launcher",
           "connect", "get", "here", "is_actor_death", "kill", "open_launcher", "wait"]


def choose_launcher(cfg: Any, user: dict[str, Any] | None = None) -> str:
    """`ray` or `local` for an `ExperimentConfig`'s `cluster.launcher` (docs/design.md
    §10.15; light to import, so the CLI can start the zygote first): `auto` is `local`
    when nothing needs Ray: no cluster to join, no GPUs and the embedded engine. Python
    objects from the API (reward functions, tools) do not decide it: they travel by value
    either way. `user` is accepted for the callers' symmetry."""
    c = cfg.cluster
    if c.launcher != "auto":
        if c.launcher == "local" and c.ray_address:
            from areal_like.core.config import ConfigError

            raise ConfigError("cluster.launcher=local starts plain processes on this machine: it cannot join "
                              f"the Ray cluster at cluster.ray_address={c.ray_address} (use launcher ray)")
        return str(c.launcher)
    from areal_like.core.config import EmbeddedEngineConfig

    gpus = (c.rollout_pool.num_gpus or 0) + (c.train_pool.num_gpus or 0)
    engine = cfg.rollout.engine
    if (c.ray_address or gpus or not isinstance(engine, EmbeddedEngineConfig) or engine.device != "cpu"
            or cfg.train.backend.device != "cpu"):
        return "ray"
    return "local"  # the API's callables travel by value (`local._call_frame`), whatever defined them


def open_launcher(cfg: Any, user: dict[str, Any] | None = None, *, kind: str | None = None,
                  num_cpus: float | None = None) -> Launcher:
    """The launcher for a run of `cfg`: `kind`, else `choose_launcher(cfg, user)`.

    The local launcher's zygote starts at once (it imports torch & co. while the caller
    goes on); Ray starts at the launcher's `up()` (an embedded Ray with at least `num_cpus`
    CPUs, or the cluster at `cluster.ray_address`). `shutdown()` stops what it started."""
    kind = kind or choose_launcher(cfg, user)
    if kind == "local":
        from areal_like.launcher.local import LocalLauncher

        return LocalLauncher.start()
    if kind == "ray":
        from areal_like.launcher.early import discard
        from areal_like.launcher.ray_launcher import RayLauncher

        discard()  # the CLI's zygote, started before it knew (`early.prestart`)
        return RayLauncher(address=cfg.cluster.ray_address, num_cpus=num_cpus, verbose=cfg.run.verbose)
    raise ValueError(f"unknown launcher {kind!r} (local or ray)")


def connect(address: str) -> Launcher:
    """The launcher whose `address` this is, from another process (an actor that starts
    actors of its own: the rollout controller its servers): `ray`: the Ray this process
    is in; else the local launcher's zygote of that name."""
    if address == "ray":
        from areal_like.launcher.ray_launcher import RayLauncher

        return RayLauncher.connect()
    from areal_like.launcher.local import LocalLauncher

    return LocalLauncher(address)


def here() -> dict[str, Any]:
    """Where this actor runs: `node_id`, `node_ip` and the `gpu_ids` it was given (Ray's
    view in a Ray actor; `local`, the loopback address and none in a plain process)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        from areal_like.launcher.ray_launcher import ray_here

        return ray_here()
    return {"node_id": "local", "node_ip": "127.0.0.1", "gpu_ids": []}
