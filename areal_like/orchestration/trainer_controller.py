"""The trainer side's schedule: data channel → buffer → train step → weights out.

    announce (version, counts[, weights, data position])
    until total_steps:
        drain the data channel: groups into the buffer, rollout stats/evals into metrics
        batch = buffer.pop_batch(v, batch_size)       (oldest first, η re-checked)
        if none: wait (idle time counted), re-announce now and then
        stats = train_on(batch)                        (v → v+1, or skipped)
        every weight_sync.every_n_steps: snapshot weights, announce them, deliver
        every run.checkpoint_every_n_steps: checkpoint trainer + counts + data position
    announce stop; wait for the rollout side's final counts; write the summary

The trainer side owns the run folder, the metrics and the summary (docs/design.md §9.6).
It does not know which backend trains or which transport carries weights: it is
handed a `TrainerHandle` and a `WeightPublisher`. `_run` is the schedule above, line
for line; recording goes to `TrainerTelemetry`, and each policy it applies is a
collaborator of its own (`trainer_policies`): which report stands (`ReportLog`), the
straggler wait (`StragglerPolicy`), the colocate hold (`ColocateHold`), weights out and
resent (`WeightFeed`), checkpoints (`Checkpointer`), announcements (`Announcer`), what
ends a run early (`StopRules`), the console (`ConsoleNotes`) and the end (`RunEnd`).
"""

from __future__ import annotations

import errno
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from areal_like.core.buffer import TrajectoryBuffer
from areal_like.core.config import ExperimentConfig
from areal_like.core.metrics import MetricsLog, MetricsRegistry
from areal_like.core.staleness import GateTally
from areal_like.core.types import (
    Goodbye,
    RolloutStats,
    TrainerId,
    Trajectory,
    TrajectoryGroup,
    VersionAnnouncement,
    WeightUpdateMeta,
)
from areal_like.orchestration import startup, stop
from areal_like.orchestration.channels import ControlPublisher, DataPuller
from areal_like.orchestration.peers import RolloutPeers
from areal_like.orchestration.run_dir import RunDir
from areal_like.orchestration.step_budget import StepBudget
from areal_like.orchestration.trainer_errors import RunAborted, RunFailed, RunInterrupted
from areal_like.orchestration.trainer_policies import (
    Announcer,
    Checkpointer,
    ColocateHold,
    ReportLog,
    RunEnd,
    StopRules,
    StragglerPolicy,
    WeightFeed,
)
from areal_like.orchestration.trainer_telemetry import TrainerTelemetry
from areal_like.orchestration.watch import ConsoleNotes

if TYPE_CHECKING:  # the driver never needs torch itself: the workers hold the tensors (design §10.34)
    import torch

__all__ = ["TrainerController", "TrainerHandle", "WeightPublisher", "RunAborted", "RunFailed", "RunInterrupted"]

log = logging.getLogger(__name__)


def _disk_full(e: BaseException) -> bool:
    """ENOSPC/EDQUOT, also when a Ray worker raised it (the cause is in the message)."""
    return getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in str(e)


class TrainerHandle(Protocol):
    version: int

    def train_on(self, trajectories: list[Trajectory], poll: Any = None) -> dict[str, float]:
        """`poll()`, if given, must be called every few tens of ms while the step runs: the
        controller takes in data meanwhile (`TrainerController._during_step`)."""
        ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """For a trainer in this process only (tests, the weight senders that live with it)."""
        ...

    def export_weights(self, path: str | Path) -> Any:
        """Write the current weights as HF safetensors under the folder `path`: the final
        export and recorded weights (`run_dir.save_hf_folder`). The train workers write
        them themselves, so the weights never pass through this process."""
        ...

    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> None: ...

    def load(self, path: str | Path) -> dict[str, Any]: ...


class WeightPublisher(Protocol):
    """Snapshot the trainer's weights as a version and return the meta; `wait` until
    delivered."""

    def publish(self, version: int, trainer: TrainerHandle) -> WeightUpdateMeta:
        """Take the trainer's current weights as `version`. A publisher that lives with the
        weights (rank 0's sender, `WorkerWeightSender`) has them handed over itself; one
        that does not reads `trainer.named_weights()`."""
        ...

    def wait(self, timeout: float | None = None) -> Any: ...

    def forget_receivers(self) -> None:
        """The rollout side was declared lost: stop waiting for its receivers."""

    @property
    def rendezvous(self) -> str | None: ...


class TrainerController:
    def __init__(
        self,
        cfg: ExperimentConfig,
        *,
        trainer: TrainerHandle,
        weights: WeightPublisher,
        puller: DataPuller,
        publisher: ControlPublisher,
        run_dir: RunDir,
        mlog: MetricsLog,
        registry: MetricsRegistry | None = None,
        model_path: str | Path,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        check_peers: Callable[[], None] | None = None,
        run_id: str | None = None,
        epoch: int = 0,
        vocab_size: int | None = None,
        reward_name: str | None = None,
        on_wait: Callable[[str], None] | None = None,
        pool: Any = None,
    ) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self.puller = puller
        self.run_dir = run_dir
        self.telemetry = TrainerTelemetry(mlog, registry or MetricsRegistry())
        self.budget = StepBudget()
        """Where the time between two step records goes (`budget_*_s` in each record)."""
        self.check_peers = check_peers
        """Raises if the rollout side (when this process knows it) has died."""
        self.buffer = TrajectoryBuffer(cfg.staleness.max_staleness, cfg.staleness.filter_uniform_groups,
                                       cfg.rollout.group_size)
        self.rules = StopRules(cfg, reward_name or cfg.agent.reward)
        self.notes = ConsoleNotes(on_step, on_wait)
        self.vocab_size = vocab_size
        """Token ids at or above it are refused at the edge (they would crash the train step)."""
        self.peers = RolloutPeers(run_id or uuid.uuid4().hex[:12], epoch, dead_s=cfg.transport.peer_dead_s,
                                  timeout_s=cfg.transport.peer_timeout_s)
        acks = lambda: self.puller.acks(self.peers.epoch)  # noqa: E731 (the epoch may change)
        self.announcer = Announcer(publisher, acks=acks, heartbeat_s=cfg.transport.heartbeat_s,
                                   accepted=lambda: self.peers.accepted,
                                   servers=(lambda: pool.target) if pool is not None else (lambda: 0))
        self.reports = ReportLog()
        self.stragglers = StragglerPolicy(cfg)
        self.hold = ColocateHold(cfg, self.peers, self.reports, announce=self._announce, drain=self._drain,
                                 announced_at=lambda: self.announcer.at)
        self.feed = WeightFeed(cfg, trainer=trainer, weights=weights, peers=self.peers, run_dir=run_dir,
                               model_path=Path(model_path), reports=self.reports,
                               phase=lambda name: self.budget.phase(name), announce=self._announce,
                               drain=self._drain, check_peers=self._check_peers)
        self.checkpoints = Checkpointer(run_dir, trainer, self.buffer, self.reports)
        self.end = RunEnd(cfg, self.peers, self.reports, acks=acks, announce=self._announce, drain=self._drain,
                          say=self.notes.say)
        if pool is not None:  # `elastic.PoolRequest`: the server count asked for through the dashboard (§10.24)
            pool.follow(lambda: self.reports.latest, lambda: self.end.stopping, lambda: self.trainer.version)
        self.tally = GateTally(self.buffer)

    @property
    def mlog(self) -> MetricsLog:
        return self.telemetry.mlog

    @property
    def rollout(self) -> RolloutStats | None:
        """The rollout side's latest report (`ReportLog`)."""
        return self.reports.latest

    @property
    def weights(self) -> WeightPublisher:
        return self.feed.weights

    @weights.setter
    def weights(self, weights: WeightPublisher) -> None:
        self.feed.weights = weights

    # ---- resume ----------------------------------------------------------------------
    def resume(self) -> None:
        ckpt = self.checkpoints.load()
        self.tally.rebase()
        # The engines start from the base model. The resumed weights go to a rollout side once
        # it has joined this epoch's weight group and said hello (`_handle`, then
        # `feed_joining_rollout`): sent now, before anyone could join, the first transfer's
        # grace ran out under load and a server missed it.
        log.info("resumed from %s at version %d (%d samples buffered)", ckpt, self.trainer.version, self.buffer.depth)

    # ---- the schedule ------------------------------------------------------------------
    def run(self) -> dict[str, int]:
        """Train to `train.total_steps` and write the summary. A fault the run cannot go on
        through raises `RunAborted`, saying which checkpoint `--resume` continues from."""
        beat = threading.Thread(target=self.announcer.heartbeat, name="trainer-heartbeat", daemon=True)
        beat.start()
        try:
            return self._run()
        except KeyboardInterrupt:
            raise self._stop_on_interrupt() from None
        except RunAborted:
            self._announce_stop()
            raise
        except Exception as e:
            self._announce_stop()
            if _disk_full(e):
                where = f" writing {e.filename}" if getattr(e, "filename", None) else ""
                raise RunAborted(f"no space left on device{where}: the run stopped at v{self.trainer.version}. "
                                 f"Free some space, then: {self.checkpoints.resume_hint()}") from e
            raise
        finally:
            self.announcer.stop()
            beat.join(timeout=5)

    def _stop_on_interrupt(self) -> RunInterrupted:
        """Ctrl-C: tell the rollout side (goodbye), save the whole state, collect the rollout
        side's final counts briefly and write the summary, so the run reads as stopped,
        not crashed, and `--resume` continues it."""
        log.info("stop requested at v%d: writing a final checkpoint and the summary", self.trainer.version)
        self.end.final_eval = False  # the user wants out: no last evaluation
        self._announce_stop()
        summary = self._finish(reason="interrupted")
        return RunInterrupted(summary, self.checkpoints.resume_hint())

    def _announce_stop(self) -> None:
        """Best effort: tell a separately started rollout side the run is over."""
        self.end.stopping = True
        try:
            self._announce(force=True)
            time.sleep(0.2)  # PUB drops what is unsent at close: let it go out
        except Exception as e:  # the channel itself may be what failed
            log.warning("could not announce the stop to the rollout side: %s", e)

    def _run(self) -> dict[str, int]:
        cfg = self.cfg
        if self.trainer.version == 0 and cfg.run.record_weights:
            self.feed.record(0)
        self._announce(data_position=self.checkpoints.data_position, force=True)
        self.budget = StepBudget()  # the first step's interval starts here
        t_wait = time.time()
        look_s = 0.05
        data_wait_s = 0.0
        while self.trainer.version < cfg.train.total_steps and self.rules.ended is None:
            if self.peers.found_dead is not None:  # found during the last step: stop before the next
                self._check_peers(self.trainer.version)
            t_loop = time.time()
            with self.budget.phase("wait_data") as wait:  # renamed below when it waited for something else
                self._drain(timeout_s=look_s)
                v = self.trainer.version
                stragglers = self._stragglers(v)
                scoring = self.rules.waits_for_score(v, self._published(v))
                ended = self.rules.ended is not None  # a score that came in just now ends it before a step
                groups = None if stragglers or scoring or ended else self.buffer.pop_batch(v, cfg.train.batch_size)
                if groups is None and not ended:
                    wait.name = "wait_eval" if scoring else self._wait_phase(stragglers)
                    self._while_waiting(v)
                    if stragglers and self.buffer.prompts >= cfg.train.batch_size:
                        self.stragglers.wait_s += time.time() - t_loop
            if wait.name == "wait_data":
                data_wait_s += time.time() - t_loop
            if groups is None:
                look_s = 0.05
                continue
            self.tally.step_began(data_wait_s, cfg.train.batch_size)  # the lead follows it (§10.50)
            data_wait_s = 0.0
            # Right after a step the next batch is often buffered already: look without waiting
            # for a message (waiting for one cost ~40 ms a quickstart step, docs/benchmarks.md).
            look_s = 0.0
            self.telemetry.idle_s += time.time() - t_wait
            t0 = time.time()
            with stop.critical():  # a Ctrl-C here is raised once the step is whole
                hold_wait = self._take_devices() if cfg.cluster.colocate else None
                stats = self._train_step(groups, v)
                self.hold.release()
                skipped = self.trainer.version == v
                rec = self.telemetry.train_step(groups, v, self.trainer.version, skipped, stats, self.buffer)
                rec["straggler_wait_s"] = self.stragglers.take_wait_s()
                if hold_wait is not None:
                    rec["colocate_wait_s"] = hold_wait
                self.telemetry.sampled_reward(rec)
                fell = self.rules.sampled(rec)
                if fell is not None:
                    self.notes.warn(fell)
                if not skipped and self._due(cfg.weight_sync.every_n_steps):
                    self._publish_weights(rec)
                else:
                    self._announce(force=True)
                self.telemetry.busy_s += time.time() - t0
                self.tally.step_ended(time.time() - t0)
                self.telemetry.write_step(rec, self.telemetry.idle_ratio(),
                                          self.rollout.loaded_version if self.rollout is not None else None,
                                          budget=self.budget)
                if "first_step" not in startup.phases():
                    startup.mark("first_step")
                    self.mlog.write("startup", self.trainer.version, **startup.phases())
                    log.info("%s", startup.summary_line())
                self.notes.step(rec, self.telemetry.evals)
                if not skipped and self.trainer.version < cfg.train.total_steps \
                        and self.trainer.version % cfg.run.checkpoint_every_n_steps == 0:
                    # (the last step's checkpoint is written by _finish, after the final report)
                    with self.budget.phase("checkpoint"):  # in the next step's record
                        self.checkpoint()
            t_wait = time.time()
        return self._finish(reason=self.rules.ended or "finished")

    def _stragglers(self, v: int) -> list[str]:
        """The groups the step from v waits for (`StragglerPolicy`)."""
        return self.stragglers.stragglers(v, self.rollout, self.peers.accepted, self.end.stopping)

    def _published(self, v: int) -> bool:
        return self.feed.last_meta is not None and self.feed.last_meta.version == v

    def _wait_phase(self, stragglers: list[str]) -> str:
        """What a pass that formed no batch waited for, as a phase of the step's budget."""
        if self.peers.accepted is None or self.rollout is None:
            return "wait_rollout"
        if stragglers and self.buffer.prompts >= self.cfg.train.batch_size:
            return "wait_straggler"
        return "wait_data"

    def _due(self, every: int) -> bool:
        v = self.trainer.version
        return v % every == 0 or v >= self.cfg.train.total_steps

    def _take_devices(self) -> float:
        """`cluster.colocate`: hold the rollout side's servers for the step (`ColocateHold`).
        Returns the seconds waited."""
        with self.budget.phase("wait_colocate"):
            return self.hold.take(self.trainer.version)

    def _train_step(self, groups: list[TrajectoryGroup], v: int) -> dict[str, float]:
        """v → v+1, or skipped (non-finite loss or gradient: the version stays)."""
        trajectories = [t for g in groups for t in g.trajectories]
        try:
            # whole: what this process takes in while the workers train is the train step's time
            with self.budget.phase("train", whole=True):
                stats = self.trainer.train_on(trajectories, poll=self._during_step)
        except (RunFailed, RunAborted):
            raise  # the run's end found while the workers trained (the poll takes the reports in), not the step's fault
        except Exception as e:
            if _disk_full(e):
                raise
            log.error("the train step at v%d failed", v, exc_info=e)
            raise RunAborted(f"the train step at v{v} failed: {e}; the run stopped: "
                             f"{self.checkpoints.resume_hint()}") from e
        self.budget.split("train", {"train_batch": stats.get("batch_time_s", 0.0),
                                    "train_logprobs_prox": stats.get("prox_time_s", 0.0),
                                    "train_fwd_bwd": stats.get("fwd_bwd_time_s", 0.0),
                                    "train_optimizer": stats.get("optimizer_time_s", 0.0)}, rest="train_other")
        if self.trainer.version == v:
            self.buffer.mark_skipped(groups)
            self.rules.skipped(v, self.checkpoints.resume_hint)
        else:
            drift = self.rules.trained(stats)
            if drift is not None:
                self.notes.warn(drift)
            self.buffer.mark_trained(groups)
            if self.cfg.run.record_trajectories:
                self.run_dir.append_trajectories(groups, consumed_at_version=v)
        return stats

    def _during_step(self) -> None:
        """While the workers train: take in what arrives, so groups dropped on arrival
        (uniform rewards, over-stale, invalid) free their gate slots on the rollout side
        now, not after the step, and announce that at once (at most every 0.1 s). At a
        high reward most groups are uniform: waiting for the step to end held the gate
        shut while the trainer was about to need them (docs/benchmarks.md, per step)."""
        dropped = self.buffer.dropped_sent
        self._drain(timeout_s=0.0)
        if self.announcer.drops_due(self.buffer.dropped_sent != dropped):
            self._announce(force=True)
        # A rollout side that stopped (no server left) or died ends the run now, not after
        # training on through the whole buffer (docs/launching.md: within 30 s)
        if self.check_peers is not None and self.peers.found_dead is None:
            try:
                self.check_peers()
            except RunFailed:
                raise
            except Exception as e:  # a crash: the step ends first, then the checkpoint and the stop
                self.peers.found_dead = e

    def _publish_weights(self, rec: dict[str, Any]) -> None:
        """The new version out (`WeightFeed.publish`). `weight_sync_s` is the time the
        trainer was held up: the rest of the previous broadcast, the snapshot, the
        announcement."""
        t0 = time.time()
        done = self.feed.publish()
        self.telemetry.weight_sync(rec, time.time() - t0, done)
        if self.feed.last_meta is not None:
            rec["weight_bytes"] = self.feed.last_meta.nbytes  # this version's; LoRA: the adapter's

    def _while_waiting(self, v: int) -> None:
        """No batch yet: keep the rollout side fed and check that it is alive."""
        self.feed.feed_joining_rollout(self.end.stopping)
        self.feed.feed_restarted_servers(self.end.stopping)
        self.feed.resend_if_rollout_stuck()
        # A rollout controller that is starting waits for an announcement before its hello (its
        # subscriber connects late, once its servers are up): every 0.1 s until one is accepted.
        self._announce(every_s=0.1 if self.peers.accepted is None else 0.5)
        self._check_peers(v)
        line = self.rules.check_signal(v)
        if line is not None:
            self.notes.warn(line)
        if self.notes.due():
            self.notes.say(self._waiting_for(v))

    def _check_peers(self, v: int) -> None:
        """Is the rollout side alive? A silent one is declared lost (logged) after
        `transport.peer_dead_s`; none past `peer_timeout_s`, or a dead one this process
        knows of, stops the run."""
        had = self.peers.accepted
        try:
            if self.peers.found_dead is not None:
                raise self.peers.found_dead
            if self.check_peers is not None:
                self.check_peers()
            self.peers.check()
            if had is not None and self.peers.accepted is None:  # declared lost just now
                self.weights.forget_receivers()
        except RunFailed:
            raise
        except Exception as e:  # the trainer's state is whole: save it before stopping
            self.checkpoints.save_before_stopping()
            raise RunAborted(f"{e}; the run stopped at v{v}: {self.checkpoints.resume_hint()}") from e

    def _waiting_for(self, v: int) -> str:
        """What the trainer waits for, in words (one console line every ~10 s)."""
        r, b = self.rollout, self.cfg.train.batch_size
        if self.peers.accepted is None:
            return "the rollout side to connect (it starts its servers and loads the model)"
        if r is None:
            return "the rollout side's first report"
        if self.rules.waits_for_score(v, self._published(v)):
            return (f"the held-out score of v{v}, which may end the run (train.stop_at_eval_accuracy="
                    f"{self.cfg.train.stop_at_eval_accuracy})")
        stragglers = self._stragglers(v)
        if stragglers and self.buffer.prompts >= b:
            return (f"{len(stragglers)} straggler group(s) that the step to v{v + 1} would push past "
                    f"η={self.cfg.staleness.max_staleness} (docs/design.md §10.4)")
        s = self.rules.signal
        uniform = f", {s.total_uniform} of {s.total_groups} groups so far filtered as uniform" if s.total_uniform else ""
        return (f"data for step {v + 1}: {self.buffer.prompts}/{b} groups buffered, {r.running} episodes running "
                f"on the rollout side (serving v{r.loaded_version}){uniform}")

    # ---- channels ------------------------------------------------------------------------
    def _announce(self, *, weights: WeightUpdateMeta | None = None, data_position: dict[str, int | str] | None = None,
                  force: bool = False, every_s: float = 0.5) -> None:
        if not self.announcer.due(time.time(), force, every_s):
            return
        stopping = self.end.stopping
        ann = VersionAnnouncement(
            version=self.trainer.version,
            counts=self.tally.counts(),
            weights=weights,
            weight_store=self.weights.rendezvous,
            data_position=data_position,
            end=Goodbye(final_eval=self.end.final_eval) if stopping else None,
            hold=0 if stopping else self.hold.number,
            trainer=TrainerId(run_id=self.peers.run_id, epoch=self.peers.epoch, rollout_id=self.peers.accepted),
            acked=self.puller.acks(self.peers.epoch),
        )
        self.announcer.publish(ann)

    def _drain(self, timeout_s: float) -> None:
        msg = self.puller.recv(timeout_s)  # up to timeout_s: the caller's phase (a wait)
        if msg is None:
            return
        with self.budget.phase("drain"):
            while msg is not None:
                self._handle(msg)
                msg = self.puller.recv(0)

    def _handle(self, msg: Any) -> None:
        if not isinstance(msg, (TrajectoryGroup, RolloutStats)):
            log.warning("unexpected message on the data channel: %s", type(msg).__name__)
            return
        if not self.peers.admit(msg, self.end.stopping):
            return
        if self.peers.joined is not None:  # hand it the current weights at once
            startup.mark("rollout_joined")
            self.peers.joined = None
            self.feed.fed_at = 0.0
            # Its gate must count what earlier controllers sent (trained, dropped, buffered):
            # a replacement that started from 0 admitted (η + v + 1)·B more and its samples
            # went over-stale (docs/design.md §10.3).
            self.tally.rebase()
        if isinstance(msg, TrajectoryGroup):
            startup.mark("first_group")
            self.stragglers.arrived(msg.group_id)
            problem = _bad_tokens(msg, self.vocab_size)
            if problem is not None:
                log.error("group %s refused at the trainer's edge: %s; its %d episodes count as failed",
                          msg.group_id, problem, msg.size)
                self.buffer.put_invalid(msg)
                return
            self.rules.signal.group(msg, self.buffer.put(msg))
            cut = self.rules.truncation.group(msg)
            if cut is not None:
                self.notes.warn(cut)
            self.telemetry.m.samples.buffer_depth.set(self.buffer.depth)
        elif isinstance(msg, RolloutStats) and msg.kind == "eval" and msg.eval is not None:
            self.telemetry.evaluation(msg, self.trainer.version)
            log.info("eval at v%d: accuracy %.3f", msg.loaded_version, msg.eval.accuracy)
            self.rules.evaluation(msg)
        else:
            if msg.kind == "final":
                self._announce(force=True)  # acknowledge it now: the rollout side waits for that to exit
            if not self.reports.apply(msg):
                return
            self._failures(msg)
            self.stragglers.still_running(set(msg.running_groups))  # what this report still lists may yet arrive
            self.telemetry.rollout_report(msg, self.trainer.version)

    def _failures(self, msg: RolloutStats) -> None:
        """Failing episodes reach the console (their first error, led by the user's file
        and line); a rollout side that stopped because of them ends the run with it."""
        f = msg.failures
        if f is not None and f.stopped and not self.end.stopping:
            tb = f"\n{f.traceback.rstrip()}" if f.traceback else ""
            raise RunFailed(f"{f.first}{tb}\n{f.stopped}; the run stopped at v{self.trainer.version}")
        self.notes.failures(msg)

    # ---- checkpoint and end ----------------------------------------------------------------
    def checkpoint(self) -> None:
        """The whole state on disk (`Checkpointer`)."""
        self.checkpoints.save()

    def _finish(self, reason: str = "finished") -> dict[str, int]:
        """The end, in the order that keeps the rollout side's channel read: the last
        version to the engines (for its evaluation), the goodbye and the final report,
        then the last checkpoint (long on a big model), then the summary."""
        self.feed.end_transfer()  # the last version reaches the engines before the stop (its evaluation)
        self.end.stopping = True
        startup.reset()  # a next run in this process measures its own
        self.end.collect_final(reason, self.trainer.version)
        if reason == "interrupted":
            self.checkpoints.save_before_stopping()
        elif not self.checkpoints.has(self.trainer.version):
            self.checkpoint()  # the final weights on disk before the summary: an export that fails can be redone
        started = self.checkpoints.accounted_before + self.peers.started()
        summary = self.buffer.summary(started=started, cancelled=self.peers.cancelled())
        ok = TrajectoryBuffer.counts_add_up(summary)
        if not ok:
            log.error("outcome counts do not add up: %s", summary)
        servers = {n: srv.model_dump() for n, srv in self.rollout.counters.per_server.items()} if self.rollout else {}
        self.mlog.write("summary", self.trainer.version, counts_add_up=ok, ended=reason, **summary,
                        refused_frames={**self.puller.refused_frames, **self.peers.refused},
                        duplicate_frames=self.puller.duplicates,
                        servers=servers,
                        target_reached=list(self.rules.target_reached) if self.rules.target_reached else None,
                        evals=[{"version": e["version"], "accuracy": e["accuracy"]} for e in self.telemetry.evals])
        return summary


def _bad_tokens(group: TrajectoryGroup, vocab_size: int | None) -> str | None:
    """Token ids outside [0, vocab_size) would index past the embedding in the train step."""
    if vocab_size is None:
        return None
    for t in group.trajectories:
        for name in ("prompt_ids", "response_ids"):
            ids = getattr(t, name)
            if ids and (min(ids) < 0 or max(ids) >= vocab_size):
                return f"{t.episode_id}: {name} outside the vocabulary [0, {vocab_size})"
    return None
