"""After saturation (#29 item 5): how much generation is thrown away per trained sample, and
how long the trainer waits for its batch, over the quickstart's 200 steps.

Once the quickstart reaches its target most groups come back uniform (all 8 samples
solved), carry no GRPO signal and are filtered (`staleness.filter_uniform_groups`); the
trainer then waits for generation. Each `--variant NAME:K=V,K=V` is a fresh `areal-like run`
of `--config` for `--steps` steps (same seed); `--run-dir NAME:PATH` analyses a finished
run instead. From each run's metrics.jsonl, per step and in total:

- `generated`: episodes the rollout side started (its reports' `started`, sampled at each
  step's record), `trained`, `filtered` samples and `uniform_groups` (filtered samples /
  `rollout.group_size`), `prompts_per_step` (trained groups per step: fewer than
  `train.batch_size` once `staleness.grow_groups_to` grows them, docs/design.md §10.25);
- `gen_per_trained`: generated / trained;
- `idle_ratio`: the trainer's waits for a batch (`budget_wait_data_s`, `budget_wait_straggler_s`,
  `budget_wait_rollout_s`: docs/design.md §10.19) over its wall time (Σ `budget_wall_s`);
- after the first evaluation at or above `--target`: the same over the next `--after-steps`
  steps, their steps/s, and `uniform_homogeneous`, the uniform share a group of
  `rollout.group_size` would have if every prompt had the same per-sample success rate
  (p^n + (1−p)^n with p the step's `reward_mean_all_groups`) beside the observed one:
  screening can only save generation when the observed share is well above it
  (docs/design.md §10.25; with grown groups the observed share is of larger groups);
- held-out accuracy (the last evaluation and the best); whether the outcome counts add up,
  no sample went over-stale and every lag stayed within η; with `--audit`, whether
  `areal-like audit` passes (the runs then record trajectories and weights).

    python bench/saturation.py --variant base: --variant grown:staleness.grow_groups_to=32
    python bench/saturation.py --run-dir base:runs/quickstart --no-record
    python bench/saturation.py --smoke    # one 3-step run of 2 prompts, temporary folder

Progress on stderr; the last stdout line is one JSON object (bench/_record.py); a real run is
appended to bench/results/saturation.jsonl.
"""

from __future__ import annotations

import argparse
import bisect
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _record  # noqa: E402
from _runs import records, run_cli  # noqa: E402

log = logging.getLogger("bench.saturation")

WAITS = ("budget_wait_data_s", "budget_wait_straggler_s", "budget_wait_rollout_s")
"""The trainer's phases that wait for its batch (step_budget.TRAINER_PHASES)."""


def _window(steps: list[dict[str, Any]], started_at: list[float], started: list[int], prev: dict[str, Any] | None,
            group_size: int) -> dict[str, Any]:
    """Counts and ratios over consecutive step records (`prev`: the record before them)."""
    if not steps:
        return {"steps": 0}

    def started_by(t: float) -> int:
        i = bisect.bisect_right(started_at, t)
        return started[i - 1] if i else 0

    t0 = prev["time"] if prev else steps[0]["time"] - steps[0].get("budget_wall_s", 0.0)
    generated = started_by(steps[-1]["time"]) - (started_by(prev["time"]) if prev else 0)
    trained = sum(int(r["samples"]) for r in steps if not r.get("skipped"))
    filtered = int(steps[-1]["filtered"]) - (int(prev["filtered"]) if prev else 0)
    prompts = sum(sum(r.get("head_lag_hist", {}).values()) for r in steps)  # one count per trained group
    wall = sum(r.get("budget_wall_s", 0.0) for r in steps)
    waits = sum(r.get(k, 0.0) for r in steps for k in WAITS)
    n = group_size
    homog = [(r["reward_mean_all_groups"] ** n + (1 - r["reward_mean_all_groups"]) ** n) for r in steps
             if "reward_mean_all_groups" in r]
    return {
        "steps": len(steps),
        "generated": generated,
        "trained": trained,
        "filtered": filtered,
        "uniform_groups": filtered // n,
        "prompts_per_step": round(prompts / len(steps), 2),
        "gen_per_trained": round(generated / trained, 3) if trained else None,
        "idle_ratio": round(waits / wall, 3) if wall else None,
        "steps_per_s": round(len(steps) / (steps[-1]["time"] - t0), 3) if steps[-1]["time"] > t0 else None,
        "uniform_observed": round(filtered / generated, 3) if generated else None,
        "uniform_homogeneous": round(sum(homog) / len(homog), 3) if homog else None,
    }


def analyse(run_dir: Path, *, target: float, after_steps: int, group_size: int, eta: int,
            audit: bool = False) -> dict[str, Any]:
    """The numbers above for one finished run (see the module docstring)."""
    recs = records(run_dir)
    steps = [r for r in recs if r["kind"] == "train_step"]
    reports = [r for r in recs if r["kind"] == "rollout" and "started" in r]
    started_at = [r["time"] for r in reports]
    started = [int(r["started"]) for r in reports]
    for i in range(1, len(started)):  # cumulative per controller; never let a restart count backwards
        started[i] = max(started[i], started[i - 1])
    evals = [r for r in recs if r["kind"] == "eval"]
    summary = next((r for r in reversed(recs) if r["kind"] == "summary"), {})
    hit = next((e for e in evals if e["accuracy"] >= target), None)
    after: dict[str, Any] = {"steps": 0}
    if hit is not None:
        k = next((i for i, r in enumerate(steps) if r["step"] > hit["version"]), len(steps))
        after = _window(steps[k:k + after_steps], started_at, started, steps[k - 1] if k else None, group_size)
        after["from_step"] = hit["version"]
    per_step = []
    for i, r in enumerate(steps):
        w = _window([r], started_at, started, steps[i - 1] if i else None, group_size)
        per_step.append({"step": r["step"], **{k: w[k] for k in ("generated", "trained", "filtered", "uniform_groups",
                                                                  "prompts_per_step", "gen_per_trained", "idle_ratio")}})
    total = _window(steps, started_at, started, None, group_size)
    total["generated"] = int(summary.get("started", total["generated"]))  # every episode the run started
    total["gen_per_trained"] = round(total["generated"] / total["trained"], 3) if total["trained"] else None
    checks = {"counts_add_up": summary.get("counts_add_up"), "over_stale": summary.get("over_stale"),
              "lag_within_eta": max((int(r["max_version_lag"]) for r in steps), default=0) <= eta}
    if audit:  # the whole audit: every trained token's logprob recomputed (run.record_* needed)
        from areal_like.orchestration.audit import audit_run

        checks["audit_ok"] = audit_run(run_dir).ok
    return {
        "total": total,
        "after_target": after,
        "target_at_step": hit["version"] if hit else None,
        "heldout_last": evals[-1]["accuracy"] if evals else None,
        "heldout_best": max((e["accuracy"] for e in evals), default=None),
        "outcomes": {k: summary.get(k) for k in ("started", "trained", "filtered", "over_stale", "failed",
                                                  "buffered", "cancelled")},
        "max_version_lag": max((int(r["max_version_lag"]) for r in steps), default=None),
        "checks": checks,
        "per_step": per_step,
    }


def _recorded_cpu(run_dir: str) -> dict[str, float] | None:
    """The other-process CPU recorded when this benchmark ran `run_dir` (its line in
    bench/results/saturation.jsonl), so a later analysis of the same run keeps it."""
    path = _record.RESULTS / "saturation.jsonl"
    found = None
    for line in path.read_text().splitlines() if path.is_file() else []:
        for r in json.loads(line).get("runs", {}).values():
            if Path(r.get("run_dir", "")).resolve() == Path(run_dir).resolve() and "run_other_cores" in r:
                found = {"other_cores": r["run_other_cores"]}
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:K=V,K=V",
                    help="repeatable: a fresh run with these overrides")
    ap.add_argument("--run-dir", action="append", default=[], metavar="NAME:PATH",
                    help="repeatable: analyse a finished run instead of starting one")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--target", type=float, default=0.9, help="held-out accuracy that counts as saturated")
    ap.add_argument("--after-steps", type=int, default=60, help="steps after the target that are measured")
    ap.add_argument("--config", default="configs/quickstart.yaml")
    ap.add_argument("--timeout-s", type=float, default=4 * 3600,
                    help="per run (a saturated quickstart on a busy 2-core machine ran 84 steps in 30 minutes)")
    ap.add_argument("--set", action="append", default=[], metavar="K=V", help="for every variant")
    ap.add_argument("--per-step", action="store_true", help="keep the per-step rows in the JSON line")
    ap.add_argument("--audit", action="store_true", help="record trajectories and weights and run `areal-like audit` "
                    "(slow: it recomputes every trained token)")
    ap.add_argument("--out", default=None, help="default: runs/bench_saturation (--smoke: a temporary folder)")
    args, recorder = _record.parse(ap, __file__, smoke={
        "variant": ["smoke:"], "steps": 3, "set": ["train.batch_size=2", "eval.every_n_steps=2",
                                                   "eval.num_samples=8", "staleness.max_concurrent=32"]})
    if not args.variant and not args.run_dir:
        ap.error("give a --variant NAME:K=V,K=V or a --run-dir NAME:PATH")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    from areal_like.core.config import load_config

    out = _record.out_dir(args.out, "saturation", args.smoke)
    runs: dict[str, dict[str, Any]] = {}
    for spec in args.run_dir:
        name, _, path = spec.partition(":")
        runs[name] = {"run_dir": path, "cpu": _recorded_cpu(path)}
    for spec in args.variant:
        name, _, kv = spec.partition(":")
        sets = [f"train.total_steps={args.steps}", "run.checkpoint_every_n_steps=100000", *args.set,
                *(["run.record_trajectories=true", "run.record_weights=true"] if args.audit else []),
                *[x for x in kv.split(",") if x]]
        run_dir = out / name
        t0 = time.time()
        cpu = run_cli(args.config, sets, run_dir, timeout_s=args.timeout_s)
        log.info("%s: %d steps in %.0f s, other processes %.2f cores", name, args.steps, time.time() - t0,
                 cpu["other_cores"])
        runs[name] = {"run_dir": str(run_dir), "cpu": cpu, "sets": sets}
    result: dict[str, Any] = {"benchmark": "saturation", "target": args.target, "after_steps": args.after_steps,
                              "runs": {}}
    for name, r in runs.items():
        cfg = load_config(str(Path(r["run_dir"]) / "config.yaml")) if (Path(r["run_dir"]) / "config.yaml").is_file() \
            else load_config(args.config)
        a = analyse(Path(r["run_dir"]), target=args.target, after_steps=args.after_steps,
                    group_size=cfg.rollout.group_size, eta=cfg.staleness.max_staleness, audit=args.audit)
        if not args.per_step:
            a.pop("per_step")
        result["runs"][name] = {**a, "sets": r.get("sets"), "run_dir": r["run_dir"],
                                **({"run_other_cores": r["cpu"]["other_cores"]} if r["cpu"] else {})}
        t, w = a["total"], a["after_target"]
        print(f"{name:>10}: total gen/trained {t['gen_per_trained']} idle {t['idle_ratio']}; after the target "
              f"(step {a['target_at_step']}): gen/trained {w.get('gen_per_trained')} idle {w.get('idle_ratio')} "
              f"steps/s {w.get('steps_per_s')} uniform {w.get('uniform_observed')} (homogeneous "
              f"{w.get('uniform_homogeneous')}); held-out {a['heldout_last']} (best {a['heldout_best']}); "
              f"checks {a['checks']}", file=sys.stderr)
    recorder.finish(result)


if __name__ == "__main__":
    main()
