"""The rollout side's schedule: prompts → gate → agent-loop groups → trainer.

    first announcement: follow its run and epoch, join the weight group, load its weights
    while not stopped:
        admit whole groups while the staleness gate allows      (invariant 1)
        each group: n episodes of one prompt, scored, sent as one TrajectoryGroup
        wait until something changes (a group ends, an announcement arrives)
    control task: trainer announcements → gate counts; new weights → engines
                  (the engines interrupt, recompute and resume by themselves)
    stop: cancel the training episodes, let the last evaluation finish, final report

`drive_rollout` runs it beside `TrainerLink.listen`, a task on the same event loop: it
awaits the asyncio-native control subscriber (`zmq.asyncio`, no thread), hands each
announcement to the controller, passes the acknowledgements it carries to the data
pusher (which then resends what a reconnect may have lost) and judges the trainer's
silence. Sends go through `asyncio.to_thread` (`make_sender`) so a slow trainer
back-pressures one group, never the event loop.

`run` is that schedule, line for line (docs/design.md §10.22 maps each arrow of the
cycle to its line); each policy it applies is a collaborator of its own
(`rollout_policies`): which trainer it follows (`TrainerFollow`), the episode counts
(`EpisodeBook`), one episode (`EpisodeRunner`), weights in (`WeightsIn`), the colocate
hold (`ServerHold`), evaluations (`Evaluator`) and frames out (`Outbox`).

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
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel

from areal_like.core.staleness import StalenessGate
from areal_like.core.types import (
    EvalResult,
    GateSnapshot,
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
from areal_like.orchestration.rollout_policies import (
    EpisodeBook,
    EpisodeRunner,
    Evaluator,
    GroupSizer,
    Outbox,
    RolloutRefused,
    RunEpisode,
    Score,
    ServerHold,
    TrainerFollow,
    WeightsIn,
    newest_weights_only,
)

if TYPE_CHECKING:
    from areal_like.orchestration.channels import ControlSubscriber, DataPusher

__all__ = ["RolloutController", "RolloutRefused", "TrainerLink", "TrainerLostError", "drive_rollout", "make_sender"]

log = logging.getLogger(__name__)


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
        resize_pool: Callable[[int], None] | None = None,
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
        grow_groups_to: int = 0,
        first_eval_after: int = 0,
        uniform_filtered: bool = True,
    ) -> None:
        self.gate = gate
        self.source = source
        self.n = group_size
        self.sizer = GroupSizer(group_size, grow_groups_to)
        """The next prompt's episodes: `group_size`, or more once most groups are uniform (§10.25)."""
        self.stats_every_s = stats_every_s
        self.fail_fast = fail_fast or FailFast()
        """Stops the run (`RolloutFailedError`) when episodes keep failing (fail_fast.py)."""
        self.announcements: asyncio.Queue[VersionAnnouncement] = asyncio.Queue()
        self._groups: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self.follow = TrainerFollow()
        self.book = EpisodeBook(group_size, seed)
        self.episodes = EpisodeRunner(run_episode=run_episode, score=score, sampling=sampling, seed=seed,
                                      timeout_s=episode_timeout_s, fail_fast=self.fail_fast, wake=self._wake.set)
        self.weights = WeightsIn(apply=apply_weights, join=join_weights, gate=gate, fail_fast=self.fail_fast,
                                 wake=self._wake.set, loaded_version=loaded_version)
        self.outbox = Outbox(send, self.follow, self.book, counters)
        self.hold = ServerHold(hold_servers, report=self._report)
        self.resize_pool = resize_pool
        """Asked for a server count by an announcement: the elastic pool (docs/design.md §10.24)."""
        self.evals = Evaluator(rows=eval_rows or [], every=eval_every, sampling=eval_sampling or sampling, seed=seed,
                               timeout_s=eval_timeout_s, episodes=self.episodes, report=self._report_eval,
                               first_after=first_eval_after, uniform_filtered=uniform_filtered)

    # ---- the schedule ---------------------------------------------------------------
    async def run(self) -> None:
        await self._first_announcement()  # its run, epoch, weight group and weights
        control = asyncio.create_task(self._control_loop(), name="rollout-control")  # announcements → gate, weights
        stats = asyncio.create_task(self._stats_loop(), name="rollout-stats")  # a report every stats_every_s
        try:
            while not self._stop.is_set():
                admitted = 0
                while not self._stop.is_set() and not self.weights.awaiting and self.gate.try_admit(self.sizer.size):
                    self._spawn_group(self.source.next(), self.sizer.size)  # n episodes → one TrajectoryGroup → trainer
                    admitted += 1
                if admitted:
                    self.evals.admitted()
                self.evals.maybe_first(self.loaded_version)
                if admitted:  # the trainer learns of new groups now, not at the next report
                    await self._report()
                self._wake.clear()
                if control.done():
                    control.result()  # surface a crashed control task
                shut = self._shut()
                t0 = time.perf_counter()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=1.0)  # a group ended, an announcement came
                except TimeoutError:
                    pass
                self.outbox.waited(shut, time.perf_counter() - t0)
                self.fail_fast.raise_if_tripped()
        finally:
            await self._shutdown(control, stats)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    async def stopping(self) -> None:
        """Returns once the controller winds down (the trainer's goodbye, or `stop()`)."""
        await self._stop.wait()

    @property
    def loaded_version(self) -> int:
        """The newest version the servers have loaded (the gate's `v`)."""
        return self.weights.version

    def _spawn_group(self, row: dict[str, Any], n: int) -> None:
        gid = self.book.new_group(self.follow.epoch, self.loaded_version, n)
        task = asyncio.create_task(self._run_group(row, gid, n), name=gid)
        self._groups.add(task)
        task.add_done_callback(self._groups.discard)
        task.add_done_callback(lambda t: self.book.ended(t.get_name()))

    async def _run_group(self, row: dict[str, Any], gid: str, n: int) -> None:
        epoch = self.follow.epoch
        results = await asyncio.gather(*(self._episode(row, gid, i) for i in range(n)))
        self.book.delivering.add(gid)  # from here on the group is delivered, not cancelled
        trajs = [r for r in results if isinstance(r, Trajectory)]
        reasons = [r for r in results if isinstance(r, str) and r != "rejected"]
        rejected = sum(1 for r in results if r == "rejected")
        self.fail_fast.group(len(reasons), n)
        group = TrajectoryGroup(
            group_id=gid, trajectories=trajs, failed=len(reasons), rejected=rejected, failure_reasons=reasons[:4]
        )
        await self.outbox.send(group)
        # a prompt every sample solves, again and again, may be skipped
        self.source.record(row, [t.reward for t in trajs], n)
        self.sizer.ended(n, [t.reward for t in trajs])
        self.evals.group_ended([t.reward for t in trajs], n // self.n)
        if epoch != self.follow.epoch:  # the trainer restarted meanwhile: the old epoch's, not counted here
            self.book.delivering.discard(gid)
            return
        self.book.count(trajs, rejected, len(reasons))
        self.gate.on_group_done(n, len(trajs))
        self.book.delivering.discard(gid)
        self._wake.set()

    async def _episode(self, row: dict[str, Any], gid: str, i: int) -> Trajectory | str:
        return await self.episodes.one(row, gid, i)

    # ---- control: announcements and weights ------------------------------------------------
    async def _first_announcement(self) -> None:
        """Admit nothing before the trainer has spoken: it may be at a later version (a
        resume, or this side joining a running trainer) whose weights must be loaded
        first, and at a later data position. A first report introduces this controller,
        so the trainer accepts it and hands it the current weights."""
        ann = await self.announcements.get()
        self.book.incarnation = ann.version
        self.follow.begin(ann)
        self.follow.refuse_if_another(ann)  # before the weight group: a refused side must not join it
        await self.weights.join(ann)
        self._seek(ann)
        await self._apply_announcement(ann)
        await self._report()  # hello: the trainer accepts us and sends its weights
        while self.loaded_version < ann.version and not self._stop.is_set():
            ann = await self.announcements.get()
            await self._apply_announcement(ann)

    async def _control_loop(self) -> None:
        while True:
            anns = [await self.announcements.get()]
            while not self.announcements.empty():  # and every one queued behind it
                anns.append(self.announcements.get_nowait())
            for ann in newest_weights_only(anns):
                await self._apply_announcement(ann)

    async def _apply_announcement(self, ann: VersionAnnouncement) -> None:
        verdict = self.follow.verdict(ann)
        if verdict == "ignore":
            return
        if verdict == "newer":
            await self._rebase(ann)
        self.follow.refuse_if_another(ann)
        if ann.servers and self.resize_pool is not None and not ann.stop:
            self.resize_pool(ann.servers)  # returns at once; the pool grows or drains beside the schedule
        self.gate.on_trainer_counts(ann.counts.consumed, ann.counts.dropped, ann.counts.sent_base, ann.version,
                                    starved=ann.counts.starved, spare=ann.counts.spare)
        await self.hold.follow(ann, before_weights=True)
        meta = ann.weights
        if meta is not None:
            if meta.version != self.loaded_version and not ann.stop:
                self.evals.maybe_first(self.loaded_version, due=True)  # scored on the start version alone
                await self.evals.baseline_ends()
            previous = self.loaded_version
            version = await self.weights.load(meta)
            if version is not None:
                self.evals.loaded(version, previous)
        await self.hold.follow(ann, before_weights=False)
        if ann.stop:
            if ann.end is not None and ann.end.final_eval:
                self.evals.start(self.loaded_version)  # the final version is always evaluated
            else:
                self.evals.skip = True  # Ctrl-C on the trainer: stop now
            self.stop()
        self._wake.set()

    async def _rebase(self, ann: VersionAnnouncement) -> None:
        """The trainer restarted (a newer epoch, after `--resume`): what runs belongs to
        the old epoch's accounting, which the new trainer restarted from its checkpoint.
        Admit nothing until the new trainer's weights are loaded, register every server in
        its weight group, cancel what runs, start counting afresh, re-base the gate on the
        announcement, and only then speak as the new epoch: its trainer sends its weights
        when it hears this side, and every server is in the group by then (docs/design.md §10.3)."""
        self.weights.forget()
        await self.weights.join(ann)
        running = [t for t in self._groups if t.get_name() not in self.book.delivering]
        log.warning("the trainer restarted (epoch %d -> %d, at v%d): cancelling %d running groups of the old epoch "
                    "and re-basing on its announcement", self.follow.epoch, ann.trainer.epoch, ann.version, len(running))
        for t in running:
            t.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        self.follow.epoch = ann.trainer.epoch
        self.book.restart(ann.version)
        self.gate.rebase()
        if self.hold.number:  # the old trainer's step is over
            await self.hold.set(0)
        self._seek(ann)
        await self._report()  # hello to the new trainer

    def _seek(self, ann: VersionAnnouncement) -> None:
        if ann.data_position is not None:
            self.source.load_state_dict(ann.data_position)
            self.book.seek(ann.data_position)

    # ---- reporting ------------------------------------------------------------------------
    def _stats(self, kind: Literal["stats", "final"] = "stats") -> RolloutStats:
        return RolloutStats(
            kind=kind,
            time=time.time(),
            loaded_version=self.loaded_version,
            started=self.book.started,
            running=self.gate.s.running,
            cancelled=self.book.cancelled,
            gate=GateSnapshot(**self.gate.state_dict(), capacity=self.gate.capacity, lead=self.gate.lead),
            outcomes=self.book.snapshot(),
            data_position=self.data_position(),
            counters=self.outbox.budget(),
            held=self.hold.number,
            running_groups=dict(self.book.running),
            failures=self.fail_fast.report(),
            stopping=self._stop.is_set(),
            eval_progress=self.evals.progress(),
        )

    async def _report(self, kind: Literal["stats", "final"] = "stats") -> None:
        await self.outbox.send(self._stats(kind))

    async def _report_eval(self, version: int, result: EvalResult) -> None:
        await self.outbox.send(RolloutStats(kind="eval", time=time.time(), loaded_version=version,
                                            started=self.book.started, running=self.gate.s.running, eval=result))

    def _shut(self) -> str:
        """Why the admission loop admits nothing more: awaiting a restarted trainer's weights,
        η's bound (waiting for the trainer's next version), or `max_concurrent` episodes
        running (the servers have all the work they may take)."""
        if self.weights.awaiting:
            return "wait_weights"
        g = self.gate
        if g.capacity - g.accepted - g.s.running < self.sizer.size:
            return "wait_gate"
        return "wait_concurrency"

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(self.stats_every_s)
            await self._report()

    async def _shutdown(self, control: asyncio.Task[None], stats: asyncio.Task[None]) -> None:
        """Wind down in the order that frees the servers soonest: cancel the training
        episodes (nothing will train them), then let the last evaluation finish on idle
        servers, reporting progress all along (the trainer waits for the final report as
        long as it hears from this side), then the final report."""
        control.cancel()
        running = list(self._groups)
        for t in running:
            if t.get_name() not in self.book.delivering:
                t.cancel()
        await asyncio.gather(*running, control, return_exceptions=True)
        await self.evals.finish(may_wait=self.fail_fast.tripped is None, announce=self._report)
        stats.cancel()
        await asyncio.gather(stats, *self.evals.cancel(), return_exceptions=True)
        self.book.cancelled = self.gate.s.running
        self.gate.on_cancel(self.book.cancelled)
        await self._report("final")

    # ---- recovery ---------------------------------------------------------------------------
    def data_position(self) -> dict[str, int | str]:
        return {**self.source.state_dict(), "group_seq": self.book.group_seq}


# ---- the link to the trainer ---------------------------------------------------------------
def make_sender(pusher: DataPusher, timeout_s: float = 120.0) -> Any:
    async def send(msg: BaseModel) -> None:
        await asyncio.to_thread(pusher.send, msg, timeout_s)

    return send


class TrainerLostError(RuntimeError):
    """The trainer went silent past `transport.peer_timeout_s`."""


class TrainerLink:
    """The control channel's listener (a task on the controller's loop): announcements
    into `controller.announcements`, their acknowledgements to `pusher`, and the verdict
    on the trainer's silence (`lost`, the reason it gave up, once it has)."""

    def __init__(self, controller: RolloutController, subscriber: ControlSubscriber, *,
                 peer_timeout_s: float | None, peer_dead_s: float | None, address: str,
                 pusher: DataPusher | None, started_at: float | None, in_run: bool = False) -> None:
        self.controller = controller
        self.subscriber = subscriber
        self.peer_timeout_s = peer_timeout_s
        self.peer_dead_s = peer_dead_s
        self.address = address
        self.pusher = pusher
        self.started = time.monotonic() if started_at is None else started_at  # (a time.monotonic() value)
        self.in_run = in_run
        """Started by `areal-like run` (or the API) beside its trainer: no advice about `areal-like train`."""
        self.lost: str | None = None

    async def listen(self) -> str | None:
        """Until the trainer is lost (returns why) or the task is cancelled."""
        ctl, pusher = self.controller, self.pusher
        last: float | None = None
        gone = False
        next_note = self.started + 10.0
        while True:
            msg = await self.subscriber.recv(0.2)
            now = time.monotonic()
            if pusher is not None:
                if isinstance(msg, VersionAnnouncement) and msg.trainer.run_id == ctl.follow.run_id:
                    pusher.ack(msg.trainer.epoch, msg.acked.get(ctl.follow.sender, []))
                pusher.maintain()
            if isinstance(msg, VersionAnnouncement):
                if gone:
                    log.warning("the trainer is back after %.0fs of silence", now - (last or now))
                    gone = False
                last = now
                ctl.announcements.put_nowait(msg)
                continue
            if msg is not None:
                log.warning("unexpected message on the control channel: %s", type(msg).__name__)
                continue
            if last is None:
                if now >= next_note:
                    next_note = now + 10.0
                    hint = ("the trainer of this run is still starting" if self.in_run
                            else "is `areal-like train` running there?")
                    log.warning("no trainer has answered at %s for %.0fs (%s); waiting up to transport.peer_timeout_s",
                                self.address, now - self.started, hint)
                if self.peer_timeout_s is not None and now - self.started > self.peer_timeout_s:
                    self.lost = (f"no trainer answered at {self.address} within {now - self.started:.0f}s "
                                 "(transport.peer_timeout_s): check transport.control_addr and that the trainer runs")
                    return self.lost
                continue
            silent = now - last
            if self.peer_dead_s is not None and not gone and silent > self.peer_dead_s:
                gone = True
                log.error("the trainer has been silent for %.0fs (transport.peer_dead_s): declared gone; "
                          "waiting up to transport.peer_timeout_s for it to come back", silent)
            if self.peer_timeout_s is not None and silent > self.peer_timeout_s:
                log.error("no announcement from the trainer for %.0fs (transport.peer_timeout_s): stopping", silent)
                self.lost = _lost_message(silent)
                return self.lost


async def drive_rollout(controller: RolloutController, subscriber: ControlSubscriber,
                        peer_timeout_s: float | None = None, peer_dead_s: float | None = None,
                        address: str = "the control address", pusher: DataPusher | None = None,
                        flush_s: float = 7.0, started_at: float | None = None, in_run: bool = False) -> None:
    """Run the controller until the trainer says goodbye (or the task is cancelled).

    The trainer heartbeats every couple of seconds. Silence longer than `peer_dead_s`
    is logged at once (the trainer is declared gone); the controller keeps its state
    and goes on if the trainer comes back (a restarted trainer re-bases it through a
    newer epoch). Silence longer than `peer_timeout_s` — or no trainer ever heard at
    `address` for that long, counted from `started_at` (a `time.monotonic()` value; the
    rollout side's start, default now) — stops the controller and raises `TrainerLostError`.

    With the data channel's `pusher`, the announcements' acknowledgements release its
    frames, it resends what a reconnect may have lost, and a normal stop waits up to
    `flush_s` for the last frames (the final report) to be acknowledged.

    Giving up stops the controller; one that has not begun its schedule yet (still
    waiting for its first announcement, or for the weights that one named: a queue `get`
    that `stop()` does not wake) is cancelled instead, as it has nothing to wind down.
    """
    gave_up = False
    run_task: asyncio.Future[None] = asyncio.ensure_future(controller.run())
    link = TrainerLink(controller, subscriber, peer_timeout_s=peer_timeout_s, peer_dead_s=peer_dead_s,
                       address=address, pusher=pusher, started_at=started_at, in_run=in_run)

    def give_up(task: asyncio.Task[str | None]) -> None:
        nonlocal gave_up
        if task.cancelled() or task.exception() is not None or task.result() is None:
            if not task.cancelled() and task.exception() is not None:  # a bug in the listener: stop, say why
                log.error("the control channel's listener failed: %r", task.exception())
                controller.stop()
            return
        controller.stop()
        if not run_task.done() and not _schedule_running():
            gave_up = True
            run_task.cancel()

    listener = asyncio.create_task(link.listen(), name="control-sub")
    listener.add_done_callback(give_up)
    try:
        try:
            await run_task
        except asyncio.CancelledError:
            if gave_up and link.lost:  # we cancelled it (not a Ctrl-C): the trainer is lost
                raise TrainerLostError(link.lost) from None
            raise
        if pusher is not None and not link.lost:
            left = await asyncio.to_thread(pusher.flush, flush_s)
            if left:
                log.warning("%d data frames were not acknowledged by the trainer within %.0fs of stopping", left, flush_s)
    except TrainerLostError:
        raise
    except Exception as e:
        if link.lost:
            raise TrainerLostError(link.lost) from e
        raise
    finally:
        if not run_task.done():  # drive_rollout itself was cancelled before the controller began
            run_task.cancel()
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
    if link.lost:
        raise TrainerLostError(link.lost)
    if not listener.cancelled() and listener.exception() is not None:
        raise listener.exception()  # type: ignore[misc]


def _schedule_running() -> bool:
    """Whether the controller has begun its schedule: its control task exists once the
    first announcement (and the weights it names) are through (`RolloutController.run`)."""
    return any(t.get_name() == "rollout-control" and not t.done() for t in asyncio.all_tasks())


def _lost_message(silent_s: float) -> str:
    return (f"the trainer has announced nothing for {silent_s:.0f}s (transport.peer_timeout_s); it is gone or "
            "stuck, so the rollout side stopped. Restart both sides with --resume.")
