"""Ray placement groups for the pools (docs/design.md §8): `place` makes one and waits
until it is ready, or says in one `ConfigError` why the cluster cannot hold it (per node:
what each bundle needs and what the node has, and which setting to change). The Ray
launcher's `place` (`ray_launcher.RayLauncher.place`); Ray is imported when it is called.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from areal_like.core.config import ConfigError

__all__ = ["place"]

log = logging.getLogger(__name__)


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
