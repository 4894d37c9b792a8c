"""The rollout side's policies, each one reason to change, called from the schedule in
`RolloutController.run` (docs/design.md §10.22):

    TrainerFollow  which trainer this side follows (run, epoch), and refusing a second controller
    EpisodeBook    every episode started and how it ended (invariant 5), and the groups' names
    EpisodeRunner  one episode: the agent loop, its reward, its timeout, its failure counted
    WeightsIn      weights in: join the trainer's weight group, load an announced version
    ServerHold     `cluster.colocate`: pause the servers while the trainer's step has the devices
    Evaluator      sampled accuracy on held-out rows per evaluated version, and its progress
    Outbox         frames out: stamped with this side's origin, the seconds spent sending and waiting
    GroupSizer     how many episodes the next prompt gets (`staleness.grow_groups_to`, §10.25)

They log under the controller's logger, so the run's log reads as it did before they
were split out of it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from pydantic import BaseModel

from areal_like.core.staleness import StalenessGate
from areal_like.core.types import (
    AgentLoopOutput,
    EpisodeOutcomes,
    EvalProgress,
    EvalResult,
    Origin,
    RolloutCounters,
    SamplingParams,
    Trajectory,
    VersionAnnouncement,
    WeightUpdateMeta,
)
from areal_like.orchestration.fail_fast import FailFast
from rollout_cluster.server_manager import NoServerAvailableError

__all__ = ["EpisodeBook", "EpisodeRunner", "Evaluator", "GroupSizer", "Outbox", "RolloutRefused", "ServerHold", "TrainerFollow",
           "WeightsIn", "episode_seed", "newest_weights_only"]

log = logging.getLogger("areal_like.orchestration.rollout_controller")

RunEpisode = Callable[[dict[str, Any], SamplingParams, str], Awaitable[AgentLoopOutput | None]]
Score = Callable[[dict[str, Any], AgentLoopOutput], Awaitable[float]]
Send = Callable[[BaseModel], Awaitable[None]]


class RolloutRefused(RuntimeError):
    """The trainer accepted another rollout controller for this run (one per run,
    docs/design.md §10.2): this one stops instead of feeding samples nobody counts."""


def episode_seed(seed: int, gid: str, i: int) -> int:
    """A stable per-episode seed (sampling randomness is a function of it and position)."""
    return (seed * 1_000_003 + zlib.crc32(f"{gid}/{i}".encode())) % (2**31 - 1)


def newest_weights_only(anns: list[VersionAnnouncement]) -> list[VersionAnnouncement]:
    """`anns` in order, with the weights of all but the newest weight-carrying one taken
    out. A weight update that failed slowly (a receiver times out) lets the trainer's
    resends pile up; loading them one by one, each already superseded, would keep this
    side behind for good."""
    with_weights = [i for i, a in enumerate(anns) if a.weights is not None]
    return [a.model_copy(update={"weights": None}) if a.weights is not None and i != with_weights[-1] else a
            for i, a in enumerate(anns)]


class TrainerFollow:
    """Which trainer this side follows: the run and the trainer epoch of its first
    announcement, then of every newer epoch (a trainer restarted with `--resume`).
    Announcements of another run are ignored (logged once per run), of an older epoch
    ignored quietly; a trainer that names another controller refuses this one."""

    def __init__(self) -> None:
        self.sender = uuid.uuid4().hex[:12]
        """This controller's id on the wire (one per start)."""
        self.run_id: str | None = None
        self.epoch = 0
        """The trainer epoch this side follows; frames are stamped with it."""
        self._ignored_runs: set[str] = set()

    def begin(self, ann: VersionAnnouncement) -> None:
        """The first announcement names the run and epoch to follow."""
        self.run_id, self.epoch = ann.trainer.run_id, ann.trainer.epoch

    def verdict(self, ann: VersionAnnouncement) -> Literal["ignore", "newer", "ours"]:
        if ann.trainer.run_id != self.run_id:
            if ann.trainer.run_id not in self._ignored_runs:
                self._ignored_runs.add(ann.trainer.run_id)
                log.error("ignoring announcements of another run (%s; this side follows %s)", ann.trainer.run_id,
                          self.run_id)
            return "ignore"
        if ann.trainer.epoch < self.epoch:
            return "ignore"  # an older trainer incarnation still publishing: not ours to follow
        return "newer" if ann.trainer.epoch > self.epoch else "ours"

    def refuse_if_another(self, ann: VersionAnnouncement) -> None:
        if ann.trainer.rollout_id is not None and ann.trainer.rollout_id != self.sender:
            who = ann.trainer
            raise RolloutRefused(f"the trainer of run {who.run_id} already has a rollout controller ({who.rollout_id}); "
                                 "one rollout controller per run: stop the other one first, or point this one at "
                                 "another trainer")

    def stamp(self, started: int) -> Origin:
        return Origin(run_id=self.run_id or "", epoch=self.epoch, sender=self.sender, started=started)


class GroupSizer:
    """How many episodes the next prompt gets (docs/design.md §10.25). Off (`largest` =
    `base`), always `base`. Else it watches the last `window` groups of the current size:
    when at least `grow_at` of them came back uniform (every reward equal: filtered, no
    GRPO signal) the size doubles, up to `largest`; when at most `shrink_at` did, it halves,
    down to `base`. If every prompt had the same success rate p, a group of n is uniform
    with chance p^n + (1−p)^n, so doubling squares the uniform share near saturation
    (0.75 → 0.56): the thresholds leave room between them so the size does not swing.
    Growth waits for three quarters, not half: while the policy still learns, half of the
    groups of 8 are already solved (held-out ~0.8 on the quickstart), and a grown group
    trains fewer prompts a step, which cost the climb to 0.9 a quarter more steps
    (docs/design.md §10.25)."""

    def __init__(self, base: int, largest: int = 0, window: int = 16, grow_at: float = 0.75,
                 shrink_at: float = 0.15) -> None:
        self.base, self.largest = base, max(base, largest)
        self.size = base
        self.window, self.grow_at, self.shrink_at = window, grow_at, shrink_at
        self._seen: list[bool] = []
        """Uniform or not, for the groups of the current size that ended (newest last)."""

    def ended(self, size: int, rewards: list[float]) -> None:
        """A group of `size` episodes ended with these rewards (its members that produced a
        sample). A group whose size is no longer current says nothing about the current one."""
        if self.largest == self.base or size != self.size or len(rewards) < 2:
            return
        self._seen = [*self._seen[-(self.window - 1):], len(set(rewards)) == 1]
        if len(self._seen) < self.window:
            return
        share = sum(self._seen) / len(self._seen)
        if share >= self.grow_at and self.size * 2 <= self.largest:
            self.size, self._seen = self.size * 2, []
            log.info("%.0f%% of the last %d groups were uniform: groups of %d episodes from now on "
                     "(staleness.grow_groups_to=%d)", 100 * share, self.window, self.size, self.largest)
        elif share <= self.shrink_at and self.size // 2 >= self.base:
            self.size, self._seen = self.size // 2, []
            log.info("%.0f%% of the last %d groups were uniform: groups of %d episodes from now on",
                     100 * share, self.window, self.size)


class EpisodeBook:
    """Every episode started ends in exactly one outcome (invariant 5): sent, rejected
    (the agent loop returned None), failed, or cancelled at stop. Groups are named
    `s{seed}-r{incarnation}[e{epoch}]-g{seq}`, unique across resumes (the incarnation is
    the trainer version this side started at); a group is *running* from its admission
    until its task ends, and *delivering* (no longer cancelled by a stop) once its
    episodes are done."""

    def __init__(self, group_size: int, seed: int) -> None:
        self.n = group_size
        self.seed = seed
        self.started = 0
        self.cancelled = 0
        self.outcomes = {"sent": 0, "rejected": 0, "failed": 0}
        self.reward_sum = 0.0
        self.running: dict[str, int] = {}
        """Running group id → loaded version when it was admitted."""
        self.delivering: set[str] = set()
        self.group_seq = 0
        self.incarnation = 0

    def new_group(self, epoch: int, loaded_version: int, size: int | None = None) -> str:
        gid = f"s{self.seed}-r{self.incarnation}{f'e{epoch}' if epoch else ''}-g{self.group_seq}"
        self.group_seq += 1
        self.started += self.n if size is None else size
        self.running[gid] = loaded_version
        return gid

    def ended(self, gid: str) -> None:
        self.running.pop(gid, None)

    def count(self, trajs: list[Trajectory], rejected: int, failed: int) -> None:
        self.outcomes["sent"] += len(trajs)
        self.reward_sum += sum(t.reward for t in trajs)
        self.outcomes["rejected"] += rejected
        self.outcomes["failed"] += failed

    def restart(self, incarnation: int) -> None:
        """A newer trainer epoch: counting starts afresh (the old epoch's episodes are its)."""
        self.incarnation = incarnation
        self.started = 0
        self.cancelled = 0
        self.outcomes = {k: 0 for k in self.outcomes}
        self.reward_sum = 0.0

    def seek(self, data_position: dict[str, int | str]) -> None:
        self.group_seq = int(data_position.get("group_seq", self.group_seq))

    def snapshot(self) -> EpisodeOutcomes:
        return EpisodeOutcomes(**self.outcomes, reward_sum=self.reward_sum)


class EpisodeRunner:
    """One episode of a group: the agent loop (`run_episode`), its reward (`score`), a
    seed of its own, `agent.episode_timeout_s`, and its end as a `Trajectory`, "rejected"
    or the reason it failed. Failures are counted in `fail_fast`, never raised: one bad
    episode must not stop the run, many do (fail_fast.py)."""

    def __init__(self, *, run_episode: RunEpisode, score: Score, sampling: SamplingParams, seed: int,
                 timeout_s: float, fail_fast: FailFast, wake: Callable[[], None]) -> None:
        self.run_episode = run_episode
        self.score = score
        self.sampling = sampling
        self.seed = seed
        self.timeout_s = timeout_s
        self.fail_fast = fail_fast
        self.wake = wake
        """Wakes the admission loop (a tripped fail-fast ends the run)."""

    async def one(self, row: dict[str, Any], gid: str, i: int) -> Trajectory | str:
        eid = f"{gid}-e{i}"
        sampling = self.sampling.model_copy(update={"seed": episode_seed(self.seed, gid, i)})

        async def attempt() -> tuple[AgentLoopOutput | None, float]:
            out = await self.run_episode(row, sampling, eid)
            return out, (await self.score(row, out) if out is not None else 0.0)

        task = asyncio.ensure_future(attempt())
        # An episode cancelled by the stop while its attempt fails: the error is counted
        # elsewhere or moot, never "Task exception was never retrieved" in the log.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            done, _ = await asyncio.wait({task}, timeout=self.timeout_s)
            if not done:  # a hung tool or server: stop it, free its capacity, say so
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                reason = f"EpisodeTimeout: longer than agent.episode_timeout_s={self.timeout_s:g}"
                self.fail_fast.episode(TimeoutError(reason))
                if self.fail_fast.should_log():
                    log.warning("episode %s failed: %s", eid, reason)
                return reason
            out, reward = task.result()
            self.fail_fast.episode(None)
            if out is None:
                return "rejected"
            return Trajectory(
                episode_id=eid,
                group_id=gid,
                prompt_ids=out.prompt_ids,
                response_ids=out.response_ids,
                response_mask=out.response_mask,
                response_logprobs=out.response_logprobs,
                response_versions=out.response_versions,
                reward=reward,
                temperature=sampling.temperature,
                truncated=out.truncated,
                num_turns=out.num_turns,
                metrics=out.metrics,
                stop_token_id=out.stop_token_id,
            )
        except asyncio.CancelledError:
            task.cancel()
            raise
        except Exception as e:  # one bad episode must not stop the run: count it, say why
            reason = f"{type(e).__name__}: {e}"
            self.fail_fast.episode(e)  # ... but many do (fail_fast.py)
            if self.fail_fast.should_log():
                log.warning("episode %s failed: %s (%d failed so far)", eid, reason, self.fail_fast.failed)
            if self.fail_fast.tripped is not None:
                self.wake()
            return reason[:300]


class WeightsIn:
    """Weights in: `join` the trainer's weight group (its store is in the announcement),
    `load` an announced version on the servers (they interrupt, recompute and resume by
    themselves). The gate admits against the version loaded (invariant 1); after a
    trainer restart nothing is admitted until its weights are loaded (`awaiting`)."""

    def __init__(self, *, apply: Callable[[WeightUpdateMeta], Awaitable[int]],
                 join: Callable[[VersionAnnouncement], Awaitable[None]] | None, gate: StalenessGate,
                 fail_fast: FailFast, wake: Callable[[], None], loaded_version: int) -> None:
        self.apply = apply
        self.join_weights = join
        self.gate = gate
        self.fail_fast = fail_fast
        self.wake = wake
        self.version = loaded_version
        self.awaiting = False
        gate.set_loaded_version(loaded_version)

    async def join(self, ann: VersionAnnouncement) -> None:
        if self.join_weights is not None:
            await self.join_weights(ann)

    async def load(self, meta: WeightUpdateMeta) -> int | None:
        """Take part in the announced transfer; the version now served, or None if it
        failed (the old version keeps serving; the next one retries). Every announced
        transfer is taken part in, the version served included (a resend for a restarted
        server, or a feed that crossed a load): the sender waits for its known receivers,
        up to weight_sync.timeout_s, and one that skips a transfer held the trainer's next
        publish for that long. The servers receive it and load nothing."""
        if meta.version < self.version:
            return None
        try:
            version = await self.apply(meta)
        except NoServerAvailableError as e:  # the servers died with the update: the run ends
            self.fail_fast.no_server_left(e)
            self.wake()
            return None
        except Exception as e:  # keep serving the old version; the next one retries
            log.error("weight update to v%d failed, still serving v%d: %s", meta.version, self.version, e)
            return None
        self.version = version
        self.gate.set_loaded_version(version)
        self.awaiting = False
        return version

    def forget(self) -> None:
        """A newer trainer epoch: its weights replace whatever is loaded, before anything is admitted."""
        self.version = -1
        self.awaiting = True


class ServerHold:
    """`cluster.colocate`: the trainer wants the devices for a step (a hold number > 0):
    pause every server, then say so in a report, which the trainer waits for; or it is
    done (0): let them run. Requests keep their state and finish later."""

    def __init__(self, hold_servers: Callable[[bool], Awaitable[None]] | None,
                 report: Callable[[], Awaitable[None]]) -> None:
        self.hold_servers = hold_servers
        """Pause (True) or resume (False) every server."""
        self.report = report
        self.number = 0
        """The trainer's hold number the servers are paused for (0: they run)."""

    async def set(self, number: int) -> None:
        if bool(number) != bool(self.number):
            if self.hold_servers is not None:
                await self.hold_servers(bool(number))
            elif number:
                log.warning("the trainer asked this rollout side to hold its servers (cluster.colocate), "
                            "but it has none to pause")
        self.number = number
        if number:
            await self.report()

    async def follow(self, ann: VersionAnnouncement, *, before_weights: bool) -> None:
        """Before the weights: wake servers that slept for the step (they must be awake to
        load); after them: pause for a new hold."""
        if before_weights:
            if self.number and (not ann.hold or ann.stop):
                await self.set(0)
        elif ann.hold and not ann.stop and ann.hold != self.number:
            await self.set(ann.hold)


class Evaluator:
    """Sampled accuracy on held-out rows (not trained on) with the weights of a version:
    the first loaded, every `eval.every_n_steps`-th, and the last. While the run ends the
    evaluation under way is reported (`progress`), and it may finish within
    `eval.final_timeout_s` (`finish`)."""

    def __init__(self, *, rows: list[dict[str, Any]], every: int, sampling: SamplingParams, seed: int,
                 timeout_s: float, episodes: EpisodeRunner,
                 report: Callable[[int, EvalResult], Awaitable[None]], first_after: int = 0,
                 uniform_filtered: bool = True) -> None:
        self.rows = rows
        self.every = every
        self.sampling = sampling
        self.seed = seed
        self.timeout_s = timeout_s
        self.episodes = episodes
        """Whose `run_episode` and `score` evaluate (the training episodes')."""
        self.report = report
        self.tasks: list[asyncio.Task[None]] = []
        self._evaluated: set[int] = set()
        self._progress: dict[int, EvalProgress] = {}
        """Version → the evaluation under way (reported while the run ends)."""
        self.skip = False
        """Ctrl-C on the trainer: no evaluation is waited for."""
        self.baseline: asyncio.Task[None] | None = None
        """The start version's evaluation, while a newer version must wait for it."""
        self.first_after = first_after
        """Prompts' worth of groups the first train step needs (`train.batch_size`): the start
        version is evaluated once they are in, so its evaluation never holds up that step."""
        self.uniform_filtered = uniform_filtered
        self._trainable = 0
        self._admitted_at: float | None = None
        self._first_done = False

    def admitted(self) -> None:
        """Training groups were admitted (the first time starts the 30 s fallback)."""
        self._admitted_at = self._admitted_at or time.monotonic()

    def group_ended(self, rewards: list[float], prompts: int) -> None:
        """A training group ended: one the trainer keeps counts toward the first step."""
        if len(set(rewards)) > 1 or (rewards and not self.uniform_filtered):
            self._trainable += prompts

    def maybe_first(self, version: int, due: bool = False) -> None:
        """The start version is evaluated once the groups of the first train step are in (the
        engines serve those first; the evaluation's requests then queue ahead of later
        groups'), when a newer version comes (`due`: it waits for this evaluation), or 30 s
        after the first groups without them: a base model that rarely succeeds still gets
        its baseline. Nothing before the first groups are admitted."""
        if self._first_done or self._admitted_at is None:
            return
        if due or self._trainable >= self.first_after or time.monotonic() - self._admitted_at >= 30.0:
            self._first_done = True
            self.first(version)

    def first(self, version: int) -> None:
        """The version this side starts on is evaluated, whatever its number."""
        if self.every:
            self.start(version)
            self.baseline = self.tasks[-1] if self.tasks else None

    async def baseline_ends(self) -> None:
        """A newer version waits (≤ `timeout_s`) for the start version's evaluation, so the
        run's baseline is scored on its own weights only. It started once the first step's
        groups were in, so this holds a version back a few seconds at most."""
        if self.baseline is not None and not self.baseline.done():
            log.info("the next weights wait for the start version's evaluation to end")
            await asyncio.wait([self.baseline], timeout=self.timeout_s)
        self.baseline = None

    def loaded(self, version: int, previous: int) -> None:
        """Every `every`-th version is evaluated or, where this side skipped it (updates queued
        behind a slow one load only the newest), the first version loaded past it."""
        if self.every and version != previous and (
                version % self.every == 0 or version // self.every > previous // self.every):
            self.start(version)

    def start(self, version: int) -> None:
        if self.rows and version not in self._evaluated:
            self._evaluated.add(version)
            self.tasks.append(asyncio.create_task(self._evaluate(version)))

    def progress(self) -> EvalProgress | None:
        return max(self._progress.values(), key=lambda p: p.version, default=None)

    async def _evaluate(self, version: int) -> None:
        progress = self._progress[version] = EvalProgress(version=version, done=0, total=len(self.rows))
        # The start version's evaluation is the run's baseline: it starts once the first step's groups
        # are in and queues ahead of later groups, so it mostly ends before the first update. Later
        # ones take the slots training episodes leave (`SamplingParams.priority`); an update that
        # lands meanwhile shows in `max_token_version`.
        priority = 0 if not self._evaluated - {version} else 1
        newest = [version]

        async def one(k: int, row: dict[str, Any]) -> float:
            sp = self.sampling.model_copy(update={"seed": episode_seed(self.seed + 7, f"eval{version}", k),
                                                  "priority": priority})
            try:
                out = await self.episodes.run_episode(row, sp, f"eval-v{version}-{k}")
                if out is not None and out.response_versions:
                    newest.append(max(out.response_versions))
                return 0.0 if out is None else float(await self.episodes.score(row, out))
            except asyncio.CancelledError:
                raise
            except Exception:
                return 0.0
            finally:
                progress.done += 1

        t0 = time.time()
        try:
            scores = await asyncio.gather(*(one(k, r) for k, r in enumerate(self.rows)))
        finally:
            self._progress.pop(version, None)
        acc = sum(1 for s in scores if s >= 1.0) / max(len(scores), 1)
        await self.report(version, EvalResult(accuracy=acc, reward_mean=sum(scores) / max(len(scores), 1),
                                              seconds=time.time() - t0, num_samples=len(scores),
                                              max_token_version=max(newest)))

    async def finish(self, *, may_wait: bool, announce: Callable[[], Awaitable[None]]) -> None:
        """The last version's evaluation is the one users look at: let it finish on idle
        servers (not when episodes keep failing, `may_wait` False: it would fail too, and
        the error waits for it), the trainer told at once what it waits for."""
        pending = [t for t in self.tasks if not t.done()]
        if pending and may_wait and not self.skip:
            await announce()
            await asyncio.wait(pending, timeout=self.timeout_s)

    def cancel(self) -> list[asyncio.Task[None]]:
        for t in self.tasks:
            t.cancel()
        return self.tasks


class Outbox:
    """Frames out through `transport` (the data channel's sender): each stamped with this
    side's origin (`TrainerFollow`, the episodes started so far), and the seconds spent
    sending and admitting nothing, by why (`seconds`), for the step's time budget
    (docs/design.md §10.19), reported with the servers' `counters`."""

    def __init__(self, transport: Send, follow: TrainerFollow, book: EpisodeBook,
                 counters: Callable[[], RolloutCounters]) -> None:
        self.transport = transport
        self.follow = follow
        self.book = book
        self.counters = counters
        self.seconds = {"send": 0.0, "wait_gate": 0.0, "wait_concurrency": 0.0, "wait_weights": 0.0}

    async def send(self, msg: Any) -> None:
        msg.origin = self.follow.stamp(self.book.started)
        t0 = time.perf_counter()
        try:
            await self.transport(msg)
        finally:
            self.seconds["send"] += time.perf_counter() - t0

    def waited(self, why: str, seconds: float) -> None:
        self.seconds[why] += seconds

    def budget(self) -> RolloutCounters:
        c = self.counters()
        return c.model_copy(update={"seconds": c.seconds.model_copy(update=dict(self.seconds))})
