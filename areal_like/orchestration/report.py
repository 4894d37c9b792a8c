"""`areal-like report RUN_DIR`: a run's metrics as PNG plots and a short text summary.

`report.png`: reward, lag, versions, throughput, idle ratios, off-policy-ness.
`budget.png`: the step's time budget (docs/design.md §10.19), stacked bars of the mean
seconds per step: the trainer's phases (they add up to the mean wall time between
steps), then the rollout side's by where they happen (`ROLLOUT_GROUPS`: its servers, its
controller, the episodes it runs side by side; work summed over them, not wall time).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from areal_like.core.metrics import read_jsonl
from areal_like.orchestration.step_budget import ROLLOUT_GROUPS, ROLLOUT_PHASES, TRAINER_PHASES, budget_of

__all__ = ["make_report", "budget_means"]

_COLORS = ["#93c5fd", "#2563eb", "#1e3a8a", "#60a5fa", "#0891b2", "#fbbf24", "#f97316", "#dc2626", "#991b1b",
           "#fb7185", "#a78bfa", "#7c3aed", "#16a34a", "#9ca3af"]
"""One colour per phase, by its place in TRAINER_PHASES / ROLLOUT_PHASES: waits blue, training warm."""


def _series(recs: list[dict[str, Any]], key: str, x: str = "step") -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in recs:
        if r.get(key) is not None and r.get(x) is not None:
            xs.append(r[x])
            ys.append(r[key])
    return xs, ys


def budget_means(steps: list[dict[str, Any]], first: int | None = None, last: int | None = None
                 ) -> dict[str, Any] | None:
    """Mean seconds per step of each budget phase over the `train_step` records with
    `first` ≤ step ≤ `last` (default: every step but the first, whose interval holds the
    start-up): {"steps": (first, last, count), "wall": s, "trainer": {phase: s},
    "rollout": {phase: s}}, phases in drawing order; None without budget records."""
    recs = [r for r in steps if "budget_wall_s" in r]
    if first is None and len(recs) > 1:
        first = recs[0]["step"] + 1
    recs = [r for r in recs if (first is None or r["step"] >= first) and (last is None or r["step"] <= last)]
    if not recs:
        return None
    n = len(recs)

    def mean(prefix: str, order: list[str]) -> dict[str, float]:
        total: dict[str, float] = {}
        for r in recs:
            for k, v in budget_of(r, prefix).items():
                total[k] = total.get(k, 0.0) + v
        names = [k for k in order if k in total] + sorted(k for k in total if k not in order)
        return {k: total[k] / n for k in names}

    return {"steps": (recs[0]["step"], recs[-1]["step"], n),
            "wall": sum(r["budget_wall_s"] for r in recs) / n,
            "trainer": mean("budget_", [k for k, _ in TRAINER_PHASES]),
            "rollout": mean("rollout_budget_", [k for k, _, _ in ROLLOUT_PHASES])}


_ORDER = {"trainer": [k for k, _ in TRAINER_PHASES], "rollout": [k for k, _, _ in ROLLOUT_PHASES]}
_LABELS = {**{k: label for k, label in TRAINER_PHASES}, **{k: label for k, _, label in ROLLOUT_PHASES}}


def _rows(b: dict[str, Any]) -> list[tuple[str, str, dict[str, float]]]:
    """(pool, title, {phase: s}) per bar: the trainer, then each group of the rollout side."""
    rows = [("trainer", f"trainer: the phases add up to the wall time between steps ({b['wall']:.3f} s)",
             b["trainer"])]
    rollout, grouped = b["rollout"], set()
    for _, title, names in ROLLOUT_GROUPS:
        parts = {k: v for k, v in rollout.items() if k in names}
        grouped |= set(names)
        if parts:
            rows.append(("rollout", f"{title}: {sum(parts.values()):.3f} s of work", parts))
    rest = {k: v for k, v in rollout.items() if k not in grouped}
    if rest:
        rows.append(("rollout", "rollout side, other", rest))
    return rows


def _budget_plot(b: dict[str, Any], png: Path) -> None:
    import matplotlib.pyplot as plt

    rows = _rows(b)
    fig, axes = plt.subplots(len(rows), 1, figsize=(13, 1.9 * len(rows) + 0.6), squeeze=False)
    first, last, n = b["steps"]
    for ax, (pool, title, parts) in zip(axes[:, 0], rows, strict=True):
        left, order = 0.0, _ORDER[pool]
        for k, v in parts.items():
            if v < 0.0005:  # nothing to see: keep the legend short
                continue
            color = _COLORS[order.index(k) % len(_COLORS)] if k in order else "#000000"
            ax.barh([0], [v], left=left, color=color, label=f"{_LABELS.get(k, k)}: {v:.3f} s")
            left += v
        ax.set_yticks([])
        ax.set_xlabel("seconds per step", fontsize=8)
        ax.set_title(title, fontsize=10)
        if left > 0:
            ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.suptitle(f"time budget per step (mean over steps {first}–{last}, {n} steps)")
    fig.tight_layout()
    fig.savefig(png, dpi=80)
    plt.close(fig)


def _budget_lines(b: dict[str, Any], top: int = 6) -> list[str]:
    first, last, n = b["steps"]
    lines = [f"time budget per step (mean over steps {first}-{last}, {n} steps; budget.png):"]
    wall = b["wall"]
    ranked = sorted(b["trainer"].items(), key=lambda kv: -kv[1])[:top]
    lines.append(f"  trainer, {wall:.3f} s between steps: "
                 + ", ".join(f"{_LABELS.get(k, k)} {v:.3f} s ({v / wall:.0%})" for k, v in ranked))
    for _, title, parts in _rows(b)[1:]:
        ranked = sorted(parts.items(), key=lambda kv: -kv[1])[:top]
        lines.append(f"  {title}: " + ", ".join(f"{_LABELS.get(k, k)} {v:.3f} s" for k, v in ranked if v >= 0.0005))
    return lines


def make_report(run_dir: str | Path, out_dir: str | Path | None = None,
                budget_steps: tuple[int | None, int | None] = (None, None)) -> tuple[Path, str]:
    """Write `report.png`, `budget.png` (when the run recorded its time budget) and
    `report.txt`; return (report.png's path, summary text). `budget_steps` bounds the
    steps the budget is averaged over (default: all but the first)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rd = Path(run_dir)
    mfile = rd / "metrics.jsonl"
    if not mfile.is_file():
        raise FileNotFoundError(f"{mfile} does not exist: is {rd} a run folder?")
    out = Path(out_dir) if out_dir else rd
    out.mkdir(parents=True, exist_ok=True)
    recs = read_jsonl(mfile)
    steps = [r for r in recs if r.get("kind") == "train_step"]
    evals = [r for r in recs if r.get("kind") == "eval"]
    rollout = [r for r in recs if r.get("kind") == "rollout"]
    summary = next((r for r in reversed(recs) if r.get("kind") == "summary"), None)
    t0 = recs[0]["time"] if recs else 0.0

    fig, ax = plt.subplots(2, 3, figsize=(15, 8))
    a = ax[0, 0]
    a.plot(*_series(steps, "reward_mean"), label="train reward (sampled)", alpha=0.6)
    if evals:
        a.plot(*_series(evals, "accuracy", x="version"), "o-", label="held-out accuracy (T=1)")
    a.set_xlabel("version")
    a.set_title("reward")
    a.legend()
    a = ax[0, 1]
    hist: dict[int, int] = {}
    for r in steps:
        for k, n in (r.get("head_lag_hist") or {}).items():
            hist[int(k)] = hist.get(int(k), 0) + n
    if hist:
        a.bar(list(hist), list(hist.values()))
    a.set_title("version lag of trained groups (head)")
    a.set_xlabel("lag")
    a = ax[0, 2]
    xs, ys = _series(steps, "trainer_version", x="time")
    a.plot([x - t0 for x in xs], ys, label="trainer")
    xs, ys = _series(rollout, "loaded_version", x="time")
    a.plot([x - t0 for x in xs], ys, label="rollout (loaded)")
    a.set_xlabel("seconds")
    a.set_title("versions over time")
    a.legend()
    def by_time(recs: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
        xs, ys = _series(recs, key, x="time")
        return [x - t0 for x in xs], ys

    a = ax[1, 0]
    a.plot(*by_time(steps, "tokens_per_s"), label="train tokens/s")
    a.plot(*by_time(rollout, "gen_tokens_per_s"), label="generation tokens/s", alpha=0.7)
    a.set_xlabel("seconds")
    a.set_title("throughput")
    a.legend()
    a = ax[1, 1]
    a.plot(*by_time(steps, "trainer_idle_ratio"), label="trainer idle (cumulative)")
    a.plot(*by_time(rollout, "rollout_idle_ratio"), label="rollout idle (cumulative)")
    a.set_ylim(0, 1)
    a.set_xlabel("seconds")
    a.set_title("idle ratios")
    a.legend()
    a = ax[1, 2]
    a.plot(*_series(steps, "behav_prox_gap"), label="|behav - prox| logprob")
    a.plot(*_series(steps, "behav_weight_max"), label="max importance weight")
    a.set_title("off-policy-ness")
    a.legend()
    fig.tight_layout()
    png = out / "report.png"
    fig.savefig(png, dpi=80)
    plt.close(fig)
    budget = budget_means(steps, *budget_steps)
    if budget is not None:
        _budget_plot(budget, out / "budget.png")

    lines = [f"run: {rd}"]
    if steps:
        last = steps[-1]
        first_r = sum(r["reward_mean"] for r in steps[:5]) / min(5, len(steps))
        last_r = sum(r["reward_mean"] for r in steps[-5:]) / min(5, len(steps))
        lines.append(f"train steps: {len(steps)} (last version {last.get('trainer_version')})")
        lines.append(f"train reward: first 5 steps {first_r:.3f} -> last 5 steps {last_r:.3f}")
        lines.append(f"max version lag: {max(r.get('max_version_lag', 0) for r in steps)}")
        dur = steps[-1]["time"] - t0
        lines.append(f"wall time: {dur:.0f} s, {sum(r.get('samples', 0) for r in steps) / max(dur, 1e-9):.1f} samples/s")
    sizes = [int(r["pool_size"]) for r in rollout if isinstance(r.get("pool_size"), (int, float)) and r["pool_size"]]
    if len(set(sizes)) > 1:  # the pool was resized while the run went (docs/design.md §10.24)
        path = [n for i, n in enumerate(sizes) if i == 0 or n != sizes[i - 1]]
        lines.append("rollout servers: " + " -> ".join(map(str, path)) + f" ({rollout[-1].get('servers_added', 0):.0f} "
                     f"added, {rollout[-1].get('servers_drained', 0):.0f} drained)")
    if evals:
        lines.append("held-out accuracy: " + ", ".join(f"v{r['version']}={r['accuracy']:.2f}" for r in evals))
    if summary:
        keys = ("trained", "rejected", "filtered", "over_stale", "failed", "skipped", "buffered", "cancelled", "started")
        lines.append("outcomes: " + ", ".join(f"{k}={summary.get(k)}" for k in keys))
    if budget is not None:
        lines += _budget_lines(budget)
    text = "\n".join(lines)
    (out / "report.txt").write_text(text + "\n")
    return png, text
