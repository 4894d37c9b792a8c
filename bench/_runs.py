"""Shared by the run-level benchmarks: launch one `areal-like run` in its own session,
watch the CPU that *other* processes use meanwhile, and summarise its metrics.

Each contender runs as a fresh `python -m areal_like.orchestration.cli run ...` (its own Ray, its
own engines), so runs cannot leak state into each other. The machines these run on
are shared: a background process halves throughput on 2 cores. `CpuMonitor` samples
every second the busy CPU time of the whole machine and of the run's own session
(the CLI and every process it started, Ray's included) and reports the difference
as the cores other processes took. `CpuMonitor(root_pid=...)` counts a process tree
instead (the process, its descendants and the sessions they lead): what `bench/_record.py`
uses for the whole benchmark.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def _busy(t: Any) -> float:
    return t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


class CpuMonitor:
    """Cores used by processes outside session `sid` (and their own cores), sampled each second.

    With `root_pid` instead of `sid`, "own" is that process, its descendants, and every
    process in a session one of those descendants leads (a daemon that re-parented itself
    stays in its session); everything else on the machine is "other".
    """

    def __init__(self, sid: int | None = None, interval_s: float = 1.0, *, root_pid: int | None = None) -> None:
        if (sid is None) == (root_pid is None):
            raise ValueError("CpuMonitor needs exactly one of sid and root_pid")
        self.sid, self.root_pid, self.interval_s = sid, root_pid, interval_s
        self._cpu: dict[Any, Any] = {}
        self._sids: set[int] = set()
        self._gone_s = 0.0
        self._stop = threading.Event()
        self.other_s = 0.0
        self.own_s = 0.0
        self.wall_s = 0.0
        self.series: list[tuple[float, float, float]] = []
        """(UNIX time, own CPU seconds so far, other CPU seconds so far) after each sample:
        `cores_between` reads a window of it (a run's steady state, not its start-up)."""
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _own(self) -> float:
        """CPU seconds of our processes so far. Each process counts itself and the children it
        reaped (`children_*`); a process that is gone keeps its last reading unless its
        parent is still ours (then its time is in the parent's `children_*`)."""
        procs = self._session() if self.root_pid is None else self._tree()
        live: set[Any] = set()
        for p in procs.values():
            try:
                with p.oneshot():
                    t, key, ppid = p.cpu_times(), (p.pid, p.create_time()), p.ppid()
            except (psutil.Error, ProcessLookupError, PermissionError):
                continue
            live.add(key)
            total = t.user + t.system + t.children_user + t.children_system
            self._cpu[key] = (max(self._cpu.get(key, (0.0, 0))[0], total), ppid)
        live_pids = {k[0] for k in live}
        for key in [k for k in self._cpu if k not in live]:
            value, ppid = self._cpu.pop(key)
            if ppid not in live_pids:  # re-parented or reaped by someone else: keep its time
                self._gone_s += value
        return self._gone_s + sum(v for v, _ in self._cpu.values())

    def _session(self) -> dict[int, psutil.Process]:
        return {p.pid: p for p in psutil.process_iter(["pid"]) if _sid(p.pid) == self.sid}

    def _tree(self) -> dict[int, psutil.Process]:
        assert self.root_pid is not None
        procs: dict[int, psutil.Process] = {}
        try:
            root = psutil.Process(self.root_pid)
            procs[root.pid] = root
            for c in root.children(recursive=True):
                procs[c.pid] = c
        except psutil.Error:
            pass
        for p in procs.values():
            if _sid(p.pid) == p.pid:  # it leads a session (the root's own, if it leads one)
                self._sids.add(p.pid)
        if self._sids:
            for p in psutil.process_iter(["pid"]):
                if p.pid not in procs and _sid(p.pid) in self._sids:
                    procs[p.pid] = p
        return procs

    def _loop(self) -> None:
        t0, sys0, own0 = time.time(), _busy(psutil.cpu_times()), self._own()
        stopping = False
        while not stopping:
            stopping = self._stop.wait(self.interval_s)  # the last round covers the part interval
            t1, sys1, own1 = time.time(), _busy(psutil.cpu_times()), self._own()
            d_own = max(0.0, own1 - own0)
            self.own_s += d_own
            self.other_s += max(0.0, (sys1 - sys0) - d_own)
            self.wall_s += t1 - t0
            self.series.append((t1, self.own_s, self.other_s))
            t0, sys0, own0 = t1, sys1, own1

    def __enter__(self) -> CpuMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def result(self) -> dict[str, float]:
        w = max(self.wall_s, 1e-9)
        return {"other_cores": round(self.other_s / w, 3), "own_cores": round(self.own_s / w, 3)}


def cores_between(series: list[tuple[float, float, float]], t0: float, t1: float) -> dict[str, float] | None:
    """Own and other cores between UNIX times `t0` and `t1` from a `CpuMonitor.series`
    (the samples nearest inside the window; None when fewer than two fall in it)."""
    inside = [x for x in series if t0 <= x[0] <= t1]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    (a, own_a, oth_a), (b, own_b, oth_b) = inside[0], inside[-1]
    return {"own_cores": round((own_b - own_a) / (b - a), 3), "other_cores": round((oth_b - oth_a) / (b - a), 3)}


def run_cli(config: str, sets: list[str], run_dir: Path, *, env: dict[str, str] | None = None,
            timeout_s: float = 1800, log: Any = None,
            series_out: list[tuple[float, float, float]] | None = None,
            watch: Callable[[int], AbstractContextManager[Any]] | None = None) -> dict[str, float]:
    """`areal-like run CONFIG --set ...` in a new session; returns the CPU monitor's result
    (and extends `series_out` with its samples, `CpuMonitor.series`, when given). `watch`,
    given the CLI's pid, makes a context held while the run runs (a sampler of its processes).

    Raises RuntimeError with the tail of the output when the run fails.
    """
    args = [sys.executable, "-m", "areal_like.orchestration.cli", "run", config, "--overwrite"]
    for s in [*sets, f"run.dir={run_dir}"]:
        args += ["--set", s]
    full_env = {**os.environ, **RAY_ENV, **(env or {})}
    out_path = run_dir.parent / f"{run_dir.name}.log"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "w") as out:
        p = subprocess.Popen(args, cwd=ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)
        with CpuMonitor(p.pid) as mon, (watch(p.pid) if watch is not None else nullcontext()):
            try:
                rc = p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 15)
                p.wait()
                rc = -1
    if series_out is not None:
        series_out.extend(mon.series)
    if rc != 0:
        tail = out_path.read_text()[-3000:]
        raise RuntimeError(f"run {run_dir} failed (exit {rc}); log {out_path}:\n{tail}")
    return mon.result()


_BURN = """
import sys, time
share, period = float(sys.argv[1]), float(sys.argv[2])
while True:  # busy for share x period of CPU time, then idle for the rest of the period
    t, c = time.perf_counter(), time.process_time()
    while time.process_time() - c < share * period:
        pass
    time.sleep(max(0.0, period - (time.perf_counter() - t)))
"""


@contextmanager
def background_load(cores: float, *, bursty: bool = False) -> Iterator[None]:
    """A known load while inside: processes that keep `cores` cores busy in all (each
    busy a share of every 50 ms, at most one core each); nothing for 0. `bursty`: one
    process, a whole core for 0.5 s, then nothing for 0.5 s (`cores` is ignored)."""
    if bursty:
        loads = [(0.5, 1.0)]
    else:
        n = math.ceil(cores) if cores > 0 else 0
        loads = [(cores / n, 0.05)] * n if n else []
    procs = []
    try:
        for share, period in loads:
            procs.append(subprocess.Popen([sys.executable, "-c", _BURN, str(share), str(period)],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def summarise(run_dir: Path, *, skip_steps: int = 2, tail_steps: int = 5,
              series: list[tuple[float, float, float]] | None = None) -> dict[str, Any]:
    """Throughput after warm-up, wall time to the last step, reward at the end, phase times;
    with the run's `CpuMonitor.series`, also the cores it and others used over the same
    steps (`steady_own_cores`, `steady_other_cores`: start-up and the final eval left out)."""
    recs = records(run_dir)
    steps = [r for r in recs if r["kind"] == "train_step" and not r.get("skipped")]
    evals = [r for r in recs if r["kind"] == "eval"]
    summary = next((r for r in reversed(recs) if r["kind"] == "summary"), {})
    t_start = recs[0]["time"]
    warm = steps[skip_steps:] if len(steps) > skip_steps + 1 else steps
    t_warm0 = steps[skip_steps - 1]["time"] if len(steps) > skip_steps + 1 and skip_steps > 0 else t_start
    samples = sum(r["samples"] for r in warm)
    wall_warm = warm[-1]["time"] - t_warm0
    tail = steps[-min(tail_steps, len(steps)):]
    # Per-step phases: T = training + publishing the weights; R = the rest of the gap
    # between steps (waiting for the batch: the rollout phase when η = 0).
    gaps, trains = [], []
    prev = t_warm0
    for r in warm:
        t = r.get("step_time_s", 0.0) + r.get("weight_sync_s", 0.0)  # step_time_s includes prox
        gaps.append(r["time"] - prev)
        trains.append(t)
        prev = r["time"]
    rollouts = [max(0.0, g - t) for g, t in zip(gaps, trains, strict=True)]
    return {
        "steps": len(steps),
        "wall_s": round(steps[-1]["time"] - t_start, 2),
        "samples_per_s": round(samples / max(wall_warm, 1e-9), 3),
        "final_reward": round(statistics.mean(r["reward_mean"] for r in tail), 4),
        "eval_accuracy": evals[-1].get("accuracy") if evals else None,
        "max_version_lag": max(r["max_version_lag"] for r in steps),
        "mean_version_lag": round(statistics.mean(r["mean_version_lag"] for r in warm), 3),
        "response_len_mean": round(statistics.mean(r["response_len_mean"] for r in warm), 1),
        "train_phase_s": round(statistics.median(trains), 3),
        "rollout_phase_s": round(statistics.median(rollouts), 3),
        "trainer_idle_ratio": round(steps[-1].get("trainer_idle_ratio", 0.0), 3),
        "counts_add_up": summary.get("counts_add_up"),
        **({f"steady_{k}": v for k, v in (cores_between(series, t_warm0, warm[-1]["time"]) or {}).items()}
           if series is not None else {}),
    }
