"""Where log lines go, in every process of a run (docs/observability.md).

Quiet by default: the console shows the progress display, our own warnings and errors,
and the summary; everything else — INFO lines of every process, library warnings, Ray's
own lines — goes to the run's log file, `<run.dir>/run.log`. `run.verbose` (the CLI's
`--verbose`) brings today's full console back (the file is still written).

Each Ray worker process (train ranks, the rollout controller, server actors) calls
`process_logging` with the log file's path; the file is appended to by every process of
the run (one line per write). A process that cannot open it (another node, without the
run folder) logs to its own stderr, which Ray keeps in its session logs.
"""

from __future__ import annotations

import logging
from pathlib import Path

__all__ = ["OWN_LOGGERS", "RunLogHandler", "process_logging", "run_log_path"]

OWN_LOGGERS = ("areal_like", "rollout_cluster", "train_cluster", "weight_sync")


class RunLogHandler(logging.FileHandler):
    """The run's log file. A write that fails (a full disk) turns it off quietly instead of
    printing a traceback per record or failing the run's own error handling: the run
    reports the disk itself where it matters (checkpoints, records)."""

    disabled = False

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        self.disabled = True

    def emit(self, record: logging.LogRecord) -> None:
        if not self.disabled:
            super().emit(record)

    def flush(self) -> None:
        try:
            super().flush()
        except OSError:
            self.disabled = True

    def close(self) -> None:
        try:
            super().close()
        except OSError:
            self.disabled = True


def run_log_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "run.log"


def process_logging(tag: str, level: str | int, log_file: str | Path | None, console: bool) -> None:
    """A worker process's logging: every record (and `warnings.warn`) to `log_file`,
    prefixed with `tag`; to stderr as well only when `console` (verbose runs, where Ray
    forwards worker output to the driver)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.setLevel(level)
    fmt = logging.Formatter(f"%(asctime)s {tag} %(levelname)s %(name)s: %(message)s")
    wrote_file = False
    if log_file is not None:
        try:
            fh = RunLogHandler(log_file, encoding="utf-8")
        except OSError:
            pass
        else:
            fh.setFormatter(fmt)
            root.addHandler(fh)
            wrote_file = True
    if console or not wrote_file:
        sh = logging.StreamHandler()
        sh.setFormatter(fmt)
        root.addHandler(sh)
    logging.captureWarnings(True)
