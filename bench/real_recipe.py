"""The real-model recipe over seeds, and variants of it (docs/real_models.md).

Runs `areal-like run configs/smollm2.yaml` once per seed (and per `--variant`, each a set of
`--set` overrides on the recipe), then reads each run's records: held-out accuracy at
version 0, at its best and at the last version; the rise (last − v0) and how much of the
best the end kept (last / best); the seconds from the command to the first train step and
to the end; the share of answers cut by the length limit over the last steps. Across seeds:
the mean rise with a 95 % t-interval, and each variant against the recipe paired by seed
(last version's accuracy, and the mean over the run's evaluations).

    python bench/real_recipe.py --seeds 0,1,2 \\
        --variant mask=train.loss.mask_truncated=true --variant overlong=train.loss.overlong_buffer=4
    python bench/real_recipe.py --smoke   # the toy model on the recipe's task, 2 steps

The model must be fetched first (`areal-like model fetch smollm2-135m-instruct`). `--reuse`
reads runs already in the output folder instead of running them again.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _record import out_dir, parse  # noqa: E402
from _runs import records, run_cli  # noqa: E402

from areal_like.orchestration.console import final_evals  # noqa: E402

sys.path.pop(0)

SMOKE = {"seeds": "0", "sets": ["model.path=areal_like/assets/quickstart_model", "train.total_steps=2",
                                "eval.num_samples=8", "rollout.max_prompt_len=160",
                                "rollout.engine.max_seq_len=256",
                                "staleness.filter_uniform_groups=false"]}  # the toy scores 0 on this task
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def interval(xs: list[float]) -> dict[str, Any]:
    """Mean and 95 % t-interval (None with one value)."""
    m = statistics.mean(xs)
    if len(xs) < 2:
        return {"mean": round(m, 4), "ci95": None, "n": len(xs)}
    half = T95.get(len(xs) - 1, 1.96) * statistics.stdev(xs) / math.sqrt(len(xs))
    return {"mean": round(m, 4), "ci95": [round(m - half, 4), round(m + half, 4)], "n": len(xs)}


def _fmt(iv: dict[str, Any], sign: bool = False) -> str:
    f = "{:+.3f}" if sign else "{:.3f}"
    ci = iv.get("ci95")
    return f.format(iv["mean"]) + (f" [{f.format(ci[0])}, {f.format(ci[1])}]" if ci else "") + f" (n={iv['n']})"


def _line(row: dict[str, Any]) -> str:
    """One variant's headline: what the summary table of docs/benchmarks.md shows."""
    parts = [f"rise {_fmt(row['rise'], sign=True)}", f"last {_fmt(row['eval_last'])}",
             f"last/best ≥ {row['kept_of_best_min']:.3f}", f"first step ≤ {row['first_step_s_max']:.0f} s",
             f"end ≤ {row['end_s_max']:.0f} s"]
    if row.get("server_peak_rss_mb"):
        parts.append(f"server peak {row['server_peak_rss_mb']:.0f} MB")
    if row.get("eval_last_s"):
        parts.append(f"last evaluation {row['eval_last_s']:.1f} s")
    if "vs_recipe_last" in row:
        parts.append(f"vs recipe: last {_fmt(row['vs_recipe_last'], sign=True)}, "
                     f"along the run {_fmt(row['vs_recipe_along_run'], sign=True)}")
    return "; ".join(parts)


def read_run(run_dir: Path, t_command: float | None = None) -> dict[str, Any]:
    recs = records(run_dir)
    evals = [(e["version"], e["accuracy"]) for e in final_evals(run_dir)]
    if not evals:
        raise RuntimeError(f"{run_dir}: no evaluation recorded (eval.every_n_steps, eval.num_samples)")
    steps = [r for r in recs if r["kind"] == "train_step"]
    summary = next((r for r in reversed(recs) if r["kind"] == "summary"), {})
    startup = next((r for r in recs if r["kind"] == "startup"), {})
    last_eval = next((r for r in reversed(recs) if r["kind"] == "eval"), {})
    v0, last = evals[0][1], evals[-1][1]
    best = max(a for _, a in evals)
    tail = steps[-10:]
    # the command's time: given, or the run's own start (its startup record holds the offsets from
    # its process start and is written at the first step)
    t0 = t_command if t_command is not None else (startup["time"] - startup["first_step"] if "first_step" in startup
                                                  else recs[0]["time"])
    return {
        "evals": [[v, a] for v, a in evals],
        "eval_v0": v0, "eval_best": best, "eval_last": last, "eval_mean": round(statistics.mean(a for _, a in evals), 4),
        "rise": round(last - v0, 4), "kept_of_best": round(last / best, 4) if best else None,
        "steps": len(steps), "ended": summary.get("ended"),
        "first_step_s": round(steps[0]["time"] - t0, 1) if steps else None,
        "end_s": round(summary["time"] - t0, 1) if summary else None,
        "truncated_frac_last10": round(statistics.mean(r.get("truncated_frac", 0.0) for r in tail), 3) if tail else None,
        "response_len_last10": round(statistics.mean(r["response_len_mean"] for r in tail), 1) if tail else None,
        # where a step's time goes (medians over the run's steps; `areal-like report --budget-steps`)
        **{k: _median(steps, f) for k, f in _PHASES.items()},
        "weight_bytes": steps[-1].get("weight_bytes") if steps else None,
        # the last version's evaluation runs on servers the trainer no longer needs (#44: ≤ 10 s)
        "eval_last_s": round(last_eval["seconds"], 1) if "seconds" in last_eval else None,
    }


_PHASES = {"step_s": "budget_wall_s", "fwd_bwd_s": "budget_train_fwd_bwd_s", "optimizer_s": "budget_train_optimizer_s",
           "wait_data_s": "budget_wait_data_s", "publish_s": "weight_sync_s",
           "server_weights_s": "rollout_budget_weights_s", "server_reprefill_s": "rollout_budget_reprefill_s"}


def _median(steps: list[dict[str, Any]], key: str) -> float | None:
    xs = [r[key] for r in steps[1:] if isinstance(r.get(key), (int, float))]  # the first step holds start-up
    return round(statistics.median(xs), 3) if xs else None


class PeakRSS:
    """The peak resident memory (MB) of a run's trainer and server processes, by process name
    (`areal-train-*`, `areal-server-*`) under the CLI's pid, read every 0.5 s: the kernel's
    own high-water mark (`VmHWM`) where there is one, so no spike between reads is missed."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, {"trainer": 0.0, "server": 0.0}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(0.5):
            try:
                procs = psutil.Process(self.pid).children(recursive=True)
            except psutil.Error:
                return
            for p in procs:
                try:
                    name, rss = p.name(), _peak_mb(p)
                except psutil.Error:
                    continue
                kind = "trainer" if name.startswith("areal-train") else "server" if name.startswith("areal-serv") else None
                if kind:
                    self.peak[kind] = max(self.peak[kind], rss)

    def __enter__(self) -> PeakRSS:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(timeout=2)


def _peak_mb(p: Any) -> float:
    try:
        with open(f"/proc/{p.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / 1e6
    except OSError:
        pass
    return float(p.memory_info().rss / 1e6)


def _watch(into: list[PeakRSS], pid: int) -> PeakRSS:
    into.append(PeakRSS(pid))
    return into[-1]


def _median_of(vals: list[dict[str, Any]], key: str) -> float | None:
    xs = [r[key] for r in vals if isinstance(r.get(key), (int, float))]
    return round(statistics.median(xs), 3) if xs else None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/smollm2.yaml")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=KEY=VALUE[,KEY=VALUE...]: the recipe with these overrides, paired with it by seed")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="KEY=VALUE for every run")
    ap.add_argument("--reuse", action="store_true", help="read runs already in the output folder")
    ap.add_argument("--reuse-only", action="store_true",
                    help="read runs already in the output folder and run none (a missing seed is left out)")
    ap.add_argument("--no-recipe", action="store_true",
                    help="run only the variants (recipe runs already in the output folder are read, for the pairing)")
    ap.add_argument("--out", default=None)
    args, rec = parse(ap, __file__, SMOKE, argv)
    out = out_dir(args.out, "real_recipe", args.smoke)
    seeds = [int(s) for s in args.seeds.split(",")]
    variants: dict[str, list[str]] = {"recipe": []}
    for v in args.variant:
        name, _, rest = v.partition("=")
        variants[name] = [kv for kv in rest.split(",") if kv]
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    for name, sets in variants.items():
        for seed in seeds:
            run_dir = out / f"{name}_s{seed}"
            done = (run_dir / "metrics.jsonl").is_file() and any(
                '"summary"' in line for line in (run_dir / "metrics.jsonl").read_text().splitlines()[-3:])
            if (args.reuse_only or (args.no_recipe and name == "recipe")) and not done:
                continue
            if not ((args.reuse or args.reuse_only or (args.no_recipe and name == "recipe")) and done):
                print(f"[real_recipe] {name} seed {seed} -> {run_dir}", file=sys.stderr, flush=True)
                t0 = time.time()
                mem: list[PeakRSS] = []
                cores = run_cli(args.config, [*args.sets, *sets, f"run.seed={seed}"], run_dir, timeout_s=3600,
                                watch=partial(_watch, mem))
                got = read_run(run_dir, t0)
                got["other_cores_during"] = cores.get("other_cores")
                got.update({f"{k}_peak_rss_mb": round(v) for k, v in mem[0].peak.items()})
                (run_dir / "peak_rss.json").write_text(json.dumps(mem[0].peak))
            else:
                got = read_run(run_dir)
                if (run_dir / "peak_rss.json").is_file():
                    peak = json.loads((run_dir / "peak_rss.json").read_text())
                    got.update({f"{k}_peak_rss_mb": round(v) for k, v in peak.items()})
            runs.setdefault(name, {})[seed] = got
            print(f"[real_recipe] {name} seed {seed}: {json.dumps(got)}", file=sys.stderr, flush=True)
    table = {}
    for name, by_seed in runs.items():
        vals = list(by_seed.values())
        row = {"rise": interval([r["rise"] for r in vals]),
               "eval_last": interval([r["eval_last"] for r in vals]),
               "kept_of_best_min": min(r["kept_of_best"] or 0.0 for r in vals),
               "first_step_s_max": max(r["first_step_s"] or 0.0 for r in vals),
               "end_s_max": max(r["end_s"] or 0.0 for r in vals),
               "truncated_frac_last10": interval([r["truncated_frac_last10"] or 0.0 for r in vals]),
               **{k: _median_of(vals, k) for k in (*_PHASES, "weight_bytes", "trainer_peak_rss_mb",
                                                   "server_peak_rss_mb", "eval_last_s")}}
        if name != "recipe" and "recipe" in runs:
            base = runs["recipe"]
            common = [s for s in by_seed if s in base]
            row["vs_recipe_last"] = interval([by_seed[s]["eval_last"] - base[s]["eval_last"] for s in common])
            row["vs_recipe_along_run"] = interval([by_seed[s]["eval_mean"] - base[s]["eval_mean"] for s in common])
        table[name] = row
    result = {"config": args.config, "seeds": seeds, "variants": variants, "table": table,
              "summary": {name: _line(row) for name, row in table.items()},
              "runs": {n: {str(s): r for s, r in v.items()} for n, v in runs.items()}}
    return rec.finish(result)


if __name__ == "__main__":
    try:
        main()
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
