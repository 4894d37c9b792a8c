"""Show a plan: a rich table, the one-line recommendation, a plot of throughput vs rollout share."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from areal_like.plan.planner import PlanReport

__all__ = ["plan_table", "plot_plan"]

COLUMNS = (
    ("rollout_devices", "rollout"), ("train_devices", "train"), ("eta", "η"), ("samples_per_s", "samples/s"),
    ("step_s", "s/step"), ("trainer_idle", "trainer idle"), ("rollout_idle", "rollout idle"),
    ("mean_lag", "lag mean"), ("max_lag", "lag max"), ("interrupts_per_sample", "interrupts/sample"),
    ("recompute_share", "recompute"), ("over_stale_share", "over-stale"), ("straggler_wait_s", "straggler s/step"),
    ("cost_per_step", "$/step"),
)


def plan_table(rep: PlanReport, top: int | None = None) -> Table:
    """The simulated configurations, fastest first (`top` keeps the first N); the best in bold."""
    rows = sorted(rep.rows(), key=lambda r: -r["samples_per_s"])
    if top:
        rows = rows[:top]
    cols = [c for c in COLUMNS if any(c[0] in r for r in rows)]
    t = Table(title=f"plan: {rep.devices} × {rep.hardware}, {rep.nodes} node(s)")
    for _, name in cols:
        t.add_column(name, justify="right")
    b = rep.best
    for r in rows:
        is_best = b is not None and (r["rollout_devices"], r["eta"]) == (b.split.rollout_devices, b.eta)
        t.add_row(*(str(r.get(k, "")) for k, _ in cols), style="bold green" if is_best else None)
    return t


def plot_plan(reps: list[tuple[str, PlanReport]], etas: tuple[int, ...], path: Path) -> Path:
    """Trained samples/s against the rollout share, one panel per report, one line per η."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(reps), figsize=(4.5 * len(reps), 3.6), squeeze=False)
    for ax, (title, rep) in zip(axes[0], reps, strict=True):
        for eta in etas:
            rs = sorted((r for r in rep.results if r.eta == eta), key=lambda r: r.split.rollout_devices)
            ax.plot([r.split.rollout_devices / rep.devices for r in rs], [r.samples_per_s for r in rs], "o-",
                    label=f"η={eta}")
        ax.set_xlabel("rollout share of devices")
        ax.set_ylabel("trained samples / s")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
