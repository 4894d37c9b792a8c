"""`areal-like sweep-staleness CONFIG --eta 0,1,2,4,8`: short runs per η, a table and a plot.

Each η runs the same config (same seed, steps, pools) in `run.dir/eta{η}`; the table
compares throughput (trained samples per second of wall time, wall time to the last
step) and reward (mean train reward of the last steps, last held-out accuracy), so a
user can see what asynchrony buys on their workload and where staleness starts to
cost reward.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from areal_like.core.config import ExperimentConfig
from areal_like.core.metrics import read_jsonl

__all__ = ["sweep_staleness", "summarise_run"]


def summarise_run(run_dir: Path, eta: int) -> dict[str, Any]:
    recs = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in recs if r["kind"] == "train_step"]
    evals = [r for r in recs if r["kind"] == "eval"]
    if not steps:
        return {"eta": eta, "steps": 0}
    t0 = recs[0]["time"]
    wall = steps[-1]["time"] - t0
    tail = steps[-min(5, len(steps)) :]
    return {
        "eta": eta,
        "steps": len(steps),
        "wall_s": round(wall, 2),
        "samples_per_s": round(sum(r["samples"] for r in steps) / max(wall, 1e-9), 2),
        "final_reward": round(sum(r["reward_mean"] for r in tail) / len(tail), 4),
        "eval_accuracy": evals[-1]["accuracy"] if evals else None,
        "max_version_lag": max(r["max_version_lag"] for r in steps),
        "trainer_idle_ratio": round(steps[-1].get("trainer_idle_ratio", 0.0), 3),
    }


def sweep_staleness(cfg: ExperimentConfig, etas: list[int], out_dir: Path) -> list[dict[str, Any]]:
    from areal_like.orchestration.launch import run_both

    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for eta in etas:
        c = cfg.model_copy(deep=True)
        c.staleness.max_staleness = eta
        c.run.dir = str(out_dir / f"eta{eta}")
        run_both(c, overwrite=True)
        rows.append(summarise_run(Path(c.run.dir), eta))
    (out_dir / "sweep.json").write_text(json.dumps(rows, indent=2))
    _plot(rows, out_dir / "sweep.png")
    return rows


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    etas = [r["eta"] for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].plot(etas, [r.get("samples_per_s", 0) for r in rows], "o-")
    ax[0].set_xlabel("η (max staleness)")
    ax[0].set_ylabel("trained samples / s")
    ax[0].set_title("throughput")
    ax[1].plot(etas, [r.get("final_reward", 0) for r in rows], "o-", label="final train reward")
    acc = [r.get("eval_accuracy") for r in rows]
    if any(a is not None for a in acc):
        ax[1].plot(etas, [a if a is not None else float("nan") for a in acc], "s-", label="held-out accuracy")
    ax[1].set_xlabel("η (max staleness)")
    ax[1].set_title("reward")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
