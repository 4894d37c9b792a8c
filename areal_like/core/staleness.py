"""The staleness gate: the rollout side's half of the bound η (invariant 1).

A new group of n episodes is admitted only while

    accepted + running + n <= (L + v + 1) · B + ahead     and     running + n <= max_concurrent

where `v` is the newest weight version the rollout side has loaded, `B` the samples
per train step, `running` the episodes started and not finished, and `accepted` the
samples handed to the trainer side and not later dropped (filtered, over-stale,
failed). Groups are admitted whole: a group of n occupies n (docs/design.md §9.3).
A step may train more than B samples (it takes every group it would otherwise push
past η): what the trainer consumed beyond `v_t · B` at its version `v_t` no longer waits
for a later step, so it widens the bound by as much (`ahead`); without it the gate would
stay shut while the trainer waits for data it cannot get.

Why it bounds staleness: by the time the trainer is at version `v_t` it has trained
on `v_t · B` samples, oldest first. A sample admitted while the rollout side was at
version `v` is among the first `(η + v + 1) · B` accepted samples, so it is trained
at the latest in step `η + v`, i.e. with lag `v_t − v ≤ η`. Drops free their slots
(the trainer's announcements carry cumulative dropped counts), so the gate never
stays shut while the trainer waits. The trainer re-checks the bound at consume time
anyway (`TrajectoryBuffer`), because drops and failures can reorder what it sees.

The lead L (docs/design.md §10.50). With `adaptive_lead`, L starts at 1 (0 at η = 0). It
rises by one, up to η, when the trainer says a step waited for data (its cumulative
`starved` count grew) and another did within `calm_versions` versions. It falls by one
after `calm_versions` versions in a row whose steps each began with the next step's data
already buffered (`spare`). η is a bound, not a target: where one version of lead keeps the
trainer fed, the rollout side does not run η versions ahead of it, so the trainer trains
fresher samples at the same speed. With `staleness.lead: full`, L = η, as in AReaL. Since
L ≤ η, the argument above holds with L in place of η.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from areal_like.core.buffer import TrajectoryBuffer
from areal_like.core.types import GateCounts

__all__ = ["StalenessGate", "GateState", "GateTally"]


@dataclass
class GateState:
    version: int = 0
    running: int = 0
    sent: int = 0
    """Samples pushed to the trainer side (cumulative)."""
    dropped: int = 0
    """Of those, samples the trainer dropped (cumulative, from its announcements)."""
    consumed: int = 0
    """Of those, samples the trainer trained on (cumulative, from its announcements)."""
    sent_base: int = 0
    """Samples sent before a resume (the trainer says how many); they still count."""
    ahead: int = 0
    """Samples the trainer consumed beyond B per step so far (its newest announcement's)."""
    rejected_at_gate: int = 0
    """Admission attempts refused (a counter for dashboards, not samples)."""


class StalenessGate:
    """Pure admission arithmetic; the controller calls it from one event loop."""

    def __init__(self, samples_per_step: int, max_staleness: int, max_concurrent: int, *,
                 adaptive_lead: bool = False, calm_versions: int = 4) -> None:
        if samples_per_step < 1 or max_staleness < 0 or max_concurrent < 1 or calm_versions < 1:
            raise ValueError(
                f"bad gate parameters: B={samples_per_step} η={max_staleness} max_concurrent={max_concurrent} "
                f"calm_versions={calm_versions}"
            )
        self.B = samples_per_step
        self.eta = max_staleness
        self.max_concurrent = max_concurrent
        self.adaptive_lead = adaptive_lead
        self.calm_versions = calm_versions
        self.s = GateState()
        self._ahead_version = -1
        self._reset_lead()

    def _reset_lead(self) -> None:
        self.lead = min(1, self.eta) if self.adaptive_lead else self.eta
        """L: versions the rollout side may run ahead of what it has loaded (≤ η)."""
        self._starved = self._spare = self._calm = 0
        self._lead_version = -1
        self._wait_version: int | None = None

    @property
    def accepted(self) -> int:
        return self.s.sent_base + self.s.sent - self.s.dropped

    @property
    def capacity(self) -> int:
        """Total samples that may ever be accepted + running at the loaded version."""
        return (self.lead + self.s.version + 1) * self.B + self.s.ahead

    def free_slots(self) -> int:
        return min(self.capacity - self.accepted - self.s.running, self.max_concurrent - self.s.running)

    def try_admit(self, n: int = 1) -> bool:
        """Admit a group of n episodes if both bounds allow it; count a refusal otherwise."""
        if n < 1:
            raise ValueError(f"a group has at least one episode, got {n}")
        if self.free_slots() >= n:
            self.s.running += n
            return True
        self.s.rejected_at_gate += 1
        return False

    def on_group_done(self, n_started: int, n_sent: int) -> None:
        """A group of `n_started` episodes finished; `n_sent` samples went to the trainer.

        Members that failed or were rejected by the workflow (`n_started - n_sent`)
        simply release their running slot.
        """
        if not 0 <= n_sent <= n_started <= self.s.running:
            raise ValueError(f"bad group completion: started={n_started} sent={n_sent} running={self.s.running}")
        self.s.running -= n_started
        self.s.sent += n_sent

    def on_cancel(self, n: int) -> None:
        """Episodes stopped before finishing (shutdown); they release their slots."""
        self.s.running -= min(n, self.s.running)

    def set_max_concurrent(self, n: int) -> None:
        """The pool grew or shrank (docs/design.md §10.24): running episodes are bounded by
        what the servers now there may run. η's bound does not depend on it. Episodes
        already running past a lowered bound finish; nothing more is admitted until then."""
        if n < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {n}")
        self.max_concurrent = n

    def on_trainer_counts(self, consumed: int, dropped: int, sent_base: int = 0,
                          trainer_version: int | None = None, starved: int = 0, spare: int = 0) -> None:
        """Apply a trainer announcement's cumulative counts. Repeated or reordered
        announcements are harmless (max keeps the newest). The version in the same
        announcement only counts once the engines have loaded it (`set_loaded_version`);
        with it, samples consumed beyond B per step widen the bound (`ahead`). `starved` and
        `spare`: the trainer's steps that waited for data, and that began with the next
        step's data buffered (cumulative), which move the lead."""
        self.s.consumed = max(self.s.consumed, consumed)
        self.s.dropped = max(self.s.dropped, dropped)
        self.s.sent_base = max(self.s.sent_base, sent_base)
        if trainer_version is not None and trainer_version >= self._ahead_version:
            self._ahead_version = trainer_version
            self.s.ahead = max(0, consumed - trainer_version * self.B)
        if self.adaptive_lead:
            self._follow_lead(starved, spare, trainer_version)

    def _follow_lead(self, starved: int, spare: int, trainer_version: int | None) -> None:
        """One more version of lead when the trainer says a step waited for data and
        another did within the last `calm_versions` versions (one wait alone is a burst that
        more lead would not have spared, two are a pattern). One less after `calm_versions`
        versions in a row whose steps each began with the next step's data already
        buffered: one version less of lead would still have had it ready in time. Within
        [min(1, η), η]. A rollout controller that joins a running trainer takes its counts
        so far as they are."""
        if self._lead_version < 0 and trainer_version is not None:
            self._starved, self._spare, self._lead_version = starved, spare, trainer_version
            return
        if starved > self._starved:
            at = trainer_version if trainer_version is not None else self._lead_version
            again = starved - self._starved > 1 or (
                self._wait_version is not None and at - self._wait_version <= self.calm_versions)
            if again:
                self.lead = min(self.eta, self.lead + 1)
            self._starved, self._wait_version, self._calm = starved, at, 0
        if trainer_version is None or trainer_version <= self._lead_version:
            return  # a heartbeat, or a drop announcement within a step: the counts are per version
        all_spare = spare - self._spare >= trainer_version - self._lead_version
        self._calm = self._calm + 1 if all_spare else 0
        if self._calm >= self.calm_versions:
            self.lead = max(min(1, self.eta), self.lead - 1)
            self._calm = 0
        self._lead_version, self._spare = trainer_version, spare

    def set_loaded_version(self, version: int) -> None:
        """The engines now serve `version` (capacity follows what is loaded)."""
        self.s.version = max(self.s.version, version)

    def rebase(self) -> None:
        """A new trainer epoch: its announcements carry the counts from its checkpoint
        (`sent_base`, consumed, dropped); what this side sent before is not its to count."""
        self.s = GateState(rejected_at_gate=self.s.rejected_at_gate)
        self._ahead_version = -1
        self._reset_lead()

    def state_dict(self) -> dict[str, int]:
        return asdict(self.s)

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore after recovery. Episodes running at the crash did not survive it."""
        self.s = GateState(**state)
        self.s.running = 0


class GateTally:
    """The trainer's half: what it tells the gate (`GateCounts`). The buffer's cumulative
    counts, the samples it held before a resume, and the two counts the lead follows:
    steps that waited for their data, and steps that began with the next step's data
    already buffered. The planner's simulated trainer keeps the same tally."""

    WAIT_FRACTION = 0.05
    """A step starved if it waited for data past this share of the step before it ..."""
    WAIT_FLOOR_S = 0.02
    """... and past this many seconds."""

    def __init__(self, buffer: TrajectoryBuffer) -> None:
        self.buffer = buffer
        self.sent_base = 0
        """Samples the trainer had received before this run was resumed (`rebase`)."""
        self.starved = 0
        self.spare = 0
        self._last_step_s: float | None = None

    def rebase(self) -> None:
        """After a resume: what the buffer had received counts as sent."""
        self.sent_base = self.buffer.consumed + self.buffer.dropped_sent + self.buffer.depth

    def step_began(self, waited_s: float, num_groups: int) -> None:
        """A step took its batch after waiting `waited_s` for data (eval and straggler waits
        apart); `num_groups` is what a step takes. The trainer's first step waits for the
        rollout side's first batch whatever the lead, so it does not count."""
        if self._last_step_s is not None and waited_s > max(self.WAIT_FLOOR_S, self.WAIT_FRACTION * self._last_step_s):
            self.starved += 1
        self.spare += int(self.buffer.prompts >= num_groups)

    def step_ended(self, step_s: float) -> None:
        self._last_step_s = step_s

    def counts(self) -> GateCounts:
        return GateCounts(consumed=self.buffer.consumed, dropped=self.buffer.dropped_sent, sent_base=self.sent_base,
                          starved=self.starved, spare=self.spare)
