"""What a person sees while a run goes: one progress display for the CLI and the Python
API, quiet by default (docs/observability.md).

- `setup_console(verbose)`: the driver's console. Quiet: only our own WARNING/ERROR
  lines reach stderr (short, no pid prefixes); library warnings and INFO lines do not.
  Verbose: every INFO line, as before.
- `attach_run_log(run_dir)`: from then on every record of the driver also goes to
  `<run.dir>/run.log` (the worker processes append there too: `areal_like.core.logs`).
- `Progress`: the per-step line (step/total, trained and all-groups reward, last eval
  accuracy, version lag, steps/s, ETA), at most one a second plus the first, the last
  and each step with a new evaluation; plain text, so a piped or CI log stays readable;
  while no step comes, `waiting` says what the trainer waits for (every ~10 s).
- `eval_summary(run_dir)`: the line that tells the end: the last held-out evaluation (the
  one of the final version, which arrives after the last step's line), the first and the
  best, and whether the end is well under the best.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from areal_like.core.logs import OWN_LOGGERS, RunLogHandler, run_log_path

__all__ = ["Progress", "attach_run_log", "detach_run_log", "eval_summary", "final_evals", "setup_console"]

_CONSOLE = "areal_like_console"


class _OwnOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.split(".", 1)[0] in OWN_LOGGERS


def setup_console(verbose: bool = False) -> None:
    """The driver's stderr handler (replacing ours or basicConfig's, once per process)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "name", None) == _CONSOLE or isinstance(h, logging.StreamHandler) and \
                not isinstance(h, logging.FileHandler) and getattr(h, "stream", None) in (sys.stderr, sys.stdout):
            root.removeHandler(h)
    h = logging.StreamHandler(sys.stderr)
    h.set_name(_CONSOLE)
    if verbose:
        h.setLevel(logging.INFO)
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    else:
        h.setLevel(logging.WARNING)
        h.addFilter(_OwnOnly())
        h.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    root.addHandler(h)
    root.setLevel(min(root.level or logging.INFO, logging.INFO))
    logging.captureWarnings(True)  # library warnings become records: the file has them, the console not


def attach_run_log(run_dir: str | Path) -> Path:
    """Append every record of this process to the run's log file from now on."""
    path = run_log_path(run_dir)
    root = logging.getLogger()
    for h in root.handlers:
        if isinstance(h, logging.FileHandler) and Path(h.baseFilename) == path.resolve():
            return path
    try:
        fh = RunLogHandler(path, encoding="utf-8")
    except OSError as e:  # a full or read-only disk: the run reports it where it matters
        logging.getLogger(__name__).warning("cannot write %s (%s); log lines stay off the file", path, e)
        return path
    fh.setLevel(logging.INFO)
    fh.setFormatter(logging.Formatter("%(asctime)s driver %(levelname)s %(name)s: %(message)s"))
    root.addHandler(fh)
    return path


def detach_run_log(path: str | Path) -> None:
    """Stop writing this process's records to the run's log file (the run is over)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        if isinstance(h, logging.FileHandler) and Path(h.baseFilename) == Path(path).resolve():
            root.removeHandler(h)
            h.close()


class Progress:
    """`on_step` for `run_both`/`TrainerSide`: one readable line per step (rate-limited)."""

    def __init__(self, total_steps: int, stream: TextIO | None = None, every_s: float = 1.0) -> None:
        self.total = total_steps
        self.stream = stream or sys.stderr
        self.every_s = every_s
        self.t0: float | None = None
        self.first_step: int | None = None
        self._last = 0.0
        self._eval: tuple[int, float] | None = None

    def start(self, *, run_dir: str | Path, dashboard_url: str | None) -> None:
        if dashboard_url:
            self._print(f"dashboard: {dashboard_url}")
        self._print(f"run folder: {run_dir}   log: {run_log_path(run_dir)}")

    def __call__(self, rec: dict[str, Any]) -> None:
        now = time.time()
        step = int(rec["step"])
        if self.t0 is None:  # the rate counts from the first step (start-up is not a step)
            self.t0, self.first_step = now, step - 1
        new_eval = rec.get("eval_accuracy") is not None and (self._eval is None or
                                                            self._eval[0] != rec.get("eval_version"))
        if new_eval:
            self._eval = (rec.get("eval_version"), float(rec["eval_accuracy"]))
        last = step >= self.total
        if not (last or new_eval or step == (self.first_step or 0) + 1 or now - self._last >= self.every_s):
            return
        self._last = now
        done = step - (self.first_step or 0)
        rate = (done - 1) / (now - self.t0) if done > 1 and now > self.t0 else 0.0  # from the first step on
        eta = (self.total - step) / rate if rate > 0 else float("inf")
        parts = [f"step {step}/{self.total}", f"reward {rec['reward_mean']:.3f} trained"]
        if "reward_mean_all_groups" in rec:
            parts[-1] += f", {rec['reward_mean_all_groups']:.3f} all groups"
        if self._eval is not None:
            parts.append(f"eval {self._eval[1]:.3f}" + (f" @v{self._eval[0]}" if self._eval[0] is not None else ""))
        parts.append(f"lag≤{rec['max_version_lag']}")
        if rate > 0:
            parts.append(f"{rate:.2f} steps/s")
            parts.append("ETA " + _dur(eta))
        self._print("  ".join(parts))

    def waiting(self, line: str) -> None:
        """What the trainer waits for, when no step has been printed for a while (the
        controller calls it at most every ~10 s): a live run is never silent."""
        self._print(f"waiting for {line}")

    def _print(self, line: str) -> None:
        print(line, file=self.stream, flush=True)


def final_evals(run_dir: str | Path) -> list[dict[str, Any]]:
    """`[{"version", "accuracy"}, ...]` of the run's evaluations in version order, from the
    `eval` records of its `metrics.jsonl` (a resumed run's included: the file keeps the whole
    history); [] without any."""
    import json

    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    by_version: dict[int, float] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if '"eval"' not in line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("kind") == "eval" and isinstance(rec.get("version"), int) and "accuracy" in rec:
                by_version[rec["version"]] = float(rec["accuracy"])
    return [{"version": v, "accuracy": a} for v, a in sorted(by_version.items())]


def eval_summary(evals: list[dict[str, Any]], keep: float = 0.9) -> str | None:
    """`held-out accuracy 0.844 at v60, the last version (v0 0.125; best 0.859 at v50)`, and a
    warning clause when the last is under `keep` × the best; None without evaluations."""
    if not evals:
        return None
    last, first = evals[-1], evals[0]
    best = max(evals, key=lambda e: e["accuracy"])
    line = f"held-out accuracy {last['accuracy']:.3f} at v{last['version']}, the last evaluation"
    if len(evals) > 1:
        line += f" (v{first['version']} {first['accuracy']:.3f}; best {best['accuracy']:.3f} at v{best['version']})"
    if best["accuracy"] > 0 and last["accuracy"] < keep * best["accuracy"]:
        line += (f": the end is {best['accuracy'] - last['accuracy']:.3f} under the run's best; its checkpoint "
                 "may be the one to keep (run.dir/checkpoints)")
    return line


def _dur(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
