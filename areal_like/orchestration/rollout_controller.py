"""The rollout side's schedule: prompts → gate → agent-loop groups → trainer.

    while not stopped:
        admit whole groups while the staleness gate allows      (invariant 1)
        each group: n episodes of one prompt, scored, sent as one TrajectoryGroup
        wait until something changes (a group ends, an announcement arrives)
    control task: trainer announcements → gate counts; new weights → engines
                  (the engines interrupt, recompute and resume by themselves)

The controller does not know engines, sockets or Ray: it is handed
`run_episode`, `score`, `send` and `apply_weights` and drives them (prime-rl's
orchestrator style), so tests run it with fakes and the launcher with the real
thing. Every episode started ends in exactly one outcome: sent, rejected (the agent
loop returned None), failed (it raised, or its reward did), or cancelled at stop.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from pydantic import BaseModel

from areal_like.core.staleness import StalenessGate
from areal_like.core.types import (
    AgentLoopOutput,
    EpisodeOutcomes,
    EvalProgress,
    EvalResult,
    GateSnapshot,
    Origin,
    RolloutCounters,
    RolloutStats,
    SamplingParams,
    Trajectory,
    TrajectoryGroup,
    VersionAnnouncement,
    WeightUpdateMeta,
)
from areal_like.orchestration.dataset import PromptSource
from areal_like.orchestration.fail_fast import FailFast
from rollout_cluster.server_manager import NoServerAvailableError

__all__ = ["RolloutController", "RolloutRefused"]

log = logging.getLogger(__name__)

class RolloutRefused(RuntimeError):
    """The trainer accepted another rollout controller for this run (one per run,
    docs/design.md §10.2): this one stops instead of feeding samples nobody counts."""


RunEpisode = Callable[[dict[str, Any], SamplingParams, str], Awaitable[AgentLoopOutput | None]]
Score = Callable[[dict[str, Any], AgentLoopOutput], Awaitable[float]]


class RolloutController:
    def __init__(
        self,
        *,
        gate: StalenessGate,
        source: PromptSource,
        group_size: int,
        sampling: SamplingParams,
        run_episode: RunEpisode,
        score: Score,
        send: Callable[[BaseModel], Awaitable[None]],
        apply_weights: Callable[[WeightUpdateMeta], Awaitable[int]],
        join_weights: Callable[[VersionAnnouncement], Awaitable[None]] | None = None,
        hold_servers: Callable[[bool], Awaitable[None]] | None = None,
        counters: Callable[[], RolloutCounters] = RolloutCounters,
        eval_rows: list[dict[str, Any]] | None = None,
        eval_every: int = 0,
        eval_sampling: SamplingParams | None = None,
        loaded_version: int = 0,
        seed: int = 0,
        stats_every_s: float = 2.0,
        eval_timeout_s: float = 60.0,
        episode_timeout_s: float = 600.0,
        fail_fast: FailFast | None = None,
    ) -> None:
        self.gate = gate
        self.source = source
        self.n = group_size
        self.sampling = sampling
        self.run_episode = run_episode
        self.score = score
        self.send = send
        self.apply_weights = apply_weights
        self.join_weights = join_weights
        self.hold_servers = hold_servers
        """`cluster.colocate`: pause (True) or resume (False) every server, for the trainer's step."""
        self._held = 0
        """The trainer's hold number the servers are paused for (0: they run)."""
        self.counters = counters
        self.eval_rows = eval_rows or []
        self.eval_every = eval_every
        self.eval_sampling = eval_sampling or sampling
        self.loaded_version = loaded_version
        self.seed = seed
        self.stats_every_s = stats_every_s
        self.eval_timeout_s = eval_timeout_s
        self.episode_timeout_s = episode_timeout_s
        self._admitted: dict[str, int] = {}
        """Running group id → loaded version when it was admitted."""
        self.fail_fast = fail_fast or FailFast()
        """Stops the run (`RolloutFailedError`) when episodes keep failing (fail_fast.py)."""
        self.announcements: asyncio.Queue[VersionAnnouncement] = asyncio.Queue()
        self.started = 0
        self.cancelled = 0
        self.outcomes = {"sent": 0, "rejected": 0, "failed": 0}
        self.reward_sum = 0.0
        self._groups: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._group_seq = 0
        self._incarnation = 0
        self.sender = uuid.uuid4().hex[:12]
        """This controller's id on the wire (one per start)."""
        self.run_id: str | None = None
        self.epoch = 0
        """The trainer epoch this side follows; frames are stamped with it."""
        self._awaiting_weights = False
        """After a trainer restart: admit nothing until its weights are loaded."""
        self._ignored_runs: set[str] = set()
        """Trainer version when this rollout side started: episode ids stay unique across resumes."""
        self._sending: set[str] = set()
        self.seconds = {"send": 0.0, "wait_gate": 0.0, "wait_concurrency": 0.0, "wait_weights": 0.0}
        """Cumulative seconds for the step's time budget (docs/design.md §10.19): in `send`,
        and admitting nothing (`_shut`: why)."""
        self._eval_tasks: list[asyncio.Task[None]] = []
        self._evaluated: set[int] = set()
        self._eval_progress: dict[int, EvalProgress] = {}
        """Version → the evaluation under way (reported while the run ends)."""
        self._skip_evals = False
        gate.set_loaded_version(loaded_version)

    # ---- the schedule ---------------------------------------------------------------
    async def run(self) -> None:
        await self._first_announcement()
        control = asyncio.create_task(self._control_loop(), name="rollout-control")
        stats = asyncio.create_task(self._stats_loop(), name="rollout-stats")
        if self.eval_every:
            self._start_eval(self.loaded_version)
        try:
            while not self._stop.is_set():
                admitted = 0
                while not self._stop.is_set() and not self._awaiting_weights and self.gate.try_admit(self.n):
                    self._spawn_group(self.source.next())
                    admitted += 1
                if admitted:  # the trainer learns of new groups now, not at the next report
                    await self._send(self._stamp(self._stats()))
                self._wake.clear()
                if control.done():
                    control.result()  # surface a crashed control task
                shut = self._shut()
                t0 = time.perf_counter()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=1.0)
                except TimeoutError:
                    pass
                self.seconds[shut] += time.perf_counter() - t0
                self.fail_fast.raise_if_tripped()
        finally:
            await self._shutdown(control, stats)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    async def stopping(self) -> None:
        """Returns once the controller winds down (the trainer's goodbye, or `stop()`)."""
        await self._stop.wait()

    def _spawn_group(self, row: dict[str, Any]) -> None:
        gid = f"s{self.seed}-r{self._incarnation}{f'e{self.epoch}' if self.epoch else ''}-g{self._group_seq}"
        self._group_seq += 1
        self.started += self.n
        self._admitted[gid] = self.loaded_version
        task = asyncio.create_task(self._run_group(row, gid), name=gid)
        self._groups.add(task)
        task.add_done_callback(self._groups.discard)
        task.add_done_callback(lambda t: self._admitted.pop(t.get_name(), None))

    async def _run_group(self, row: dict[str, Any], gid: str) -> None:
        epoch = self.epoch
        results = await asyncio.gather(*(self._episode(row, gid, i) for i in range(self.n)))
        self._sending.add(gid)  # from here on the group is delivered, not cancelled
        trajs = [r for r in results if isinstance(r, Trajectory)]
        reasons = [r for r in results if isinstance(r, str) and r != "rejected"]
        rejected = sum(1 for r in results if r == "rejected")
        self.fail_fast.group(len(reasons), self.n)
        group = TrajectoryGroup(
            group_id=gid, trajectories=trajs, failed=len(reasons), rejected=rejected, failure_reasons=reasons[:4]
        )
        await self._send(self._stamp(group))
        # a prompt every sample solves, again and again, may be skipped
        self.source.record(row, [t.reward for t in trajs], self.n)
        if epoch != self.epoch:  # the trainer restarted meanwhile: the old epoch's, not counted here
            self._sending.discard(gid)
            return
        self.outcomes["sent"] += len(trajs)
        self.reward_sum += sum(t.reward for t in trajs)
        self.outcomes["rejected"] += rejected
        self.outcomes["failed"] += len(reasons)
        self.gate.on_group_done(self.n, len(trajs))
        self._sending.discard(gid)
        self._wake.set()

    async def _episode(self, row: dict[str, Any], gid: str, i: int) -> Trajectory | str:
        eid = f"{gid}-e{i}"
        sampling = self.sampling.model_copy(update={"seed": _episode_seed(self.seed, gid, i)})

        async def attempt() -> tuple[AgentLoopOutput | None, float]:
            out = await self.run_episode(row, sampling, eid)
            return out, (await self.score(row, out) if out is not None else 0.0)

        task = asyncio.ensure_future(attempt())
        # An episode cancelled by the stop while its attempt fails: the error is counted
        # elsewhere or moot, never "Task exception was never retrieved" in the log.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            done, _ = await asyncio.wait({task}, timeout=self.episode_timeout_s)
            if not done:  # a hung tool or server: stop it, free its capacity, say so
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                reason = f"EpisodeTimeout: longer than agent.episode_timeout_s={self.episode_timeout_s:g}"
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
                self._wake.set()
            return reason[:300]

    # ---- control: announcements and weights ------------------------------------------------
    async def _first_announcement(self) -> None:
        """Admit nothing before the trainer has spoken: it may be at a later version (a
        resume, or this side joining a running trainer) whose weights must be loaded
        first, and at a later data position. A first report introduces this controller,
        so the trainer accepts it and hands it the current weights."""
        ann = await self.announcements.get()
        self._incarnation = ann.version
        self.run_id, self.epoch = ann.run_id, ann.epoch
        self._refuse_if_another(ann)  # before the weight group: a refused side must not join it
        if self.join_weights is not None:
            await self.join_weights(ann)
        if ann.data_position is not None:
            self.source.load_state_dict(ann.data_position)
            self._group_seq = int(ann.data_position.get("group_seq", self._group_seq))
        await self._apply_announcement(ann)
        await self._send(self._stamp(self._stats()))  # hello: the trainer accepts us and sends its weights
        while self.loaded_version < ann.version and not self._stop.is_set():
            ann = await self.announcements.get()
            await self._apply_announcement(ann)

    async def _control_loop(self) -> None:
        while True:
            for ann in self._newest_weights_only([await self.announcements.get()]):
                await self._apply_announcement(ann)

    def _newest_weights_only(self, anns: list[VersionAnnouncement]) -> list[VersionAnnouncement]:
        """`anns` and every announcement queued behind them, in order, with the weights of
        all but the newest weight-carrying one taken out. A weight update that failed slowly
        (a receiver times out) lets the trainer's resends pile up; loading them one by one,
        each already superseded, would keep this side behind for good."""
        while True:
            try:
                anns.append(self.announcements.get_nowait())
            except asyncio.QueueEmpty:
                break
        with_weights = [i for i, a in enumerate(anns) if a.weights is not None]
        return [a.model_copy(update={"weights": None}) if a.weights is not None and i != with_weights[-1] else a
                for i, a in enumerate(anns)]

    async def _apply_announcement(self, ann: VersionAnnouncement) -> None:
        if ann.run_id != self.run_id:
            if ann.run_id not in self._ignored_runs:
                self._ignored_runs.add(ann.run_id)
                log.error("ignoring announcements of another run (%s; this side follows %s)", ann.run_id, self.run_id)
            return
        if ann.epoch < self.epoch:
            return  # an older trainer incarnation still publishing: not ours to follow
        if ann.epoch > self.epoch:
            await self._rebase(ann)
        self._refuse_if_another(ann)
        self.gate.on_trainer_counts(ann.consumed, ann.dropped, ann.sent_base)
        if self._held and (not ann.hold or ann.stop):
            await self._hold(0)  # first: a server that slept for the step must be awake to load weights
        meta = ann.weights
        again = meta is not None and meta.version == self.loaded_version
        # Every announced transfer is taken part in, the version served included (a resend
        # for a restarted server, or a feed that crossed a load): the sender waits for its
        # known receivers, up to weight_sync.timeout_s, and one that skips a transfer held
        # the trainer's next publish for that long. The servers receive it and load nothing.
        if meta is not None and meta.version >= self.loaded_version:
            try:
                version = await self.apply_weights(meta)
            except NoServerAvailableError as e:  # the servers died with the update: the run ends
                self.fail_fast.no_server_left(e)
                self._wake.set()
            except Exception as e:  # keep serving the old version; the next one retries
                log.error("weight update to v%d failed, still serving v%d: %s", meta.version, self.loaded_version, e)
            else:
                self.loaded_version = version
                self.gate.set_loaded_version(version)
                self._awaiting_weights = False
                if self.eval_every and version % self.eval_every == 0 and not again:
                    self._start_eval(version)
        if ann.hold and not ann.stop and ann.hold != self._held:
            await self._hold(ann.hold)
        if ann.stop:
            if ann.final_eval:
                self._start_eval(self.loaded_version)  # the final version is always evaluated
            else:
                self._skip_evals = True  # Ctrl-C on the trainer: stop now
            self.stop()
        self._wake.set()

    def _refuse_if_another(self, ann: VersionAnnouncement) -> None:
        if ann.rollout_id is not None and ann.rollout_id != self.sender:
            raise RolloutRefused(f"the trainer of run {ann.run_id} already has a rollout controller ({ann.rollout_id}); "
                                 "one rollout controller per run: stop the other one first, or point this one at "
                                 "another trainer")

    async def _hold(self, number: int) -> None:
        """`cluster.colocate`: the trainer wants the devices for a step (`number` > 0):
        pause every server, then say so in a report, which the trainer waits for; or it
        is done (0): let them run. Requests keep their state and finish later."""
        if bool(number) != bool(self._held):
            if self.hold_servers is not None:
                await self.hold_servers(bool(number))
            elif number:
                log.warning("the trainer asked this rollout side to hold its servers (cluster.colocate), "
                            "but it has none to pause")
        self._held = number
        if number:
            await self._send(self._stamp(self._stats()))

    async def _rebase(self, ann: VersionAnnouncement) -> None:
        """The trainer restarted (a newer epoch, after `--resume`): what runs belongs to
        the old epoch's accounting, which the new trainer restarted from its checkpoint.
        Cancel it, start counting afresh, re-base the gate on the announcement and admit
        nothing until the new trainer's weights are loaded (docs/design.md §10.3)."""
        running = [t for t in self._groups if t.get_name() not in self._sending]
        log.warning("the trainer restarted (epoch %d -> %d, at v%d): cancelling %d running groups of the old epoch "
                    "and re-basing on its announcement", self.epoch, ann.epoch, ann.version, len(running))
        for t in running:
            t.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        self.epoch = ann.epoch
        self._incarnation = ann.version
        self.started = 0
        self.cancelled = 0
        self.outcomes = {k: 0 for k in self.outcomes}
        self.reward_sum = 0.0
        self.gate.rebase()
        if self._held:  # the old trainer's step is over
            await self._hold(0)
        self.loaded_version = -1
        self._awaiting_weights = True
        if self.join_weights is not None:
            await self.join_weights(ann)
        if ann.data_position is not None:
            self.source.load_state_dict(ann.data_position)
            self._group_seq = int(ann.data_position.get("group_seq", self._group_seq))

    # ---- reporting ------------------------------------------------------------------------
    def _stats(self, kind: Literal["stats", "final"] = "stats") -> RolloutStats:
        return RolloutStats(
            kind=kind,
            time=time.time(),
            loaded_version=self.loaded_version,
            started=self.started,
            running=self.gate.s.running,
            cancelled=self.cancelled,
            gate=GateSnapshot(**self.gate.state_dict(), capacity=self.gate.capacity),
            outcomes=EpisodeOutcomes(**self.outcomes, reward_sum=self.reward_sum),
            data_position=self.data_position(),
            counters=self.counters().model_copy(update={f"{k}_seconds_total": v for k, v in self.seconds.items()}),
            held=self._held,
            running_groups=dict(self._admitted),
            failures=self.fail_fast.report(),
            stopping=self._stop.is_set(),
            eval_progress=max(self._eval_progress.values(), key=lambda p: p.version, default=None),
        )

    def _shut(self) -> str:
        """Why the admission loop admits nothing more: awaiting a restarted trainer's weights,
        η's bound (waiting for the trainer's next version), or `max_concurrent` episodes
        running (the servers have all the work they may take)."""
        if self._awaiting_weights:
            return "wait_weights"
        g = self.gate
        if g.capacity - g.accepted - g.s.running < self.n:
            return "wait_gate"
        return "wait_concurrency"

    async def _send(self, msg: BaseModel) -> None:
        t0 = time.perf_counter()
        try:
            await self.send(msg)
        finally:
            self.seconds["send"] += time.perf_counter() - t0

    def _stamp(self, msg: TrajectoryGroup | RolloutStats) -> TrajectoryGroup | RolloutStats:
        msg.origin = Origin(run_id=self.run_id or "", epoch=self.epoch, sender=self.sender, started=self.started)
        return msg

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(self.stats_every_s)
            await self._send(self._stamp(self._stats()))

    def _start_eval(self, version: int) -> None:
        if self.eval_rows and version not in self._evaluated:
            self._evaluated.add(version)
            self._eval_tasks.append(asyncio.create_task(self._evaluate(version)))

    async def _evaluate(self, version: int) -> None:
        """Sampled accuracy on held-out rows with the weights of `version` (not trained on)."""
        progress = self._eval_progress[version] = EvalProgress(version=version, done=0, total=len(self.eval_rows))

        async def one(k: int, row: dict[str, Any]) -> float:
            sp = self.eval_sampling.model_copy(update={"seed": _episode_seed(self.seed + 7, f"eval{version}", k)})
            try:
                out = await self.run_episode(row, sp, f"eval-v{version}-{k}")
                return 0.0 if out is None else float(await self.score(row, out))
            except asyncio.CancelledError:
                raise
            except Exception:
                return 0.0
            finally:
                progress.done += 1

        t0 = time.time()
        try:
            scores = await asyncio.gather(*(one(k, r) for k, r in enumerate(self.eval_rows)))
        finally:
            self._eval_progress.pop(version, None)
        acc = sum(1 for s in scores if s >= 1.0) / max(len(scores), 1)
        stats = RolloutStats(
            kind="eval",
            time=time.time(),
            loaded_version=version,
            started=self.started,
            running=self.gate.s.running,
            eval=EvalResult(accuracy=acc, reward_mean=sum(scores) / max(len(scores), 1), seconds=time.time() - t0,
                            num_samples=len(scores)),
        )
        await self._send(self._stamp(stats))

    async def _shutdown(self, control: asyncio.Task[None], stats: asyncio.Task[None]) -> None:
        """Wind down in the order that frees the servers soonest: cancel the training
        episodes (nothing will train them), then let the last evaluation finish on idle
        servers, reporting progress all along (the trainer waits for the final report as
        long as it hears from this side), then the final report."""
        control.cancel()
        running = list(self._groups)
        for t in running:
            if t.get_name() not in self._sending:
                t.cancel()
        await asyncio.gather(*running, control, return_exceptions=True)
        pending = [t for t in self._eval_tasks if not t.done()]
        if pending and self.fail_fast.tripped is None and not self._skip_evals:
            # The last version's evaluation is the one users look at: let it finish (not
            # when episodes keep failing: it would fail too, and the error waits for it).
            await self._send(self._stamp(self._stats()))  # the trainer hears at once what it waits for
            await asyncio.wait(pending, timeout=self.eval_timeout_s)
        stats.cancel()
        for t in self._eval_tasks:
            t.cancel()
        await asyncio.gather(stats, *self._eval_tasks, return_exceptions=True)
        self.cancelled = self.gate.s.running
        self.gate.on_cancel(self.cancelled)
        await self._send(self._stamp(self._stats("final")))

    # ---- recovery ---------------------------------------------------------------------------
    def data_position(self) -> dict[str, int]:
        return {**self.source.state_dict(), "group_seq": self._group_seq}


def _episode_seed(seed: int, gid: str, i: int) -> int:
    """A stable per-episode seed (sampling randomness is a function of it and position)."""
    import zlib

    return (seed * 1_000_003 + zlib.crc32(f"{gid}/{i}".encode())) % (2**31 - 1)
