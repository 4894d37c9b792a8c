"""The trainer in the planner's simulation (`areal_like.plan.sim`): its step, re-planned as
CPU contention changes, and how its weights go out (the broadcast behind the next step)."""

from __future__ import annotations

from areal_like.core.types import TrajectoryGroup

__all__ = ["SimTrainer"]


class SimTrainer:
    """The trainer in the simulation: the step it runs (re-planned as CPU contention
    changes), the version it has trained, and its time line (step ends, phases, busy).

    Its weights go out as `WeightFeed.publish` sends them: after a step the trainer waits
    for the previous version's broadcast to end (the sender reuses its staging buffer),
    is held for the snapshot, and is then free for the next step while the broadcast runs
    in the background; servers receive the version when the broadcast ends."""

    def __init__(self, snapshot_s: float = 0.0) -> None:
        self.snapshot_s = snapshot_s
        """Seconds each publish holds the trainer for the snapshot."""
        self.version = 0
        self.training = False
        """From popping a batch until the step's snapshot is taken (the trainer is free again)."""
        self.in_compute = False
        """During the train step itself (not the publish after it)."""
        self.groups: list[TrajectoryGroup] = []
        self.started = 0.0
        self.left = 0.0
        """Seconds of the step still to compute at full speed, as of `planned_at`."""
        self.planned_at = 0.0
        self.factor = 0.0
        """The contention the running step was last planned at (0: not planned yet)."""
        self.gen = 0
        """Bumped at every re-plan: older `train_done` events are stale."""
        self.broadcast_ends = 0.0
        """When the last started broadcast ends (the next publish waits for it)."""
        self.step_times: list[float] = []
        """When each version was published (the step's record: the trainer is free again)."""
        self.delivered_at: list[float] = []
        """When each version's broadcast ended (servers receive it)."""
        self.phases: list[float] = []
        """Per step: train + the wait for the previous broadcast + the snapshot, seconds."""
        self.busy: list[tuple[float, float]] = []
        """(start, end) of each computing or snapshotting interval (waits are idle)."""
        self.tokens: list[int] = []
        """Tokens each step trained on (prompts, tool answers, generated)."""

    def start(self, groups: list[TrajectoryGroup], seconds: float, now: float, tokens: int = 0) -> None:
        self.training = self.in_compute = True
        self.tokens.append(tokens)
        self.left = seconds
        self.started = now
        self.groups = groups
        self.factor = 0.0

    def replan(self, now: float, factor: float) -> float | None:
        """(Re)plan the end of the running step at contention `factor`: what was done since
        the last plan is credited at the old rate. Returns the new end, or None when the
        rate did not change."""
        if factor == self.factor:
            return None
        if self.factor:
            self.left -= (now - self.planned_at) / self.factor
        self.planned_at, self.factor = now, factor
        self.gen += 1
        return now + max(0.0, self.left) * factor

    def is_current(self, gen: int) -> bool:
        """Whether a `train_done` event of re-plan `gen` ends the running step."""
        return gen == self.gen and self.in_compute

    def finish(self, now: float, sync_s: float) -> tuple[list[TrajectoryGroup], float, float]:
        """The step's compute ends now. Returns the trained groups, when the version is
        published (after the previous broadcast ends and the snapshot) and when its
        `sync_s` broadcast ends."""
        self.in_compute = False
        self.busy.append((self.started, now))
        snap_from = max(now, self.broadcast_ends)
        published = snap_from + self.snapshot_s
        self.busy.append((snap_from, published))
        self.broadcast_ends = published + sync_s
        self.phases.append(published - self.started)
        self.step_times.append(published)
        self.delivered_at.append(self.broadcast_ends)
        return self.groups, published, self.broadcast_ends

    def published(self) -> None:
        """The snapshot is taken: the version is out, the trainer is free for the next batch."""
        self.version += 1
        self.training = False

    def busy_between(self, t0: float, t1: float) -> float:
        return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in self.busy)
