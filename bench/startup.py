"""Where start-up goes: seconds from the command to each start-up phase and the first
train step of `areal-like run` (the quickstart), over repeats.

Each repeat is a fresh `python -m areal_like.orchestration.cli run configs/quickstart.yaml`
(its own Ray) with 2 train steps; the run writes its phases as a `startup` record
(`areal_like/orchestration/startup.py`: offsets from its process start, so interpreter
start-up and imports count). Reported: the median offset of each phase and each phase's
own share, and the CPU other processes used meanwhile.

    python bench/startup.py [--repeats 3] [--set KEY=VALUE ...]
    python bench/startup.py --smoke   # one launch, into a temporary folder

Progress on stderr; the last stdout line is one JSON object (bench/_record.py; its
`other_cores` covers the whole benchmark, `other_cores_median_of_runs` each launch).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _record  # noqa: E402
from _runs import records, run_cli  # noqa: E402

log = logging.getLogger("bench.startup")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--config", default="configs/quickstart.yaml")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default=None, help="default: runs/bench_startup (--smoke: a temporary folder)")
    args, recorder = _record.parse(ap, __file__, smoke={"repeats": 1})
    out = _record.out_dir(args.out, "startup", args.smoke)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    runs = []
    for k in range(args.repeats):
        run_dir = out / f"rep{k}"
        cpu = run_cli(args.config, ["train.total_steps=2", "eval.every_n_steps=0", *args.sets], run_dir)
        rec = next(r for r in records(run_dir) if r["kind"] == "startup")
        phases = {n: v for n, v in rec.items() if n not in ("time", "kind", "trainer_version")}
        runs.append({"phases": phases, **cpu})
        log.info("[%d/%d] first step at %.1f s (other CPU %.2f cores): %s", k + 1, args.repeats,
                 phases["first_step"], cpu["other_cores"], phases)
    names = list(runs[0]["phases"])
    median = {n: round(statistics.median(r["phases"][n] for r in runs), 2) for n in names}
    share, prev = {}, 0.0
    for n in names:
        share[n] = round(median[n] - prev, 2)
        prev = median[n]
    print(f"\n{'phase':>16} {'at (s)':>8} {'its own (s)':>12}", file=sys.stderr)
    for n in names:
        print(f"{n:>16} {median[n]:>8.2f} {share[n]:>12.2f}", file=sys.stderr)
    recorder.finish({"benchmark": "startup", "repeats": args.repeats, "extra_sets": args.sets,
                "median_at_s": median, "median_share_s": share, "first_step_s": median["first_step"],
                "other_cores_median_of_runs": round(statistics.median(r["other_cores"] for r in runs), 2),
                "runs": runs})


if __name__ == "__main__":
    main()
