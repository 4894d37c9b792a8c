"""The planner checked out of sample (#33 item 4): calibrate once, predict runs it never saw.

1. **Calibration**, once: `areal-like profile configs/quickstart.yaml --out costs.json`
   (decode, prefill, train step, snapshot and weight sync of the quickstart model on this
   machine). Nothing below changes a number in that file.
2. **Unseen runs**, each a real `areal-like run` (`_runs.run_cli`), sequential:
   the quickstart at η ∈ {0, 1, 2, 4}; the quickstart at η = 2 with 2 rollout servers;
   `configs/long_answers.yaml`; the quickstart at η = 2 on a bigger Qwen2 built here
   (`--big-size` M parameters, the shapes of bench/scale_out.py).
3. **Prediction** of each with `areal_like.plan.simulate(cfg, costs, Split(servers, 1))`:
   `cfg` is the run's own config (the same `--set`s), `costs` the calibration file as it
   is, except what the profile itself derives from a config and nothing else — the
   length guess (`profile.default_lengths`: lognormal, median half the response budget)
   and the loop shape (`default_episode`) — and, for the bigger model only, the plain
   per-parameter scaling `costs.scale_to_model` (an assumption, see its docstring).
4. **Report** per run: measured vs predicted s/step and trained samples/s over the same
   steady steps (after `skip` steps), their relative errors, and the trainer's idle ratio
   — measured from the run's own time budget (`budget_wait_*_s` over `budget_wall_s` of
   the steady `train_step` records: waiting for data, stragglers, the rollout side and
   the previous broadcast), not derived from samples/s — vs the simulator's (the share of
   the steady window it neither computed nor took a snapshot). Also the mean version lag
   and the mean response length (a diagnostic: the lengths are a guess, not measured),
   and the CPU other processes used (`other_cores`: the machine is shared).

Every run uses the simulator's device model on this 2-core box: one torch thread per
rollout server and for the trainer, thread lending off (`cluster.lend_idle_threads`: the
simulator does not lend), uniform groups kept (the profile measures no reward), no
evaluation or checkpoints during the steps.

    python bench/plan_validation.py [--steps 16] [--etas 0,1,2,4] [--big-size 25] [--runs NAME,...]
    python bench/plan_validation.py --smoke   # a quick profile and one unseen run (a 1M "bigger" model), 3 steps

Progress on stderr; the last stdout line is one JSON object (bench/_record.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _record  # noqa: E402
from _runs import RAY_ENV, ROOT, records, run_cli, summarise  # noqa: E402

sys.path.pop(0)

log = logging.getLogger("bench.plan_validation")

BIG_SHAPES = {  # the shapes of bench/scale_out.py's sizes (~M parameters)
    1: dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
    25: dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=8,
             num_key_value_heads=4),
}
WAITS = ("wait_data", "wait_straggler", "wait_rollout", "wait_colocate", "wait_broadcast")
"""The trainer's phases (areal_like/orchestration/step_budget.py) in which it waits."""


def common_sets(steps: int) -> list[str]:
    return [
        f"train.total_steps={steps}",
        "rollout.server_threads=1",
        "train.backend.threads=1",
        "cluster.rollout_pool.num_cpus=1",
        "cluster.train_pool.num_cpus=1",
        "cluster.lend_idle_threads=false",
        "staleness.filter_uniform_groups=false",
        "eval.every_n_steps=0",
        "eval.num_samples=8",
        "run.checkpoint_every_n_steps=1000",
        "metrics.dashboard_port=0",
    ]


def plan_runs(args: argparse.Namespace, big_model: Path | None) -> list[dict[str, Any]]:
    """The unseen runs: name, what differs from the calibration, config, extra sets, steps."""
    qs = "configs/quickstart.yaml"
    runs = [{"name": f"eta{e}", "unseen": f"quickstart, η = {e}", "config": qs,
             "sets": [f"staleness.max_staleness={e}", *args.sets], "steps": args.steps}
            for e in (int(x) for x in args.etas.split(","))]
    runs.append({"name": "servers2", "unseen": "quickstart, η = 2, 2 rollout servers", "config": qs,
                 "sets": ["staleness.max_staleness=2", "rollout.num_servers=2", *args.sets], "steps": args.steps})
    runs.append({"name": "long_answers", "unseen": "configs/long_answers.yaml (η = 2)", "config": "configs/long_answers.yaml",
                 "sets": list(args.sets), "steps": args.steps})
    if big_model is not None:
        runs.append({"name": "bigger", "unseen": f"quickstart, η = 2, a {args.big_size}M-parameter Qwen2",
                     "config": qs, "model": str(big_model),
                     "sets": ["staleness.max_staleness=2", f"model.path={big_model}",
                              f"train.batch_size={args.big_batch}", *args.sets], "steps": args.big_steps})
    wanted = set(args.runs.split(",")) if args.runs else None
    return [r for r in runs if wanted is None or r["name"] in wanted]


def build_big_model(size: int, out: Path) -> Path:
    from areal_like.models.tiny_model import init_model

    model = out / f"model_{size}m"
    if not (model / "config.json").is_file():
        init_model(model, **BIG_SHAPES[size], max_position_embeddings=512)
    return model


def model_bytes(model: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in sorted(model.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():  # noqa: SIM118
                s = h.get_slice(k)
                n = 1
                for d in s.get_shape():
                    n *= d
                total += n * {"F32": 4, "BF16": 2, "F16": 2}.get(s.get_dtype(), 4)
    return total


def calibrate(out: Path, quick: bool) -> tuple[Path, float, str]:
    """`areal-like profile configs/quickstart.yaml --out costs.json` once; (file, seconds, command)."""
    path = out / "costs.json"
    cmd = [sys.executable, "-m", "areal_like.orchestration.cli", "profile", "configs/quickstart.yaml",
           "--out", str(path), *(["--quick"] if quick else [])]
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **RAY_ENV}, capture_output=True, text=True,
                       timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f"profile failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    shown = "areal-like profile configs/quickstart.yaml --out costs.json" + (" --quick" if quick else "")
    return path, time.time() - t0, shown


def measure(run_dir: Path, skip: int, series: list[tuple[float, float, float]]) -> dict[str, Any]:
    """The run's steady steps (after `skip`): rates from the records' times, the trainer's
    idle share from its own time budget."""
    steps = [r for r in records(run_dir) if r["kind"] == "train_step" and not r.get("skipped")]
    warm, t0 = steps[skip:], steps[skip - 1]["time"]
    span = warm[-1]["time"] - t0
    wall = sum(r["budget_wall_s"] for r in warm)
    phases = {p: sum(r.get(f"budget_{p}_s", 0.0) for r in warm) for p in WAITS}
    train = sum(sum(v for k, v in r.items() if k.startswith("budget_train_") and k.endswith("_s")) for r in warm)
    tokens = sum(r.get("num_tokens", 0) for r in warm)
    s = summarise(run_dir, skip_steps=skip, series=series)
    return {
        "steps": len(steps), "window_steps": len(warm),
        "step_s": round(span / len(warm), 3), "samples_per_s": s["samples_per_s"],
        "trainer_idle": round(sum(phases.values()) / max(wall, 1e-9), 3),
        "wait_s_per_step": {p: round(v / len(warm), 3) for p, v in phases.items() if v > 0},
        "train_s_per_step": round(train / len(warm), 3),
        "train_tokens_per_step": round(tokens / len(warm), 1),
        "train_s_per_token": round(train / max(tokens, 1), 7),
        "publish_s_per_step": round(sum(r.get("budget_publish_s", 0.0) for r in warm) / len(warm), 3),
        "budget_covers_window": round(wall / max(span, 1e-9), 3),
        "mean_lag": s["mean_version_lag"], "response_len_mean": s["response_len_mean"],
        "steady_other_cores": s.get("steady_other_cores"), "steady_own_cores": s.get("steady_own_cores"),
    }


def run_cfg(run: dict[str, Any]) -> Any:
    from areal_like.core.config import load_config

    return load_config(ROOT / run["config"], [*run["sets"], *run["common"]])


def run_eta(run: dict[str, Any]) -> int:
    return run_cfg(run).staleness.max_staleness


def predict(run: dict[str, Any], costs_path: Path, skip: int) -> dict[str, Any]:
    """The simulator's prediction from the calibration file: only the run's config differs."""
    from areal_like.plan import Split, load_costs, simulate
    from areal_like.plan.costs import scale_to_model
    from areal_like.plan.profile import default_episode, default_lengths
    from areal_like.plan.sim import sample_length, snapshot_s

    cfg = run_cfg(run)
    costs = load_costs(costs_path)
    costs = costs.model_copy(update={"lengths": default_lengths(cfg), "episode": default_episode(cfg)})
    if run.get("model"):
        costs = scale_to_model(costs, model_bytes(Path(run["model"])))
    split = Split(cfg.rollout.num_servers * costs.decode.gpus_per_server, 1)
    r = simulate(cfg, costs, split, steps=run["steps"], warmup_steps=skip)
    rng = random.Random(0)
    mean_len = statistics.mean(sample_length(costs.lengths, cfg.rollout.response_length, rng) for _ in range(4000))
    return {
        "step_s": round(r.step_s, 3), "samples_per_s": round(r.samples_per_s, 3),
        "trainer_idle": round(r.trainer_idle_ratio, 3), "train_phase_s": round(r.train_phase_s, 3),
        "rollout_phase_s": round(r.rollout_phase_s, 3), "train_tokens_per_step": round(r.train_tokens_per_step, 1),
        "train_s_per_token": round((r.train_phase_s - snapshot_s(costs)) / max(r.train_tokens_per_step, 1), 7),
        "mean_lag": round(r.lag.mean, 2), "generated_len_mean": round(mean_len, 1),
        "weight_sync_s": round(r.weight_sync_s, 4), "snapshot_s": round(snapshot_s(costs), 4),
        "compute_scale": round(costs.weight_sync.model_bytes / load_costs(costs_path).weight_sync.model_bytes, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--etas", default="0,1,2,4")
    ap.add_argument("--big-size", type=int, default=25, choices=sorted(BIG_SHAPES))
    ap.add_argument("--big-steps", type=int, default=10)
    ap.add_argument("--big-batch", type=int, default=2, help="prompts per step of the bigger model's run")
    ap.add_argument("--skip", type=int, default=None, help="steps left out before the steady window "
                                                          "(default: 2 + the run's η, at most steps − 3)")
    ap.add_argument("--runs", default=None, help="only these runs (names: eta0,...,servers2,long_answers,bigger)")
    ap.add_argument("--quick-profile", action="store_true", help="areal-like profile --quick")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="extra config override for every run (repeatable)")
    ap.add_argument("--out", default=None, help="default: runs/bench_plan_validation (--smoke: a temporary folder)")
    args, recorder = _record.parse(ap, __file__, smoke={
        "etas": "0", "steps": 3, "big_steps": 3, "big_size": 1, "quick_profile": True, "runs": "bigger",
        "sets": ["train.batch_size=2"]})
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    out = _record.out_dir(args.out, "plan_validation", args.smoke)
    out.mkdir(parents=True, exist_ok=True)
    log.info("calibration: areal-like profile configs/quickstart.yaml ...")
    costs_path, profile_s, profile_cmd = calibrate(out, args.quick_profile)
    calibration = json.loads(costs_path.read_text())
    log.info("    %.0f s: %s", profile_s, calibration["source"])
    want_big = args.runs is None or "bigger" in args.runs.split(",")
    big = build_big_model(args.big_size, out) if want_big else None
    results = []
    for i, run in enumerate(plan_runs(args, big)):
        run["common"] = common_sets(run["steps"])
        skip = min(args.skip if args.skip is not None else 2 + run_eta(run), max(1, run["steps"] - 3))
        pred = predict(run, costs_path, skip)
        log.info("[%d] %s: predicted %.3f s/step, %.2f samples/s, trainer idle %.2f; running ...", i + 1,
                 run["name"], pred["step_s"], pred["samples_per_s"], pred["trainer_idle"])
        run_dir = out / run["name"]
        series: list[tuple[float, float, float]] = []
        cpu = run_cli(run["config"], [*run["sets"], *run["common"]], run_dir, series_out=series)
        meas = {**measure(run_dir, skip, series), **cpu}
        err = {k: round(pred[k] / meas[k] - 1, 3) for k in ("step_s", "samples_per_s")}
        err["trainer_idle_abs"] = round(pred["trainer_idle"] - meas["trainer_idle"], 3)
        row = {"name": run["name"], "unseen": run["unseen"], "config": run["config"], "sets": run["sets"],
               "skip": skip, "measured": meas, "predicted": pred, "error": err}
        results.append(row)
        log.info("    measured %.3f s/step, %.2f samples/s, trainer idle %.2f (other CPU %.2f cores): "
                 "error s/step %+.0f%%, samples/s %+.0f%%", meas["step_s"], meas["samples_per_s"], meas["trainer_idle"],
                 meas["other_cores"], 100 * err["step_s"], 100 * err["samples_per_s"])
    print(table(results), file=sys.stderr)
    recorder.finish({
        "benchmark": "plan_validation",
        "calibration": {"command": profile_cmd, "seconds": round(profile_s, 1), "source": calibration["source"],
                        "costs": calibration},
        "common_sets": common_sets(args.steps),
        "runs": results,
        "samples_per_s_error": {r["name"]: r["error"]["samples_per_s"] for r in results},
        "abs_error_samples_per_s_median": round(statistics.median(abs(r["error"]["samples_per_s"]) for r in results), 3)
        if results else None,
    })


def table(results: list[dict[str, Any]]) -> str:
    """The results as the markdown table of docs/planning.md."""
    head = ("| unseen run | s/step measured / predicted | error | samples/s measured / predicted | error | "
            "trainer idle measured / predicted | mean lag measured / predicted | response length measured "
            "/ predicted generated | other CPU (cores) |\n|" + " --- |" * 9)
    lines = [head]
    for r in results:
        m, p, e = r["measured"], r["predicted"], r["error"]
        lines.append(
            f"| {r['unseen']} | {m['step_s']:.2f} / {p['step_s']:.2f} | {100 * e['step_s']:+.0f} % | "
            f"{m['samples_per_s']:.2f} / {p['samples_per_s']:.2f} | {100 * e['samples_per_s']:+.0f} % | "
            f"{m['trainer_idle']:.2f} / {p['trainer_idle']:.2f} | {m['mean_lag']:.2f} / {p['mean_lag']:.2f} | "
            f"{m['response_len_mean']:.0f} / {p['generated_len_mean']:.0f} | {m['other_cores']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
