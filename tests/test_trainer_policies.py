"""The trainer controller's policies (areal_like/orchestration/trainer_policies.py), each
on its own: no channels, no threads, no schedule — a report in, a decision out."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from areal_like.core.buffer import TrajectoryBuffer
from areal_like.core.config import load_config
from areal_like.core.types import (
    EvalResult,
    Origin,
    RolloutCounters,
    RolloutStats,
    ServerPoolCounters,
    TrainerId,
    VersionAnnouncement,
    WeightUpdateMeta,
)
from areal_like.orchestration.peers import RolloutPeers
from areal_like.orchestration.run_dir import RunDir
from areal_like.orchestration.trainer_errors import RunAborted
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
from areal_like.orchestration.watch import ConsoleNotes


def _cfg(*overrides: str):
    return load_config(None, list(overrides))


def _report(seq: int = 1, sender: str = "r1", **kw: Any) -> RolloutStats:
    kw.setdefault("loaded_version", 0)
    return RolloutStats(time=time.time(), started=0, running=kw.pop("running", 0),
                        origin=Origin(run_id="run", epoch=0, sender=sender, seq=seq), **kw)


def _peers(accepted: str | None = "r1") -> RolloutPeers:
    p = RolloutPeers("run", 0, dead_s=30.0, timeout_s=600.0)
    p.accepted = accepted
    p.heard_at = time.time()
    return p


# ---- ReportLog ------------------------------------------------------------------------
def test_report_log_applies_only_newer_reports_per_sender() -> None:
    reports = ReportLog()
    assert reports.apply(_report(seq=2, loaded_version=2))
    assert not reports.apply(_report(seq=1, loaded_version=1))  # resent after a reconnect
    assert reports.latest is not None and reports.latest.loaded_version == 2
    assert reports.apply(_report(seq=1, sender="r2", loaded_version=5))  # another sender counts its own
    assert reports.apply(_report(seq=0, loaded_version=7))  # unnumbered: always applied
    assert reports.latest.loaded_version == 7 and reports.at > 0


# ---- StragglerPolicy --------------------------------------------------------------------
def test_a_straggler_holds_the_step_that_would_push_it_past_eta() -> None:
    policy = StragglerPolicy(_cfg("staleness.max_staleness=1"))
    r = _report(running_groups={"old": 0, "new": 3})
    # at v=0 the step to v1 keeps "old" (admitted at v0) within η=1: no wait
    assert policy.stragglers(0, r, "r1", stopping=False) == []
    # at v=1 the step to v2 would push it past η: the trainer waits for it
    assert policy.stragglers(1, r, "r1", stopping=False) == ["old"]
    # not for a group that arrived, nor for another side's report, nor while stopping
    assert policy.stragglers(1, r, "r2", stopping=False) == []
    assert policy.stragglers(1, r, "r1", stopping=True) == []
    policy.arrived("old")
    assert policy.stragglers(1, r, "r1", stopping=False) == []


def test_a_straggler_is_given_up_after_its_timeout(caplog) -> None:
    cfg = _cfg("staleness.max_staleness=0", "agent.episode_timeout_s=0.2", "transport.heartbeat_s=0.05")
    policy = StragglerPolicy(cfg)
    r = _report(running_groups={"g": 0})
    assert policy.stragglers(0, r, "r1", stopping=False) == ["g"]
    time.sleep(0.5)  # past episode_timeout_s + 4 heartbeats
    with caplog.at_level(logging.WARNING):
        assert policy.stragglers(0, r, "r1", stopping=False) == []
        assert policy.stragglers(0, r, "r1", stopping=False) == []
    assert sum("training on without it" in m for m in caplog.messages) == 1  # said once


def test_the_straggler_wait_is_taken_once_per_step_and_reports_prune_what_finished() -> None:
    policy = StragglerPolicy(_cfg("staleness.max_staleness=0"))
    policy.wait_s += 1.5
    assert policy.take_wait_s() == 1.5 and policy.take_wait_s() == 0.0
    policy.arrived("a")
    policy.still_running({"b"})  # "a" is no longer listed: if listed again it is a new wait
    assert policy.stragglers(0, _report(running_groups={"a": 0}), "r1", stopping=False) == ["a"]


# ---- ColocateHold -----------------------------------------------------------------------
def test_the_colocate_hold_waits_until_the_servers_say_they_hold() -> None:
    reports, announced = ReportLog(), []
    hold: ColocateHold

    def drain(_timeout_s: float) -> None:  # the rollout side answers the announced hold
        reports.apply(_report(seq=len(announced) + 1, held=hold.number))

    hold = ColocateHold(_cfg("cluster.colocate_timeout_s=5"), _peers(), reports,
                        announce=lambda **kw: announced.append(hold.number), drain=drain, announced_at=time.time)
    reports.apply(_report(seq=1))
    waited = hold.take(v=3)
    assert waited < 1.0 and hold.number == 1 and announced[0] == 1 and hold.devices_free()
    hold.release()
    assert hold.number == 0


def test_the_colocate_hold_trains_anyway_after_its_timeout(caplog) -> None:
    reports = ReportLog()
    reports.apply(_report(seq=1))
    hold = ColocateHold(_cfg("cluster.colocate_timeout_s=0.2"), _peers(), reports, announce=lambda **kw: None,
                        drain=lambda t: None, announced_at=time.time)
    with caplog.at_level(logging.WARNING):
        waited = hold.take(v=2)
    assert 0.2 <= waited < 2.0
    assert any("colocate_timeout_s" in m and "training at v2" in m for m in caplog.messages)


def test_no_rollout_side_means_the_devices_are_free() -> None:
    hold = ColocateHold(_cfg(), _peers(None), ReportLog(), announce=lambda **kw: None, drain=lambda t: None,
                        announced_at=time.time)
    assert hold.devices_free()


# ---- WeightFeed -------------------------------------------------------------------------
class _Trainer:
    def __init__(self, version: int = 0) -> None:
        self.version = version
        self.saved: list[tuple[Path, dict[str, Any]]] = []

    def named_weights(self):
        yield "w", torch.zeros(2)

    def save(self, path: Path, extra: dict[str, Any] | None = None) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.saved.append((path, dict(extra or {})))

    def load(self, path: Path) -> dict[str, Any]:
        return self.saved[-1][1]


class _Weights:
    rendezvous = None

    def __init__(self) -> None:
        self.published: list[int] = []
        self.waited = 0

    def publish(self, version: int, trainer: Any) -> WeightUpdateMeta:
        self.published.append(version)
        return WeightUpdateMeta(version=version, transport="disk", tensors=[], checksum="x")

    def wait(self, timeout: float | None = None) -> None:
        self.waited += 1


def _feed(tmp_path: Path, trainer: _Trainer, weights: _Weights, reports: ReportLog, *cfg: str):
    from contextlib import nullcontext

    announced: list[Any] = []
    feed = WeightFeed(_cfg("run.record_weights=false", *cfg), trainer=trainer, weights=weights, peers=_peers(),
                      run_dir=RunDir(tmp_path / "run"), model_path=tmp_path, reports=reports,
                      phase=lambda name: nullcontext(), announce=lambda **kw: announced.append(kw.get("weights")),
                      drain=lambda t: None, check_peers=lambda v: None)
    return feed, announced


def test_publishing_announces_the_version_and_waits_for_the_previous_broadcast(tmp_path) -> None:
    trainer, weights = _Trainer(1), _Weights()
    feed, announced = _feed(tmp_path, trainer, weights, ReportLog())
    feed.publish()
    assert weights.published == [1] and feed.in_flight == 1 and announced[-1].version == 1
    assert weights.waited == 0  # its broadcast overlaps the next step
    trainer.version = 2
    feed.publish()
    assert weights.waited == 1 and feed.in_flight == 2  # v1's broadcast waited for first
    feed.end_transfer()
    assert feed.in_flight is None and feed.end_transfer() is None


def test_weights_are_recorded_every_nth_version_when_asked(tmp_path) -> None:
    """`run.record_weights_every`: at 135M a version is 538 MB, and a benchmark that scores
    checkpoints afterwards keeps every N-th (v0 always)."""
    trainer, weights = _Trainer(1), _Weights()
    feed, _ = _feed(tmp_path, trainer, weights, ReportLog(), "run.record_weights=true", "run.record_weights_every=2")
    recorded: list[int] = []
    feed.run_dir.record_weights = lambda v, source, path: recorded.append(v)  # type: ignore[method-assign]
    feed.record(0)
    for v in (1, 2, 3, 4):
        trainer.version = v
        feed.publish()
    assert recorded == [0, 2, 4]


def test_a_recorded_version_is_written_after_the_servers_are_told_of_it(tmp_path) -> None:
    """Writing a recorded copy takes 0.3-0.9 s at 135M: written before the announcement, it
    held each recorded version back from the servers by as much (docs/benchmarks.md)."""
    trainer, weights = _Trainer(2), _Weights()
    feed, announced = _feed(tmp_path, trainer, weights, ReportLog(), "run.record_weights=true")
    seen: list[list[int]] = []
    feed.run_dir.record_weights = (  # type: ignore[method-assign]
        lambda v, source, path: seen.append([m.version for m in announced if m is not None]))
    feed.publish()
    assert seen == [[2]]  # v2's announcement had gone out when its copy was written


def test_a_rollout_side_more_than_eta_behind_gets_the_weights_again(tmp_path, caplog) -> None:
    trainer, weights, reports = _Trainer(5), _Weights(), ReportLog()
    feed, announced = _feed(tmp_path, trainer, weights, reports, "staleness.max_staleness=1",
                            "weight_sync.timeout_s=0.1")
    reports.apply(_report(seq=1, loaded_version=4))  # within η: nothing to do
    feed.resend_if_rollout_stuck()
    assert weights.published == []
    feed.sent_at = time.time() - 1.0
    reports.apply(_report(seq=2, loaded_version=3))  # 2 behind, reported well after the last send
    with caplog.at_level(logging.WARNING):
        feed.resend_if_rollout_stuck()
    assert weights.published == [5] and announced[-1].version == 5
    assert any("sending v5 again" in m for m in caplog.messages)
    feed.resend_if_rollout_stuck()  # no report since that send: not again
    assert weights.published == [5]


def test_restarted_servers_and_a_joining_side_are_fed(tmp_path) -> None:
    trainer, weights, reports = _Trainer(3), _Weights(), ReportLog()
    feed, _ = _feed(tmp_path, trainer, weights, reports)
    feed.feed_joining_rollout(stopping=False)  # fed just now (at start): not yet
    assert weights.published == []
    feed.fed_at = 0.0  # a side joined
    feed.feed_joining_rollout(stopping=False)
    assert weights.published == [3]
    feed.sent_at = time.time() - 10.0
    reports.apply(_report(seq=1, loaded_version=3, counters=RolloutCounters(pool=ServerPoolCounters(servers_waiting_for_weights=1))))
    feed.feed_restarted_servers(stopping=True)  # not once the run stops
    assert weights.published == [3]
    feed.feed_restarted_servers(stopping=False)
    assert weights.published == [3, 3]


# ---- Checkpointer -----------------------------------------------------------------------
def test_the_checkpointer_writes_complete_and_keeps_two(tmp_path) -> None:
    run_dir, trainer, reports = RunDir(tmp_path / "run"), _Trainer(), ReportLog()
    buffer = TrajectoryBuffer(1, True)
    ckpts = Checkpointer(run_dir, trainer, buffer, reports)
    assert "no complete checkpoint" in ckpts.resume_hint()
    reports.apply(_report(data_position={"epoch": 0, "index": 7}))
    for v in (1, 2, 3):
        trainer.version = v
        ckpts.save()
        assert ckpts.has(v)
    left = sorted(p.name for p in run_dir.checkpoints.iterdir())
    assert left == ["v000002", "v000003"]
    assert all((run_dir.checkpoints / n / "COMPLETE").is_file() for n in left)
    assert str(run_dir.checkpoint_dir(3)) in ckpts.resume_hint()
    assert ckpts.load() == run_dir.checkpoint_dir(3)
    assert ckpts.data_position == {"epoch": 0, "index": 7} and ckpts.accounted_before == 0


def test_a_checkpoint_before_stopping_that_fails_is_logged_not_raised(tmp_path, caplog) -> None:
    class _Broken(_Trainer):
        def save(self, path: Path, extra: dict[str, Any] | None = None) -> None:
            raise OSError("disk gone")

    ckpts = Checkpointer(RunDir(tmp_path / "run"), _Broken(), TrajectoryBuffer(1, True), ReportLog())
    with caplog.at_level(logging.ERROR):
        ckpts.save_before_stopping()
    assert any("could not write a checkpoint" in m for m in caplog.messages)
    with pytest.raises(RuntimeError, match="no complete checkpoint"):
        ckpts.load()


# ---- Announcer --------------------------------------------------------------------------
def test_announcements_are_throttled_unless_forced_and_drops_go_out_at_once() -> None:
    class _Pub:
        def __init__(self) -> None:
            self.sent: list[Any] = []

        def publish(self, ann: Any) -> None:
            self.sent.append(ann)

    a = Announcer(_Pub(), acks=dict, heartbeat_s=1.0)
    now = time.time()
    assert a.due(now, force=False) and not a.due(now + 0.1, force=False) and a.due(now + 0.1, force=True)
    a.at = time.time()
    assert not a.drops_due(True)  # announced just now: kept for a moment
    a.at = time.time() - 1.0
    assert a.drops_due(False)  # the drop seen before still goes out
    assert not a.drops_due(False)


def test_a_heartbeat_names_the_controller_accepted_now_without_the_weights() -> None:
    """The heartbeat repeats the last announcement, but says which rollout controller the
    trainer accepts now: one accepted during a long step is named at once, so a second
    controller is refused before it joins the weight group."""
    import threading

    class _Pub:
        def __init__(self) -> None:
            self.sent: list[Any] = []
            self.got = threading.Event()

        def publish(self, ann: Any) -> None:
            self.sent.append(ann)
            self.got.set()

    accepted: list[str | None] = [None]
    pub = _Pub()
    a = Announcer(pub, acks=lambda: {"ro-a": [3]}, heartbeat_s=0.05, accepted=lambda: accepted[0])
    meta = WeightUpdateMeta(version=2, transport="disk", tensors=[], checksum="x")
    a.publish(VersionAnnouncement(version=2, weights=meta, trainer=TrainerId(run_id="run", epoch=1)))
    accepted[0] = "ro-a"  # accepted after that announcement was made
    pub.got.clear()
    t = threading.Thread(target=a.heartbeat, daemon=True)
    t.start()
    assert pub.got.wait(5)
    a.stop()
    t.join(5)
    beat = pub.sent[-1]
    assert beat.trainer == TrainerId(run_id="run", epoch=1, rollout_id="ro-a")
    assert beat.weights is None and beat.acked == {"ro-a": [3]} and beat.version == 2


# ---- RunEnd -----------------------------------------------------------------------------
def test_the_end_waits_for_no_one_when_no_rollout_side_is_accepted() -> None:
    end = RunEnd(_cfg(), _peers(None), ReportLog(), acks=dict, announce=lambda **kw: None, drain=lambda t: None,
                 say=lambda line: None)
    t0 = time.time()
    end.collect_final("finished", 3)
    assert end.stopping and not end.waiting() and time.time() - t0 < 1.0


def test_the_end_note_says_what_the_rollout_side_still_does() -> None:
    reports = ReportLog()
    end = RunEnd(_cfg(), _peers(), reports, acks=dict, announce=lambda **kw: None, drain=lambda t: None,
                 say=lambda line: None)
    assert "cancelling its episodes" in end.note(30)
    reports.apply(_report(running=4))
    assert "4 episodes still running" in end.note(30) and "at most 30s more" in end.note(30)


# ---- StopRules, ConsoleNotes ------------------------------------------------------------
def test_skipped_steps_in_a_row_end_the_run_and_a_trained_step_resets_them(caplog) -> None:
    rules = StopRules(_cfg("train.max_consecutive_skips=2"), "r")
    rules.skipped(4, lambda: "hint")
    rules.trained({})
    rules.skipped(4, lambda: "hint")
    with pytest.raises(RunAborted, match="2 train steps in a row at v4.*hint"):
        rules.skipped(4, lambda: "hint")


def test_a_policy_drifting_from_the_sampler_is_said_once_per_doubling() -> None:
    """The mean behaviour–proximal gap of the last 5 steps past 0.3 nats: one line naming
    the gap, η and lr and what to lower; quiet below it, and again only once it doubles."""
    rules = StopRules(_cfg("staleness.max_staleness=8", "train.lr=2.5e-4"), "r")
    lines = [rules.trained({"behav_prox_gap": g}) for g in (0.1, 0.12, 0.11, 0.13, 0.12, 0.1)]
    assert lines == [None] * 6  # a healthy run (the shipped lr at η = 8: ~0.12)
    lines = [rules.trained({"behav_prox_gap": g}) for g in (0.6, 0.6, 0.6, 0.6)]
    said = [x for x in lines if x is not None]
    assert len(said) == 1 and "η=8" in said[0] and "lr=0.00025" in said[0], lines
    assert "train.lr" in said[0] and "staleness.max_staleness" in said[0]
    assert [rules.trained({"behav_prox_gap": 0.55}) for _ in range(5)] == [None] * 5  # not doubled since
    assert rules.trained({"behav_prox_gap": 5.0}) is not None
    assert rules.trained({}) is None  # a step without the statistic (a backend that does not log it)


# The newest episodes' reward per step in two runs of the staleness ablation (η = 8, the
# quickstart, 2026-11-27): a decoupled run that collapsed at step 28 (held-out 0.35 at the
# end, the trained batches still ~0.9) and a healthy naive run.
COLLAPSED = [0.52, 0.31, 0.66, 0.45, 0.55, 0.73, 0.53, 0.63, 0.75, 0.81, 0.78, 0.94, 0.67, 0.92, 0.91, 0.72,
             0.83, 0.95, 0.88, 0.7, 0.92, 0.8, 0.89, 0.88, 0.95, 0.88, 0.72, 0.34, 0.53, 0.11]
HEALTHY = [0.59, 0.62, 0.56, 0.56, 0.46, 0.57, 0.62, 0.61, 0.69, 0.68, 0.8, 0.77, 0.69, 0.68, 0.8, 0.78, 0.81,
           0.77, 0.69, 0.73, 0.84, 0.85, 0.69, 0.64, 0.83, 0.72, 0.77]


def test_a_collapse_the_stale_batches_hide_is_said_once() -> None:
    """The newest episodes' reward (3-step mean) 0.3 under its best: one line naming both,
    η and the steps the trained reward lags, what to lower and the checkpoint to resume
    from; nothing for a healthy run, nothing while it stays down, again after a recovery."""
    rules = StopRules(_cfg("staleness.max_staleness=8"), "r")

    def feed(series: list[float], trained: float = 0.9, start: int = 1) -> list[tuple[int, str]]:
        out = []
        for k, fresh in enumerate(series, start):
            line = rules.sampled({"step": k, "reward_mean": trained, "reward_mean_all_groups": fresh})
            if line is not None:
                out.append((k, line))
        return out

    assert feed(HEALTHY) == []
    rules = StopRules(_cfg("staleness.max_staleness=8"), "r")
    said = feed(COLLAPSED)
    assert [k for k, _ in said] == [29], said
    line = said[0][1]
    assert "fell to 0.53" in line and "from 0.91 at step 25" in line, line
    assert "η=8" in line and "still score 0.90" in line and "about 8 steps" in line
    assert "staleness.max_staleness" in line and "train.lr" in line and "step 25 or earlier" in line
    assert "train.loss.eps_clip=0.1 and train.lr_schedule=cosine" in line  # the measured setting, η ≥ 4
    assert feed([0.1, 0.1, 0.12], start=31) == []  # still down: said once
    assert feed([0.9, 0.9, 0.9], start=34) == []  # recovered: armed again
    assert [k for k, _ in feed([0.2, 0.2, 0.2], start=37)] == [38]
    assert rules.sampled({"step": 41}) is None  # a step with no finished episodes since the last


def test_the_eval_target_is_reached_once() -> None:
    rules = StopRules(_cfg("train.stop_at_eval_accuracy=0.5", "eval.every_n_steps=1"), "r")

    def ev(acc: float, v: int) -> RolloutStats:
        return _report(kind="eval", loaded_version=v,
                       eval=EvalResult(accuracy=acc, reward_mean=acc, seconds=1.0, num_samples=8))

    rules.evaluation(ev(0.4, 1))
    assert rules.target_reached is None
    rules.evaluation(ev(0.6, 2))
    rules.evaluation(ev(0.9, 3))
    assert rules.target_reached == (2, 0.6)


def test_with_an_eval_target_the_step_past_an_evaluated_version_waits_for_its_score(caplog) -> None:
    """The run ends on the version that reached the target: no step leaves an evaluated
    version before its score is in; without a target, or a score seen yet, nothing waits."""
    def ev(rules: StopRules, acc: float, v: int) -> None:
        rules.evaluation(_report(kind="eval", loaded_version=v,
                                 eval=EvalResult(accuracy=acc, reward_mean=acc, seconds=1.0, num_samples=8)))

    free = StopRules(_cfg("eval.every_n_steps=10"), "r")
    ev(free, 0.5, 0)
    assert not free.waits_for_score(10, published=True)  # no target: evaluation never holds a step
    rules = StopRules(_cfg("train.stop_at_eval_accuracy=0.9", "eval.every_n_steps=10", "train.total_steps=40",
                           "eval.final_timeout_s=0.2"), "r")
    assert not rules.waits_for_score(10, published=True)  # no score yet: maybe no held-out rows at all
    ev(rules, 0.5, 0)
    assert [rules.waits_for_score(v, published=True) for v in (5, 10, 11)] == [False, True, False]
    assert not rules.waits_for_score(10, published=False)  # a version the servers never get is never scored
    ev(rules, 0.6, 10)
    assert not rules.waits_for_score(10, published=True) and rules.ended is None
    assert rules.waits_for_score(20, published=True)
    ev(rules, 0.95, 20)
    assert rules.ended == "target_reached" and rules.target_reached == (20, 0.95)
    assert not rules.waits_for_score(40, published=True)  # the last version ends the run anyway
    with caplog.at_level(logging.WARNING, logger="areal_like.orchestration.trainer_controller"):
        caplog.clear()
        assert rules.waits_for_score(30, published=True)
        time.sleep(0.25)
        assert not rules.waits_for_score(30, published=True) and not rules.waits_for_score(30, published=True)
    assert [r.getMessage() for r in caplog.records] == [
        "no held-out score of v30 in eval.final_timeout_s=0.2s: training goes on without it"]


def test_console_notes_print_steps_with_the_last_eval_and_say_waits() -> None:
    steps: list[dict[str, Any]] = []
    said: list[str] = []
    notes = ConsoleNotes(steps.append, said.append)
    notes.step({"version": 2}, [{"version": 1, "accuracy": 0.5}])
    assert steps == [{"version": 2, "eval_accuracy": 0.5, "eval_version": 1}]
    assert not notes.due()  # a line was just printed
    notes.say("data for step 3")
    assert said == ["data for step 3"]


def test_the_fall_line_names_the_measured_setting_only_where_it_applies() -> None:
    """At η ≥ 4 the line gives the settings that kept the ablation's runs from falling, those
    the run does not use already; at η = 2 (where they were not better) it does not."""
    def line_for(*sets: str) -> str:
        rules = StopRules(_cfg(*sets), "r")
        said = [rules.sampled({"step": k, "reward_mean": 0.9, "reward_mean_all_groups": f})
                for k, f in enumerate(COLLAPSED, 1)]
        return next(x for x in said if x is not None)

    hint, stop = "train.loss.eps_clip=0.1 and train.lr_schedule=cosine", "train.loss.neg_behav_clip=0.2"
    assert hint in line_for("staleness.max_staleness=4")
    assert stop not in line_for("staleness.max_staleness=4")  # on by default
    assert stop in line_for("staleness.max_staleness=4", "train.loss.neg_behav_clip=null")
    assert hint in line_for("staleness.max_staleness=8", "train.lr_schedule=cosine")  # ε still 0.2
    assert hint not in line_for("staleness.max_staleness=8", "train.lr_schedule=cosine", "train.loss.eps_clip=0.1")
    line = line_for("staleness.max_staleness=2", "train.loss.neg_behav_clip=null")
    assert hint not in line and stop not in line
