"""Quickstart to a held-out accuracy target: seconds from the command to the first
evaluation at or above `--target`, for configurations given as `--variant NAME:K=V,K=V`.

Each repeat is a fresh `areal-like run` of the quickstart that stops once the target is
reached (`train.stop_at_eval_accuracy`) or at `--max-steps`. Time is counted from the
command's process start (the run's `startup` record dates it), so start-up counts.
Variants alternate order per repeat; the CPU other processes used is reported.

    python bench/time_to_target.py --variant before:eval.every_n_steps=20 \
        --variant after:eval.every_n_steps=5 [--target 0.9] [--repeats 2]
    python bench/time_to_target.py --smoke   # one run to 0.99 (evaluated every step on 8
                                             # problems, 2 steps at most), temporary folder

Progress on stderr; the last stdout line is one JSON object (bench/_record.py).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _record  # noqa: E402
from _runs import records, run_cli  # noqa: E402

log = logging.getLogger("bench.time_to_target")


def time_to_target(run_dir: Path, target: float, t_launch: float) -> dict[str, float | int | None]:
    recs = records(run_dir)
    # The run dates its process start in its `startup` record, written at the first step; a run
    # that reached the target at version 0 (the evaluation before any step) has none.
    start = next((r for r in recs if r["kind"] == "startup"), None)
    t0 = start["time"] - start["first_step"] if start else t_launch
    hit = next((r for r in recs if r["kind"] == "eval" and r["accuracy"] >= target), None)
    steps = [r for r in recs if r["kind"] == "train_step"]
    return {"seconds": round(hit["time"] - t0, 1) if hit else None, "version": hit["version"] if hit else None,
            "accuracy": hit["accuracy"] if hit else None, "steps_run": len(steps),
            "first_step_s": start["first_step"] if start else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", metavar="NAME:K=V,K=V", help="repeatable; at least one")
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-steps", type=int, default=120)
    ap.add_argument("--config", default="configs/quickstart.yaml")
    ap.add_argument("--out", default=None, help="default: runs/bench_time_to_target (--smoke: a temporary folder)")
    args, recorder = _record.parse(ap, __file__, smoke={
        "variant": ["smoke:eval.every_n_steps=1,eval.num_samples=8"], "target": 0.99, "repeats": 1, "max_steps": 2})
    if not args.variant:
        ap.error("give at least one --variant NAME:K=V,K=V")
    out = _record.out_dir(args.out, "time_to_target", args.smoke)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    variants = []
    for v in args.variant:
        name, _, kv = v.partition(":")
        variants.append((name, [x for x in kv.split(",") if x]))
    results: dict[str, list] = {name: [] for name, _ in variants}
    for k in range(args.repeats):
        for name, sets in variants if k % 2 == 0 else list(reversed(variants)):
            run_dir = out / f"{name}_rep{k}"
            t_launch = time.time()
            cpu = run_cli(args.config, [f"train.total_steps={args.max_steps}",
                                        f"train.stop_at_eval_accuracy={args.target}",
                                        "run.checkpoint_every_n_steps=1000", *sets], run_dir)
            r = {**time_to_target(run_dir, args.target, t_launch), **cpu}
            results[name].append(r)
            log.info("%s rep %d: %s", name, k, r)
    table = {}
    for name, rs in results.items():
        secs = [r["seconds"] for r in rs if r["seconds"] is not None]
        table[name] = {"median_s": round(statistics.median(secs), 1) if secs else None,
                       "reached": f"{len(secs)}/{len(rs)}",
                       "versions": [r["version"] for r in rs],
                       "other_cores": round(statistics.median(r["other_cores"] for r in rs), 2)}
        print(f"{name:>12}: {table[name]}", file=sys.stderr)
    recorder.finish({"benchmark": "time_to_target", "target": args.target, "variants": dict(variants),
                     "table": table, "runs": results})


if __name__ == "__main__":
    main()
