"""What every benchmark's last JSON line carries, and where real runs keep it (#29).

Each benchmark in `bench/` parses its command line with
`args, rec = parse(ap, __file__, smoke={...})` and ends with `rec.finish(result)` instead
of printing its result itself:

- `--smoke`: the same code path at tiny sizes (the `smoke` defaults; flags given on the
  command line still win), a few seconds; run by `tests/test_bench_smoke.py` for every
  script here, so a benchmark that stops working fails the default test suite. A smoke
  run writes only to temporary folders and records nothing.
- `--no-record`: a real run that is not appended to `bench/results/<name>.jsonl`.

`finish` adds to the result: `smoke`, `command` (the command line as run), `commit` (git
short hash, `-dirty` when tracked files other than `bench/results/` and `docs/` differ
from it), `date` (UTC, ISO 8601, when the benchmark started), `bench_s` (its wall time), and
`other_cores` / `own_cores`: CPU seconds per wall second used by processes outside /
inside this benchmark's process tree while it ran (`_runs.CpuMonitor`), out of
`cpu_count`. It prints the result as one JSON line on stdout and, for a real run, appends
the same line to `bench/results/<name>.jsonl`, which `scripts/bench_table.py` turns into
the summary table of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _runs import CpuMonitor  # noqa: E402

sys.path.pop(0)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
COMMAND_ENV = "AREAL_BENCH_COMMAND"
"""Set by a benchmark that re-executes itself (vs_trl.py into .venv-trl): the command the user ran."""


def parse(ap: argparse.ArgumentParser, script: str, smoke: dict[str, Any],
          argv: list[str] | None = None, smoke_aliases: tuple[str, ...] = ()) -> tuple[argparse.Namespace, Recorder]:
    """Add --smoke and --no-record to `ap`, parse, and apply the `smoke` defaults under --smoke."""
    ap.add_argument("--smoke", *smoke_aliases, action="store_true",
                    help="tiny sizes, a few seconds, the same code path: checks that the benchmark runs "
                         "(tests/test_bench_smoke.py); writes to temporary folders only, records nothing")
    ap.add_argument("--no-record", action="store_true",
                    help=f"do not append the result line to bench/results/{Path(script).stem}.jsonl")
    args = ap.parse_args(argv)
    if args.smoke:
        ap.set_defaults(**smoke)
        args = ap.parse_args(argv)
    return args, Recorder(script, smoke=args.smoke, record=not (args.smoke or args.no_record))


SMOKE_DIR_ENV = "AREAL_BENCH_SMOKE_DIR"
"""Where smoke runs put their files (tests/test_bench_smoke.py sets it to pytest's tmp_path);
unset, a temporary folder removed at exit."""


def out_dir(given: str | None, name: str, smoke: bool) -> Path:
    """A benchmark's output folder: `given` (--out), else `runs/bench_<name>` for a real run,
    else a fresh temporary folder for a smoke run (never inside the repository)."""
    if given is not None:
        return Path(given)
    if not smoke:
        return ROOT / "runs" / f"bench_{name}"
    parent = os.environ.get(SMOKE_DIR_ENV)
    if parent:
        Path(parent).mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"{name}_", dir=parent))
    d = tempfile.mkdtemp(prefix=f"bench_smoke_{name}_")
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    return Path(d)


def command() -> str:
    """The command line as run: `python bench/NAME.py ARGS` (the interpreter named by path
    only when it is not the repository's .venv, e.g. `.venv-vllm/bin/python`)."""
    if os.environ.get(COMMAND_ENV):
        return os.environ[COMMAND_ENV]
    exe = "python"
    prefix = Path(sys.prefix).resolve()
    if prefix != (ROOT / ".venv").resolve() and prefix.is_relative_to(ROOT):
        exe = os.path.relpath(sys.executable, ROOT)
    script = Path(sys.argv[0]).resolve()
    shown = str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else sys.argv[0]
    return shlex.join([exe, shown, *sys.argv[1:]])


def commit() -> str:
    """git short hash of HEAD, `-dirty` if tracked code differs from it (results and docs excepted)."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no", "--",
                                ".", ":(exclude)bench/results", ":(exclude)docs"], capture_output=True, text=True,
                               timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


RECORD_KEYS = {"smoke", "command", "commit", "date", "bench_s", "other_cores", "own_cores", "cpu_count"}


class Recorder:
    """Started when the arguments are parsed; `finish` ends the benchmark's output."""

    def __init__(self, script: str, *, smoke: bool, record: bool) -> None:
        self.name = Path(script).stem
        self.smoke, self.record = smoke, record
        self.command = command()
        self.commit = commit()
        self.date = datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat()
        self.t0 = time.time()
        self.monitor = CpuMonitor(root_pid=os.getpid(), interval_s=0.5).__enter__()
        self.finished = False

    def finish(self, result: dict[str, Any]) -> dict[str, Any]:
        """Add the record's fields to `result`, print it as the last stdout line, keep it."""
        self.monitor.__exit__(None, None, None)
        if self.finished:
            raise RuntimeError("finish() called twice")
        self.finished = True
        clash = sorted(set(result) & RECORD_KEYS)
        if clash:
            raise ValueError(f"the result of bench/{self.name}.py has keys the record adds: {clash}")
        out = {
            **result,
            "smoke": self.smoke,
            "command": self.command,
            "commit": self.commit,
            "date": self.date,
            "bench_s": round(time.time() - self.t0, 1),
            **self.monitor.result(),
            "cpu_count": os.cpu_count(),
        }
        line = json.dumps(out)
        if self.record:
            RESULTS.mkdir(parents=True, exist_ok=True)
            with open(RESULTS / f"{self.name}.jsonl", "a") as f:
                f.write(line + "\n")
            print(f"recorded in {(RESULTS / f'{self.name}.jsonl').relative_to(ROOT)} "
                  "(scripts/bench_table.py updates docs/benchmarks.md)", file=sys.stderr, flush=True)
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
        return out
