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
for line; recording goes to `TrainerTelemetry`, and what keeps a stuck or resumed
rollout side fed (`_while_waiting`) and checkpoints are calls out of it.

Why this file is long: the controller still holds its policies (stragglers, weight resends,
colocate hold, checkpoints, the end of a run); issue #32 moves them into named
collaborators (branch `trainer-split`: 523 lines here), after which this reason goes.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from areal_like.core.buffer import TrajectoryBuffer
from areal_like.core.config import ExperimentConfig
from areal_like.core.metrics import MetricsLog, MetricsRegistry
from areal_like.core.types import (
    RolloutStats,
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
from areal_like.orchestration.trainer_telemetry import TrainerTelemetry
from areal_like.orchestration.watch import FailureNotes, SignalWatch, WaitNotes

__all__ = ["TrainerController", "TrainerHandle", "WeightPublisher", "RunAborted", "RunFailed", "RunInterrupted"]

log = logging.getLogger(__name__)


class RunAborted(RuntimeError):
    """The run stopped on a fault it cannot go on through (a dead train worker, a dead
    rollout side, a full disk). The message says what happened and which checkpoint
    `--resume` continues from."""


class RunFailed(RunAborted):
    """The run stopped because of something `--resume` cannot fix: user code that keeps
    failing (its file and line first), or no learning signal. The message leads with
    the cause and carries no resume hint."""


class RunInterrupted(KeyboardInterrupt):
    """The user stopped the run (Ctrl-C, SIGTERM): a final checkpoint and the summary are
    written; `summary` holds the counts and `hint` the --resume line."""

    def __init__(self, summary: dict[str, int], hint: str) -> None:
        super().__init__(hint)
        self.summary = summary
        self.hint = hint


def _disk_full(e: BaseException) -> bool:
    """ENOSPC/EDQUOT, also when a Ray worker raised it (the cause is in the message)."""
    return getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in str(e)


class TrainerHandle(Protocol):
    version: int

    def train_on(self, trajectories: list[Trajectory], poll: Any = None) -> dict[str, float]:
        """`poll()`, if given, must be called every few tens of ms while the step runs: the
        controller takes in data meanwhile (`TrainerController._during_step`)."""
        ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]: ...

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
    ) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self.weights = weights
        self.puller = puller
        self.publisher = publisher
        self.run_dir = run_dir
        self.mlog = mlog
        self.telemetry = TrainerTelemetry(mlog, registry or MetricsRegistry())
        self.budget = StepBudget()
        """Where the time between two step records goes (`budget_*_s` in each record)."""
        self.model_path = Path(model_path)
        self.on_step = on_step
        self.check_peers = check_peers
        """Raises if the rollout side (when this process knows it) has died."""
        self.buffer = TrajectoryBuffer(cfg.staleness.max_staleness, cfg.staleness.filter_uniform_groups)
        self.signal = SignalWatch(reward_name or cfg.agent.reward, max_no_signal_s=cfg.agent.max_no_signal_s)
        self.failure_notes = FailureNotes()
        self.on_wait = on_wait
        """Prints what the trainer waits for (the console's `Progress.waiting`); else the log."""
        self.wait_notes = WaitNotes()
        self.vocab_size = vocab_size
        """Token ids at or above it are refused at the edge (they would crash the train step)."""
        self.peers = RolloutPeers(run_id or uuid.uuid4().hex[:12], epoch, dead_s=cfg.transport.peer_dead_s,
                                  timeout_s=cfg.transport.peer_timeout_s)
        self._last_ann: VersionAnnouncement | None = None
        self._beat_stop = threading.Event()
        self.started_before_resume = 0
        self.sent_base = 0
        self.rollout: RolloutStats | None = None
        self.data_position: dict[str, int] | None = None
        self.last_meta: WeightUpdateMeta | None = None
        self._in_flight: int | None = None
        """The published version whose broadcast may still run (see `_end_transfer`)."""
        self._hold = 0
        """`cluster.colocate`: the hold number announced while a step wants the devices (0: none)."""
        self._hold_seq = 0
        self.resumed_meta: WeightUpdateMeta | None = None
        self.idle_s = 0.0
        self.straggler_wait_s = 0.0
        """Waited since the last step for a straggler that would otherwise cross η."""
        self._arrived: set[str] = set()
        self._report_seq: dict[str, int] = {}
        """Sender → seq of the newest rollout report applied (a resent older one is ignored)."""
        self._straggler_since: dict[str, float] = {}
        self.skips_in_a_row = 0
        self.busy_s = 0.0
        self._last_announce = 0.0
        self._drops_unannounced = False
        self._fed_at = time.time()
        self._stopping = False
        self._final_eval = True
        """With the stop: whether the rollout side evaluates the last version first."""
        self._sent_at = time.time()
        """When weights were last sent (a rollout report must come later to say it lags)."""
        self._rollout_at = 0.0
        self.target_reached: tuple[int, float] | None = None
        """(version, accuracy) of the evaluation that reached `train.stop_at_eval_accuracy`."""
        """When the last rollout report (not an eval) arrived."""

    # ---- resume ----------------------------------------------------------------------
    def resume(self) -> None:
        ckpt = self.run_dir.latest_checkpoint()
        if ckpt is None:
            raise RuntimeError(f"--resume: no complete checkpoint in {self.run_dir.checkpoints}")
        extra = self.trainer.load(ckpt / "trainer")
        self.buffer.load_state_dict(extra["buffer"])
        self.started_before_resume = int(extra["accounted"])
        self.sent_base = self.buffer.consumed + self.buffer.dropped_sent + self.buffer.depth
        self.data_position = extra.get("data_position")
        # The engines start from the base model: hand them the resumed weights first.
        self.resumed_meta = self._send_weights(self.trainer.version)
        log.info("resumed from %s at version %d (%d samples buffered)", ckpt, self.trainer.version, self.buffer.depth)

    # ---- the schedule ------------------------------------------------------------------
    def run(self) -> dict[str, int]:
        """Train to `train.total_steps` and write the summary. A fault the run cannot go on
        through raises `RunAborted`, saying which checkpoint `--resume` continues from."""
        beat = threading.Thread(target=self._heartbeat, name="trainer-heartbeat", daemon=True)
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
                                 f"Free some space, then: {self._resume_hint()}") from e
            raise
        finally:
            self._beat_stop.set()
            beat.join(timeout=5)

    def _heartbeat(self) -> None:
        """Re-publish the latest announcement every `transport.heartbeat_s`, also while a
        train step runs, so the rollout side can tell a busy trainer from a dead one. The
        repeat carries no weights (a transfer is announced once, by the schedule)."""
        while not self._beat_stop.wait(self.cfg.transport.heartbeat_s):
            ann = self._last_ann
            if ann is not None:
                try:
                    self.publisher.publish(ann.model_copy(update={"weights": None, "acked": self.puller.acks(self.peers.epoch)}))
                except Exception as e:  # the channel is closing: the schedule reports what matters
                    log.debug("heartbeat not sent: %s", e)
                    return

    def _stop_on_interrupt(self) -> RunInterrupted:
        """Ctrl-C: tell the rollout side (goodbye), save the whole state, collect the rollout
        side's final counts briefly and write the summary, so the run reads as stopped,
        not crashed, and `--resume` continues it."""
        log.info("stop requested at v%d: writing a final checkpoint and the summary", self.trainer.version)
        self._final_eval = False  # the user wants out: no last evaluation
        self._announce_stop()
        summary = self._finish(reason="interrupted")
        return RunInterrupted(summary, self._resume_hint())

    def _announce_stop(self) -> None:
        """Best effort: tell a separately started rollout side the run is over."""
        self._stopping = True
        try:
            self._announce(force=True)
            time.sleep(0.2)  # PUB drops what is unsent at close: let it go out
        except Exception as e:  # the channel itself may be what failed
            log.warning("could not announce the stop to the rollout side: %s", e)

    def _run(self) -> dict[str, int]:
        cfg = self.cfg
        if self.trainer.version == 0 and cfg.run.record_weights:
            self.run_dir.record_weights(0, dict(self.trainer.named_weights()), self.model_path)
        self._announce(weights=self.resumed_meta, data_position=self.data_position, force=True)
        self.budget = StepBudget()  # the first step's interval starts here
        t_wait = time.time()
        look_s = 0.05
        while self.trainer.version < cfg.train.total_steps and self.target_reached is None:
            t_loop = time.time()
            with self.budget.phase("wait_data") as wait:  # renamed below when it waited for something else
                self._drain(timeout_s=look_s)
                v = self.trainer.version
                stragglers = self._stragglers(v)
                groups = None if stragglers else self.buffer.pop_batch(v, cfg.train.batch_size)  # oldest first, η re-checked
                if groups is None:
                    wait.name = self._wait_phase(stragglers)
                    self._while_waiting(v)
                    if stragglers and self.buffer.num_groups >= cfg.train.batch_size:
                        self.straggler_wait_s += time.time() - t_loop
            if groups is None:
                look_s = 0.05
                continue
            # Right after a step the next batch is often buffered already: look without waiting
            # for a message (waiting for one cost ~40 ms a quickstart step, docs/benchmarks.md).
            look_s = 0.0
            self.idle_s += time.time() - t_wait
            t0 = time.time()
            with stop.critical():  # a Ctrl-C here is raised once the step is whole
                hold_wait = self._take_devices() if cfg.cluster.colocate else None
                stats = self._train_step(groups, v)
                self._hold = 0  # the announcement after the step lets the servers run again
                skipped = self.trainer.version == v
                rec = self.telemetry.train_step(groups, v, self.trainer.version, skipped, stats, self.buffer)
                rec["straggler_wait_s"], self.straggler_wait_s = self.straggler_wait_s, 0.0
                if hold_wait is not None:
                    rec["colocate_wait_s"] = hold_wait
                self.telemetry.sampled_reward(rec)
                if not skipped and self._due(cfg.weight_sync.every_n_steps):
                    self._publish_weights(rec)
                else:
                    self._announce(force=True)
                self.busy_s += time.time() - t0
                self.telemetry.write_step(rec, self.idle_s / max(self.idle_s + self.busy_s, 1e-9),
                                          self.rollout.loaded_version if self.rollout is not None else None,
                                          budget=self.budget)
                if "first_step" not in startup.phases():
                    startup.mark("first_step")
                    self.mlog.write("startup", self.trainer.version, **startup.phases())
                    log.info("%s", startup.summary_line())
                if self.on_step is not None:
                    if self.telemetry.evals:  # the last held-out evaluation, for the progress line
                        rec = {**rec, "eval_accuracy": self.telemetry.evals[-1]["accuracy"],
                               "eval_version": self.telemetry.evals[-1]["version"]}
                    self.on_step(rec)
                    self.wait_notes.printed()
                if not skipped and self.trainer.version < cfg.train.total_steps \
                        and self.trainer.version % cfg.run.checkpoint_every_n_steps == 0:
                    # (the last step's checkpoint is written by _finish, after the final report)
                    with self.budget.phase("checkpoint"):  # in the next step's record
                        self.checkpoint()
            t_wait = time.time()
        return self._finish(reason="target_reached" if self.target_reached is not None else "finished")

    def _stragglers(self, v: int) -> list[str]:
        """Admitted groups still running that the step v → v+1 would push past η: the
        trainer waits for them instead of dropping them as over-stale later — they are
        the long answers, and dropping them biases training toward short ones
        (docs/design.md §10.4). Bounded: the rollout side fails an episode after
        `agent.episode_timeout_s`, and past that (plus a margin) the trainer goes on."""
        r = self.rollout
        if r is None or r.origin is None or r.origin.sender != self.peers.accepted or self._stopping:
            return []
        eta, now = self.cfg.staleness.max_staleness, time.time()
        give_up = self.cfg.agent.episode_timeout_s + 4 * self.cfg.transport.heartbeat_s
        out = []
        for gid, admitted_at in r.running_groups.items():
            if gid in self._arrived or v + 1 - admitted_at <= eta:
                continue
            since = self._straggler_since.setdefault(gid, now)
            if now - since > give_up:
                if since > 0:
                    log.warning("group %s is still running %.0fs after it held the step at v%d: training on "
                                "without it (it may arrive over-stale)", gid, now - since, v)
                    self._straggler_since[gid] = 0.0  # said once
                continue
            out.append(gid)
        return out

    def _wait_phase(self, stragglers: list[str]) -> str:
        """What a pass that formed no batch waited for, as a phase of the step's budget."""
        if self.peers.accepted is None or self.rollout is None:
            return "wait_rollout"
        if stragglers and self.buffer.num_groups >= self.cfg.train.batch_size:
            return "wait_straggler"
        return "wait_data"

    def _due(self, every: int) -> bool:
        v = self.trainer.version
        return v % every == 0 or v >= self.cfg.train.total_steps

    def _take_devices(self) -> float:
        """`cluster.colocate`: announce a new hold and wait until the rollout side reports
        that its servers are paused for it (≤ `cluster.colocate_timeout_s`, then train
        anyway, said in the log). Data that arrives meanwhile is taken in. Returns the
        seconds waited."""
        with self.budget.phase("wait_colocate"):
            return self._wait_for_devices()

    def _wait_for_devices(self) -> float:
        t0 = time.time()
        self._hold_seq += 1
        self._hold = self._hold_seq
        self._announce(force=True)
        deadline = t0 + self.cfg.cluster.colocate_timeout_s
        while not self._devices_free():
            if time.time() > deadline:
                log.warning("the rollout side did not say within cluster.colocate_timeout_s=%gs that its servers "
                            "hold: training at v%d beside them", self.cfg.cluster.colocate_timeout_s,
                            self.trainer.version)
                break
            self._drain(timeout_s=0.01)
            if time.time() - self._last_announce >= 1.0:  # a rollout side that joined meanwhile hears it too
                self._announce(force=True)
        return time.time() - t0

    def _devices_free(self) -> bool:
        r = self.rollout
        if r is None or self.peers.accepted is None or (r.origin is not None and r.origin.sender != self.peers.accepted):
            return True  # no rollout side (yet, or any more) to wait for
        if time.time() - self.peers.heard_at > self.cfg.transport.peer_dead_s:
            return True  # a silent one: the peer check declares it lost
        return r.held == self._hold

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
            raise RunAborted(f"the train step at v{v} failed: {e}; the run stopped: {self._resume_hint()}") from e
        self.budget.split("train", {"train_batch": stats.get("batch_time_s", 0.0),
                                    "train_logprobs_prox": stats.get("prox_time_s", 0.0),
                                    "train_fwd_bwd": stats.get("fwd_bwd_time_s", 0.0),
                                    "train_optimizer": stats.get("optimizer_time_s", 0.0)}, rest="train_other")
        if self.trainer.version == v:
            self.buffer.mark_skipped(groups)
            self.skips_in_a_row += 1
            limit = self.cfg.train.max_consecutive_skips
            log.warning("train step at v%d skipped (non-finite loss or gradient), %d in a row", v, self.skips_in_a_row)
            if self.skips_in_a_row >= limit:
                raise RunAborted(f"{self.skips_in_a_row} train steps in a row at v{v} were skipped for a non-finite "
                                 f"loss or gradient (train.max_consecutive_skips={limit}): lower train.lr or check "
                                 f"the rewards and the model; {self._resume_hint()}")
        else:
            self.skips_in_a_row = 0
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
        if self.buffer.dropped_sent != dropped:
            self._drops_unannounced = True
        if self._drops_unannounced and time.time() - self._last_announce >= 0.1:
            self._drops_unannounced = False
            self._announce(force=True)

    def _publish_weights(self, rec: dict[str, Any]) -> None:
        """Snapshot the new version and announce it. Its broadcast runs on rank 0's sender
        thread while the workers train the next step; the next publish (or the end of the
        run) waits for it, bounded. `weight_sync_s` is the time the trainer was held up:
        the rest of the previous broadcast, the snapshot, the announcement."""
        new_v = self.trainer.version
        t0 = time.time()
        done = self._end_transfer()
        with self.budget.phase("publish"):
            meta = self._send_weights(new_v)
            self._sent_at = time.time()
            self._in_flight = new_v
            if self.cfg.run.record_weights:
                self.run_dir.record_weights(new_v, dict(self.trainer.named_weights()), self.model_path)
            self.last_meta = meta
            self._announce(weights=meta, force=True)
        self.telemetry.weight_sync(rec, time.time() - t0, done)

    def _end_transfer(self) -> Any:
        """Wait (≤ weight_sync.timeout_s) for the broadcast of the last published version;
        its stats, or None. The gate, not this wait, keeps the rollout side within η: it
        admits by the version its engines have loaded."""
        v, self._in_flight = self._in_flight, None
        if v is None:
            return None
        with self.budget.phase("wait_broadcast"):
            return self._wait_for_transfer(v)

    def _wait_for_transfer(self, v: int) -> Any:
        deadline = time.time() + self.cfg.weight_sync.timeout_s
        while True:  # in slices: the rollout side's liveness is judged meanwhile, not after
            try:
                done = self.weights.wait(timeout=max(0.0, min(1.0, deadline - time.time())))
                break
            except Exception as e:  # still on the wire (a stalled or dead receiver)
                if time.time() >= deadline:
                    log.warning("weights v%d: %s; training goes on", v, e)
                    return None
            self._drain(timeout_s=0.0)
            self._check_peers(self.trainer.version)
            if self.peers.accepted is None:  # declared lost: its receivers will not come
                log.info("weights v%d: the rollout side is gone; its broadcast ends on its own", v)
                return None
        if done is not None and not done.ok:
            log.error("weight sync of v%d failed: %s (engines keep their version)", v, done.error)
        return done

    def _send_weights(self, version: int) -> WeightUpdateMeta:
        """Hand the trainer's current weights to the transport as `version`
        (`WeightPublisher.publish`)."""
        with self.budget.phase("publish"):
            meta = self.weights.publish(version, self.trainer)
        return meta.model_copy(update={"epoch": self.peers.epoch})

    def _while_waiting(self, v: int) -> None:
        """No batch yet: keep the rollout side fed and check that it is alive."""
        self._feed_joining_rollout()
        self._feed_restarted_servers()
        self._resend_if_rollout_stuck()
        self._announce()
        self._check_peers(v)
        line, verdict = self.signal.check()
        if verdict is not None:
            raise RunFailed(f"{verdict}\nthe run stopped at v{v}")
        if line is not None:
            log.warning("%s", line)
            self.wait_notes.printed()
        if self.wait_notes.due():
            self._say(self._waiting_for(v))

    def _check_peers(self, v: int) -> None:
        """Is the rollout side alive? A silent one is declared lost (logged) after
        `transport.peer_dead_s`; none past `peer_timeout_s`, or a dead one this process
        knows of, stops the run."""
        had = self.peers.accepted
        try:
            if self.check_peers is not None:
                self.check_peers()
            self.peers.check()
            if had is not None and self.peers.accepted is None:  # declared lost just now
                self.weights.forget_receivers()
        except RunFailed:
            raise
        except Exception as e:  # the trainer's state is whole: save it before stopping
            self._abort_checkpoint()
            raise RunAborted(f"{e}; the run stopped at v{v}: {self._resume_hint()}") from e

    def _say(self, line: str) -> None:
        if self.on_wait is not None:
            self.on_wait(line)
        else:
            log.info("waiting: %s", line)

    def _waiting_for(self, v: int) -> str:
        """What the trainer waits for, in words (one console line every ~10 s)."""
        r, b = self.rollout, self.cfg.train.batch_size
        if self.peers.accepted is None:
            return "the rollout side to connect (it starts its servers and loads the model)"
        if r is None:
            return "the rollout side's first report"
        stragglers = self._stragglers(v)
        if stragglers and self.buffer.num_groups >= b:
            return (f"{len(stragglers)} straggler group(s) that the step to v{v + 1} would push past "
                    f"η={self.cfg.staleness.max_staleness} (docs/design.md §10.4)")
        s = self.signal
        uniform = f", {s.total_uniform} of {s.total_groups} groups so far filtered as uniform" if s.total_uniform else ""
        return (f"data for step {v + 1}: {self.buffer.num_groups}/{b} groups buffered, {r.running} episodes running "
                f"on the rollout side (serving v{r.loaded_version}){uniform}")

    def _abort_checkpoint(self) -> None:
        try:
            self.checkpoint()
        except Exception as e:  # the periodic checkpoints are still there
            log.error("could not write a checkpoint before stopping: %s", e)

    def _resume_hint(self) -> str:
        ckpt = self.run_dir.latest_checkpoint()
        if ckpt is None:
            return "there is no complete checkpoint to resume from"
        return f"run the same command with --resume to continue from the checkpoint {ckpt}"

    def _feed_joining_rollout(self, every_s: float = 3.0) -> None:
        """A rollout controller that has delivered nothing yet while serving an older
        version than the trainer (the trainer resumed, or the controller joined mid-run)
        gets the current weights every few seconds until it has loaded them: a dist
        transfer reaches only receivers registered when it starts, and the controller
        registers on its first announcement."""
        v, r = self.trainer.version, self.rollout
        if v == 0 or self._stopping or (r is not None and self.peers.accepted is None):
            return  # nothing new yet, or the rollout side is gone: nobody to feed until one joins
        if r is not None and (r.loaded_version >= v or self.peers.delivered(self.peers.accepted) > 0):
            return
        try:
            self.weights.wait(timeout=0)
        except Exception:  # the last transfer is still on the wire: a send now would wait for it
            return
        now = time.time()
        if now - self._fed_at < every_s:
            return
        self._fed_at = now
        self.last_meta = self._send_weights(v)
        self._sent_at = time.time()
        self._announce(weights=self.last_meta, force=True)

    def _feed_restarted_servers(self, every_s: float = 5.0) -> None:
        """A rollout server restarted with no live sibling to copy the served version from
        waits, out of rotation, for the trainer to send it again (the rollout side says so
        in its reports): send the current version, at most every `every_s`."""
        r = self.rollout
        if r is None or r.kind == "final" or self._stopping or not r.counters.servers_waiting_for_weights:
            return
        if time.time() - self._sent_at < every_s or self._rollout_at < self._sent_at:
            return  # a send is recent, or no report has come since it
        try:
            self.weights.wait(timeout=0)
        except Exception:  # the last transfer is still on the wire
            return
        v = self.trainer.version
        log.info("%d restarted rollout server(s) wait for the served weights: sending v%d again",
                 int(r.counters.servers_waiting_for_weights), v)
        self.last_meta = self._send_weights(v)
        self._sent_at = time.time()
        self._announce(weights=self.last_meta, force=True)

    def _resend_if_rollout_stuck(self) -> None:
        """A rollout side that missed a version (its receiver stalled past the timeout, or
        the transfer failed) keeps serving its old weights. Once it is more than η behind,
        every sample it makes is over-stale, the trainer starves and no new version would
        ever be sent: send the current weights again (after a report that came in at least
        `weight_sync.timeout_s` after the last send, so a transfer still landing is not
        sent twice)."""
        r, cfg = self.rollout, self.cfg
        if r is None or r.kind == "final" or self.trainer.version - r.loaded_version <= cfg.staleness.max_staleness:
            return
        if self._rollout_at - self._sent_at < cfg.weight_sync.timeout_s:
            return
        try:
            self.weights.wait(timeout=0)
        except Exception:  # the last transfer is still on the wire
            return
        v = self.trainer.version
        log.warning("the rollout side still serves v%d, more than η=%d behind v%d (it missed a weight update): "
                    "sending v%d again", r.loaded_version, cfg.staleness.max_staleness, v, v)
        self.last_meta = self._send_weights(v)
        if cfg.run.record_weights and not self.run_dir.weights_dir(v).is_dir():
            self.run_dir.record_weights(v, dict(self.trainer.named_weights()), self.model_path)
        self._sent_at = time.time()
        self._announce(weights=self.last_meta, force=True)

    # ---- channels ------------------------------------------------------------------------
    def _announce(self, *, weights: WeightUpdateMeta | None = None, data_position: dict[str, int] | None = None,
                  force: bool = False) -> None:
        now = time.time()
        if not force and now - self._last_announce < 0.5:
            return
        self._last_announce = now
        ann = VersionAnnouncement(
            version=self.trainer.version,
            consumed=self.buffer.consumed,
            dropped=self.buffer.dropped_sent,
            sent_base=self.sent_base,
            weights=weights,
            weight_store=self.weights.rendezvous,
            data_position=data_position,
            stop=self._stopping,
            final_eval=self._final_eval,
            hold=0 if self._stopping else self._hold,
            run_id=self.peers.run_id,
            epoch=self.peers.epoch,
            rollout_id=self.peers.accepted,
            acked=self.puller.acks(self.peers.epoch),
        )
        self._last_ann = ann
        self.publisher.publish(ann)

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
        if not self.peers.admit(msg, self._stopping):
            return
        if self.peers.joined is not None:  # hand it the current weights at once
            startup.mark("rollout_joined")
            self.peers.joined = None
            self._fed_at = 0.0
            # Its gate must count what earlier controllers sent (trained, dropped, buffered):
            # a replacement that started from 0 admitted (η + v + 1)·B more and its samples
            # went over-stale (docs/design.md §10.3).
            self.sent_base = self.buffer.consumed + self.buffer.dropped_sent + self.buffer.depth
        if isinstance(msg, TrajectoryGroup):
            startup.mark("first_group")
            self._arrived.add(msg.group_id)
            problem = _bad_tokens(msg, self.vocab_size)
            if problem is not None:
                log.error("group %s refused at the trainer's edge: %s; its %d episodes count as failed",
                          msg.group_id, problem, msg.size)
                self.buffer.put_invalid(msg)
                return
            self.signal.group(msg, self.buffer.put(msg))
            self.telemetry.m.buffer_depth.set(self.buffer.depth)
        elif isinstance(msg, RolloutStats) and msg.kind == "eval" and msg.eval is not None:
            self.telemetry.evaluation(msg, self.trainer.version)
            log.info("eval at v%d: accuracy %.3f", msg.loaded_version, msg.eval.accuracy)
            target = self.cfg.train.stop_at_eval_accuracy
            if target is not None and msg.eval.accuracy >= target and self.target_reached is None:
                self.target_reached = (msg.loaded_version, msg.eval.accuracy)
                log.warning("held-out accuracy %.3f at v%d reached train.stop_at_eval_accuracy=%g: the run ends "
                            "after this step", msg.eval.accuracy, msg.loaded_version, target)
        else:
            if msg.kind == "final":
                self._announce(force=True)  # acknowledge it now: the rollout side waits for that to exit
            seq = msg.origin.seq if msg.origin is not None else 0
            if seq and seq < self._report_seq.get(msg.origin.sender, 0):  # type: ignore[union-attr]
                return  # an older report, resent after a reconnect: the newer one stands
            if seq:
                self._report_seq[msg.origin.sender] = seq  # type: ignore[union-attr]
            self.rollout = msg
            self._rollout_at = time.time()
            self._failures(msg)
            running = set(msg.running_groups)  # what this report still lists may yet arrive
            self._arrived &= running
            self._straggler_since = {g: t for g, t in self._straggler_since.items() if g in running}
            self.telemetry.rollout_report(msg, self.trainer.version)

    def _failures(self, msg: RolloutStats) -> None:
        """Failing episodes reach the console (their first error, led by the user's file
        and line); a rollout side that stopped because of them ends the run with it."""
        f = msg.failures
        if f is not None and f.stopped and not self._stopping:
            tb = f"\n{f.traceback.rstrip()}" if f.traceback else ""
            raise RunFailed(f"{f.first}{tb}\n{f.stopped}; the run stopped at v{self.trainer.version}")
        line = self.failure_notes.report(msg)
        if line is not None:
            log.warning("%s", line)
            self.wait_notes.printed()

    # ---- checkpoint and end ----------------------------------------------------------------
    def _accounted(self) -> int:
        """Episodes whose outcome is known to the trainer side (trained/dropped/buffered)."""
        return sum(self.buffer.counts.values()) + self.buffer.depth

    def checkpoint(self) -> None:
        v = self.trainer.version
        ckpt = self.run_dir.checkpoint_dir(v)
        ckpt.mkdir(parents=True, exist_ok=True)
        (ckpt / "COMPLETE").unlink(missing_ok=True)  # rewriting v (a checkpoint before stopping)
        data_position = self.rollout.data_position if self.rollout is not None else None
        extra = {"buffer": self.buffer.state_dict(), "accounted": self._accounted(), "data_position": data_position}
        self.trainer.save(ckpt / "trainer", extra=extra)
        self.run_dir.mark_complete(ckpt, {"version": v, "time": time.time()})
        self.run_dir.prune_checkpoints(keep=2)

    def _collect_final(self, reason: str) -> None:
        """Wait for the accepted rollout side's final report, re-announcing the stop and
        reading the data channel, for as long as that side is heard from (it reports every
        couple of seconds while it cancels its episodes and finishes the last evaluation),
        at most the last evaluation's bound plus a margin (`eval.final_timeout_s`; after
        Ctrl-C, which skips that evaluation, a short one). Said on the console every ~10 s."""
        self._stopping = True
        log.info("the run ends at v%d (%s): announced the stop; waiting for the rollout side's final report",
                 self.trainer.version, reason)
        margin = 4 * self.cfg.transport.heartbeat_s + 10.0
        bound = margin + (self.cfg.eval.final_timeout_s if self._final_eval else 10.0)
        t0 = time.time()
        next_note = t0 + 10.0
        waiting = self._waiting_final
        # Silence counts from now at the earliest: the trainer did not read while it saved
        # its last checkpoint, which may take longer than peer_dead_s on a big model.
        while waiting() and (now := time.time()) < t0 + bound and now - max(self.peers.heard_at, t0) < self.peers.dead_s:
            self._announce(force=True)
            self._drain(timeout_s=0.2)
            if time.time() >= next_note:
                next_note = time.time() + 10.0
                self._say(self._final_note(t0 + bound - time.time()))
        if self.peers.accepted_final() is not None:
            self._announce(force=True)  # acknowledges the final report: the rollout side exits on it
            time.sleep(0.2)  # PUB drops what is unsent at close
        elif self.peers.accepted is not None:
            silent = time.time() - max(self.peers.heard_at, t0)
            why = (f"it has been silent for {silent:.0f}s (transport.peer_dead_s)" if silent >= self.peers.dead_s
                   else f"within {time.time() - t0:.0f}s (eval.final_timeout_s plus a margin)")
            # After Ctrl-C the short wait is the user's wish, not a fault: said in the log, not as an ERROR.
            (log.info if reason == "interrupted" else log.error)(
                "the rollout side did not report its final counts: %s; what it started and did not deliver "
                "is counted as cancelled", why)

    def _waiting_final(self) -> bool:
        return self.peers.accepted is not None and (
            self.peers.accepted_final() is None or self.peers.missing_before_final(self.puller.acks(self.peers.epoch)))

    def _final_note(self, left_s: float) -> str:
        r = self.rollout
        what = []
        if r is not None and r.eval_progress is not None:
            p = r.eval_progress
            what.append(f"evaluating v{p.version}: {p.done}/{p.total} samples")
        if r is not None and r.running:
            what.append(f"{r.running} episodes still running")
        doing = "; ".join(what) or "cancelling its episodes"
        return f"stopping: waiting for the rollout side's final report ({doing}); at most {max(left_s, 0):.0f}s more"

    def _finish(self, reason: str = "finished") -> dict[str, int]:
        """The end, in the order that keeps the rollout side's channel read: the last
        version to the engines (for its evaluation), the goodbye and the final report,
        then the last checkpoint (long on a big model), then the summary."""
        self._end_transfer()  # the last version reaches the engines before the stop (its evaluation)
        self._stopping = True
        startup.reset()  # a next run in this process measures its own
        self._collect_final(reason)
        if reason == "interrupted":
            self._abort_checkpoint()
        elif not (self.run_dir.checkpoint_dir(self.trainer.version) / "COMPLETE").is_file():
            self.checkpoint()  # the final weights on disk before the summary: an export that fails can be redone
        started = self.started_before_resume + self.peers.started()
        summary = self.buffer.summary(started=started, cancelled=self.peers.cancelled())
        ok = TrajectoryBuffer.counts_add_up(summary)
        if not ok:
            log.error("outcome counts do not add up: %s", summary)
        servers = {n: srv.model_dump() for n, srv in self.rollout.counters.per_server.items()} if self.rollout else {}
        self.mlog.write("summary", self.trainer.version, counts_add_up=ok, ended=reason, **summary,
                        refused_frames={**self.puller.refused_frames, **self.peers.refused},
                        duplicate_frames=self.puller.duplicates,
                        servers=servers,
                        target_reached=list(self.target_reached) if self.target_reached else None,
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
