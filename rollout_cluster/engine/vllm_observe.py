"""What a vLLM engine tells us about itself: why it died, and its scheduler's numbers.

Engine death: vLLM raises its `EngineDeadError` ("See stack trace (above)") once the
engine core process is gone; the real error is only in that process's log. The
engine's child processes also write their ERROR records to a file (`ErrorLog`, through
`VLLM_LOGGING_CONFIG_PATH`, set only while the engine starts), and `VLLMEngine` turns
any failure of a dead engine into our `EngineDeadError` whose message starts with the
root cause (`root_cause_from_log`: `RuntimeError: ...` from that file, or
`process_status`: how the engine core process ended, e.g. killed by SIGKILL).

vLLM's own metrics (KV cache usage, running/waiting requests, preemptions, prefix
cache hits) come from a stat logger handed to `AsyncLLM` (`StatsLogger`) and are
returned by `VLLMEngine.metrics()` as `vllm_*` keys beside the engine-agnostic ones.

Nothing here imports vLLM at module level (the pure parts are tested without it).
"""

from __future__ import annotations

import json
import os
import re
import signal
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["ErrorLog", "root_cause_from_log", "engine_processes", "process_status", "VLLMStats", "StatsLogger"]


# ---- engine death ------------------------------------------------------------------------


class ErrorLog:
    """A file the engine's child processes (engine core, workers) also log ERROR records
    to, so the adapter can name the root cause of a dead engine.

    vLLM configures logging in each process from `VLLM_LOGGING_CONFIG_PATH` at import;
    the children inherit the environment when they are spawned during `AsyncLLM`
    construction, so the variable is set only for that window (and not at all when the
    user has their own logging config)."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="areal_vllm_")
        self.path = os.path.join(self.dir, "engine_errors.log")
        self._config_path: str | None = None
        try:
            from vllm.logger import DEFAULT_LOGGING_CONFIG
        except ImportError:  # pragma: no cover - other vLLM layouts: no capture
            return
        config = json.loads(json.dumps(DEFAULT_LOGGING_CONFIG))
        config["formatters"]["areal_plain"] = {"format": "%(message)s"}
        config["handlers"]["areal_errors"] = {
            "class": "logging.FileHandler",
            "filename": self.path,
            "level": "ERROR",
            "formatter": "areal_plain",
        }
        config["loggers"]["vllm"]["handlers"] = [*config["loggers"]["vllm"]["handlers"], "areal_errors"]
        self._config_path = os.path.join(self.dir, "logging.json")
        with open(self._config_path, "w") as f:
            json.dump(config, f)

    def __enter__(self) -> ErrorLog:
        self._prev = os.environ.get("VLLM_LOGGING_CONFIG_PATH")
        if self._config_path is not None and self._prev is None:
            os.environ["VLLM_LOGGING_CONFIG_PATH"] = self._config_path
        return self

    def __exit__(self, *exc: object) -> None:
        if self._config_path is not None and self._prev is None:
            os.environ.pop("VLLM_LOGGING_CONFIG_PATH", None)

    def read(self) -> str:
        try:
            with open(self.path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""


_EXC_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Z]\w*(?:Error|Exception|Exit|Interrupt)): (.*\S)")


def root_cause_from_log(text: str, max_details: int = 4000) -> tuple[str, str]:
    """The first exception line (`Type: message`) in an engine error log, and the log's
    tail as details; ("", tail) when there is none. The first one is the root: vLLM
    re-raises a worker's error in the engine core as "Worker failed with error ...",
    and its own `EngineDeadError` comes last."""
    for line in text.splitlines():
        m = _EXC_LINE.match(line.strip())
        if m and "EngineDeadError" not in m.group(1):
            return f"{m.group(1)}: {m.group(2)}", text[-max_details:]
    return "", text[-max_details:]


def engine_processes(llm: Any) -> list[Any]:
    """vLLM's engine core processes (internal API, looked up defensively)."""
    resources = getattr(getattr(llm, "engine_core", None), "resources", None)
    return list(getattr(getattr(resources, "engine_manager", None), "processes", None) or [])


def process_status(procs: Iterable[Any]) -> str:
    """How the engine core processes that ended did so ("" while all run)."""
    parts = []
    for p in procs:
        code = p.exitcode
        if code is None:
            continue
        if code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        parts.append(f"the {p.name} process (pid {p.pid}) {how}")
    return "; ".join(parts)


# ---- vLLM's scheduler stats ----------------------------------------------------------


@dataclass
class VLLMStats:
    """The last scheduler stats and cumulative iteration counts of one engine."""

    kv_cache_usage: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    def as_metrics(self) -> dict[str, float]:
        return {
            "vllm_kv_cache_usage": float(self.kv_cache_usage),
            "vllm_num_running": float(self.num_running),
            "vllm_num_waiting": float(self.num_waiting),
            "vllm_preemptions": float(self.preemptions),
            "vllm_prefix_cache_queries": float(self.prefix_cache_queries),
            "vllm_prefix_cache_hits": float(self.prefix_cache_hits),
        }


class StatsLogger:
    """A per-engine vLLM stat logger (`stat_loggers=[factory]`): vLLM calls `record` with
    each step's `SchedulerStats` / `IterationStats`; we keep what `metrics()` reports.
    Duck-typed on `StatLoggerBase` (record, log, log_engine_initialized) so this
    module imports without vLLM."""

    def __init__(self, stats: VLLMStats) -> None:
        self.stats = stats

    def record(
        self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
    ) -> None:
        st = self.stats
        if scheduler_stats is not None:
            st.kv_cache_usage = float(getattr(scheduler_stats, "kv_cache_usage", 0.0))
            st.num_running = int(getattr(scheduler_stats, "num_running_reqs", 0))
            st.num_waiting = int(getattr(scheduler_stats, "num_waiting_reqs", 0))
            prefix = getattr(scheduler_stats, "prefix_cache_stats", None)
            if prefix is not None:
                st.prefix_cache_queries += int(getattr(prefix, "queries", 0))
                st.prefix_cache_hits += int(getattr(prefix, "hits", 0))
        if iteration_stats is not None:
            st.preemptions += int(getattr(iteration_stats, "num_preempted_reqs", 0))

    def log(self) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass

    def record_sleep_state(self, *args: Any) -> None:
        pass
