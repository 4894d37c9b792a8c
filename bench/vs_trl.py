"""Time to a held-out accuracy target: our quickstart vs TRL's `GRPOTrainer`, same task.

Both contenders train the committed warm-started quickstart model
(areal_like/assets/quickstart_model) on the arithmetic task with the calculator tool
(the tool form; `--form single_turn` for the direct-answer form), 8 prompts x 8 samples
per step, grad clip 1, 48 response tokens (tool answer included), at most 2 assistant
turns, temperature 1 (configs/quickstart.yaml). Each at its own learning rate: ours as
shipped (4 optimizer mini-batches of lr 7.5e-5 per step), TRL one optimizer step per
batch at `--trl-lr` (3e-4, what our quickstart used with one mini-batch; TRL at 7.5e-5
learns slower). They run one after the other (alternating with --repeats) on the same
2 cores: ours as a user starts it (`areal-like run configs/quickstart.yaml`: its
launcher, rollout 1 thread + train 1 thread, eta = 2), TRL in one process with
`torch.set_num_threads(2)`.

Each contender saves its weights with a timestamp after every optimiser step. After
both runs, the same evaluator (not timed) measures held-out sampled accuracy (T = 1,
the quickstart's tool loop, `--eval-n` problems of the held-out split, one seed) of the
checkpoints in order; time to target = time from the command (the contender's process
start: imports, setup, model loading and training all count) to the first checkpoint
whose accuracy reaches `--target`; the same after each contender's imports is reported
beside it. A contender that never gets there is reported as "not reached" with its
best accuracy. Ours also reports its start-up breakdown and each pool's CPU cores used.

Other agents may share this machine: the CPU time that processes outside the
contender's process tree used during each run is recorded (total busy CPU from
/proc/stat minus the tree's, sampled every 0.5 s), with the load average.

Runs in `.venv-trl` (bench/setup_trl.sh, run first unless --no-setup; the script
re-executes itself there). Progress goes to stderr; the last stdout line is one JSON
object with `speedup_time_to_target_vs_trl` (TRL's time / ours).

    python bench/vs_trl.py [--target 0.9] [--repeats 1] [--form tool]
    python bench/vs_trl.py --smoke   # (or --quick) 2 steps each, the last evaluated on 8 problems

`--smoke` (tests/test_bench_smoke.py) never runs bench/setup_trl.sh: it runs our side for
real and, when `.venv-trl` is missing (the default test environment has none), only
compiles bench/_trl_contender.py and reports `"trl": "skipped: .venv-trl missing"` (or
`...not set up to the end` without setup_trl.sh's stamp) with no speedup. With `.venv-trl`
set up, the TRL side runs too (2 steps). The JSON line is bench/_record.py's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
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

# Run as a script, this folder is sys.path[0], and bench/weight_sync.py would shadow the
# `weight_sync` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
TRL_VENV = ROOT / ".venv-trl"
CONFIG = ROOT / "configs" / "quickstart.yaml"
log = logging.getLogger("bench.vs_trl")


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


def _run_logged(cmd: list[str], tag: str, env: dict[str, str], log_file: Path) -> tuple[int, dict[str, float], float]:
    """Run `cmd`, echoing its output to stderr with a tag, while accounting CPU."""
    t_launch = time.time()
    with log_file.open("w") as lf:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1)
        mon = CpuMonitor(proc.pid)
        assert proc.stdout is not None
        for line in proc.stdout:
            lf.write(line)
            if _interesting(line):
                print(f"[{tag}] {line.rstrip()}", file=sys.stderr, flush=True)
        rc = proc.wait()
        cpu = mon.stop()
    return rc, cpu, t_launch


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


def run_ours(out: Path, steps: int, form: str, extra: list[str] | None = None) -> dict[str, Any]:
    """The quickstart as a user starts it: `areal-like run configs/quickstart.yaml`."""
    d = out / "ours"
    d.mkdir(parents=True, exist_ok=True)
    run_dir = d / "run"
    sets = [
        f"run.dir={run_dir}",
        f"train.total_steps={steps}",
        "run.record_weights=true",
        "run.checkpoint_every_n_steps=1000000",  # TRL saves no resumable checkpoints either
        "eval.every_n_steps=0",  # the held-out evaluation is done afterwards, for both
        f"dataset.form={form}",
    ]
    if form == "single_turn":
        sets.append("agent.default_loop=single_turn")
    sets += extra or []
    cmd = [sys.executable, "-m", "areal_like.orchestration.cli", "run", str(CONFIG), "--overwrite"]
    for x in sets:
        cmd += ["--set", x]
    rc, cpu, t_launch = _run_logged(cmd, "ours", _contender_env(), d / "log.txt")
    if rc != 0:
        raise RuntimeError(f"our contender failed (rc {rc}); see {d / 'log.txt'}")
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    startup = next((r for r in recs if r["kind"] == "startup"), {})
    t0 = t_launch + float(startup.get("imports", 0.0))  # after its imports, as TRL's t0
    ckpts = []
    for r in recs:
        if r["kind"] == "train_step" and not r.get("skipped"):
            w = run_dir / "weights" / f"v{r['step']}" / "model.safetensors"
            if w.exists():
                ckpts.append({"step": r["step"], "time": r["time"], "path": str(w), "train_reward": r["reward_mean"]})
    cores = [(r.get("train_cores_used"), r.get("step")) for r in recs if r["kind"] == "train_step"]
    roll = [r.get("rollout_cores_used") for r in recs if r["kind"] == "rollout" and r.get("rollout_cores_used")]
    util = {"train_cores_used_mean": _mean([c for c, _ in cores if c is not None]),
            "rollout_cores_used_mean": _mean(roll)}
    return {"t0": t0, "t_launch": t_launch, "cpu": cpu, "ckpts": ckpts, "startup": startup, "utilisation": util,
            "steps_done": len(ckpts), "train_s": round(ckpts[-1]["time"] - t0, 1) if ckpts else None}


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 2) if xs else None


def run_trl(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    d = out / "trl"
    d.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(ROOT / "bench" / "_trl_contender.py"), "--out", str(d), "--form", args.form,
           "--max-steps", str(args.trl_max_steps), "--max-seconds", str(args.trl_max_seconds),
           "--threads", str(args.threads), "--config", str(CONFIG), "--lr", str(args.trl_lr)]
    if args.trl_stop_margin is not None:
        cmd += ["--stop-reward", str(min(1.0, args.target + args.trl_stop_margin)),
                "--extra-steps", str(args.trl_extra_steps)]
    rc, cpu, t_launch = _run_logged(cmd, "trl", _contender_env(args.threads), d / "log.txt")
    if rc != 0:
        raise RuntimeError(f"the TRL contender failed (rc {rc}); see {d / 'log.txt'}")
    recs = [json.loads(x) for x in (d / "steps.jsonl").read_text().splitlines() if x.strip()]
    t0 = next(r["time"] for r in recs if r["kind"] == "start")
    rewards = {r["step"]: r["reward"] for r in recs if r["kind"] == "log"}
    ckpts = [{"step": r["step"], "time": r["time"], "path": str(d / "ckpt" / f"step{r['step']}.safetensors"),
              "train_reward": rewards.get(r["step"])} for r in recs if r["kind"] == "step"]
    return {"t0": t0, "t_launch": t_launch, "cpu": cpu, "ckpts": ckpts,
            "steps_done": len(ckpts), "train_s": round(ckpts[-1]["time"] - t0, 1) if ckpts else None}


# ---------------------------------------------------------------------------------------
# the shared evaluator
# ---------------------------------------------------------------------------------------
class Evaluator:
    """Held-out sampled accuracy with the quickstart's episode rules, batched HF generate.

    Tool form: turn 1 is sampled; a hermes calculator call gets the calculator's answer
    as a tool message (template ids, like our loop), then turn 2 is sampled with what
    is left of the 48-token budget (observation included); the reward is ours on the
    last turn's text. Single-turn form: one turn. Same seed for every checkpoint."""

    def __init__(self, form: str, n: int, seed: int, threads: int) -> None:
        import torch
        from transformers import Qwen2ForCausalLM

        from areal_like.core.config import load_config
        from areal_like.models.tiny_model import load_tokenizer
        from areal_like.orchestration.dataset import load_rows
        from areal_like.orchestration.preflight import resolve_model_path
        from rollout_cluster.agent_loop.chat import ChatTemplate
        from rollout_cluster.tool_parser import HermesToolParser
        from rollout_cluster.tools.calculator import CalculatorTool

        torch.set_num_threads(threads)
        self.torch = torch
        cfg = load_config(str(CONFIG), [f"dataset.form={form}"])
        self.cfg = cfg
        self.form = form
        self.seed = seed
        path = resolve_model_path(cfg)
        self.tok = load_tokenizer(path)
        self.model = Qwen2ForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        self.base_state = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.chat = ChatTemplate(self.tok)
        self.parser = HermesToolParser()
        self.tools = [CalculatorTool("calculator").schema] if form == "tool" else None
        self.rows = load_rows(cfg.dataset, "eval", cfg.run.seed)[:n]
        self.prompts = [self.chat.prompt_ids(r["prompt"], tools=self.tools) for r in self.rows]
        self.budget = cfg.rollout.response_length
        self.eos = self.tok.eos_token_id
        self.pad = self.tok.pad_token_id

    def load(self, path: str | None) -> None:
        from safetensors.torch import load_file

        self.model.load_state_dict(self.base_state)
        if path is not None:
            sd = load_file(path)
            missing, unexpected = self.model.load_state_dict(sd, strict=False)
            if unexpected or any(k != "lm_head.weight" for k in missing):
                raise RuntimeError(f"{path}: missing {missing}, unexpected {unexpected}")
            if self.model.config.tie_word_embeddings:
                self.model.tie_weights()

    def _sample(self, seqs: list[list[int]], max_new: list[int]) -> list[list[int]]:
        """One turn per sequence: sampled tokens up to and including eos, at most max_new[i]."""
        torch = self.torch
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad, dtype=torch.long)
        att = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, width - len(s):] = torch.tensor(s)
            att[i, width - len(s):] = 1
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=att, do_sample=True, temperature=1.0, top_k=0,
                                      top_p=1.0, max_new_tokens=max(max_new), eos_token_id=self.eos,
                                      pad_token_id=self.pad)
        res = []
        for i, row in enumerate(out[:, width:].tolist()):
            row = row[: max_new[i]]
            if self.eos in row:
                row = row[: row.index(self.eos) + 1]
            res.append(row)
        return res

    def accuracy(self, path: str | None) -> float:
        from areal_like.tasks.arithmetic import arithmetic_reward, calculate

        self.load(path)
        self.torch.manual_seed(self.seed)
        n = len(self.rows)
        turn1 = self._sample(self.prompts, [self.budget] * n)
        finals: list[str] = []
        second: list[tuple[int, list[int], int]] = []
        for i, ids in enumerate(turn1):
            parsed = self.parser.parse(self.tok.decode(ids, skip_special_tokens=True))
            finals.append(parsed.content)
            stopped = bool(ids) and ids[-1] == self.eos
            if self.form != "tool" or not parsed.calls or not stopped or len(ids) >= self.budget:
                continue
            call = parsed.calls[0]
            if call.error is not None:
                text = f"Error: {call.error}"
            elif call.name != "calculator":
                text = f"Error: unknown tool {call.name!r}"
            else:
                try:
                    text = str(calculate(str(call.arguments.get("expression", ""))))
                except Exception as e:
                    text = f"Error: {e}"
            obs = self.chat.observation_ids([{"role": "tool", "content": text, "name": call.name or "calculator"}])
            if len(ids) + len(obs) >= self.budget:
                continue  # no room for another turn: the episode ends on the call
            second.append((i, self.prompts[i] + ids + obs, self.budget - len(ids) - len(obs)))
        if second:
            turn2 = self._sample([s for _, s, _ in second], [m for _, _, m in second])
            for (i, _, _), ids in zip(second, turn2, strict=True):
                finals[i] = self.parser.parse(self.tok.decode(ids, skip_special_tokens=True)).content
        hits = sum(arithmetic_reward(r, f) for r, f in zip(self.rows, finals, strict=True))
        return hits / n


def _other_cores(cpu: dict[str, Any], t_from: float, t_to: float) -> float | None:
    """Average cores other processes used between two times (from the monitor's samples)."""
    samples = cpu.get("samples") or []

    def at(t: float) -> tuple[float, float]:
        return min(samples, key=lambda s: abs(s[0] - t))

    if len(samples) < 2:
        return None
    (a_t, a_v), (b_t, b_v) = at(t_from), at(t_to)
    return round((b_v - a_v) / (b_t - a_t), 2) if b_t > a_t else None


def time_to_target(ev: Evaluator, run: dict[str, Any], target: float, stride: int, tag: str) -> dict[str, Any]:
    """Evaluate every `stride`-th checkpoint until one reaches `target`, then the ones
    before it back to the last miss; the first that reaches it is the answer."""
    ckpts = run["ckpts"]
    evaluated: dict[int, float] = {}

    def acc(k: int) -> float:
        if k not in evaluated:
            evaluated[k] = ev.accuracy(ckpts[k]["path"])
            c = ckpts[k]
            log.info("[eval %s] step %d (t=%.1fs): accuracy %.3f", tag, c["step"], c["time"] - run["t0"], evaluated[k])
        return evaluated[k]

    hit = None
    last_miss = -1
    idx = list(range(stride - 1, len(ckpts), stride))
    if ckpts and (not idx or idx[-1] != len(ckpts) - 1):
        idx.append(len(ckpts) - 1)
    for k in idx:
        if acc(k) >= target:
            hit = k
            break
        last_miss = k
    if hit is not None:
        for k in range(last_miss + 1, hit):
            if acc(k) >= target:
                hit = k
                break
    curve = [{"step": ckpts[k]["step"], "t_s": round(ckpts[k]["time"] - run["t0"], 1), "accuracy": round(a, 4)}
             for k, a in sorted(evaluated.items())]
    step_s = median_step_s(ckpts, hit)
    best = max(evaluated.values()) if evaluated else None
    out: dict[str, Any] = {
        "reached": hit is not None,
        "time_to_target_s": round(ckpts[hit]["time"] - run["t0"], 1) if hit is not None else "not reached",
        "time_to_target_from_launch_s": round(ckpts[hit]["time"] - run["t_launch"], 1) if hit is not None else None,
        "steps_to_target": ckpts[hit]["step"] if hit is not None else None,
        # setup cost: contender start to its first optimiser step (Ray, actors, model, first batch)
        "first_step_s": round(ckpts[0]["time"] - run["t0"], 1) if ckpts else None,
        # what other processes used while this contender was on its way to the target
        "other_processes_avg_cores_to_target": _other_cores(run["cpu"], run["t0"], ckpts[hit]["time"])
        if hit is not None else None,
        "best_accuracy": round(best, 4) if best is not None else None,
        # the step's cost: the median interval between optimiser steps up to the target
        "median_step_s_to_target": round(step_s, 3) if step_s is not None else None,
        "eval_curve": curve,
    }
    return out


def median_step_s(ckpts: list[dict[str, Any]], upto: int | None, warmup: int = 3) -> float | None:
    """The median seconds between consecutive optimiser steps (checkpoint timestamps), from
    step `warmup` (the first steps carry start-up: our servers' first batch, TRL's first
    generate) to the checkpoint at index `upto` (the target; None: every step). A short run
    (a smoke) skips no warm-up."""
    last = len(ckpts) - 1 if upto is None else upto
    first = warmup if last - warmup >= 2 else 0
    times = [c["time"] for c in ckpts[first:last + 1]]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return statistics.median(gaps) if gaps else None


# ---------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=float, default=0.9, help="held-out sampled accuracy to reach")
    ap.add_argument("--form", choices=["tool", "single_turn"], default="tool")
    ap.add_argument("--repeats", type=int, default=1, help="pairs of runs, order alternating")
    ap.add_argument("--first", choices=["ours", "trl"], default="ours", help="who runs first in the first pair")
    ap.add_argument("--ours-steps", type=int, default=60)
    ap.add_argument("--ours-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for our run (repeatable), to try a variant")
    ap.add_argument("--ours-only", action="store_true", help="run and evaluate ours only (no TRL, no speedup)")
    ap.add_argument("--trl-max-steps", type=int, default=200)
    ap.add_argument("--trl-max-seconds", type=float, default=1200.0)
    ap.add_argument("--trl-stop-margin", type=float, default=0.03,
                    help="TRL stops --trl-extra-steps after its last-5-step train reward reaches target+margin "
                         "(negative: never early)")
    ap.add_argument("--trl-extra-steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the TRL process (ours: 1 + 1)")
    ap.add_argument("--eval-n", type=int, default=256)
    ap.add_argument("--eval-stride", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="default: runs/vs_trl (--smoke: a temporary folder)")
    ap.add_argument("--no-setup", action="store_true", help="do not run bench/setup_trl.sh first")
    ap.add_argument("--trl-lr", type=float, default=3e-4,
                    help="TRL's learning rate: one optimizer step per batch wants the larger rate our "
                         "quickstart used before it took 4 mini-batches (7.5e-5 each); TRL at 7.5e-5 is slower")
    args, recorder = _record.parse(ap, __file__, smoke_aliases=("--quick",), smoke={
        "ours_steps": 2, "trl_max_steps": 2, "trl_max_seconds": 300.0, "eval_n": 8, "eval_stride": 2,
        "trl_stop_margin": -1.0, "repeats": 1})
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)

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
    pairs: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        order = ["ours", "trl"] if (rep % 2 == 0) == (args.first == "ours") else ["trl", "ours"]
        if args.ours_only:
            order = ["ours"]
        runs: dict[str, Any] = {}
        for who in order:
            d = out / f"rep{rep}"
            log.info("repeat %d: running %s (load average %.2f)", rep, who, os.getloadavg()[0])
            runs[who] = run_ours(d, args.ours_steps, args.form, args.ours_set) if who == "ours" else run_trl(d, args)
            log.info("repeat %d: %s done: %d steps in %ss; CPU %s", rep, who, runs[who]["steps_done"],
                     runs[who]["train_s"], {k: v for k, v in runs[who]["cpu"].items() if k != "samples"})
        pairs.append({"order": order, **runs})

    log.info("evaluating checkpoints (%d held-out problems, sampled T=1; not timed)", args.eval_n)
    ev = Evaluator(args.form, args.eval_n, args.seed, threads=2)
    base_acc = ev.accuracy(None)
    log.info("base model accuracy %.3f", base_acc)
    results = []
    for rep, p in enumerate(pairs):
        res: dict[str, Any] = {"order": p["order"]}
        for who in p["order"]:
            r = p[who]
            tt = time_to_target(ev, r, args.target, args.eval_stride, f"{who} rep{rep}")
            tr = [c["train_reward"] for c in r["ckpts"] if c["train_reward"] is not None]
            res[who] = {**tt, "steps_run": r["steps_done"], "train_s": r["train_s"],
                        "s_per_step": round(r["train_s"] / max(r["steps_done"], 1), 2) if r["train_s"] else None,
                        "train_reward_last5": round(sum(tr[-5:]) / len(tr[-5:]), 4) if tr else None,
                        "cpu": {k: v for k, v in r["cpu"].items() if k != "samples"}}
        res["ours"]["startup"] = p["ours"].get("startup")
        res["ours"]["utilisation"] = p["ours"].get("utilisation")
        if args.ours_only:
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
            trl_all = p["trl"]["ckpts"][-1]["time"] - p["trl"]["t_launch"] if p["trl"]["ckpts"] else 0.0
            res["speedup"] = f">{round(trl_all / o['time_to_target_from_launch_s'], 2)}"
        elif t["reached"]:
            ours_all = p["ours"]["ckpts"][-1]["time"] - p["ours"]["t_launch"] if p["ours"]["ckpts"] else 1e-9
            res["speedup"] = f"<{round(t['time_to_target_from_launch_s'] / ours_all, 2)}"
        else:
            res["speedup"] = None
        results.append(res)

    speedups = [r["speedup"] for r in results if isinstance(r["speedup"], float)]
    if speedups:
        headline: Any = round(statistics.median(speedups), 2)
    else:
        headline = next((r["speedup"] for r in results if r["speedup"] is not None), None)
    summary = {
        "benchmark": "vs_trl",
        "metric": f"wall time from the command to held-out sampled accuracy >= {args.target} "
                  f"({args.eval_n} problems, T=1)",
        "form": args.form,
        "target": args.target,
        "speedup_time_to_target_vs_trl": headline,
        "ours_time_to_target_from_command_s": [r["ours"]["time_to_target_from_launch_s"] for r in results],
        "trl_time_to_target_from_command_s": [r["trl"]["time_to_target_from_launch_s"] for r in results if "trl" in r],
        "ours_time_to_target_s": [r["ours"]["time_to_target_s"] for r in results],
        "trl_time_to_target_s": [r["trl"]["time_to_target_s"] for r in results if "trl" in r],
        # a step's cost up to the target (median seconds between optimiser steps, after 3 warm-up
        # steps), per repeat; the bar: ours <= TRL's, synchronous, on the same cores
        "ours_median_step_s": [r["ours"]["median_step_s_to_target"] for r in results],
        "trl_median_step_s": [r["trl"]["median_step_s_to_target"] for r in results if "trl" in r],
        "step_cost_ratio_ours_over_trl": _median_or_none([r.get("step_cost_ratio_ours_over_trl") for r in results]),
        "base_accuracy": round(base_acc, 4),
        "runs": results,
        "settings": {
            "prompts_per_step": 8, "samples_per_prompt": 8, "grad_clip": 1.0, "response_length": 48,
            "ours": "areal-like run configs/quickstart.yaml (lr 7.5e-5, 4 mini-batches), eta 2, rollout 1 thread + "
                    "train 1 thread",
            "ours_set": args.ours_set,
            "trl_lr": args.trl_lr,
            "trl_setup": f"GRPOTrainer, HF generate, {args.threads} torch threads, loss dapo, scale_rewards group, beta 0, "
                   "gradient_checkpointing off",
            "torch": torch.__version__, "trl_version": _trl_version(), "transformers": transformers.__version__,
            "cpu_count": os.cpu_count(),
        },
    }
    if trl_skipped:
        summary["trl"] = trl_skipped
    (out / "result.json").write_text(json.dumps(summary, indent=2))
    recorder.finish(summary)


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
