"""What the trainer's console says when a run is not learning or its episodes fail
(docs/design.md §10.13, §10.18). The watches are plain bookkeeping, no I/O: the trainer
controller feeds them and prints or raises what they return, through `ConsoleNotes` (each
step's line, what the trainer waits for, warnings), the one place these lines go out.

- `SignalWatch`: groups whose samples all scored the same carry no GRPO signal and are
  dropped as `filtered` (`staleness.filter_uniform_groups`). When nothing but such groups
  arrives, the trainer never forms a batch and, before this, printed nothing for as long
  as the user waited. It names the situation (the reward, its values, the share of
  groups filtered, the setting that filters them) and, past `agent.max_no_signal_s` with
  no group to learn from, says the run must stop.
- `FailureNotes`: episodes that fail (a reward that raises on some rows) are counted on
  the rollout side, whose log is not the console; one line within seconds of the first
  report of them, then at most one a minute while the count grows.
- `WaitNotes`: a line at least every `every_s` while the trainer waits, saying for what.
- `DriftWatch`: the trainer's policy running away from the sampler's (the train steps' mean
  |log π_prox − log π_behav|, nats per token). In the staleness ablation the runs whose
  gap stayed above a few tenths of a nat lost held-out accuracy, decoupled PPO most
  (docs/benchmarks.md, "A faster learning rate"); nothing said so while they ran.
- `FreshRewardWatch`: the newest episodes' reward falling far below where it was. With
  η > 0 the batch being trained was sampled up to η versions ago, so the trained reward
  shows a policy that broke only η versions later. In the staleness ablation at η = 8,
  decoupled runs collapsed late (the newest episodes at 0.1–0.5 while the trained batches
  still scored ~0.9) and nothing on the console said so.
- `TruncationWatch`: answers cut by the length limit. On SmolLM2-135M-Instruct a policy
  that had learned the task stopped ending its turns: the share of answers that reached
  `rollout.response_length` went from a third to all of them and the held-out accuracy
  fell with it, and the console said nothing (docs/real_models.md).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from areal_like.core.types import EpisodeFailures, RolloutStats, TrajectoryGroup

log = logging.getLogger("areal_like.orchestration.trainer_controller")  # the run's log reads as one

__all__ = ["ConsoleNotes", "SignalWatch", "FailureNotes", "WaitNotes", "DriftWatch", "FreshRewardWatch", "TruncationWatch"]


def _values(counts: Counter[float], most: int = 4) -> str:
    """`0.0 ×296` or `1.0 ×40, 0.0 ×8` (the most common first)."""
    parts = [f"{v:g} ×{n}" for v, n in counts.most_common(most)]
    if len(counts) > most:
        parts.append(f"{len(counts) - most} more values")
    return ", ".join(parts)


class TruncationWatch:
    """One line when the share of answers cut by the length limit, over the last `window`
    samples that arrived (trained or filtered), reaches `threshold` and has risen by `rise`
    since the run's first window; again only after it fell below half of it. A model whose
    answers start out cut that often is named once, from its first window: that is a length
    limit to look at, not a policy that stopped ending its answers."""

    def __init__(self, *, response_length: int, mask_truncated: bool = False, overlong_buffer: int = 0,
                 threshold: float = 0.5, rise: float = 0.25, window: int = 64) -> None:
        self.response_length = response_length
        self.mask_truncated = mask_truncated
        self.overlong_buffer = overlong_buffer
        self.threshold = threshold
        self.rise = rise
        self.window = window
        self._recent: list[bool] = []
        self.first: float | None = None
        """The share of the run's first `window` answers."""
        self._armed = True

    @classmethod
    def for_config(cls, cfg: Any) -> TruncationWatch:
        loss = cfg.train.loss
        return cls(response_length=cfg.rollout.response_length, mask_truncated=loss.mask_truncated,
                   overlong_buffer=loss.overlong_buffer)

    def group(self, group: TrajectoryGroup) -> str | None:
        self._recent = [*self._recent, *(bool(t.truncated) for t in group.trajectories)][-self.window:]
        if len(self._recent) < self.window:
            return None
        share = sum(self._recent) / len(self._recent)
        limit = f"the length limit (rollout.response_length={self.response_length})"
        if self.first is None:
            self.first = share
            if share >= self.threshold:
                return (f"{share:.0%} of the run's first {len(self._recent)} answers were cut by {limit}: raise it if "
                        "the answers need the room, or let the run teach shorter ones" + self._settings())
            return None
        if not self._armed:
            self._armed = share < self.threshold / 2 or share < self.first + self.rise / 2
            return None
        if share < self.threshold or share < self.first + self.rise:
            return None
        self._armed = False
        return (f"{share:.0%} of the last {len(self._recent)} answers were cut by {limit}, up from {self.first:.0%} at "
                "the start: a policy that stops ending its answers loses what the reward reads at the end"
                + self._settings())

    def _settings(self) -> str:
        on = [k for k, v in (("train.loss.mask_truncated", self.mask_truncated),
                             ("train.loss.overlong_buffer", self.overlong_buffer)) if v]
        if on:
            return f" ({' and '.join(on)} on)"
        return ("; train.loss.mask_truncated=true keeps them out of the loss, train.loss.overlong_buffer=N "
                "penalises answers that run into the last N tokens (DAPO)")


class SignalWatch:
    """Counts groups without a learning signal since the last one that had it."""

    def __init__(self, reward_name: str, *, max_no_signal_s: float, name_after_s: float = 10.0,
                 every_s: float = 30.0, min_groups: int = 2, clock: Any = time.monotonic,
                 uniform_after: int = 0) -> None:
        self.reward_name = reward_name
        self.uniform_after = uniform_after
        self.max_no_signal_s = max_no_signal_s
        self.name_after_s = name_after_s
        self.every_s = every_s
        self.min_groups = min_groups
        self.clock = clock
        self.since: float | None = None
        """When the first group of the current stretch without signal arrived (None: the last group had signal)."""
        self.uniform = 0
        self.values: Counter[float] = Counter()
        self.total_uniform = 0
        self.total_groups = 0
        self._said_at: float | None = None
        self.best: float | None = None
        """The highest reward any sample of the run scored."""
        self.worst: float | None = None
        self.early: list[float] = []
        """The rewards of the run's first `early_samples` samples."""
        self.early_samples = 64

    def group(self, group: TrajectoryGroup, outcome: str | None) -> None:
        """A group arrived at the buffer; `outcome` is what the buffer did with it
        (`None`: kept for training, `filtered`: uniform rewards, other drops ignored)."""
        self.total_groups += 1
        rewards = [float(t.reward) for t in group.trajectories]
        self.early.extend(rewards[: self.early_samples - len(self.early)])
        if rewards:
            self.best = max(rewards) if self.best is None else max(self.best, *rewards)
            self.worst = min(rewards) if self.worst is None else min(self.worst, *rewards)
        if outcome is None:
            self.since, self.uniform, self._said_at = None, 0, None
            self.values.clear()
        elif outcome == "filtered":
            self.total_uniform += 1
            if self.since is None:
                self.since = self.clock()
            self.uniform += 1
            self.values.update(round(float(t.reward), 4) for t in group.trajectories)

    @property
    def solved(self) -> bool:
        """The groups without signal all scored the run's best reward, which at the start fewer
        than half of the samples did: a task learned to its ceiling, not a reward that (nearly)
        always gives the same value (one outlier in a constant reward is not learning)."""
        if len(self.values) != 1 or self.best is None or self.worst is None or not self.worst < self.best:
            return False
        at_best = sum(1 for r in self.early if round(r, 4) == round(self.best, 4))
        return next(iter(self.values)) == round(self.best, 4) and at_best < len(self.early) / 2

    def check(self) -> tuple[str | None, str | None]:
        """`(line, verdict)`: a console line to print now (or None), and, past
        `max_no_signal_s` without a group to learn from, why the run must stop."""
        if self.since is None or self.uniform < self.min_groups:
            return None, None
        now = self.clock()
        waited = now - self.since
        if self.solved:
            what = (f"every sample of the last {self.uniform} groups ({waited:.0f}s) scored {self.best:g}, the best "
                    f"reward of this run (reward {self.reward_name!r}): the policy solves these prompts"
                    + ("; dataset.uniform_after=2 draws such prompts less often" if not self.uniform_after
                       else f" (dataset.uniform_after={self.uniform_after}: the prompts drawn at "
                            "dataset.difficulty_floor are solved too)")
                    + "; train.stop_at_eval_accuracy ends a run at a held-out target")
            if waited >= self.max_no_signal_s:
                return None, f"the task is solved: {what}; the run ends here (agent.max_no_signal_s)"
            if waited < self.name_after_s or (self._said_at is not None and now - self._said_at < self.every_s):
                return None, None
            self._said_at = now
            return (f"{what}. The run ends in {self.max_no_signal_s - waited:.0f}s (agent.max_no_signal_s) unless a "
                    "group with different rewards arrives."), None
        what = (f"all {self.uniform} groups of the last {waited:.0f}s scored the same within each group "
                f"(reward {self.reward_name!r}, samples: {_values(self.values)}); staleness.filter_uniform_groups "
                "drops them (set it false to train on them with advantage 0), so there is nothing to train on")
        mixed = self.total_groups - self.total_uniform
        if mixed:  # a run that finds signal, only rarely, reads differently from one that never did
            what += (f"; {mixed} of the run's {self.total_groups} groups so far ({mixed / self.total_groups:.0%}) "
                     "had different rewards, and each one resets this clock")
        if waited >= self.max_no_signal_s:
            return None, (f"no learning signal for {waited:.0f}s (agent.max_no_signal_s={self.max_no_signal_s:g}): "
                          f"{what}. Check that the reward can tell answers apart on these rows.")
        if waited < self.name_after_s or (self._said_at is not None and now - self._said_at < self.every_s):
            return None, None
        self._said_at = now
        left = self.max_no_signal_s - waited
        return (f"no learning signal: {what}. The run stops in {left:.0f}s (agent.max_no_signal_s) unless a group "
                "with different rewards arrives."), None


class FailureNotes:
    """One console line for failing episodes, then one a minute while the count grows."""

    def __init__(self, every_s: float = 60.0, clock: Any = time.monotonic) -> None:
        self.every_s = every_s
        self.clock = clock
        self._said: tuple[float, int] | None = None

    def report(self, stats: RolloutStats) -> str | None:
        f: EpisodeFailures | None = stats.failures
        failed = stats.outcomes.failed
        if f is None or failed == 0 or f.stopped or f.judging:  # judging: fail-fast speaks first
            return None
        now = self.clock()
        if self._said is not None and (now - self._said[0] < self.every_s or failed == self._said[1]):
            return None
        self._said = (now, failed)
        done = stats.outcomes.sent + stats.outcomes.rejected + failed
        return (f"{failed} of {done} episodes failed so far ({failed / max(done, 1):.0%}); they are counted as "
                f"failed and the run goes on. First: {f.first}")


class WaitNotes:
    """A line at least every `every_s` seconds while nothing else is printed."""

    def __init__(self, every_s: float = 10.0, clock: Any = time.monotonic) -> None:
        self.every_s = every_s
        self.clock = clock
        self._last = clock()

    def printed(self) -> None:
        """Something was printed (a progress line): the next wait line is due later."""
        self._last = self.clock()

    def due(self) -> bool:
        if self.clock() - self._last < self.every_s:
            return False
        self._last = self.clock()
        return True


class DriftWatch:
    """One line when the mean behaviour–proximal gap of the last `window` trained steps
    passes `warn_nats`, and again each time that mean doubles: at a high learning rate with
    η > 0 the policy moves further per version than the data can follow."""

    def __init__(self, *, eta: int, lr: float, warn_nats: float = 0.3, window: int = 5) -> None:
        self.eta = eta
        self.lr = lr
        self.warn_nats = warn_nats
        self.window = window
        self._gaps: list[float] = []
        self._next = warn_nats

    def step(self, stats: dict[str, Any]) -> str | None:
        gap = stats.get("behav_prox_gap")
        if gap is None:
            return None
        self._gaps = [*self._gaps[-(self.window - 1):], float(gap)]
        mean = sum(self._gaps) / len(self._gaps)
        if len(self._gaps) < self.window or mean < self._next:
            return None
        self._next = 2 * mean
        return (f"the sampler's policy is {mean:.2f} nats per token away from the trainer's (mean "
                f"|log π_prox − log π_behav| over the last {self.window} steps, η={self.eta}, lr={self.lr:g}): "
                "the policy moves further per version than the stale data can follow; in the staleness ablation "
                "runs like this lost held-out accuracy (decoupled PPO most). Lower train.lr or "
                "staleness.max_staleness (docs/staleness.md)")


class FreshRewardWatch:
    """One line when the reward of the newest episodes (`reward_mean_all_groups`: every
    trajectory finished since the last step, filtered groups included) falls `drop` or
    more below its best, each a mean over `window` steps; again only after it came back
    within half of that. It compares the fresh reward with its own past, not with the
    trained batch's, because the trained mean leaves out filtered groups (all right, or
    all wrong) and sits away from the fresh one in a healthy run."""

    def __init__(self, *, eta: int, lr: float, drop: float = 0.3, window: int = 3, eps_clip: float = 0.2,
                 lr_schedule: str = "constant", neg_behav_clip: float | None = 0.2) -> None:
        self.eta = eta
        self.lr = lr
        self.eps_clip = eps_clip
        self.lr_schedule = lr_schedule
        self.neg_behav_clip = neg_behav_clip
        self.drop = drop
        self.window = window
        self._recent: list[float] = []
        self._best: tuple[float, int] | None = None
        self._armed = True

    @classmethod
    def for_config(cls, cfg: Any) -> FreshRewardWatch:
        """The watch of a run (an `ExperimentConfig`): its η, and the settings its line names."""
        t = cfg.train
        return cls(eta=cfg.staleness.max_staleness, lr=t.lr, eps_clip=t.loss.eps_clip, lr_schedule=t.lr_schedule,
                   neg_behav_clip=t.loss.neg_behav_clip)

    def step(self, rec: dict[str, Any]) -> str | None:
        fresh = rec.get("reward_mean_all_groups")
        if fresh is None:
            return None
        self._recent = [*self._recent[-(self.window - 1):], float(fresh)]
        if len(self._recent) < self.window:
            return None
        now = sum(self._recent) / self.window
        step = int(rec.get("step", 0))
        if self._best is None or now > self._best[0]:
            self._best = (now, step)
        best, at = self._best
        if not self._armed:
            if best - now <= self.drop / 2:
                self._armed = True
            return None
        if best - now < self.drop:
            return None
        self._armed = False
        trained = rec.get("reward_mean")
        stale = (f" The batches being trained were sampled up to η={self.eta} versions ago"
                 + (f" and still score {trained:.2f}" if trained is not None else "")
                 + f", so the trained reward will show this only about {self.eta} steps from now.") if self.eta else ""
        # What kept every ablation run at η 4 and 8 from falling (docs/staleness.md, #34).
        fixes = []
        if self.eta >= 4 and self.neg_behav_clip is None:
            fixes.append("train.loss.neg_behav_clip=0.2 (the default; this run has it off)")
        if self.eta >= 4 and (self.eps_clip > 0.1 or self.lr_schedule == "constant"):
            fixes.append(f"train.loss.eps_clip=0.1 and train.lr_schedule=cosine (now {self.eps_clip:g} and "
                         f"{self.lr_schedule})")
        setting = (" With η ≥ 4 these kept every staleness ablation run from falling: " + "; or ".join(fixes) + "."
                   if fixes else "")
        return (f"the newest episodes' reward fell to {now:.2f} (mean of the last {self.window} steps) from "
                f"{best:.2f} at step {at}: the policy got worse.{stale} In the staleness ablation, runs like "
                f"this had collapsed (docs/staleness.md).{setting} Lower staleness.max_staleness or train.lr "
                f"(now {self.lr:g}), or resume from a checkpoint of step {at} or earlier")


class ConsoleNotes:
    """What the user reads while the trainer runs: each step (`on_step`), what it waits for
    (`on_wait`, else the log, one line every ~10 s), failing episodes (every ~60 s) — a
    printed line puts the next waiting note off."""

    def __init__(self, on_step: Callable[[dict[str, Any]], None] | None, on_wait: Callable[[str], None] | None) -> None:
        self.on_step = on_step
        self.on_wait = on_wait
        """Prints what the trainer waits for (the console's `Progress.waiting`); else the log."""
        self.wait_notes = WaitNotes()
        self.failure_notes = FailureNotes()

    def step(self, rec: dict[str, Any], evals: list[dict[str, Any]]) -> None:
        if self.on_step is None:
            return
        if evals:  # the last held-out evaluation, for the progress line
            rec = {**rec, "eval_accuracy": evals[-1]["accuracy"], "eval_version": evals[-1]["version"]}
        self.on_step(rec)
        self.wait_notes.printed()

    def warn(self, line: str) -> None:
        log.warning("%s", line)
        self.wait_notes.printed()

    def failures(self, msg: RolloutStats) -> None:
        line = self.failure_notes.report(msg)
        if line is not None:
            self.warn(line)

    def due(self) -> bool:
        """Whether a waiting note is due."""
        return self.wait_notes.due()

    def say(self, line: str) -> None:
        if self.on_wait is not None:
            self.on_wait(line)
        else:
            log.info("waiting: %s", line)
