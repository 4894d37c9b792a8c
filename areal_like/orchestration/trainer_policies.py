"""The trainer side's policies, each one reason to change, called from the schedule in
`TrainerController._run`:

    ReportLog        which rollout report stands (a resent older one does not)
    StragglerPolicy  whether the next step waits for groups it would push past η
    ColocateHold     `cluster.colocate`: the hold announced while a step wants the devices
    WeightFeed       weights out: each new version, and again to a side that needs them
    Checkpointer     checkpoints on disk (COMPLETE, the last two kept) and the --resume line
    Announcer        the version announcement on the control channel, and its heartbeat
    RunEnd           the stop: the goodbye and waiting for the rollout side's final report
    StopRules        what ends a run early: no learning signal, skipped steps, the eval target

What the user reads (each step, what the trainer waits for, failures) is `ConsoleNotes`, in
`watch.py` with the watches that feed it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from areal_like.core.buffer import TrajectoryBuffer
from areal_like.core.config import ExperimentConfig
from areal_like.core.types import RolloutStats, VersionAnnouncement, WeightUpdateMeta
from areal_like.orchestration.peers import RolloutPeers
from areal_like.orchestration.run_dir import RunDir
from areal_like.orchestration.trainer_errors import RunAborted, RunFailed
from areal_like.orchestration.watch import DriftWatch, FreshRewardWatch, SignalWatch, TruncationWatch

__all__ = ["Announcer", "Checkpointer", "ColocateHold", "ReportLog", "RunEnd", "StopRules",
           "StragglerPolicy", "WeightFeed"]

log = logging.getLogger("areal_like.orchestration.trainer_controller")

Announce = Callable[..., None]
"""`TrainerController._announce(weights=..., force=...)`."""


class ReportLog:
    """The rollout side's reports (not its evaluations): the newest one applied per sender
    stands; an older one resent after a reconnect is ignored."""

    def __init__(self) -> None:
        self.latest: RolloutStats | None = None
        self.at = 0.0
        """When the last applied report arrived."""
        self._seq: dict[str, int] = {}
        """Sender → seq of the newest report applied."""

    def apply(self, msg: RolloutStats) -> bool:
        """Take `msg` as the latest report unless a newer one from its sender stands."""
        seq = msg.origin.seq if msg.origin is not None else 0
        if seq and seq < self._seq.get(msg.origin.sender, 0):  # type: ignore[union-attr]
            return False  # an older report, resent after a reconnect: the newer one stands
        if seq:
            self._seq[msg.origin.sender] = seq  # type: ignore[union-attr]
        self.latest = msg
        self.at = time.time()
        return True


class StragglerPolicy:
    """Admitted groups still running that the step v → v+1 would push past η: the trainer
    waits for them instead of dropping them as over-stale later — they are the long
    answers, and dropping them biases training toward short ones (docs/design.md §10.4).
    Bounded: the rollout side fails an episode after `agent.episode_timeout_s`, and past
    that (plus a margin) the trainer goes on."""

    def __init__(self, cfg: ExperimentConfig) -> None:
        self.cfg = cfg
        self.wait_s = 0.0
        """Waited since the last step for a straggler that would otherwise cross η."""
        self._arrived: set[str] = set()
        self._since: dict[str, float] = {}

    def arrived(self, group_id: str) -> None:
        self._arrived.add(group_id)

    def still_running(self, group_ids: set[str]) -> None:
        """A report lists the groups still running: only those may yet arrive."""
        self._arrived &= group_ids
        self._since = {g: t for g, t in self._since.items() if g in group_ids}

    def stragglers(self, v: int, report: RolloutStats | None, accepted: str | None, stopping: bool) -> list[str]:
        """The groups the step from `v` waits for, per the accepted side's latest report."""
        r = report
        if r is None or r.origin is None or r.origin.sender != accepted or stopping:
            return []
        eta, now = self.cfg.staleness.max_staleness, time.time()
        give_up = self.cfg.agent.episode_timeout_s + 4 * self.cfg.transport.heartbeat_s
        out = []
        for gid, admitted_at in r.running_groups.items():
            if gid in self._arrived or v + 1 - admitted_at <= eta:
                continue
            since = self._since.setdefault(gid, now)
            if now - since > give_up:
                if since > 0:
                    log.warning("group %s is still running %.0fs after it held the step at v%d: training on "
                                "without it (it may arrive over-stale)", gid, now - since, v)
                    self._since[gid] = 0.0  # said once
                continue
            out.append(gid)
        return out

    def take_wait_s(self) -> float:
        """The straggler wait since the last step (for its record), and start anew."""
        s, self.wait_s = self.wait_s, 0.0
        return s


class ColocateHold:
    """`cluster.colocate`: before a step, announce a new hold and wait until the rollout
    side reports that its servers are paused for it (≤ `cluster.colocate_timeout_s`, then
    train anyway, said in the log); after it, release them."""

    def __init__(self, cfg: ExperimentConfig, peers: RolloutPeers, reports: ReportLog, *, announce: Announce,
                 drain: Callable[[float], None], announced_at: Callable[[], float]) -> None:
        self.cfg = cfg
        self.peers = peers
        self.reports = reports
        self._announce = announce
        self._drain = drain
        self._announced_at = announced_at
        self.number = 0
        """The hold number announced while a step wants the devices (0: none)."""
        self._seq = 0

    def take(self, v: int) -> float:
        """Hold the servers for the step at `v`; data that arrives meanwhile is taken in.
        Returns the seconds waited."""
        t0 = time.time()
        self._seq += 1
        self.number = self._seq
        self._announce(force=True)
        deadline = t0 + self.cfg.cluster.colocate_timeout_s
        while not self.devices_free():
            if time.time() > deadline:
                log.warning("the rollout side did not say within cluster.colocate_timeout_s=%gs that its servers "
                            "hold: training at v%d beside them", self.cfg.cluster.colocate_timeout_s, v)
                break
            self._drain(0.01)
            if time.time() - self._announced_at() >= 1.0:  # a rollout side that joined meanwhile hears it too
                self._announce(force=True)
        return time.time() - t0

    def release(self) -> None:
        """The announcement after the step lets the servers run again."""
        self.number = 0

    def devices_free(self) -> bool:
        r = self.reports.latest
        if r is None or self.peers.accepted is None or (r.origin is not None and r.origin.sender != self.peers.accepted):
            return True  # no rollout side (yet, or any more) to wait for
        if time.time() - self.peers.heard_at > self.cfg.transport.peer_dead_s:
            return True  # a silent one: the peer check declares it lost
        return r.held == self.number


class WeightFeed:
    """Weights out: each new version (its broadcast overlapping the next step), and the
    current version again to a rollout side that needs it — one that joined or resumed
    behind, a restarted server, a side that missed an update and fell more than η behind."""

    def __init__(self, cfg: ExperimentConfig, *, trainer: Any, weights: Any, peers: RolloutPeers, run_dir: RunDir,
                 model_path: Path, reports: ReportLog, phase: Callable[[str], AbstractContextManager[Any]],
                 announce: Announce, drain: Callable[[float], None], check_peers: Callable[[int], None]) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self.weights = weights
        """The `WeightPublisher`."""
        self.peers = peers
        self.run_dir = run_dir
        self.model_path = model_path
        self.reports = reports
        self._phase = phase
        self._announce = announce
        self._drain = drain
        self._check_peers = check_peers
        self.last_meta: WeightUpdateMeta | None = None
        self.in_flight: int | None = None
        """The published version whose broadcast may still run (see `end_transfer`)."""
        self.sent_at = time.time()
        """When weights were last sent (a rollout report must come later to say it lags)."""
        self.fed_at = time.time()

    def record(self, v: int) -> None:
        """`weights/v{v}/` (every `run.record_weights_every`-th version): the trainer writes
        them (its train ranks), never through here."""
        if self.cfg.run.record_weights and v % self.cfg.run.record_weights_every == 0:
            self.run_dir.record_weights(v, self.trainer, self.model_path)

    def send(self, version: int) -> WeightUpdateMeta:
        """Hand the trainer's current weights to the transport as `version`
        (`WeightPublisher.publish`)."""
        with self._phase("publish"):
            meta = self.weights.publish(version, self.trainer)
        return meta.model_copy(update={"epoch": self.peers.epoch})

    def publish(self) -> Any:
        """Snapshot the new version and announce it. Its broadcast runs on rank 0's sender
        thread while the workers train the next step; the next publish (or the end of the
        run) waits for it, bounded. Returns the previous broadcast's stats (or None)."""
        new_v = self.trainer.version
        done = self.end_transfer()
        with self._phase("publish"):
            meta = self.send(new_v)
            self.sent_at = time.time()
            self.in_flight = new_v
            self.last_meta = meta
            self._announce(weights=meta, force=True)
            # after the announcement: the servers load the version while its copy is written
            # (written first, it held each recorded version back by the write: 0.3-0.9 s at 135M)
            self.record(new_v)
        return done

    def end_transfer(self) -> Any:
        """Wait (≤ weight_sync.timeout_s) for the broadcast of the last published version;
        its stats, or None. The gate, not this wait, keeps the rollout side within η: it
        admits by the version its engines have loaded."""
        v, self.in_flight = self.in_flight, None
        if v is None:
            return None
        with self._phase("wait_broadcast"):
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
            self._drain(0.0)
            self._check_peers(self.trainer.version)
            if self.peers.accepted is None:  # declared lost: its receivers will not come
                log.info("weights v%d: the rollout side is gone; its broadcast ends on its own", v)
                return None
        if done is not None and not done.ok:
            log.error("weight sync of v%d failed: %s (engines keep their version)", v, done.error)
        return done

    def _idle(self) -> bool:
        try:
            self.weights.wait(timeout=0)
        except Exception:  # the last transfer is still on the wire: a send now would wait for it
            return False
        return True

    def _resend(self, v: int) -> None:
        self.last_meta = self.send(v)
        self._sent()

    def _sent(self) -> None:
        self.sent_at = time.time()
        self._announce(weights=self.last_meta, force=True)

    def feed_joining_rollout(self, stopping: bool, every_s: float = 3.0) -> None:
        """A rollout controller that has delivered nothing yet while serving an older
        version than the trainer (the trainer resumed, or the controller joined mid-run)
        gets the current weights every few seconds until it has loaded them: a dist
        transfer reaches only receivers registered when it starts, and the controller
        registers on its first announcement."""
        v, r = self.trainer.version, self.reports.latest
        if v == 0 or stopping or (r is not None and self.peers.accepted is None):
            return  # nothing new yet, or the rollout side is gone: nobody to feed until one joins
        if r is not None and (r.loaded_version >= v or self.peers.delivered(self.peers.accepted) > 0):
            return
        if not self._idle():
            return
        now = time.time()
        if now - self.fed_at < every_s:
            return
        self.fed_at = now
        self._resend(v)

    def feed_restarted_servers(self, stopping: bool, every_s: float = 5.0) -> None:
        """A rollout server restarted with no live sibling to copy the served version from
        waits, out of rotation, for the trainer to send it again (the rollout side says so
        in its reports): send the current version, at most every `every_s`."""
        r = self.reports.latest
        if r is None or r.kind == "final" or stopping or not r.counters.pool.servers_waiting_for_weights:
            return
        if time.time() - self.sent_at < every_s or self.reports.at < self.sent_at:
            return  # a send is recent, or no report has come since it
        if not self._idle():
            return
        v = self.trainer.version
        log.info("%d restarted rollout server(s) wait for the served weights: sending v%d again",
                 int(r.counters.pool.servers_waiting_for_weights), v)
        self._resend(v)

    def resend_if_rollout_stuck(self) -> None:
        """A rollout side that missed a version (its receiver stalled past the timeout, or
        the transfer failed) keeps serving its old weights. Once it is more than η behind,
        every sample it makes is over-stale, the trainer starves and no new version would
        ever be sent: send the current weights again (after a report that came in at least
        `weight_sync.timeout_s` after the last send, so a transfer still landing is not
        sent twice)."""
        r, cfg = self.reports.latest, self.cfg
        if r is None or r.kind == "final" or self.trainer.version - r.loaded_version <= cfg.staleness.max_staleness:
            return
        if self.reports.at - self.sent_at < cfg.weight_sync.timeout_s:
            return
        if not self._idle():
            return
        v = self.trainer.version
        log.warning("the rollout side still serves v%d, more than η=%d behind v%d (it missed a weight update): "
                    "sending v%d again", r.loaded_version, cfg.staleness.max_staleness, v, v)
        self.last_meta = self.send(v)
        if not self.run_dir.weights_dir(v).is_dir():
            self.record(v)
        self._sent()


class Checkpointer:
    """Checkpoints: the trainer's state, the buffer, the counts and the data position,
    marked COMPLETE once whole; the last two are kept. Says which one `--resume` uses."""

    def __init__(self, run_dir: RunDir, trainer: Any, buffer: TrajectoryBuffer, reports: ReportLog) -> None:
        self.run_dir = run_dir
        self.trainer = trainer
        self.buffer = buffer
        self.reports = reports
        self.accounted_before = 0
        """Episodes accounted for in the checkpoint resumed from (0: a fresh run)."""
        self.data_position: dict[str, int | str] | None = None
        """The rollout side's data position in the checkpoint resumed from."""

    def accounted(self) -> int:
        """Episodes whose outcome is known to the trainer side (trained/dropped/buffered)."""
        return sum(self.buffer.counts.values()) + self.buffer.depth

    def save(self) -> None:
        v = self.trainer.version
        ckpt = self.run_dir.checkpoint_dir(v)
        ckpt.mkdir(parents=True, exist_ok=True)
        (ckpt / "COMPLETE").unlink(missing_ok=True)  # rewriting v (a checkpoint before stopping)
        r = self.reports.latest
        data_position = r.data_position if r is not None else None
        extra = {"buffer": self.buffer.state_dict(), "accounted": self.accounted(), "data_position": data_position}
        self.trainer.save(ckpt / "trainer", extra=extra)
        self.run_dir.mark_complete(ckpt, {"version": v, "time": time.time()})
        self.run_dir.prune_checkpoints(keep=2)

    def save_before_stopping(self) -> None:
        """Best effort: a fault stops the run; the periodic checkpoints are still there."""
        try:
            self.save()
        except Exception as e:
            log.error("could not write a checkpoint before stopping: %s", e)

    def has(self, v: int) -> bool:
        return (self.run_dir.checkpoint_dir(v) / "COMPLETE").is_file()

    def load(self) -> Path:
        """The latest complete checkpoint into the trainer and the buffer (and the counts
        and data position it holds into `accounted_before`, `data_position`): its path."""
        ckpt = self.run_dir.latest_checkpoint()
        if ckpt is None:
            raise RuntimeError(f"--resume: no complete checkpoint in {self.run_dir.checkpoints}")
        extra = self.trainer.load(ckpt / "trainer")
        self.buffer.load_state_dict(extra["buffer"])
        self.accounted_before = int(extra["accounted"])
        self.data_position = extra.get("data_position")
        return ckpt

    def resume_hint(self) -> str:
        ckpt = self.run_dir.latest_checkpoint()
        if ckpt is None:
            return "there is no complete checkpoint to resume from"
        return f"run the same command with --resume to continue from the checkpoint {ckpt}"


class Announcer:
    """Publishes the version announcement, and re-publishes the latest one every
    `transport.heartbeat_s`, also while a train step runs, so the rollout side can tell
    a busy trainer from a dead one. The repeat carries no weights (a transfer is
    announced once, by the schedule)."""

    def __init__(self, publisher: Any, *, acks: Callable[[], Any], heartbeat_s: float,
                 accepted: Callable[[], str | None] = lambda: None, servers: Callable[[], int] = lambda: 0) -> None:
        self.publisher = publisher
        self._acks = acks
        self._accepted = accepted
        self._servers = servers
        """The rollout server count asked for now (`elastic.PoolRequest`; 0: none), in
        every announcement and heartbeat (docs/design.md §10.24)."""
        """The rollout controller the trainer accepts now: a heartbeat says it, not the one
        of the announcement it repeats (a controller accepted during a long train step
        would otherwise be unnamed there, and a second one would join the weight group
        before its refusal)."""
        self._heartbeat_s = heartbeat_s
        self.last: VersionAnnouncement | None = None
        self.at = 0.0
        """When the last announcement (not a heartbeat) was made."""
        self._stop = threading.Event()
        self._drops_pending = False

    def drops_due(self, dropped: bool) -> bool:
        """Groups dropped on arrival while a step runs free gate slots on the rollout side:
        whether to announce them now (at once, at most every 0.1 s)."""
        self._drops_pending = self._drops_pending or dropped
        if self._drops_pending and time.time() - self.at >= 0.1:
            self._drops_pending = False
            return True
        return False

    def due(self, now: float, force: bool, every_s: float = 0.5) -> bool:
        """Whether to announce now (at most every `every_s` unless forced); if so, it counts as made."""
        if not force and now - self.at < every_s:
            return False
        self.at = now
        return True

    def publish(self, ann: VersionAnnouncement) -> None:
        if self._servers():
            ann = ann.model_copy(update={"servers": self._servers()})
        self.last = ann
        self.publisher.publish(ann)

    def heartbeat(self) -> None:
        """The heartbeat thread's loop, until `stop`."""
        while not self._stop.wait(self._heartbeat_s):
            ann = self.last
            if ann is not None:
                try:
                    who = ann.trainer.model_copy(update={"rollout_id": self._accepted()})
                    self.publisher.publish(ann.model_copy(update={"weights": None, "acked": self._acks(),
                                                                  "trainer": who, "servers": self._servers()}))
                except Exception as e:  # the channel is closing: the schedule reports what matters
                    log.debug("heartbeat not sent: %s", e)
                    return

    def stop(self) -> None:
        self._stop.set()


class RunEnd:
    """The end of a run: the stop announced, then the accepted rollout side's final report
    waited for (bounded), said on the console every ~10 s."""

    def __init__(self, cfg: ExperimentConfig, peers: RolloutPeers, reports: ReportLog, *, acks: Callable[[], Any],
                 announce: Announce, drain: Callable[[float], None], say: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.peers = peers
        self.reports = reports
        self._acks = acks
        self._announce = announce
        self._drain = drain
        self._say = say
        self.stopping = False
        self.final_eval = True
        """With the stop: whether the rollout side evaluates the last version first."""

    def collect_final(self, reason: str, v: int) -> None:
        """Wait for the accepted rollout side's final report, re-announcing the stop and
        reading the data channel, for as long as that side is heard from (it reports every
        couple of seconds while it cancels its episodes and finishes the last evaluation),
        at most the last evaluation's bound plus a margin (`eval.final_timeout_s`; after
        Ctrl-C, which skips that evaluation, a short one). Said on the console every ~10 s."""
        self.stopping = True
        log.info("the run ends at v%d (%s): announced the stop; waiting for the rollout side's final report",
                 v, reason)
        margin = 4 * self.cfg.transport.heartbeat_s + 10.0
        bound = margin + (self.cfg.eval.final_timeout_s if self.final_eval else 10.0)
        t0 = time.time()
        next_note = t0 + 10.0
        waiting = self.waiting
        # Silence counts from now at the earliest: the trainer did not read while it saved
        # its last checkpoint, which may take longer than peer_dead_s on a big model.
        while waiting() and (now := time.time()) < t0 + bound and now - max(self.peers.heard_at, t0) < self.peers.dead_s:
            self._announce(force=True)
            self._drain(0.2)
            if time.time() >= next_note:
                next_note = time.time() + 10.0
                self._say(self.note(t0 + bound - time.time()))
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

    def waiting(self) -> bool:
        """Whether the accepted side's final report (and everything before it) is still to come."""
        return self.peers.accepted is not None and (
            self.peers.accepted_final() is None or self.peers.missing_before_final(self._acks()))

    def note(self, left_s: float) -> str:
        r = self.reports.latest
        what = []
        if r is not None and r.eval_progress is not None:
            p = r.eval_progress
            what.append(f"evaluating v{p.version}: {p.done}/{p.total} samples")
        if r is not None and r.running:
            what.append(f"{r.running} episodes still running")
        doing = "; ".join(what) or "cancelling its episodes"
        return f"stopping: waiting for the rollout side's final report ({doing}); at most {max(left_s, 0):.0f}s more"


class StopRules:
    """What ends a run before `train.total_steps`: no learning signal (`SignalWatch`),
    `train.max_consecutive_skips` steps in a row skipped for a non-finite loss or
    gradient, a held-out accuracy at `train.stop_at_eval_accuracy`. With that target the
    trainer takes no step past an evaluated version before its score is in (`waits_for_score`),
    so the run ends on the version that reached it (docs/design.md §10.49)."""

    def __init__(self, cfg: ExperimentConfig, reward_name: str) -> None:
        self.cfg = cfg
        self.signal = SignalWatch(reward_name, max_no_signal_s=cfg.agent.max_no_signal_s,
                                  uniform_after=cfg.dataset.uniform_after)
        self.drift = DriftWatch(eta=cfg.staleness.max_staleness, lr=cfg.train.lr)
        self.fresh = FreshRewardWatch.for_config(cfg)
        self.truncation = TruncationWatch.for_config(cfg)  # not a stop: a line when answers run to the limit
        self.skips_in_a_row = 0
        self.target_reached: tuple[int, float] | None = None
        """(version, accuracy) of the evaluation that reached `train.stop_at_eval_accuracy`."""
        self.solved_at: int | None = None
        """The version at which every group had scored the run's best reward for `agent.max_no_signal_s`."""
        self.scored_through = -1
        """The newest version a held-out evaluation scored."""
        self._waiting_since: tuple[int, float] | None = None

    def trained(self, stats: dict[str, Any]) -> str | None:
        """A step was applied: a line to say if the policy drifts from the sampler's."""
        self.skips_in_a_row = 0
        return self.drift.step(stats)

    def sampled(self, rec: dict[str, Any]) -> str | None:
        """A step's record with the newest episodes' reward: a line if that reward fell far."""
        return self.fresh.step(rec)

    def skipped(self, v: int, resume_hint: Callable[[], str]) -> None:
        """The step at v was skipped: said in the log; raises `RunAborted` at the limit."""
        self.skips_in_a_row += 1
        limit = self.cfg.train.max_consecutive_skips
        log.warning("train step at v%d skipped (non-finite loss or gradient), %d in a row", v, self.skips_in_a_row)
        if self.skips_in_a_row >= limit:
            raise RunAborted(f"{self.skips_in_a_row} train steps in a row at v{v} were skipped for a non-finite "
                             f"loss or gradient (train.max_consecutive_skips={limit}): lower train.lr or check "
                             f"the rewards and the model; {resume_hint()}")

    def evaluation(self, msg: RolloutStats) -> None:
        """A held-out evaluation came in: does it reach the target?"""
        assert msg.eval is not None
        self.scored_through = max(self.scored_through, msg.loaded_version)
        target = self.cfg.train.stop_at_eval_accuracy
        if target is not None and msg.eval.accuracy >= target and self.target_reached is None:
            self.target_reached = (msg.loaded_version, msg.eval.accuracy)
            log.warning("held-out accuracy %.3f at v%d reached train.stop_at_eval_accuracy=%g: the run ends "
                        "before another step", msg.eval.accuracy, msg.loaded_version, target)

    def waits_for_score(self, v: int, published: bool) -> bool:
        """Whether the step from v waits for v's held-out score: v is a published multiple of
        `eval.every_n_steps` and the run ends at `train.stop_at_eval_accuracy`. The rollout
        side evaluates the first version it loads at each multiple, so this one, on its own
        weights (no newer version lands during it). At most `eval.final_timeout_s` a version."""
        cfg = self.cfg
        every = cfg.eval.every_n_steps
        if (cfg.train.stop_at_eval_accuracy is None or not every or not published or v <= 0 or v % every
                or v >= cfg.train.total_steps or not 0 <= self.scored_through < v):  # none yet: no held-out rows
            return False
        if self._waiting_since is None or self._waiting_since[0] != v:
            self._waiting_since = (v, time.monotonic())
        waited = time.monotonic() - self._waiting_since[1]
        if waited < cfg.eval.final_timeout_s:
            return True
        if waited != float("inf"):
            log.warning("no held-out score of v%d in eval.final_timeout_s=%gs: training goes on without it",
                        v, cfg.eval.final_timeout_s)
            self._waiting_since = (v, -float("inf"))  # given up on v
        return False

    def check_signal(self, v: int) -> str | None:
        """A line to say about the learning signal, if any; raises `RunFailed` when there is none."""
        line, verdict = self.signal.check()
        if verdict is not None and self.signal.solved:  # an end, not a failure
            log.warning("%s", verdict)
            self.solved_at = v
        elif verdict is not None:
            raise RunFailed(f"{verdict}\nthe run stopped at v{v}")
        return line

    @property
    def ended(self) -> str | None:
        """Why the run ends before `train.total_steps`, if it does: `target_reached` or `solved`."""
        return "target_reached" if self.target_reached is not None else "solved" if self.solved_at is not None else None
