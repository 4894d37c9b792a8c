"""Time to a held-out accuracy target: ours vs TRL's `GRPOTrainer`, same model, task and batch.

Two workloads (`--workload`):

- `quickstart` (default): the committed warm-started quickstart model
  (areal_like/assets/quickstart_model) on the arithmetic task with the calculator tool (the
  tool form; `--form single_turn` for the direct-answer form), 8 prompts x 8 samples per
  step, grad clip 1, 48 response tokens (tool answer included), at most 2 assistant turns,
  temperature 1 (configs/quickstart.yaml). Ours as shipped (4 optimizer mini-batches of lr
  7.5e-5 per step), TRL one optimizer step per batch at `--trl-lr` (3e-4, what our
  quickstart used with one mini-batch; TRL at 7.5e-5 learns slower). Target 0.9 on 256
  held-out problems.
- `smollm2`: the real recipe (configs/smollm2.yaml; `areal-like model fetch
  smollm2-135m-instruct` first): SmolLM2-135M-Instruct, sums asked in words answered in its
  chat template, 4 prompts x 4 samples, 16 tokens, lr 2e-5 with a cosine schedule over 40
  steps for both (TRL's rate is the one our recipe was tuned to; `--trl-lr` to try
  another). Target 0.8 on the recipe's 64 held-out rows. Weights are saved every 2nd step
  by both (538 MB each: the disk holds no more), and evaluated and deleted after each run.

Both contenders stop early the same way (`--trl-stop-margin`, `--trl-extra-steps`): 10 steps
after the mean train reward of their last 5 steps reaches target + 0.03. TRL's callback does
it in its process; ours gets one SIGINT (an orderly stop) once its console's reward over all
groups does (its "trained" reward counts only the groups with a reward spread).

They run one after the other (alternating with --repeats) on the same 2 cores: ours as a
user starts it (`areal-like run CONFIG`: its launcher, rollout 1 thread + train 1 thread),
TRL in one process with `torch.set_num_threads(2)`.

Each contender saves its weights with a timestamp after every (`save_every`-th) optimiser
step. After each run, one evaluator (bench/_heldout.py, not timed) measures held-out
sampled accuracy of the checkpoints in order; time to target = time from the command (the
contender's process start: imports, setup, model loading and training all count) to the
first checkpoint whose accuracy reaches `--target`; the same after each contender's imports
is reported beside it. A contender that never gets there is reported as "not reached" with
its best accuracy. The step's cost is the median interval between optimiser steps up to
the target. Ours also reports its start-up breakdown and each pool's CPU cores used.

With --repeats N, TRL's seed (its data order and sampling) is --seed + the pair's index;
ours varies with its asynchronous timing, and the data (run.seed) and the evaluation stay
the same for both. The headline is the median over the pairs, a pair where TRL never
reached the target counted at its lower bound, one where ours never did as 0.

Other agents may share this machine: the CPU time that processes outside the
contender's process tree used during each run is recorded (total busy CPU from
/proc/stat minus the tree's, sampled every 0.5 s), with the load average.

Runs in `.venv-trl` (bench/setup_trl.sh, run first unless --no-setup; the script
re-executes itself there). Progress goes to stderr; the last stdout line is one JSON
object with `speedup_time_to_target_vs_trl` (TRL's time / ours).

    python bench/vs_trl.py [--target 0.9] [--repeats 1] [--form tool]
    python bench/vs_trl.py --workload smollm2 --repeats 3
    python bench/vs_trl.py --smoke   # (or --quick) 2 steps each, the last evaluated on 8 problems

`--smoke` (tests/test_bench_smoke.py) never runs bench/setup_trl.sh: it runs our side for
real and, when `.venv-trl` is missing (the default test environment has none), only
compiles bench/_trl_contender.py and reports `"trl": "skipped: .venv-trl missing"` (or
`...not set up to the end` without setup_trl.sh's stamp) with no speedup. With `.venv-trl`
set up, the TRL side runs too (2 steps). The smoke runs the quickstart workload, and with
`--workload smollm2` the recipe's settings on the quickstart model (no fetch needed). The
JSON line is bench/_record.py's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _record  # noqa: E402
from _heldout import Evaluator, time_to_target  # noqa: E402

# Run as a script, this folder is sys.path[0], and bench/weight_sync.py would shadow the
# `weight_sync` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
TRL_VENV = ROOT / ".venv-trl"
log = logging.getLogger("bench.vs_trl")
WORKLOADS: dict[str, dict[str, Any]] = {
    "quickstart": {"config": "configs/quickstart.yaml", "target": 0.9, "ours_steps": 60, "trl_max_steps": 200,
                   "trl_lr": 3e-4, "eval_n": 256, "eval_stride": 4, "save_every": 1},
    # eval_stride counts saved checkpoints (every 2nd step): each is evaluated until the target
    "smollm2": {"config": "configs/smollm2.yaml", "target": 0.8, "ours_steps": 40, "trl_max_steps": 40,
                "trl_lr": None, "eval_n": 64, "eval_stride": 1, "save_every": 2},
}
# The smoke of the real workload: its settings on the quickstart model (nothing to fetch).
SMOLLM2_SMOKE_SETS = ["model.path=areal_like/assets/quickstart_model", "rollout.max_prompt_len=160",
                      "rollout.engine.max_seq_len=256", "staleness.filter_uniform_groups=false"]


# ---------------------------------------------------------------------------------------
# environment
# ---------------------------------------------------------------------------------------
def _in_trl_venv() -> bool:
    return Path(sys.prefix).resolve() == TRL_VENV.resolve()


def _trl_venv_ready() -> bool:
    """Set up by bench/setup_trl.sh to the end (it writes its stamp last), for this
    pyproject.toml: the stamp is the script's own (a stale one lacks a new dependency)."""
    import hashlib

    stamp = TRL_VENV / ".setup_trl"
    if not ((TRL_VENV / "bin" / "python").exists() and stamp.is_file()):
        return False
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + (ROOT / "bench" / "setup_trl.sh").read_bytes())
    want = f"{digest.hexdigest()[:16]}-{os.environ.get('TRL_SPEC', 'trl==1.16.0')}"
    return stamp.read_text().strip() == want


def _reexec_in_trl_venv(argv: list[str], setup: bool) -> None:
    if _in_trl_venv():
        return
    if setup or not (TRL_VENV / "bin" / "python").exists():
        log.info("setting up %s (bench/setup_trl.sh)", TRL_VENV)
        subprocess.run(["bash", str(ROOT / "bench" / "setup_trl.sh")], check=True, stdout=sys.stderr)
    py = str(TRL_VENV / "bin" / "python")
    os.environ[_record.COMMAND_ENV] = _record.command()  # the command the user ran, not the re-exec
    os.execv(py, [py, str(Path(__file__).resolve()), *argv])


# ---------------------------------------------------------------------------------------
# CPU accounting
# ---------------------------------------------------------------------------------------
class CpuMonitor:
    """CPU seconds of one process tree vs the whole machine, sampled in a thread.

    A process's CPU time is read while it lives (every `every_s`), so a short-lived
    child loses at most one interval; the machine total comes from /proc/stat."""

    def __init__(self, root_pid: int, every_s: float = 0.5) -> None:
        import psutil

        self.psutil = psutil
        self.root = psutil.Process(root_pid)
        self.every_s = every_s
        self.seen: dict[tuple[int, float], float] = {}
        self.self_proc = psutil.Process()
        self.t0 = time.time()
        self.sys0 = self._busy()
        self.self0 = self._self_cpu()
        self.load0 = os.getloadavg()
        self.samples: list[tuple[float, float]] = [(self.t0, 0.0)]
        """(time, CPU seconds of other processes so far), one every sample."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _busy(self) -> float:
        t = self.psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)

    def _self_cpu(self) -> float:
        c = self.self_proc.cpu_times()
        return c.user + c.system

    def _sample(self) -> None:
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except self.psutil.NoSuchProcess:
            return
        for p in procs:
            try:
                c = p.cpu_times()
                key = (p.pid, p.create_time())
                self.seen[key] = max(self.seen.get(key, 0.0), c.user + c.system)
            except (self.psutil.NoSuchProcess, self.psutil.AccessDenied, self.psutil.ZombieProcess):
                continue
        other = self._busy() - self.sys0 - sum(self.seen.values()) - (self._self_cpu() - self.self0)
        self.samples.append((time.time(), max(0.0, other)))

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def stop(self) -> dict[str, float]:
        self._sample()
        self._stop.set()
        self._thread.join()
        wall = time.time() - self.t0
        total = self._busy() - self.sys0
        tree = sum(self.seen.values())
        harness = self._self_cpu() - self.self0
        other = max(0.0, total - tree - harness)
        return {
            "wall_s": round(wall, 1),
            "machine_busy_cpu_s": round(total, 1),
            "contender_cpu_s": round(tree, 1),
            "harness_cpu_s": round(harness, 1),
            "other_processes_cpu_s": round(other, 1),
            "other_processes_avg_cores": round(other / max(wall, 1e-9), 2),
            "loadavg_1m_start": round(self.load0[0], 2),
            "loadavg_1m_end": round(os.getloadavg()[0], 2),
            "samples": self.samples,
        }


def _run_logged(cmd: list[str], tag: str, env: dict[str, str], log_file: Path,
                stop: RewardStop | None = None) -> tuple[int, dict[str, float], float]:
    """Run `cmd`, echoing its output to stderr with a tag, while accounting CPU. With
    `stop`, the process gets one SIGINT (an orderly stop) once `stop` says so; its exit
    code 130 then counts as 0."""
    t_launch = time.time()
    interrupted = False
    with log_file.open("w") as lf:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1)
        mon = CpuMonitor(proc.pid)
        assert proc.stdout is not None
        for line in proc.stdout:
            lf.write(line)
            if _interesting(line):
                print(f"[{tag}] {line.rstrip()}", file=sys.stderr, flush=True)
            if stop is not None and not interrupted and stop.feed(line):
                print(f"[{tag}] {stop.why}: stopping it (SIGINT)", file=sys.stderr, flush=True)
                proc.send_signal(signal.SIGINT)
                interrupted = True
        rc = proc.wait()
        cpu = mon.stop()
    return (0 if interrupted and rc == 130 else rc), cpu, t_launch


class RewardStop:
    """TRL's early stop (bench/_trl_contender.py `--stop-reward`) applied to our console:
    once the mean reward over all groups of the last 5 steps reaches `reward`, the run
    goes `extra` more steps. Our train reward counts only the groups it trains on (those
    with a reward spread), so the console's "all groups" figure is the one TRL's matches."""

    STEP = re.compile(r"^step (\d+)/\d+\s+reward [\d.]+ trained, ([\d.]+) all groups")

    def __init__(self, reward: float, extra: int) -> None:
        self.reward, self.extra = reward, extra
        self.tail: list[float] = []
        self.stop_at: int | None = None
        self.why = ""

    def feed(self, line: str) -> bool:
        m = self.STEP.match(line.strip())
        if not m:
            return False
        step = int(m[1])
        self.tail = [*self.tail[-4:], float(m[2])]
        if self.stop_at is None and len(self.tail) == 5 and sum(self.tail) / 5 >= self.reward:
            self.stop_at = step + self.extra
            self.why = f"reward over all groups reached {self.reward} at step {step}; stopped at step {self.stop_at}"
        return self.stop_at is not None and step >= self.stop_at


def _interesting(line: str) -> bool:
    """Progress lines worth echoing (the contenders are chatty)."""
    s = line.strip()
    if not s or "Warning" in s or "warnings.warn" in s or s.startswith("{'"):
        return False
    return any(k in s for k in ("[trl]", "[ours]", "step", "Error", "error", "Traceback", "eval at", "done:"))


# ---------------------------------------------------------------------------------------
# contenders
# ---------------------------------------------------------------------------------------
def _contender_env(threads: int | None = None) -> dict[str, str]:
    from areal_like.orchestration.launch import ray_env

    env = {**os.environ, **ray_env(), "PYTHONUNBUFFERED": "1"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def _sets(args: argparse.Namespace) -> list[str]:
    """The overrides both contenders and the evaluator apply to the workload's config."""
    sets = [f"dataset.form={args.form}"] if args.workload == "quickstart" else []
    if args.form == "single_turn":
        sets.append("agent.default_loop=single_turn")
    if args.smoke and args.workload == "smollm2":
        sets += SMOLLM2_SMOKE_SETS
    return sets


def run_ours(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The workload as a user starts it: `areal-like run CONFIG`."""
    d = out / "ours"
    d.mkdir(parents=True, exist_ok=True)
    run_dir = d / "run"
    sets = [
        f"run.dir={run_dir}",
        f"train.total_steps={args.ours_steps}",
        "run.record_weights=true",
        f"run.record_weights_every={args.save_every}",
        "run.checkpoint_every_n_steps=1000000",  # TRL saves no resumable checkpoints either
        "eval.every_n_steps=0",  # the held-out evaluation is done afterwards, for both
        *_sets(args),
        *args.ours_set,
    ]
    cmd = [sys.executable, "-m", "areal_like.orchestration.cli", "run", str(args.config), "--overwrite"]
    for x in sets:
        cmd += ["--set", x]
    stop = (RewardStop(min(1.0, args.target + args.trl_stop_margin), args.trl_extra_steps)
            if args.trl_stop_margin is not None else None)
    rc, cpu, t_launch = _run_logged(cmd, "ours", _contender_env(), d / "log.txt", stop)
    if rc != 0:
        raise RuntimeError(f"our contender failed (rc {rc}); see {d / 'log.txt'}")
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    startup = next((r for r in recs if r["kind"] == "startup"), {})
    t0 = t_launch + float(startup.get("imports", 0.0))  # after its imports, as TRL's t0
    steps = [r for r in recs if r["kind"] == "train_step" and not r.get("skipped")]
    ckpts = []
    for r in steps:
        w = run_dir / "weights" / f"v{r['step']}" / "model.safetensors"
        if w.exists():
            ckpts.append({"step": r["step"], "time": r["time"], "path": str(w), "train_reward": r["reward_mean"]})
    cores = [r.get("train_cores_used") for r in steps]
    roll = [r.get("rollout_cores_used") for r in recs if r["kind"] == "rollout" and r.get("rollout_cores_used")]
    util = {"train_cores_used_mean": _mean([c for c in cores if c is not None]),
            "rollout_cores_used_mean": _mean(roll)}
    return {"t0": t0, "t_launch": t_launch, "cpu": cpu, "ckpts": ckpts, "startup": startup, "utilisation": util,
            "steps": [(r["step"], r["time"]) for r in steps], "rewards": [r["reward_mean"] for r in steps],
            "steps_done": len(steps), "train_s": round(steps[-1]["time"] - t0, 1) if steps else None,
            "weights": [run_dir / "weights", run_dir / "checkpoints", run_dir / "final"]}


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 2) if xs else None


def run_trl(out: Path, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    d = out / "trl"
    d.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(ROOT / "bench" / "_trl_contender.py"), "--out", str(d), "--seed", str(seed),
           "--max-steps", str(args.trl_max_steps), "--max-seconds", str(args.trl_max_seconds),
           "--threads", str(args.threads), "--config", str(args.config), "--save-every", str(args.save_every)]
    cmd += [x for kv in _sets(args) for x in ("--set", kv)]
    if args.trl_lr is not None:
        cmd += ["--lr", str(args.trl_lr)]
    if args.trl_stop_margin is not None:
        cmd += ["--stop-reward", str(min(1.0, args.target + args.trl_stop_margin)),
                "--extra-steps", str(args.trl_extra_steps)]
    rc, cpu, t_launch = _run_logged(cmd, "trl", _contender_env(args.threads), d / "log.txt")
    if rc != 0:
        raise RuntimeError(f"the TRL contender failed (rc {rc}); see {d / 'log.txt'}")
    recs = [json.loads(x) for x in (d / "steps.jsonl").read_text().splitlines() if x.strip()]
    t0 = next(r["time"] for r in recs if r["kind"] == "start")
    rewards = {r["step"]: r["reward"] for r in recs if r["kind"] == "log"}
    steps = [r for r in recs if r["kind"] == "step"]
    ckpts = [{"step": r["step"], "time": r["time"], "path": r["path"], "train_reward": rewards.get(r["step"])}
             for r in steps if r.get("path")]
    return {"t0": t0, "t_launch": t_launch, "cpu": cpu, "ckpts": ckpts, "steps": [(r["step"], r["time"]) for r in steps],
            "rewards": [rewards[r["step"]] for r in steps if r["step"] in rewards],
            "steps_done": len(steps), "train_s": round(steps[-1]["time"] - t0, 1) if steps else None,
            "weights": [d / "ckpt"]}


# ---------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="quickstart",
                    help="quickstart: the toy on the tool task; smollm2: the real recipe (configs/smollm2.yaml)")
    ap.add_argument("--target", type=float, default=None, help="held-out sampled accuracy to reach "
                    "(default: the workload's, 0.9 / 0.8)")
    ap.add_argument("--form", choices=["tool", "single_turn"], default="tool", help="the quickstart's form")
    ap.add_argument("--repeats", type=int, default=1, help="pairs of runs, order alternating")
    ap.add_argument("--first", choices=["ours", "trl"], default="ours", help="who runs first in the first pair")
    ap.add_argument("--ours-steps", type=int, default=None)
    ap.add_argument("--ours-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for our run (repeatable), to try a variant")
    ap.add_argument("--ours-only", action="store_true", help="run and evaluate ours only (no TRL, no speedup)")
    ap.add_argument("--trl-only", action="store_true", help="run and evaluate TRL only (no speedup)")
    ap.add_argument("--trl-max-steps", type=int, default=None)
    ap.add_argument("--trl-max-seconds", type=float, default=1200.0)
    ap.add_argument("--trl-stop-margin", type=float, default=0.03,
                    help="each contender stops --trl-extra-steps after its last-5-step train reward (ours: over all "
                         "groups) reaches target+margin (negative: never early)")
    ap.add_argument("--trl-extra-steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the TRL process (ours: 1 + 1)")
    ap.add_argument("--eval-n", type=int, default=None)
    ap.add_argument("--eval-stride", type=int, default=None, help="in saved checkpoints")
    ap.add_argument("--save-every", type=int, default=None, help="both contenders save every N-th step's weights")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="default: runs/vs_trl (--smoke: a temporary folder)")
    ap.add_argument("--no-setup", action="store_true", help="do not run bench/setup_trl.sh first")
    ap.add_argument("--trl-lr", type=float, default=None,
                    help="TRL's learning rate (quickstart: 3e-4, one optimizer step per batch wants the larger "
                         "rate our quickstart used before it took 4 mini-batches of 7.5e-5 each; smollm2: the "
                         "config's train.lr)")
    args, recorder = _record.parse(ap, __file__, smoke_aliases=("--quick",), smoke={
        "ours_steps": 2, "trl_max_steps": 2, "trl_max_seconds": 300.0, "eval_n": 8, "eval_stride": 2,
        "trl_stop_margin": -1.0, "repeats": 1})
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    for k, v in WORKLOADS[args.workload].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    args.config = ROOT / args.config

    trl_skipped = None
    if args.smoke and not args.ours_only and not _in_trl_venv() and not _trl_venv_ready():
        # No downloads in a smoke run: our side for real, the TRL side compiled only.
        contender = ROOT / "bench" / "_trl_contender.py"
        compile(contender.read_text(), str(contender), "exec")  # a SyntaxError fails the smoke run
        trl_skipped = ("skipped: .venv-trl missing" if not (TRL_VENV / "bin" / "python").exists()
                       else "skipped: .venv-trl not set up to the end (no .setup_trl stamp)")
        log.warning("smoke: %s (bench/setup_trl.sh sets it up); bench/_trl_contender.py compiles; "
                    "running ours only", TRL_VENV)
        args.ours_only = True
    elif not args.ours_only or not args.smoke:
        _reexec_in_trl_venv(sys.argv[1:], setup=not (args.no_setup or args.smoke))
    if args.trl_stop_margin is not None and args.trl_stop_margin < 0:
        args.trl_stop_margin = None

    import torch
    import transformers

    out = _record.out_dir(args.out, "vs_trl", args.smoke) if args.out or args.smoke else ROOT / "runs" / "vs_trl"
    out.mkdir(parents=True, exist_ok=True)
    ev = Evaluator(args.config, _sets(args), args.eval_n, args.seed, threads=2)
    base_acc = ev.accuracy(None)
    log.info("base model accuracy %.3f (%d held-out problems, sampled T=1)", base_acc, args.eval_n)
    results = []
    # TRL's own seed (data order and sampling) differs per pair: one fixed seed compared a single
    # TRL draw with our spread, which varies with asynchronous timing. The data (run.seed) and the
    # evaluation's seed stay the same for both.
    trl_seeds = [args.seed + rep for rep in range(args.repeats)]
    for rep in range(args.repeats):
        order = ["ours", "trl"] if (rep % 2 == 0) == (args.first == "ours") else ["trl", "ours"]
        if args.ours_only or args.trl_only:
            order = ["ours"] if args.ours_only else ["trl"]
        res: dict[str, Any] = {"order": order}
        runs: dict[str, dict[str, Any]] = {}
        for who in order:
            log.info("repeat %d: running %s (load average %.2f)", rep, who, os.getloadavg()[0])
            r = runs[who] = (run_ours(out / f"rep{rep}", args) if who == "ours"
                             else run_trl(out / f"rep{rep}", args, trl_seeds[rep]))
            log.info("repeat %d: %s done: %d steps in %ss; CPU %s", rep, who, r["steps_done"],
                     r["train_s"], {k: v for k, v in r["cpu"].items() if k != "samples"})
            # evaluated now (not timed), then the weights go: at 135M they would fill the disk
            tt = time_to_target(ev, r, args.target, args.eval_stride, f"{who} rep{rep}")
            for w in r["weights"]:  # the run's records stay
                shutil.rmtree(w, ignore_errors=True)
            tr = r["rewards"]
            res[who] = {**tt, "steps_run": r["steps_done"], "train_s": r["train_s"],
                        "s_per_step": round(r["train_s"] / max(r["steps_done"], 1), 2) if r["train_s"] else None,
                        "train_reward_last5": round(sum(tr[-5:]) / len(tr[-5:]), 4) if tr else None,
                        "cpu": {k: v for k, v in r["cpu"].items() if k != "samples"}}
            if who == "ours":
                res[who]["startup"], res[who]["utilisation"] = r.get("startup"), r.get("utilisation")
        if args.ours_only or args.trl_only:
            res["speedup"] = None
            results.append(res)
            continue
        o, t = res["ours"], res["trl"]
        if o["median_step_s_to_target"] and t["median_step_s_to_target"]:
            res["step_cost_ratio_ours_over_trl"] = round(o["median_step_s_to_target"] / t["median_step_s_to_target"], 3)
        if o["reached"] and t["reached"]:  # from the command: imports, start-up and training all count
            res["speedup"] = round(t["time_to_target_from_launch_s"] / o["time_to_target_from_launch_s"], 2)
            res["speedup_after_imports"] = round(t["time_to_target_s"] / o["time_to_target_s"], 2)
        elif o["reached"]:
            # TRL never got there: its whole run is a lower bound on its time to target
            trl_all = runs["trl"]["ckpts"][-1]["time"] - runs["trl"]["t_launch"] if runs["trl"]["ckpts"] else 0.0
            res["speedup"] = f">{round(trl_all / o['time_to_target_from_launch_s'], 2)}"
        elif t["reached"]:
            ours_all = runs["ours"]["ckpts"][-1]["time"] - runs["ours"]["t_launch"] if runs["ours"]["ckpts"] else 1e-9
            res["speedup"] = f"<{round(t['time_to_target_from_launch_s'] / ours_all, 2)}"
        else:
            res["speedup"] = None
        results.append(res)

    headline = _median_speedup([r["speedup"] for r in results if not (args.ours_only or args.trl_only)])
    summary = {
        "benchmark": "vs_trl",
        "metric": f"wall time from the command to held-out sampled accuracy >= {args.target} "
                  f"({args.eval_n} problems, T=1)",
        "workload": args.workload,
        "form": args.form if args.workload == "quickstart" else ev.form,
        "target": args.target,
        "speedup_time_to_target_vs_trl": headline,
        "ours_time_to_target_from_command_s": [r["ours"]["time_to_target_from_launch_s"] for r in results if "ours" in r],
        "trl_time_to_target_from_command_s": [r["trl"]["time_to_target_from_launch_s"] for r in results if "trl" in r],
        "ours_time_to_target_s": [r["ours"]["time_to_target_s"] for r in results if "ours" in r],
        "trl_time_to_target_s": [r["trl"]["time_to_target_s"] for r in results if "trl" in r],
        # a step's cost up to the target (median seconds between optimiser steps, after 3 warm-up
        # steps), per repeat; the bar: ours <= TRL's, synchronous, on the same cores
        "ours_median_step_s": [r["ours"]["median_step_s_to_target"] for r in results if "ours" in r],
        "trl_median_step_s": [r["trl"]["median_step_s_to_target"] for r in results if "trl" in r],
        "step_cost_ratio_ours_over_trl": _median_or_none([r.get("step_cost_ratio_ours_over_trl") for r in results]),
        "base_accuracy": round(base_acc, 4),
        "runs": results,
        "settings": {
            **ev.settings,
            "ours": f"areal-like run {args.config.relative_to(ROOT)} (lr {ev.cfg.train.lr}, "
                    f"{ev.cfg.train.mini_batches} mini-batches, {ev.cfg.train.lr_schedule}), "
                    f"eta {ev.cfg.staleness.max_staleness}, rollout 1 thread + train 1 thread",
            "ours_set": args.ours_set,
            "trl_lr": args.trl_lr if args.trl_lr is not None else ev.cfg.train.lr,
            "trl_seeds": trl_seeds,
            "save_every": args.save_every,
            "trl_setup": f"GRPOTrainer, HF generate, {args.threads} torch threads, loss dapo, scale_rewards group, beta 0, "
                   f"mask_truncated_completions {ev.cfg.train.loss.mask_truncated}, gradient_checkpointing off",
            "torch": torch.__version__, "trl_version": _trl_version(), "transformers": transformers.__version__,
            "cpu_count": os.cpu_count(),
        },
    }
    if trl_skipped:
        summary["trl"] = trl_skipped
    (out / "result.json").write_text(json.dumps(summary, indent=2))
    recorder.finish(summary)


def _median_speedup(speedups: list[float | str | None]) -> float | str | None:
    """The median over the pairs, each counted against us where a contender missed the target:
    ">x" (TRL never reached it) as x, a lower bound; "<x" or None (ours never did) as 0. With
    no pair where both ran, the first bound there is."""
    if not any(isinstance(s, float) for s in speedups):
        return next((s for s in speedups if s is not None), None)
    vals = [s if isinstance(s, float) else float(s[1:]) if isinstance(s, str) and s[0] == ">" else 0.0
            for s in speedups]
    return round(statistics.median(vals), 2)


def _median_or_none(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return round(statistics.median(vals), 3) if vals else None


def _trl_version() -> str | None:
    try:
        import trl
    except ImportError:
        return None
    return trl.__version__


def r_train(run: dict[str, Any]) -> float:
    return float(run["train_s"] or 0.0)


if __name__ == "__main__":
    main()
