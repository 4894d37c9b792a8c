"""Staleness ablation (AReaL's Table 2 at small scale): naive vs decoupled PPO over η.

Grid: η ∈ {0, 2, 8} × {naive PPO (behaviour logprobs used as π_old:
`train.loss.naive_ppo_ablation=true`), decoupled PPO (explicit proximal policy, the
default, behaviour weight π_prox/π_behav capped: `decoupled`), decoupled PPO with the
weight's out-of-range tokens masked instead (`decoupled_mask`:
`train.loss.behav_weight_mode=mask`)} × seeds (`--modes` picks objectives). Everything else is the quickstart (tool-form arithmetic, warm-started
model, 8 prompts × 8 samples, lr 3e-4). At η = 0 both objectives coincide up to
numerics (behaviour = proximal policy), so η = 0 is the reference; the question is how
each objective holds up as samples get staler. Reported per cell: final held-out
sampled accuracy and final train reward (mean, and spread = max − min over seeds),
the version lag actually reached (a bound only bites if the rollout runs ahead of the
trainer), and the CPU other processes used meanwhile. Contenders alternate order per
seed. Up to ~30 minutes with the defaults on 2 shared cores.

    python bench/staleness_ablation.py [--etas 0,2,8] [--seeds 0,1,2] [--steps 30]
        [--modes naive,decoupled,decoupled_mask]
    python bench/staleness_ablation.py --smoke   # η 2, decoupled, one seed, 2 steps of 2 prompts,
                                                 # 8 held-out problems, a temporary folder

Also reported per cell, from the train-step records: the mean per-token gap
|log π_prox − log π_behav| (how far the trainer has moved from the sampler), the largest
behaviour weight seen, and the fraction of tokens whose weight was capped or masked —
the numbers that explain why one objective holds up better than the other.

Progress on stderr; the last stdout line is one JSON object (bench/_record.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _record  # noqa: E402
from _runs import records, run_cli, summarise  # noqa: E402

log = logging.getLogger("bench.staleness_ablation")

MODES = ("naive", "decoupled", "decoupled_mask")


def sets_for(eta: int, mode: str, seed: int, steps: int, eval_samples: int) -> list[str]:
    return [
        f"staleness.max_staleness={eta}",
        f"train.loss.naive_ppo_ablation={'true' if mode == 'naive' else 'false'}",
        f"train.loss.behav_weight_mode={'mask' if mode == 'decoupled_mask' else 'cap'}",
        f"run.seed={seed}",
        f"train.total_steps={steps}",
        "run.checkpoint_every_n_steps=1000",
        "eval.every_n_steps=0",  # evaluate the final version only
        f"eval.num_samples={eval_samples}",
        "rollout.server_threads=1",
        "train.backend.threads=1",
        # Uniform groups are trained (with zero advantage) instead of filtered: the filter
        # would make the rollout the bottleneck, and a bound the lag never reaches tests nothing.
        "staleness.filter_uniform_groups=false",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--etas", default="0,2,8")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--modes", default=",".join(MODES), help=f"objectives, from {','.join(MODES)}")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--eval-samples", type=int, default=256)
    ap.add_argument("--config", default="configs/quickstart.yaml")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="extra config override for every run (repeatable)")
    ap.add_argument("--out", default=None,
                    help="default: runs/bench_staleness_ablation (--smoke: a temporary folder)")
    ap.add_argument("--reuse", action="store_true", help="keep runs that finished in --out (same settings!)")
    args, recorder = _record.parse(ap, __file__, smoke={"etas": "2", "seeds": "0", "modes": "decoupled",
                                                         "steps": 2, "eval_samples": 8,
                                                         "sets": ["train.batch_size=2"]})
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    etas = [int(x) for x in args.etas.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    out = _record.out_dir(args.out, "staleness_ablation", args.smoke)
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        ap.error(f"unknown --modes {sorted(unknown)}; pick from {','.join(MODES)}")
    cells = [(e, m) for e in etas for m in modes]
    runs: list[dict] = []
    t_all = time.time()
    k = 0
    for i, seed in enumerate(seeds):
        for eta, mode in cells if i % 2 == 0 else list(reversed(cells)):
            k += 1
            run_dir = out / f"eta{eta}_{mode}_seed{seed}"
            log.info("[%d/%d] η=%d %s seed %d ...", k, len(cells) * len(seeds), eta, mode, seed)
            done_file = run_dir.parent / f"{run_dir.name}.cpu.json"
            if args.reuse and done_file.exists():  # finished earlier with the same settings
                cpu = json.loads(done_file.read_text())
            else:
                cpu = run_cli(args.config, [*sets_for(eta, mode, seed, args.steps, args.eval_samples), *args.sets], run_dir)
                done_file.write_text(json.dumps(cpu))
            s = {"eta": eta, "mode": mode, "seed": seed, **summarise(run_dir), **weight_stats(run_dir), **cpu}
            runs.append(s)
            log.info("    accuracy %s, train reward %.3f, lag max %d (mean %.2f), %.1f s, other CPU %.2f cores",
                     s["eval_accuracy"], s["final_reward"], s["max_version_lag"], s["mean_version_lag"],
                     s["wall_s"], s["other_cores"])

    table = []
    for eta, mode in cells:
        rs = [r for r in runs if r["eta"] == eta and r["mode"] == mode]
        acc = [r["eval_accuracy"] for r in rs if r["eval_accuracy"] is not None]
        rew = [r["final_reward"] for r in rs]
        table.append({
            "eta": eta, "mode": mode,
            "accuracy_mean": round(statistics.mean(acc), 4) if acc else None,
            "accuracy_spread": round(max(acc) - min(acc), 4) if acc else None,
            "reward_mean": round(statistics.mean(rew), 4),
            "reward_spread": round(max(rew) - min(rew), 4),
            "mean_version_lag": round(statistics.mean(r["mean_version_lag"] for r in rs), 2),
            "prox_gap_mean": round(statistics.mean(r["prox_gap_mean"] for r in rs), 4),
            "prox_gap_max": round(max(r["prox_gap_max"] for r in rs), 4),
            "behav_weight_max": round(max(r["behav_weight_max"] for r in rs), 3),
            "capped_or_masked": round(statistics.mean(r["capped_or_masked"] for r in rs), 5),
            "max_version_lag": max(r["max_version_lag"] for r in rs),
            "other_cores": round(statistics.median(r["other_cores"] for r in rs), 2),
        })
    print(f"\n{'η':>3} {'objective':>15} {'accuracy':>14} {'train reward':>14} {'lag mean/max':>12} "
          f"{'gap mean/max':>14} {'w max':>7} {'cut/step':>9}", file=sys.stderr)
    for row in table:
        print(f"{row['eta']:>3} {row['mode']:>15} {row['accuracy_mean']:>7.3f} ±{row['accuracy_spread']:<5.3f} "
              f"{row['reward_mean']:>7.3f} ±{row['reward_spread']:<5.3f} "
              f"{row['mean_version_lag']:>6.2f}/{row['max_version_lag']:<5} "
              f"{row['prox_gap_mean']:>6.3f}/{row['prox_gap_max']:<6.3f} {row['behav_weight_max']:>7.2f} "
              f"{row['capped_or_masked']:>7.4f}", file=sys.stderr)

    def cell(eta: int, mode: str) -> dict:
        return next(r for r in table if r["eta"] == eta and r["mode"] == mode)

    hi, lo = max(etas), min(etas)
    result = {
        "benchmark": "staleness_ablation",
        "steps": args.steps,
        "seeds": seeds,
        "extra_sets": args.sets,
        "table": table,
        "runs": runs,
        "total_s": round(time.time() - t_all, 1),
    }
    for mode in modes:
        a_hi, a_lo = cell(hi, mode)["accuracy_mean"], cell(lo, mode)["accuracy_mean"]
        if a_hi is not None and a_lo is not None:
            result[f"{mode}_accuracy_drop_eta{hi}_vs_eta{lo}"] = round(a_lo - a_hi, 4)
    _plot(table, etas, modes, out / "staleness_ablation.png")
    result["plot"] = str(out / "staleness_ablation.png")
    recorder.finish(result)


def weight_stats(run_dir: Path) -> dict[str, float]:
    """How far π_prox is from π_behav over the run, and what the weight cap/mask cut."""
    steps = [r for r in records(run_dir) if r["kind"] == "train_step" and not r.get("skipped")]
    gaps = [r.get("behav_prox_gap", 0.0) for r in steps]
    cut = [r.get("behav_capped", 0.0) + r.get("behav_masked", 0.0) for r in steps]
    return {"prox_gap_mean": statistics.mean(gaps), "prox_gap_max": max(gaps),
            "behav_weight_max": max(r.get("behav_weight_max", 1.0) for r in steps),
            "capped_or_masked": statistics.mean(cut)}


def _plot(table: list[dict], etas: list[int], modes: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    styles = {"naive": "s--", "decoupled": "o-", "decoupled_mask": "^:"}
    for k, mode in enumerate(modes):
        rows = [r for r in table if r["mode"] == mode]
        ax.errorbar([r["eta"] + 0.08 * (k - 1) for r in rows], [r["accuracy_mean"] for r in rows],
                    yerr=[r["accuracy_spread"] / 2 for r in rows], fmt=styles[mode], capsize=3,
                    label=mode.replace("_", " (") + (")" if "_" in mode else "") + " PPO")
    ax.set_xlabel("η (max staleness)")
    ax.set_ylabel("held-out sampled accuracy")
    ax.set_xticks(etas)
    ax.legend()
    ax.set_title("staleness ablation")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


if __name__ == "__main__":
    main()
