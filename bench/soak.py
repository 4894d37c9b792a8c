"""Soak benchmark: a long quickstart run, with the memory, open files and sockets of
every process of the run sampled over time. A manual benchmark, not CI (docs/design.md §9.19).

Launches `areal-like run CONFIG` in its own session with enough train steps to last
`--minutes`, samples every process of that session (and every descendant of the run,
Ray's raylet/GCS/workers included) every `--interval` seconds with psutil: RSS, open
file descriptors, sockets. After `--minutes` the run is stopped with SIGINT (Ctrl-C: the
CLI tears Ray and its sockets down); anything of the session still alive 90 s
later is killed and reported as leaked.

Writes `soak.csv`, `soak.png` and `soak.log` (the run's output) into the run folder,
prints progress, and ends with ONE JSON line: per-process RSS growth between the end of
warm-up and the end, fd / socket / process-count growth, and pass/fail against the
bound (RSS of every process that lived through the measured window flat within
`--max-growth`, default 10%; no growth in fds, sockets or processes).

    nice -n 10 python bench/soak.py --minutes 60 [--warmup-minutes 10] [--interval 10]
        [--config configs/quickstart.yaml] [--run-dir runs/soak] [--set KEY=VALUE ...]
    python bench/soak.py --summarise runs/soak/soak.csv [--warmup-minutes 10]
    python bench/soak.py --smoke   # 6 s sampled every 0.5 s, no warm-up, a temporary folder

The JSON line is bench/_record.py's (its `other_cores`: CPU of processes outside this
benchmark and the run it started).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _record  # noqa: E402

_WINDOW = 3
_FIELDS = ["t_s", "pid", "name", "rss", "fds", "sockets"]  # samples averaged (median / min) at each end of the measured window


def _label(p: psutil.Process) -> str:
    """A stable, readable name: Ray workers retitle themselves `ray::Class`."""
    try:
        cmd = p.cmdline()
    except (psutil.Error, OSError):
        cmd = []
    if cmd:
        first = cmd[0]
        if first.startswith("ray::"):  # `ray::Class.method` while a task runs: keep the class
            return first.split()[0].split(".")[0]
        base = os.path.basename(first)
        if base.startswith("python") and len(cmd) > 1:
            arg = next((c for c in cmd[1:] if not c.startswith("-")), cmd[1])
            return f"{base} {os.path.basename(arg)}"[:60]
        return base[:60]
    try:
        return p.name()
    except psutil.Error:
        return "?"


def _sockets(p: psutil.Process) -> tuple[int, int]:
    """(open fds, of which sockets). /proc on Linux; psutil elsewhere."""
    fd_dir = f"/proc/{p.pid}/fd"
    if os.path.isdir(fd_dir):
        fds = socks = 0
        try:
            names = os.listdir(fd_dir)
        except OSError:
            return p.num_fds(), 0
        for n in names:
            try:
                target = os.readlink(f"{fd_dir}/{n}")
            except OSError:
                continue
            fds += 1
            socks += target.startswith("socket:")
        return fds, socks
    return p.num_fds(), len(p.net_connections(kind="all"))


def _session_procs(root_pid: int, sid: int) -> list[psutil.Process]:
    found: dict[int, psutil.Process] = {}
    try:
        root = psutil.Process(root_pid)
        found[root.pid] = root
        for c in root.children(recursive=True):
            found[c.pid] = c
    except psutil.Error:
        pass
    for p in psutil.process_iter():
        if p.pid in found:
            continue
        try:
            if os.getsid(p.pid) == sid:
                found[p.pid] = p
        except OSError:
            continue
    return list(found.values())


def _sample(root_pid: int, sid: int, labels: dict[int, str]) -> list[dict]:
    rows = []
    for p in _session_procs(root_pid, sid):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            rss = p.memory_info().rss
            fds, socks = _sockets(p)
            labels[p.pid] = _label(p)  # Ray workers retitle themselves (ray::IDLE, then ray::Class)
        except (psutil.Error, OSError):
            continue
        rows.append({"pid": p.pid, "name": labels[p.pid], "rss": rss, "fds": fds, "sockets": socks})
    return rows


def _last_step(run_dir: Path) -> int:
    """The last train step in metrics.jsonl, read from its end (rollout reports are long and
    frequent: a slow trainer's last step can lie megabytes back)."""
    path = run_dir / "metrics.jsonl"
    step = 0
    window = 65536
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            while True:
                f.seek(max(0, size - window))
                for line in f.read().decode("utf-8", "replace").splitlines():
                    if '"train_step"' in line:
                        try:
                            step = max(step, int(json.loads(line).get("step", 0)))
                        except (ValueError, TypeError):
                            continue
                if step or window >= size:
                    return step
                window *= 4
    except OSError:
        pass
    return step


def _window(samples: list[tuple[float, list[dict]]], start: bool) -> list[list[dict]]:
    part = samples[:_WINDOW] if start else samples[-_WINDOW:]
    return [rows for _, rows in part]


def summarise(samples: list[tuple[float, list[dict]]], warmup_s: float, max_growth: float) -> dict:
    """Compare the first samples after warm-up with the last samples.

    RSS: median over the window, per process. fds/sockets: the minimum over the window
    (a leak raises the floor; a descriptor open for a moment during one sample does not).
    Only processes present in both windows are compared; processes that came or went are
    listed by name and the process count is compared too.
    """
    measured = [(t, rows) for t, rows in samples if t >= warmup_s]
    if len(measured) < 2 * _WINDOW:
        return {"error": f"only {len(measured)} samples after warm-up; run longer or sample more often",
                "pass": False}
    first, last = _window(measured, True), _window(measured, False)

    def per_pid(window: list[list[dict]]) -> dict[int, list[dict]]:
        out: dict[int, list[dict]] = {}
        for rows in window:
            for r in rows:
                out.setdefault(r["pid"], []).append(r)
        return out

    a, b = per_pid(first), per_pid(last)
    procs = []
    for pid in sorted(set(a) & set(b)):
        ra, rb = a[pid], b[pid]
        rss0 = statistics.median(r["rss"] for r in ra)
        rss1 = statistics.median(r["rss"] for r in rb)
        procs.append({
            "pid": pid, "name": rb[-1]["name"],
            "rss_start_mb": round(rss0 / 2**20, 1), "rss_end_mb": round(rss1 / 2**20, 1),
            "rss_growth": round((rss1 - rss0) / rss0, 4) if rss0 else 0.0,
            "fds_start": min(r["fds"] for r in ra), "fds_end": min(r["fds"] for r in rb),
            "sockets_start": min(r["sockets"] for r in ra), "sockets_end": min(r["sockets"] for r in rb),
        })
    gone = sorted({a[p][0]["name"] for p in set(a) - set(b)})
    new = sorted({b[p][0]["name"] for p in set(b) - set(a)})
    n0 = min(len(rows) for rows in first)
    n1 = min(len(rows) for rows in last)
    total = [sum(r["rss"] for r in rows) for rows in (first + last)]
    total0, total1 = statistics.median(total[:len(first)]), statistics.median(total[len(first):])
    fd_growth = sum(p["fds_end"] - p["fds_start"] for p in procs)
    sock_growth = sum(p["sockets_end"] - p["sockets_start"] for p in procs)
    worst = max(procs, key=lambda p: p["rss_growth"]) if procs else None
    ok = (bool(procs) and all(p["rss_growth"] <= max_growth for p in procs)
          and fd_growth <= 0 and sock_growth <= 0 and n1 <= n0)
    return {
        "measured_s": round(measured[-1][0] - measured[0][0], 1),
        "processes": procs,
        "max_rss_growth": worst["rss_growth"] if worst else None,
        "max_rss_growth_process": worst["name"] if worst else None,
        "total_rss_start_mb": round(total0 / 2**20, 1), "total_rss_end_mb": round(total1 / 2**20, 1),
        "total_rss_growth": round((total1 - total0) / total0, 4) if total0 else 0.0,
        "fd_growth": fd_growth, "socket_growth": sock_growth,
        "num_procs_start": n0, "num_procs_end": n1,
        "processes_gone": gone, "processes_new": new,
        "bound": max_growth, "pass": ok,
    }


def _plot(samples: list[tuple[float, list[dict]]], warmup_s: float, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[tuple[int, str], dict[str, list]] = {}
    names: dict[int, str] = {}
    for t, rows in samples:
        for r in rows:
            # one line per process, named as first seen once Ray has retitled it
            name = names.setdefault(r["pid"], r["name"].split(".")[0] if r["name"].startswith("ray::") else r["name"])
            if name == "ray::IDLE" and r["name"] != "ray::IDLE":
                name = names[r["pid"]] = r["name"].split(".")[0]
            s = series.setdefault((r["pid"], name), {"t": [], "rss": [], "fds": [], "sockets": []})
            s["t"].append(t / 60)
            s["rss"].append(r["rss"] / 2**20)
            s["fds"].append(r["fds"])
            s["sockets"].append(r["sockets"])
    # Readable legend: the processes with the most memory, the rest drawn thin and grey.
    ranked = sorted(series, key=lambda k: -max(series[k]["rss"]))
    top = set(ranked[:8])
    fig, axes = plt.subplots(3, 1, figsize=(11, 10), sharex=True)
    for key in ranked:
        s = series[key]
        kw = {"label": f"{key[1]} ({key[0]})", "lw": 1.4} if key in top else {"color": "0.75", "lw": 0.7}
        axes[0].plot(s["t"], s["rss"], **kw)
        axes[1].plot(s["t"], s["fds"], **kw)
        axes[2].plot(s["t"], s["sockets"], **kw)
    for ax, ylabel in zip(axes, ("RSS (MiB)", "open fds", "sockets"), strict=True):
        ax.axvline(warmup_s / 60, color="k", ls="--", lw=0.8)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes[0].set_title(title)
    axes[2].set_xlabel("minutes (dashed: end of warm-up)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _stop(proc: subprocess.Popen, sid: int, grace_s: float) -> list[str]:
    """Stop the run (SIGINT), wait, then kill whatever of its session is left. Returns the leaked."""
    if proc.poll() is None:
        # SIGINT, the Ctrl-C path: after ray.init the driver's SIGTERM handler is Ray's own
        # (it aborts the process without the CLI's teardown).
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    time.sleep(3)
    leaked = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                leaked.append(f"{_label(p)} ({p.pid})")
                p.kill()
        except (psutil.Error, OSError):
            continue
    return leaked


def load_csv(path: Path) -> list[tuple[float, list[dict]]]:
    by_t: dict[float, list[dict]] = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            by_t.setdefault(float(r["t_s"]), []).append({
                "pid": int(r["pid"]), "name": r["name"], "rss": int(r["rss"]),
                "fds": int(r["fds"]), "sockets": int(r["sockets"])})
    return sorted(by_t.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=60.0, help="run length (the documented target is 60)")
    ap.add_argument("--warmup-minutes", type=float, default=None,
                    help="excluded from the growth figures (default: 10, or a sixth of --minutes if shorter)")
    ap.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    ap.add_argument("--config", default="configs/quickstart.yaml")
    ap.add_argument("--run-dir", default=None, help="default: runs/soak (--smoke: in a temporary folder)")
    ap.add_argument("--max-growth", type=float, default=0.10, help="RSS growth bound per process")
    ap.add_argument("--steps", type=int, default=None,
                    help="train.total_steps (default: more than the run can reach in --minutes)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="extra --set KEY=VALUE")
    ap.add_argument("--summarise", metavar="CSV", default=None,
                    help="no run: summarise and plot an existing soak.csv (e.g. of a run cut short)")
    args, recorder = _record.parse(ap, __file__, smoke={"minutes": 0.1, "interval": 0.5, "warmup_minutes": 0.0})
    if args.run_dir is None:
        args.run_dir = str(_record.out_dir(None, "soak", True) / "soak") if args.smoke else "runs/soak"

    if args.summarise:
        path = Path(args.summarise)
        samples = load_csv(path)
        warmup = args.warmup_minutes * 60 if args.warmup_minutes is not None else min(600.0, samples[-1][0] / 6)
        result = {"bench": "soak", "csv": str(path), "duration_s": samples[-1][0], "warmup_s": warmup,
                  "samples": len(samples)}
        result.update(summarise(samples, warmup, args.max_growth))
        png = path.with_suffix(".png")
        _plot(samples, warmup, png, f"soak: {path.parent.name}, {samples[-1][0] / 60:.0f} min")
        result["png"] = str(png)
        recorder.finish(result)
        return

    duration = args.minutes * 60
    warmup = (args.warmup_minutes * 60 if args.warmup_minutes is not None
              else min(600.0, duration / 6))
    steps = args.steps or max(100, int(args.minutes * 60))  # > 1 step/s: the run outlasts --minutes
    run_dir = Path(args.run_dir).resolve()
    log_path = run_dir.parent / f".{run_dir.name}.soak.log"
    tmp_csv = run_dir.parent / f".{run_dir.name}.soak.csv"
    run_dir.parent.mkdir(parents=True, exist_ok=True)

    env = dict(os.environ)
    for k, v in (("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"), ("RAY_AUTH_MODE", "disabled"),
                 ("RAY_USAGE_STATS_ENABLED", "0")):
        env.setdefault(k, v)
    exe = Path(sys.executable).parent / "areal-like"
    cmd = [str(exe) if exe.exists() else "areal-like", "run", args.config, "--overwrite",
           "--set", f"run.dir={run_dir}", "--set", f"train.total_steps={steps}"]
    for kv in args.overrides:
        cmd += ["--set", kv]
    print(f"[soak] {' '.join(cmd)}", file=sys.stderr, flush=True)
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    sid = proc.pid  # start_new_session: the child leads its own session

    labels: dict[int, str] = {}
    samples: list[tuple[float, list[dict]]] = []
    # Streamed as it goes: a run cut short still leaves its samples (see --summarise).
    csv_file = open(tmp_csv, "w", newline="")
    writer = csv.DictWriter(csv_file, fieldnames=_FIELDS)
    writer.writeheader()
    t0 = time.monotonic()
    ended_early = False
    try:
        while True:
            t = time.monotonic() - t0
            if t >= duration:
                break
            if proc.poll() is not None:
                ended_early = True
                break
            rows = _sample(proc.pid, sid, labels)
            samples.append((t, rows))
            writer.writerows({"t_s": round(t, 1), **r} for r in rows)
            csv_file.flush()
            step = _last_step(run_dir)
            print(f"[soak] {t / 60:6.1f} min  step {step:5d}  procs {len(rows):3d}  "
                  f"rss {sum(r['rss'] for r in rows) / 2**20:8.1f} MiB  fds {sum(r['fds'] for r in rows):5d}  "
                  f"sockets {sum(r['sockets'] for r in rows):4d}", file=sys.stderr, flush=True)
            time.sleep(max(0.0, args.interval - (time.monotonic() - t0 - t)))
    except KeyboardInterrupt:
        print("[soak] interrupted: stopping the run", file=sys.stderr, flush=True)
    finally:
        leaked = _stop(proc, sid, grace_s=90)
        log.close()
        csv_file.close()

    final_step = _last_step(run_dir)
    result = {"bench": "soak", "config": args.config, "run_dir": str(run_dir),
              "minutes_target": args.minutes, "duration_s": round(samples[-1][0], 1) if samples else 0.0,
              "warmup_s": warmup, "interval_s": args.interval, "samples": len(samples),
              "train_steps": final_step, "run_exit_code": proc.returncode,
              "run_ended_early": ended_early, "leaked_after_stop": leaked}
    result.update(summarise(samples, warmup, args.max_growth))
    if leaked:
        result["pass"] = False

    out_dir = run_dir if run_dir.is_dir() else run_dir.parent
    csv_path, png_path = out_dir / "soak.csv", out_dir / "soak.png"
    os.replace(tmp_csv, csv_path)
    if run_dir.is_dir():
        os.replace(log_path, run_dir / "soak.log")
    if samples:
        _plot(samples, warmup, png_path,
              f"soak: {args.config}, {result['duration_s'] / 60:.0f} min, {final_step} steps")
    result["csv"], result["png"] = str(csv_path), str(png_path)
    recorder.finish(result)


if __name__ == "__main__":
    main()
