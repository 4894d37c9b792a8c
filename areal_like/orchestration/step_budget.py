"""A step's time budget: where the trainer's wall time goes between two step records.

The trainer controller opens a named phase around each thing its schedule does
(`with budget.phase("drain"): ...`); `take()`, called as a step's record is written,
returns the seconds of each phase since the previous record, plus `other` (what no
phase covered), so the parts add up exactly to the wall interval (docs/design.md §10.19):

    budget_wall_s = Σ budget_<phase>_s            (every other budget_* field of the record)

Phases nest: a phase opened inside another takes its own time out of the outer one
(receiving data while waiting for it is `drain`, not `wait_data`), except inside a
`whole` phase, which keeps everything (the train step: the workers train while this
process takes in data, so those seconds are training). A phase's name can change
before it ends (`ph.name = "wait_straggler"`): a wait is named by what it turned out to
wait for. `split` hands a phase's seconds to named parts measured elsewhere (the train
workers' forward/backward and optimizer), the remainder to a rest part.

Rollout-side numbers are not here: they arrive cumulative in the rollout reports
(`RolloutCounters.*_seconds_total`) and `TrainerTelemetry` turns them into per-step
`rollout_budget_*_s` deltas.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["StepBudget", "TRAINER_PHASES", "ROLLOUT_PHASES", "ROLLOUT_GROUPS", "budget_of"]

TRAINER_PHASES: tuple[tuple[str, str], ...] = (
    ("wait_rollout", "wait: no rollout side (connecting, first report)"),
    ("wait_data", "wait: groups for the batch"),
    ("wait_straggler", "wait: stragglers η would drop"),
    ("wait_colocate", "wait: servers to hold (colocate)"),
    ("wait_eval", "wait: the held-out score that may end the run"),
    ("drain", "take in data (groups into the buffer, reports)"),
    ("train_batch", "train: build the batch (advantages, packing)"),
    ("train_logprobs_prox", "train: π_prox logprobs"),
    ("train_fwd_bwd", "train: forward + backward"),
    ("train_optimizer", "train: optimizer"),
    ("train_other", "train: shipping, the workers' rest"),
    ("wait_broadcast", "wait: previous weight broadcast"),
    ("publish", "publish weights (snapshot, announce)"),
    ("checkpoint", "checkpoint"),
    ("other", "other (records, console, loop)"),
)
"""The trainer's phases in drawing order, with labels: `budget_<name>_s` in a `train_step` record."""

ROLLOUT_PHASES: tuple[tuple[str, str, str], ...] = (
    ("generate", "generate_seconds_total", "generate (engine steps)"),
    ("engine_idle", "engine_idle_seconds_total", "engine idle"),
    ("weights", "weights_seconds_total", "receive + load weights (until served)"),
    ("reprefill", "reprefill_seconds_total", "re-prefill the answers a load interrupted"),
    ("held", "rollout_held_s", "held for the trainer (colocate)"),
    ("agent_loop", "agent_loop_seconds_total", "agent loop (its own, and its turn on the event loop)"),
    ("tools", "tools_seconds_total", "tool calls"),
    ("reward", "reward_seconds_total", "reward"),
    ("send", "send_seconds_total", "encode + send"),
    ("wait_gate", "wait_gate_seconds_total", "wait: η's bound (the next version)"),
    ("wait_concurrency", "wait_concurrency_seconds_total", "full: max_concurrent episodes run"),
    ("wait_weights", "wait_weights_seconds_total", "wait: weights after a trainer restart"),
)
"""The rollout side's activities: (name, the cumulative `RolloutCounters` field, label).
A `train_step` record carries `rollout_budget_<name>_s`, the seconds since the previous
step. They overlap (servers and episodes run side by side), so they do not add up to
the wall interval the way the trainer's phases do."""

ROLLOUT_GROUPS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("servers", "rollout servers (Σ servers)", ("generate", "engine_idle", "weights", "reprefill", "held")),
    ("controller", "rollout controller", ("send", "wait_gate", "wait_concurrency", "wait_weights")),
    ("episodes", "episodes (Σ episodes, side by side)", ("agent_loop", "tools", "reward")),
)
"""The rollout phases by where they happen, one bar each when drawn: the servers' engines
(about the servers' wall time), the controller's admission loop and sends, and the
episodes it runs concurrently (their seconds add up over episodes, far beyond the wall)."""


class _Phase:
    __slots__ = ("name", "whole", "since", "spent")

    def __init__(self, name: str, whole: bool, now: float) -> None:
        self.name = name
        self.whole = whole
        self.since = now
        self.spent = 0.0


class StepBudget:
    """Seconds per named phase since the last `take()`; see the module docstring."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._wall_clock = wall_clock
        self._start = clock()
        self._spent: dict[str, float] = {}
        self._open: list[_Phase] = []
        self.taken_at = wall_clock()
        """UNIX time of the last `take()` (the record's `time`): consecutive records' times
        differ by their `budget_wall_s`."""

    @contextmanager
    def phase(self, name: str, *, whole: bool = False) -> Iterator[_Phase]:
        """Time inside goes to `name` (renamable through the yielded handle's `name`)."""
        if self._open and self._open[-1].whole:  # inside a whole phase: it keeps the time
            yield _Phase(name, whole, 0.0)
            return
        now = self._clock()
        if self._open:
            outer = self._open[-1]
            outer.spent += now - outer.since
        ph = _Phase(name, whole, now)
        self._open.append(ph)
        try:
            yield ph
        finally:
            now = self._clock()
            self._open.pop()
            ph.spent += now - ph.since
            self._spent[ph.name] = self._spent.get(ph.name, 0.0) + ph.spent
            if self._open:
                self._open[-1].since = now

    def split(self, name: str, parts: dict[str, float], rest: str) -> None:
        """Hand the seconds of phase `name` so far to `parts` (measured elsewhere, e.g. by
        the train workers) and the remainder to `rest`. Parts that claim more than the
        phase had are scaled down to fit, so the sum still holds."""
        total = self._spent.pop(name, 0.0)
        claimed = sum(max(0.0, s) for s in parts.values())
        scale = min(1.0, total / claimed) if claimed > 0 else 0.0
        for part, s in parts.items():
            self._spent[part] = self._spent.get(part, 0.0) + max(0.0, s) * scale
        self._spent[rest] = self._spent.get(rest, 0.0) + total - claimed * scale

    def take(self) -> dict[str, float]:
        """`budget_wall_s` (seconds since the previous take, or since the budget began)
        and `budget_<phase>_s` for every phase that ran, `budget_other_s` included; the
        phases add up to the wall. Starts the next interval."""
        now = self._clock()
        self.taken_at = self._wall_clock()
        if self._open:  # still open (not in the schedule as built): split at the take
            top = self._open[-1]
            top.spent += now - top.since
            top.since = now
        for ph in self._open:
            if ph.spent:
                self._spent[ph.name] = self._spent.get(ph.name, 0.0) + ph.spent
            ph.spent = 0.0
        wall = now - self._start
        self._start = now
        spent, self._spent = self._spent, {}
        spent.pop("other", None)  # a phase named so: what no other phase took, as the rest
        other = wall - sum(spent.values())
        out = {"budget_wall_s": wall}
        out.update({f"budget_{k}_s": v for k, v in spent.items()})
        out["budget_other_s"] = max(other, 0.0)  # ≥ 0 but for float rounding: the phases are disjoint
        return out


def budget_of(rec: dict[str, object], prefix: str = "budget_") -> dict[str, float]:
    """Phase → seconds of one record's budget fields with `prefix` (`budget_` for the
    trainer, `rollout_budget_` for the rollout side); `budget_wall_s` is not a phase."""
    out: dict[str, float] = {}
    for k, v in rec.items():
        if (k.startswith(prefix) and k.endswith("_s") and k != "budget_wall_s"
                and isinstance(v, (int, float)) and not isinstance(v, bool)):
            out[k[len(prefix):-2]] = float(v)
    return out
