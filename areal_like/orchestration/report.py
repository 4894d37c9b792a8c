"""`areal-like report RUN_DIR`: a run's metrics as PNG plots and a short text summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from areal_like.core.metrics import read_jsonl

__all__ = ["make_report"]


def _series(recs: list[dict[str, Any]], key: str, x: str = "step") -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in recs:
        if r.get(key) is not None and r.get(x) is not None:
            xs.append(r[x])
            ys.append(r[key])
    return xs, ys


def make_report(run_dir: str | Path, out_dir: str | Path | None = None) -> tuple[Path, str]:
    """Write `report.png` (+ `report.txt`) and return (png path, summary text)."""
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
    if evals:
        lines.append("held-out accuracy: " + ", ".join(f"v{r['version']}={r['accuracy']:.2f}" for r in evals))
    if summary:
        keys = ("trained", "rejected", "filtered", "over_stale", "failed", "skipped", "buffered", "cancelled", "started")
        lines.append("outcomes: " + ", ".join(f"{k}={summary.get(k)}" for k in keys))
    text = "\n".join(lines)
    (out / "report.txt").write_text(text + "\n")
    return png, text
