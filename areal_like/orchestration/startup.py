"""Where start-up time goes: seconds from the command's process start to each phase.

The driver marks phases as it passes them (`mark`); the first train step writes them
as one `startup` record to metrics.jsonl and one log line, so `bench/startup.py` and a
user alike can see what the first step waited for. Phases are cumulative offsets from
the process start (interpreter start-up and imports included), in the order reached:

- `imports`: the CLI has parsed the command and loaded the config;
- `ray`: Ray is up (started, or joined); not under the local launcher;
- `pools`: both placement groups are placed; not under the local launcher;
- `trainer_side`: run folder, dashboard and channels are up;
- `train_workers`: the train workers have started and loaded the model (the local
  launcher's zygote imports first, alongside the driver);
- `weight_group`: rank 0's weight sender is ready;
- `rollout_joined`: the rollout controller said hello (its servers are up);
- `first_group`: the first trajectory group arrived;
- `first_step`: the first train step is done.
"""

from __future__ import annotations

import logging
import os
import time

__all__ = ["mark", "phases", "since_start", "reset"]

log = logging.getLogger(__name__)

_phases: dict[str, float] = {}


def _process_start() -> float:
    try:
        import psutil

        return float(psutil.Process(os.getpid()).create_time())
    except Exception:  # psutil missing or restricted: count from the first import of this module
        return _IMPORTED


_IMPORTED = time.time()
_T0 = _process_start()


def since_start() -> float:
    return time.time() - _T0


def mark(phase: str) -> None:
    """Record `phase` once (the first time it is reached)."""
    if phase not in _phases:
        _phases[phase] = round(since_start(), 3)


def phases() -> dict[str, float]:
    return dict(_phases)


def reset() -> None:
    _phases.clear()


def summary_line() -> str:
    """`imports 1.9 s, ray +3.1 s, ...`: each phase's own share."""
    parts, prev = [], 0.0
    for name, t in _phases.items():
        parts.append(f"{name} +{t - prev:.1f}s")
        prev = t
    return f"start-up {prev:.1f}s: " + ", ".join(parts)
