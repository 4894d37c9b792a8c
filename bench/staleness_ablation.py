"""Staleness ablation (AReaL's Table 2 at small scale): naive vs decoupled PPO over η, with statistics.

Grid: configs × η × objectives × seeds. Configs: the quickstart and `configs/long_answers.yaml`
(answers long enough that weight updates land mid-decode). η ∈ {0, 2, 4, 8}. Objectives
(`--modes`): `naive` PPO (behaviour logprobs used as π_old: `train.loss.naive_ppo_ablation=true`),
`decoupled` PPO (explicit proximal policy, behaviour weight π_prox/π_behav capped: the shipped
objective, which since 2026-11-27 also stops the gradient of a bad token the policy already left,
`train.loss.neg_behav_clip`) and, on request, `decoupled_areal` (AReaL's objective, without that
stop: what `decoupled` ran before) and `decoupled_mask` (`train.loss.behav_weight_mode=mask`).
Seeds 0–7 by default.
Everything else is the config's, so `--set KEY=VALUE` applies to every run. At η = 0 the two
objectives coincide up to numerics; the question is how each holds up as samples get staler.

Statistics. The unit is a seed: for every (config, η), naive and decoupled run with the same
seed (same prompts, same initial weights), so the difference decoupled − naive of the final
held-out sampled accuracy is paired per seed. Reported per (config, η): each objective's mean
with a 95 % Student-t interval over seeds, the mean paired difference with its 95 % t-interval,
the paired t-test's two-sided p-value and an exact sign-flip permutation p-value (all 2^n
sign patterns of the differences for n ≤ 16, else 100 000 draws from `random.Random(0)`;
distribution-free, so it does not lean on normality with 8 seeds). scipy is not a dependency:
the t quantile and the t CDF are computed here (regularised incomplete beta, Lentz's continued
fraction) and tested against tabulated values (tests/test_staleness_stats.py).

Along the run (`--eval-every N`): each run also evaluates every N versions (the same held-out
rows, the same sampling seeds per version for both objectives), and the mean of its curve
over versions N, 2N, …, steps is paired per seed beside the final accuracy. Two objectives
can end on the same plateau after different paths; the curve's mean tells which one learns
faster from stale samples (a staleness correction exists to keep that speed).
Evaluations during a run share its rollout servers: they slow the rollout side, and the
lag a run reaches shrinks (3.6 of η = 8 with one every 5 versions, against 6.7 without).
`--eval-after N` keeps the run as it is: each run saves its versions
(`run.record_weights`), and `areal-like eval RUN --versions every:N` scores them after it
(the same rows and sampling seeds as an evaluation during the run; the saved weights are
deleted afterwards).

Also per cell, from the train-step records (what the objective did, #34): the version lag
reached (a bound only bites if the rollout runs ahead), the mean |log π_prox − log π_behav|,
|log π_θ − log π_prox| and |log π_θ − log π_behav|, the largest behaviour weight, the share of
tokens whose weight was capped or masked, the proximal clip fraction, the dual-clip fraction and
the advantage scale (mean |A|, share of tokens with A = 0). Contenders alternate order per seed;
the CPU that other processes used meanwhile is recorded per run.

    python bench/staleness_ablation.py                      # the full grid: 2 × 4 × 2 × 8 = 128 runs
    python bench/staleness_ablation.py --configs configs/quickstart.yaml --etas 8 --seeds 0,1,2,3 --steps 20
    python bench/staleness_ablation.py --configs configs/quickstart.yaml --etas 4,8 --eval-every 5
    python bench/staleness_ablation.py --configs configs/quickstart.yaml --etas 4,8 --eval-after 5
    python bench/staleness_ablation.py --etas 4,8 --eval-after 5 --modes naive,decoupled,tight \
        --variant tight=decoupled,train.loss.eps_clip=0.1      # another objective, paired with naive too
    python bench/staleness_ablation.py --jobs 7 ...   # 7 runs at once on a many-core machine
    python bench/staleness_ablation.py --smoke   # quickstart, η 2, decoupled at ε 0.1 (a variant), one seed,
                                                 # 2 steps of 2 prompts,
                                                 # each version evaluated after the run

Writes `staleness_ablation.png` (accuracy ± 95 % CI per η, and the paired difference), with
`--eval-every` also `staleness_curves.png` (the mean curves per η), and
`staleness_ablation.md` (the tables) to the output folder; without `--smoke` and unless
`--no-doc`, the tables also replace the generated part of the "Staleness ablation" section of
docs/benchmarks.md. Progress on stderr; the last stdout line is one JSON object (bench/_record.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import random
import re
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _record  # noqa: E402
from _runs import records, run_cli, summarise  # noqa: E402

log = logging.getLogger("bench.staleness_ablation")

ROOT = Path(__file__).resolve().parent.parent

# An objective in the grid: (the objective it runs, its own extra overrides). `--variant`
# adds more, e.g. `decoupled_eps01=decoupled,train.loss.eps_clip=0.1`.
# `decoupled` is the shipped objective; since 2026-11-27 it stops the gradient of stale bad tokens
# (`train.loss.neg_behav_clip`, design §10.37); `decoupled_areal` is AReaL's, without that, which
# every `decoupled` run recorded before then was.
BUILTIN_MODES: dict[str, tuple[str, list[str]]] = {
    "naive": ("naive", []), "decoupled": ("decoupled", []),
    "decoupled_areal": ("decoupled", ["train.loss.neg_behav_clip=null"]),
    "decoupled_mask": ("decoupled", ["train.loss.behav_weight_mode=mask"]),
}
STYLE_CYCLE = ("D-.", "v-", "P--", "X:")
COLOR_CYCLE = ("tab:red", "tab:purple", "tab:brown", "tab:olive")
DEFAULT_CONFIGS = "configs/quickstart.yaml,configs/long_answers.yaml"
FALL_AT = 0.15  # a run "fell" when its final held-out accuracy is this far under its best along the run
DOC = ROOT / "docs" / "benchmarks.md"
DOC_BEGIN = "<!-- staleness-ablation:begin: generated by bench/staleness_ablation.py; do not edit -->"
DOC_END = "<!-- staleness-ablation:end -->"
# Per-step means taken from the train-step records (key in the record -> key in a run's summary).
STEP_MEANS = {
    "behav_prox_gap": "prox_gap_mean", "theta_prox_gap": "theta_prox_gap", "theta_behav_gap": "theta_behav_gap",
    "behav_cut_frac": "cut_frac", "clip_frac": "clip_frac", "dual_clip_frac": "dual_clip_frac",
    "adv_abs_mean": "adv_abs_mean", "adv_zero_frac": "adv_zero_frac", "neg_behav_clip_frac": "neg_behav_clip_frac",
}


# ---- statistics (no scipy) -------------------------------------------------------------------

def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularised incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-14:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lbt = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(lbt) * _betacf(a, b, x) / a
    return 1.0 - math.exp(lbt) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T ≤ t) for Student's t with `df` degrees of freedom."""
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t (bisection on `t_cdf`, to 1e-10)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    lo, hi = -1e4, 1e4
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-10:
            break
    return (lo + hi) / 2.0


def mean_ci(xs: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): the Student-t interval for the mean; (x, x, x) for a single value."""
    n = len(xs)
    m = statistics.mean(xs)
    if n < 2:
        return m, m, m
    half = t_quantile(0.5 + level / 2.0, n - 1) * statistics.stdev(xs) / math.sqrt(n)
    return m, m - half, m + half


def sign_flip_p(diffs: list[float], *, draws: int = 100_000, exact_up_to: int = 16) -> float:
    """Two-sided p of the sign-flip permutation test of mean(diffs) = 0 (paired, distribution-free).

    Under the null each paired difference is as likely +d as −d; p is the share of the 2^n sign
    patterns whose |mean| is at least the observed one (the observed pattern included). Exact for
    n ≤ `exact_up_to`, else `draws` random patterns from `random.Random(0)` (plus the observed)."""
    n = len(diffs)
    if n == 0:
        return 1.0
    obs = abs(sum(diffs)) - 1e-12
    if n <= exact_up_to:
        hits = sum(abs(sum(s * d for s, d in zip(signs, diffs, strict=True))) >= obs
                   for signs in itertools.product((1, -1), repeat=n))
        return hits / 2 ** n
    rng = random.Random(0)
    hits = 1 + sum(abs(sum(d if rng.random() < 0.5 else -d for d in diffs)) >= obs for _ in range(draws))
    return hits / (draws + 1)


def paired(a: list[float], b: list[float], level: float = 0.95) -> dict[str, Any]:
    """Paired comparison of b − a (same seed at the same index): mean, t-interval, t-test, sign-flip test."""
    diffs = [y - x for x, y in zip(a, b, strict=True)]
    n = len(diffs)
    out: dict[str, Any] = {"n": n}
    if n == 0:
        return out
    m, lo, hi = mean_ci(diffs, level)
    out.update(diff_mean=round(m, 4), diff_ci=[round(lo, 4), round(hi, 4)],
               b_wins=sum(d > 0 for d in diffs), ties=sum(d == 0 for d in diffs))
    if n >= 2:
        sd = statistics.stdev(diffs)
        t = m / (sd / math.sqrt(n)) if sd > 0 else (0.0 if m == 0 else math.copysign(math.inf, m))
        out["t"] = round(t, 3) if math.isfinite(t) else t
        out["p_t"] = round(2.0 * (1.0 - t_cdf(abs(t), n - 1)), 4) if math.isfinite(t) else 0.0
    out["p_signflip"] = round(sign_flip_p(diffs), 4)
    return out


# ---- the runs ----------------------------------------------------------------------------------

def parse_variant(text: str) -> tuple[str, str, list[str]]:
    """`NAME=BASE,KEY=VALUE,...` -> (NAME, BASE, [KEY=VALUE, ...]); BASE is naive or decoupled."""
    name, sep, rest = text.partition("=")
    parts = [x.strip() for x in rest.split(",") if x.strip()]
    if not sep or not re.fullmatch(r"[A-Za-z0-9_]+", name) or not parts:
        raise ValueError(f"--variant {text!r}: expected NAME=BASE,KEY=VALUE,... (NAME of letters, digits, _)")
    base, sets = parts[0], parts[1:]
    if base not in ("naive", "decoupled"):
        raise ValueError(f"--variant {text!r}: BASE must be naive or decoupled, got {base!r}")
    bad = [x for x in sets if "=" not in x]
    if bad:
        raise ValueError(f"--variant {text!r}: {bad} are not KEY=VALUE")
    if name in BUILTIN_MODES:
        raise ValueError(f"--variant {text!r}: {name} is a built-in objective")
    return name, base, sets


def sets_for(eta: int, mode: str, seed: int, steps: int, eval_samples: int, eval_every: int = 0,
             record_weights: bool = False) -> list[str]:
    """The overrides of one run; `mode` is the objective it runs (naive or decoupled)."""
    return [
        f"staleness.max_staleness={eta}",
        "staleness.lead=full",  # every sample η old, as the ablation means (not the least lead that feeds)
        f"train.loss.naive_ppo_ablation={'true' if mode == 'naive' else 'false'}",
        "train.loss.behav_weight_mode=cap",
        f"run.seed={seed}",
        f"train.total_steps={steps}",
        "run.checkpoint_every_n_steps=1000",
        "run.record_trajectories=false",
        f"run.record_weights={'true' if record_weights else 'false'}",  # --eval-after evaluates them
        f"eval.every_n_steps={eval_every}",  # 0: the final version only
        f"eval.num_samples={eval_samples}",
        "rollout.server_threads=1",
        "train.backend.threads=1",
        # Uniform groups are trained (with zero advantage) instead of filtered: the filter
        # would make the rollout the bottleneck, and a bound the lag never reaches tests nothing.
        "staleness.filter_uniform_groups=false",
    ]


def curve_stats(run_dir: Path, every: int, steps: int) -> dict[str, Any]:
    """Held-out accuracy along the run (`--eval-every`): the version -> accuracy curve and
    `curve_mean`, the mean over the evaluations at versions every, 2·every, …, steps (the
    area under the learning curve: how fast an objective learns from stale samples, where
    the final version alone can show two objectives that reached the same plateau)."""
    evals = {r["version"]: r["accuracy"] for r in records(run_dir) if r["kind"] == "eval"}
    offline = run_dir / "offline_eval.jsonl"
    if offline.is_file():  # --eval-after: the saved versions, evaluated after the run
        evals.update({r["version"]: r["accuracy"] for r in map(json.loads, offline.read_text().splitlines())})
    if not every:
        return {"eval_curve": evals, "curve_mean": None, "curve_points": 0}
    due = [v for v in range(every, steps + 1, every)] + ([steps] if steps % every else [])
    got = [evals[v] for v in due if v in evals]
    # How far the final version sits under the run's best evaluated version: a late fall.
    fall = max(got) - evals[steps] if got and steps in evals else None
    return {"eval_curve": evals, "curve_mean": statistics.mean(got) if got else None, "curve_points": len(got),
            "fall": fall}


def evaluate_after(run_dir: Path, every: int, samples: int) -> None:
    """`areal-like eval` on the run's saved versions N, 2N, … (and the last), as a user runs it;
    the saved weights are removed afterwards (they are the run's largest files)."""
    import shutil
    import subprocess

    out = run_dir / "offline_eval.jsonl"
    if out.exists():
        out.unlink()
    p = subprocess.run([sys.executable, "-m", "areal_like.orchestration.cli", "eval", str(run_dir),
                        "--versions", f"every:{every}", "--num-samples", str(samples)],
                       cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"areal-like eval {run_dir} failed ({p.returncode}): {p.stderr[-2000:]}")
    shutil.rmtree(run_dir / "weights", ignore_errors=True)


def weight_stats(run_dir: Path) -> dict[str, float]:
    """What the objective did over the run: per-step means of the train-step records (#34)."""
    steps = [r for r in records(run_dir) if r["kind"] == "train_step" and not r.get("skipped")]
    out = {short: statistics.mean(r.get(key, 0.0) for r in steps) for key, short in STEP_MEANS.items()}
    out["prox_gap_max"] = max(r.get("behav_prox_gap", 0.0) for r in steps)
    # The largest move of one step on its own batch (|log π_θ − log π_prox| as the last
    # mini-batch saw it) after the first third of the run: what a late fall follows.
    late = [r.get("theta_prox_gap", 0.0) for r in steps if r.get("step", 0) > len(steps) // 3] or [0.0]
    out["step_move_late_max"] = max(late)
    out["behav_weight_max"] = max(r.get("behav_weight_max", 1.0) for r in steps)
    out["capped_or_masked"] = statistics.mean(r.get("behav_capped", 0.0) + r.get("behav_masked", 0.0) for r in steps)
    return out


def tabulate(runs: list[dict[str, Any]], configs: list[str], etas: list[int], modes: list[str]
             ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(cells, pairs): per (config, η, mode) means with 95 % intervals; per (config, η) the
    paired test, of the final accuracy (`metric: final`) and, where the runs evaluated along
    the way (`--eval-every`), of the curve's mean (`metric: curve`)."""
    cells, pairs = [], []
    for cfg, eta in itertools.product(configs, etas):
        by_mode: dict[str, dict[int, float]] = {}
        by_mode_curve: dict[str, dict[int, float]] = {}
        for mode in modes:
            rs = [r for r in runs if r["config"] == cfg and r["eta"] == eta and r["mode"] == mode]
            if not rs:
                continue
            acc = {r["seed"]: r["eval_accuracy"] for r in rs if r["eval_accuracy"] is not None}
            curve = {r["seed"]: r["curve_mean"] for r in rs if r.get("curve_mean") is not None}
            by_mode[mode] = acc
            by_mode_curve[mode] = curve
            m, lo, hi = mean_ci(list(acc.values())) if acc else (None, None, None)
            cm, clo, chi = mean_ci(list(curve.values())) if curve else (None, None, None)
            row: dict[str, Any] = {
                "config": cfg, "eta": eta, "mode": mode, "seeds": len(rs),
                "accuracy_mean": _r(m), "accuracy_ci": [_r(lo), _r(hi)],
                "accuracy_spread": _r(max(acc.values()) - min(acc.values())) if acc else None,
                "curve_mean": _r(cm), "curve_ci": [_r(clo), _r(chi)],
                "reward_mean": _r(statistics.mean(r["final_reward"] for r in rs)),
                "mean_version_lag": _r(statistics.mean(r["mean_version_lag"] for r in rs), 2),
                "max_version_lag": max(r["max_version_lag"] for r in rs),
                "behav_weight_max": _r(max(r["behav_weight_max"] for r in rs), 3),
                "prox_gap_max": _r(max(r["prox_gap_max"] for r in rs)),
                "step_move_late_max": _r(statistics.mean(r.get("step_move_late_max", 0.0) for r in rs)),
                # runs whose final version is FALL_AT or more under their best evaluated one
                "falls": sum(1 for r in rs if (r.get("fall") or 0.0) >= FALL_AT) if curve else None,
                "capped_or_masked": _r(statistics.mean(r["capped_or_masked"] for r in rs), 5),
                "other_cores": _r(statistics.median(r["other_cores"] for r in rs), 2),
            }
            for short in STEP_MEANS.values():
                row[short] = _r(statistics.mean(r.get(short, 0.0) for r in rs), 5)
            cells.append(row)
        for metric, values in (("final", by_mode), ("curve", by_mode_curve)):
            for base, other in (("naive", m) for m in modes if m != "naive"):
                if values.get(base) and values.get(other):
                    seeds = sorted(set(values[base]) & set(values[other]))
                    pairs.append({"config": cfg, "eta": eta, "a": base, "b": other, "metric": metric, "seeds": seeds,
                                  **paired([values[base][s] for s in seeds], [values[other][s] for s in seeds])})
    return cells, pairs


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def _f(x: float | None, nd: int = 3, sign: bool = False) -> str:
    return "—" if x is None else (f"{x:+.{nd}f}" if sign else f"{x:.{nd}f}")


def markdown(cells: list[dict[str, Any]], pairs: list[dict[str, Any]], command: str, note: str) -> str:
    """The two tables (per cell, and the paired test per η) as markdown. With curves, a cell
    also shows its falls (runs whose final version is FALL_AT or more under their best) and
    the mean over seeds of each run's largest step after the first third (|θ − prox|)."""
    curves = any(c.get("curve_mean") is not None for c in cells)
    out = [f"`{command}` ({note})", "",
           "| config | η | objective | seeds | held-out accuracy, mean [95 % CI] "
           + ("| along the run (curve mean) [95 % CI] | falls | late step, max abs(θ−prox) " if curves else "")
           + "| lag mean/max "
           "| w max | cut share | clip frac | abs(θ−prox) | abs(prox−behav) | mean abs(A) | A = 0 |",
           "| --- | ---: | --- | ---: | --- " + ("| --- | ---: | ---: " if curves else "")
           + "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c in cells:
        lo, hi = c["accuracy_ci"]
        curve = ""
        if curves:
            clo, chi = c.get("curve_ci", [None, None])
            falls = "—" if c.get("falls") is None else f"{c['falls']}/{c['seeds']}"
            curve = (f"| {_f(c.get('curve_mean'))} [{_f(clo)}, {_f(chi)}] | {falls} "
                     f"| {_f(c.get('step_move_late_max'), 4)} ")
        out.append(f"| {c['config']} | {c['eta']} | {c['mode']} | {c['seeds']} | {_f(c['accuracy_mean'])} "
                   f"[{_f(lo)}, {_f(hi)}] {curve}| {_f(c['mean_version_lag'], 2)}/{c['max_version_lag']} "
                   f"| {_f(c['behav_weight_max'], 2)} | {_f(c['cut_frac'], 4)} | {_f(c['clip_frac'], 4)} "
                   f"| {_f(c['theta_prox_gap'], 4)} | {_f(c['prox_gap_mean'], 4)} | {_f(c['adv_abs_mean'], 3)} "
                   f"| {_f(c['adv_zero_frac'], 3)} |")
    out += ["", "| config | η | held-out accuracy | paired difference (b − a) | seeds | mean [95 % t-interval] "
                "| b better | p (t) | p (sign-flip) |", "| --- | ---: | --- | --- | ---: | --- | ---: | ---: | ---: |"]
    what = {"final": "final version", "curve": "along the run"}
    for p in pairs:
        lo, hi = p.get("diff_ci", [None, None])
        out.append(f"| {p['config']} | {p['eta']} | {what[p['metric']]} | {p['b']} − {p['a']} | {p['n']} "
                   f"| {_f(p.get('diff_mean'), 3, True)} "
                   f"[{_f(lo, 3, True)}, {_f(hi, 3, True)}] | {p.get('b_wins', '—')}/{p['n']} "
                   f"| {_f(p.get('p_t'), 3)} | {_f(p.get('p_signflip'), 3)} |")
    return "\n".join(out) + "\n"


def write_doc(md: str, doc: Path = DOC) -> None:
    """Replace the generated part of the staleness section of docs/benchmarks.md."""
    text = doc.read_text()
    if text.count(DOC_BEGIN) != 1 or text.count(DOC_END) != 1:
        raise SystemExit(f"{doc}: the staleness section must hold the markers once each:\n{DOC_BEGIN}\n{DOC_END}")
    head, rest = text.split(DOC_BEGIN)
    _, tail = rest.split(DOC_END)
    doc.write_text(f"{head}{DOC_BEGIN}\n{md}{DOC_END}{tail}")


def plot(cells: list[dict[str, Any]], pairs: list[dict[str, Any]], configs: list[str], etas: list[int],
         modes: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(configs), figsize=(4.5 * len(configs), 6), squeeze=False, sharex=True)
    styles = {"naive": "s--", "decoupled": "o-", "decoupled_mask": "^:"}
    extra = [m for m in modes if m not in styles]
    styles.update({m: STYLE_CYCLE[i % len(STYLE_CYCLE)] for i, m in enumerate(extra)})
    for j, cfg in enumerate(configs):
        ax, dx = axes[0][j], axes[1][j]
        for k, mode in enumerate(modes):
            rows = [c for c in cells if c["config"] == cfg and c["mode"] == mode and c["accuracy_mean"] is not None]
            if not rows:
                continue
            xs = [c["eta"] + 0.1 * (k - 1) for c in rows]
            ys = [c["accuracy_mean"] for c in rows]
            err = [[y - c["accuracy_ci"][0] for y, c in zip(ys, rows, strict=True)],
                   [c["accuracy_ci"][1] - y for y, c in zip(ys, rows, strict=True)]]
            ax.errorbar(xs, ys, yerr=err, fmt=styles[mode], capsize=3, label=mode.replace("_", " "))
        ax.set_title(cfg)
        ax.set_ylabel("held-out accuracy (95 % CI)")
        ax.legend(fontsize=8)
        for k, b in enumerate(m for m in modes if m != "naive"):
            rows = [p for p in pairs if p["config"] == cfg and p["b"] == b and p["metric"] == "final"
                    and "diff_mean" in p]
            if rows:
                ys = [p["diff_mean"] for p in rows]
                err = [[y - p["diff_ci"][0] for y, p in zip(ys, rows, strict=True)],
                       [p["diff_ci"][1] - y for y, p in zip(ys, rows, strict=True)]]
                dx.errorbar([p["eta"] + 0.1 * k for p in rows], ys, yerr=err, fmt=styles[b], capsize=3,
                            label=f"{b.replace('_', ' ')} − naive")
        dx.axhline(0.0, color="grey", lw=0.8)
        dx.set_xlabel("η (max staleness)")
        dx.set_ylabel("paired difference (95 % CI)")
        dx.set_xticks(etas)
        dx.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_curves(runs: list[dict[str, Any]], configs: list[str], etas: list[int], modes: list[str],
                path: Path) -> None:
    """Held-out accuracy along the run (`--eval-every`): per config and η, each objective's
    mean over seeds with its 95 % interval at every evaluated version."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(configs), len(etas), figsize=(3.6 * len(etas), 3.2 * len(configs)),
                             squeeze=False, sharey=True)
    colors = {"naive": "tab:orange", "decoupled": "tab:blue", "decoupled_mask": "tab:green"}
    extra = [m for m in modes if m not in colors]
    colors.update({m: COLOR_CYCLE[i % len(COLOR_CYCLE)] for i, m in enumerate(extra)})
    for i, cfg in enumerate(configs):
        for j, eta in enumerate(etas):
            ax = axes[i][j]
            for mode in modes:
                rs = [r for r in runs if r["config"] == cfg and r["eta"] == eta and r["mode"] == mode]
                versions = sorted({int(v) for r in rs for v in r["eval_curve"]})
                xs, ys, los, his = [], [], [], []
                for v in versions:
                    vals = [r["eval_curve"][v] for r in rs if v in r["eval_curve"]]
                    if len(vals) == len(rs):
                        m, lo, hi = mean_ci(vals)
                        xs.append(v)
                        ys.append(m)
                        los.append(lo if lo is not None else m)
                        his.append(hi if hi is not None else m)
                if xs:
                    ax.plot(xs, ys, "o-", color=colors[mode], ms=3, label=mode.replace("_", " "))
                    ax.fill_between(xs, los, his, color=colors[mode], alpha=0.2)
            ax.set_title(f"{cfg}, η = {eta}", fontsize=9)
            ax.set_xlabel("version (train steps)")
            if j == 0:
                ax.set_ylabel("held-out accuracy (95 % CI)")
            ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def config_name(path: str) -> str:
    return Path(path).stem


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", "--config", dest="configs", default=DEFAULT_CONFIGS,
                    help="comma-separated config files (default: quickstart and long_answers)")
    ap.add_argument("--etas", default="0,2,4,8")
    ap.add_argument("--seeds", default="0,1,2,3,4,5,6,7")
    ap.add_argument("--modes", default="naive,decoupled",
                    help=f"objectives, from {','.join(BUILTIN_MODES)} and the --variant names")
    ap.add_argument("--variant", dest="variants", action="append", default=[], metavar="NAME=BASE,KEY=VALUE,...",
                    help="another objective: BASE (naive or decoupled) with its own overrides, paired with naive "
                         "like the others; name it in --modes (repeatable)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--eval-samples", type=int, default=256)
    ap.add_argument("--eval-every", type=int, default=0,
                    help="also evaluate every N versions, and test the curve's mean (0: the final version only)")
    ap.add_argument("--eval-after", type=int, default=0,
                    help="as --eval-every, but each run saves its versions and `areal-like eval` scores every N-th "
                         "after the run: the evaluations do not slow the rollout side, so the lag is the run's own")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="extra config override for every run (repeatable)")
    ap.add_argument("--out", default=None,
                    help="default: runs/bench_staleness_ablation (--smoke: a temporary folder)")
    ap.add_argument("--reuse", action="store_true", help="keep runs that finished in --out (same settings!)")
    ap.add_argument("--no-doc", action="store_true", help="do not rewrite the tables in docs/benchmarks.md")
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs at once (a machine with many cores; each run uses about 2)")
    args, recorder = _record.parse(ap, __file__, smoke={"configs": "configs/quickstart.yaml", "etas": "2",
                                                         "seeds": "0", "modes": "tight", "steps": 2,
                                                         "variants": ["tight=decoupled,train.loss.eps_clip=0.1"],
                                                         "eval_samples": 8, "eval_after": 1,
                                                         "sets": ["train.batch_size=2"],
                                                         "jobs": 2})  # the pool's path too
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    configs = [c for c in args.configs.split(",") if c]
    etas = [int(x) for x in args.etas.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    out = _record.out_dir(args.out, "staleness_ablation", args.smoke)
    modes = [m for m in args.modes.split(",") if m]
    if args.eval_every and args.eval_after:
        ap.error("--eval-every and --eval-after: pick one")
    curve_every = args.eval_every or args.eval_after
    known = dict(BUILTIN_MODES)
    for text in args.variants:
        try:
            name, base, vsets = parse_variant(text)
        except ValueError as e:
            ap.error(str(e))
        known[name] = (base, vsets)
    unknown = set(modes) - set(known)
    if unknown:
        ap.error(f"unknown --modes {sorted(unknown)}; pick from {','.join(known)}")
    names = [config_name(c) for c in configs]
    if len(set(names)) != len(names):
        ap.error(f"--configs: two files share a name: {names}")
    cells_grid = [(c, e, m) for c in configs for e in etas for m in modes]
    order = [(seed, cfg, eta, mode) for i, seed in enumerate(seeds)
             for cfg, eta, mode in (cells_grid if i % 2 == 0 else list(reversed(cells_grid)))]
    t_all = time.time()

    def run_dir_of(cfg: str, eta: int, mode: str, seed: int) -> Path:
        return out / config_name(cfg) / f"eta{eta}_{mode}_seed{seed}"

    def one(k: int, seed: int, cfg: str, eta: int, mode: str) -> None:
        """Run one cell-seed unless it finished earlier (--reuse); its CPU lands beside it."""
        run_dir = run_dir_of(cfg, eta, mode, seed)
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        done_file = run_dir.parent / f"{run_dir.name}.cpu.json"
        if args.reuse and done_file.exists():  # finished earlier with the same settings
            return
        log.info("[%d/%d] %s η=%d %s seed %d ...", k, len(order), config_name(cfg), eta, mode, seed)
        t = time.time()
        base, mode_sets = known[mode]
        cpu = run_cli(cfg, [*sets_for(eta, base, seed, args.steps, args.eval_samples, args.eval_every,
                                      record_weights=bool(args.eval_after)), *args.sets, *mode_sets], run_dir)
        if args.eval_after:
            evaluate_after(run_dir, args.eval_after, args.eval_samples)
        done_file.write_text(json.dumps(cpu))
        log.info("    done: %s η=%d %s seed %d in %.0f s", config_name(cfg), eta, mode, seed, time.time() - t)

    if args.jobs <= 1:
        for k, task in enumerate(order, 1):
            one(k, *task)
    else:  # a big machine: N runs at once; each run's `other_cores` then counts its siblings
        failed = []
        with ThreadPoolExecutor(args.jobs) as pool:
            futures = {pool.submit(one, k, *task): task for k, task in enumerate(order, 1)}
            for fut in as_completed(futures):
                if fut.exception() is not None:
                    log.error("run %s failed: %s", futures[fut], fut.exception())
                    failed.append(futures[fut])
        if failed:  # the finished ones are kept: rerun with --reuse
            raise SystemExit(f"{len(failed)} of {len(order)} runs failed: {failed}")
    runs: list[dict[str, Any]] = []
    for seed, cfg, eta, mode in order:
        run_dir = run_dir_of(cfg, eta, mode, seed)
        cpu = json.loads((run_dir.parent / f"{run_dir.name}.cpu.json").read_text())
        s = {"config": config_name(cfg), "eta": eta, "mode": mode, "seed": seed, **summarise(run_dir),
             **weight_stats(run_dir), **curve_stats(run_dir, curve_every, args.steps), **cpu}
        runs.append(s)
        log.info("%s η=%d %s seed %d: accuracy %s, train reward %.3f, lag max %d (mean %.2f), cut %.4f, "
                 "clip %.4f, |θ−prox| %.4f, %.1f s, other CPU %.2f cores", s["config"], eta, mode, seed,
                 s["eval_accuracy"], s["final_reward"], s["max_version_lag"], s["mean_version_lag"],
                 s["cut_frac"], s["clip_frac"], s["theta_prox_gap"], s["wall_s"], s["other_cores"])

    cells, pairs = tabulate(runs, names, etas, modes)
    other = statistics.median(r["other_cores"] for r in runs)
    md = markdown(cells, pairs, recorder.command,
                  f"{args.steps} steps"
                  + (f", evaluated every {args.eval_every}" if args.eval_every else "")
                  + (f", every {args.eval_after}-th version evaluated after the run" if args.eval_after else "")
                  + f", other processes {other:.2f} cores (median)")
    print(md, file=sys.stderr)
    (out / "staleness_ablation.md").write_text(md)
    result: dict[str, Any] = {
        "benchmark": "staleness_ablation",
        "configs": names,
        "steps": args.steps,
        "seeds": seeds,
        "extra_sets": args.sets,
        "variants": {m: {"base": known[m][0], "sets": known[m][1]} for m in modes},
        "table": cells,
        "paired": pairs,
        "eval_every": args.eval_every,
        "eval_after": args.eval_after,
        "paired_diff": {f"{p['config']}.eta{p['eta']}.{p['b']}" + ("" if p["metric"] == "final" else ".curve"): (
            f"{p['diff_mean']:+.3f} [{p['diff_ci'][0]:+.3f}, {p['diff_ci'][1]:+.3f}] p={p['p_signflip']:.3f}")
            for p in pairs if "diff_mean" in p},
        # the shipped objective against naive PPO, per config and η: the summary table's headline
        "decoupled_vs_naive": {
            f"{p['config']}.eta{p['eta']}": "; ".join(
                f"{'final' if q['metric'] == 'final' else 'along the run'} {q['diff_mean']:+.3f} "
                f"[{q['diff_ci'][0]:+.3f}, {q['diff_ci'][1]:+.3f}] {q['b_wins']}/{q['n']}"
                for q in pairs if (q["config"], q["eta"], q["b"]) == (p["config"], p["eta"], "decoupled")
                and "diff_mean" in q)
            for p in pairs if p["b"] == "decoupled" and p["metric"] == "final" and "diff_mean" in p},
        "runs": runs,
        "total_s": round(time.time() - t_all, 1),
        # the runs' own other-process CPU (median over runs): with --reuse the record's
        # `other_cores` is the tabulation's, not the runs'; the summary table shows this one
        "runs_other_cores": round(other, 3),
    }
    hi, lo = max(etas), min(etas)
    for name, mode in itertools.product(names, modes):
        cell = {(c["eta"], c["mode"]): c for c in cells if c["config"] == name}
        a_hi, a_lo = cell[(hi, mode)]["accuracy_mean"], cell[(lo, mode)]["accuracy_mean"]
        if a_hi is not None and a_lo is not None and hi != lo:
            result[f"{name}.{mode}_accuracy_drop_eta{hi}_vs_eta{lo}"] = round(a_lo - a_hi, 4)
    plot(cells, pairs, names, etas, modes, out / "staleness_ablation.png")
    result["plot"] = str(out / "staleness_ablation.png")
    if curve_every:
        plot_curves(runs, names, etas, modes, out / "staleness_curves.png")
        result["plot_curves"] = str(out / "staleness_curves.png")
    if not args.smoke and not args.no_doc:
        write_doc(md)
        result["doc"] = str(DOC.relative_to(ROOT))
    recorder.finish(result)


if __name__ == "__main__":
    main()
