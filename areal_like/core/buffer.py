"""The trainer side's trajectory buffer: use-once, oldest first, η re-checked.

Mission text calls it the replay buffer; nothing is replayed: every sample is
trained on at most once (invariant 5). Groups arrive whole from the rollout side
and leave whole (docs/design.md §9.4):

- at arrival, members that failed or were rejected by the workflow are counted;
  a group left with fewer than 2 members (or fewer than its full size when that
  is 1) is dropped as `failed`; a group whose rewards are all equal carries no
  GRPO signal and is dropped as `filtered` (when filtering is on);
- at consume time, the buffer re-checks `v_trainer − head_version ≤ η` for each
  group, drops violators as `over_stale` (counted, never silent), and hands out the
  groups with the oldest head versions first, plus any the step would push past η.

Every sample ends in exactly one bucket of `OUTCOMES`. `consumed` and `dropped`
(cumulative, in samples) go out in the trainer's version announcements so the
rollout gate frees capacity for drops (docs/design.md §9.3).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from areal_like.core.types import TrajectoryGroup

__all__ = ["TrajectoryBuffer", "OUTCOMES"]

OUTCOMES = ("trained", "rejected", "filtered", "over_stale", "failed", "skipped", "buffered", "cancelled")


class TrajectoryBuffer:
    def __init__(self, max_staleness: int, filter_uniform_groups: bool = True, group_size: int | None = None) -> None:
        self.eta = max_staleness
        self.filter_uniform_groups = filter_uniform_groups
        self.group_size = group_size
        """`rollout.group_size`: a group of k times it counts as k prompts of a batch (groups
        grown by `staleness.grow_groups_to`, docs/design.md §10.25); None: every group one."""
        self._queue: deque[TrajectoryGroup] = deque()
        self.counts: dict[str, int] = {k: 0 for k in OUTCOMES if k not in ("buffered", "cancelled")}
        self.dropped_sent = 0
        """Samples that reached the trainer side and were dropped (frees gate capacity)."""
        self.consumed = 0
        """Samples trained on."""
        self.lag_history: list[int] = []
        """Head version lag of every group handed out (for metrics)."""

    # ---- arrival ---------------------------------------------------------------
    def put(self, group: TrajectoryGroup) -> str | None:
        """Accept a group; return the outcome name if it was dropped on arrival."""
        self.counts["rejected"] += group.rejected
        self.counts["failed"] += group.failed
        n = len(group.trajectories)
        if n == 0:
            return "failed" if group.failed else "rejected"
        if n < min(2, group.size):
            self._drop(n, "failed")
            return "failed"
        if self.filter_uniform_groups and n > 1 and len({t.reward for t in group.trajectories}) == 1:
            self._drop(n, "filtered")
            return "filtered"
        self._queue.append(group)
        return None

    def put_invalid(self, group: TrajectoryGroup) -> None:
        """A group that failed a check at the trainer's edge (e.g. token ids outside the
        vocabulary): every member counts as failed; the sent ones free their capacity."""
        self.counts["rejected"] += group.rejected
        self.counts["failed"] += group.failed
        self._drop(len(group.trajectories), "failed")

    def _drop(self, n: int, outcome: str) -> None:
        self.counts[outcome] += n
        self.dropped_sent += n

    # ---- consumption -------------------------------------------------------------
    def pop_batch(self, trainer_version: int, num_groups: int) -> list[TrajectoryGroup] | None:
        """The `num_groups` groups with the oldest head versions (arrival order among
        equals) within η of `trainer_version`, or None if fewer are available. Over-stale
        groups are dropped and counted. Oldest head first, not oldest arrival: a long
        group that arrives behind newer ones is the one the next step would push past η.
        A grown group (k × `group_size` episodes) counts as k groups: oldest first until
        `num_groups` are covered, so a step trains at least as many samples as before.
        A group the step would leave more than η behind comes too, past `num_groups`: with
        several long groups of one head arriving at once (after a straggler wait), taking
        only `num_groups` of them dropped the rest as over-stale at the next step."""
        kept: deque[TrajectoryGroup] = deque()
        for g in self._queue:
            if trainer_version - g.head_version > self.eta:
                self._drop(len(g.trajectories), "over_stale")
            else:
                kept.append(g)
        self._queue = kept
        if self.prompts < num_groups:
            return None
        order = sorted(range(len(self._queue)), key=lambda i: (self._queue[i].head_version, i))
        chosen: set[int] = set()
        units = 0
        for i in order:
            if units >= num_groups and trainer_version + 1 - self._queue[i].head_version <= self.eta:
                break
            chosen.add(i)
            units += self._units(self._queue[i])
        out = [self._queue[i] for i in sorted(chosen, key=lambda i: (self._queue[i].head_version, i))]
        self._queue = deque(g for i, g in enumerate(self._queue) if i not in chosen)
        for g in out:
            self.lag_history.append(trainer_version - g.head_version)
        return out

    def _units(self, g: TrajectoryGroup) -> int:
        return 1 if self.group_size is None else max(1, g.size // self.group_size)

    def mark_trained(self, groups: list[TrajectoryGroup]) -> None:
        n = sum(len(g.trajectories) for g in groups)
        self.counts["trained"] += n
        self.consumed += n

    def mark_skipped(self, groups: list[TrajectoryGroup]) -> None:
        """The step was skipped (NaN/inf): its samples are dropped, not trained. The
        version did not advance, so they must free their gate capacity like any drop,
        or η+1 skipped steps would shut the gate for good (docs/design.md §10.9)."""
        self._drop(sum(len(g.trajectories) for g in groups), "skipped")

    # ---- views ---------------------------------------------------------------------
    @property
    def depth(self) -> int:
        """Samples waiting."""
        return sum(len(g.trajectories) for g in self._queue)

    @property
    def num_groups(self) -> int:
        return len(self._queue)

    @property
    def prompts(self) -> int:
        """Groups waiting, a grown one counted as the prompts it stands for (`pop_batch`)."""
        return sum(self._units(g) for g in self._queue)

    def summary(self, started: int, cancelled: int) -> dict[str, int]:
        """Outcome counts (docs/design.md §9.5); `started` must equal the sum of the rest."""
        out = dict(self.counts)
        out["buffered"] = self.depth
        out["cancelled"] = cancelled
        out["started"] = started
        return out

    @staticmethod
    def counts_add_up(summary: dict[str, int]) -> bool:
        return sum(summary[k] for k in OUTCOMES) == summary["started"]

    # ---- recovery --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "counts": dict(self.counts),
            "dropped_sent": self.dropped_sent,
            "consumed": self.consumed,
            "queue": [g.model_dump(mode="json") for g in self._queue],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counts = {k: int(state["counts"].get(k, 0)) for k in self.counts}
        self.dropped_sent = int(state["dropped_sent"])
        self.consumed = int(state["consumed"])
        self._queue = deque(TrajectoryGroup.model_validate(g) for g in state["queue"])
