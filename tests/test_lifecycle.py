"""The lifecycle protocol between the clusters (docs/design.md §10.3, §10.7), with the real
trainer and rollout controllers over real ZMQ channels and fake engines/trainers:

- strangers (another run, an older epoch, unstamped frames, a second rollout controller)
  are refused with a logged reason, counted, and never trained on;
- a second rollout controller that joins is told so and stops with a clear error;
- a rollout side that vanishes is declared lost after `transport.peer_dead_s`, a new one
  joins, and the run ends with counts that add up (what the lost one started and never
  delivered is counted as cancelled).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from areal_like.core.config import load_config
from areal_like.core.metrics import MetricsLog, read_jsonl
from areal_like.core.staleness import StalenessGate
from areal_like.core.types import Origin, SamplingParams, Trajectory, TrajectoryGroup
from areal_like.orchestration.channels import ControlPublisher, ControlSubscriber, DataPuller, DataPusher
from areal_like.orchestration.dataset import PromptSource
from areal_like.orchestration.rollout_controller import (
    RolloutController,
    RolloutRefused,
    drive_rollout,
    make_sender,
)
from areal_like.orchestration.run_dir import RunDir
from areal_like.orchestration.trainer_controller import TrainerController
from tests.test_orchestration_fake import FakeTrainer, FakeWeights
from tests.test_rollout_controller import FakeRollout, _rows

pytestmark = pytest.mark.timeout(240)


class Harness:
    def __init__(self, tmp_path, steps: int = 6, *extra: str) -> None:
        self.cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", f"train.total_steps={steps}", "train.batch_size=2",
                                      "rollout.group_size=4", "staleness.max_staleness=1",
                                      "transport.peer_dead_s=1.0", "transport.heartbeat_s=0.2", *extra])
        self.rd = RunDir(self.cfg.run.dir)
        self.rd.prepare(self.cfg)
        self.puller = DataPuller("tcp://127.0.0.1:0")
        self.publisher = ControlPublisher("tcp://127.0.0.1:0")
        self.trainer = FakeTrainer()
        self.tc = TrainerController(self.cfg, trainer=self.trainer, weights=FakeWeights(), puller=self.puller,
                                    publisher=self.publisher, run_dir=self.rd, mlog=MetricsLog(self.rd.metrics),
                                    model_path=tmp_path, run_id="run-a", epoch=0)
        self.threads: list[threading.Thread] = []

    def controller(self, seed: int, *, stop_after_groups: int | None = None) -> RolloutController:
        fake = FakeRollout(seed)
        return RolloutController(
            gate=StalenessGate(self.cfg.samples_per_step, self.cfg.staleness.max_staleness, 16),
            source=PromptSource(_rows(), seed=seed), group_size=self.cfg.rollout.group_size,
            sampling=SamplingParams(), run_episode=fake.run_episode, score=fake.score, send=None,  # set in start
            apply_weights=fake.apply_weights, loaded_version=0, seed=seed, stats_every_s=0.1,
        )

    def start(self, ctl: RolloutController, *, vanish_when=None) -> dict:  # noqa: ANN001
        """Run `ctl` on its own thread; with `vanish_when`, kill it without a word once
        that returns true (polled on the controller's own loop, so nothing of it runs
        between the check and the kill)."""
        out: dict = {}

        def main() -> None:
            async def run() -> None:
                pusher = DataPusher(self.puller.addr)
                sub = ControlSubscriber(self.publisher.addr)
                ctl.outbox.transport = make_sender(pusher)
                task = asyncio.create_task(drive_rollout(ctl, sub, peer_timeout_s=60, peer_dead_s=5))
                try:
                    if vanish_when is not None:  # killed without a word: no final report
                        deadline = time.time() + 60
                        while not vanish_when() and not task.done() and time.time() < deadline:
                            await asyncio.sleep(0.01)
                        task.cancel()
                        out["vanished_at"] = time.time()
                        ctl.outbox.transport = _silent
                    await task
                except RolloutRefused as e:
                    out["refused"] = str(e)
                except asyncio.CancelledError:
                    out["vanished"] = True
                finally:
                    pusher.close()
                    sub.close()

            asyncio.run(run())

        t = threading.Thread(target=main, daemon=True)
        t.start()
        self.threads.append(t)
        return out

    def buffer_seen(self) -> bool:
        return self.tc.buffer.depth > 0

    def finish(self) -> tuple[dict, list[dict]]:
        summary = self.tc.run()
        for t in self.threads:
            t.join(30)
            assert not t.is_alive()
        self.puller.close()
        self.publisher.close()
        self.tc.mlog.close()
        return summary, read_jsonl(self.rd.metrics)


async def _silent(msg) -> None:  # noqa: ANN001 - a dead process sends nothing
    await asyncio.sleep(0)


def _group(origin: Origin | None, gid: str) -> TrajectoryGroup:
    trajs = [Trajectory(episode_id=f"{gid}-{i}", group_id=gid, prompt_ids=[1], response_ids=[5], response_mask=[1],
                        response_logprobs=[-0.1], response_versions=[0], reward=float(i % 2)) for i in range(4)]
    return TrajectoryGroup(group_id=gid, trajectories=trajs, origin=origin)


def _adds_up(summary: dict) -> bool:
    return summary["started"] == sum(v for k, v in summary.items() if k != "started")


def test_strangers_are_refused_logged_counted_and_never_trained(tmp_path, caplog) -> None:
    h = Harness(tmp_path)
    h.tc.peers.epoch = 1  # a restarted trainer (the real controller follows the announced epoch)
    strangers = {
        "another run": Origin(run_id="run-b", epoch=1, sender="x1", started=4),
        "older epoch": Origin(run_id="run-a", epoch=0, sender="x2", started=4),
        "no origin": None,
    }
    p = DataPusher(h.puller.addr)  # queued before the trainer drains anything
    for name, origin in strangers.items():
        p.send(_group(origin, f"stranger-{name.replace(' ', '-')}"))
    p.close()
    h.start(h.controller(0))
    with caplog.at_level(logging.ERROR):
        summary, recs = h.finish()
    ids = {eid for eid in h.trainer.seen}
    assert not any(e.startswith("stranger") for e in ids)
    final = recs[-1]
    assert final["refused_frames"].keys() >= {"a frame of another run", "a frame of another trainer epoch",
                                              "a frame without an origin"}, final["refused_frames"]
    assert "refused frames from rollout controller" in caplog.text
    assert _adds_up(summary) and final["counts_add_up"]


def test_a_second_rollout_controller_is_refused_and_stops(tmp_path) -> None:
    h = Harness(tmp_path, 40)
    first = h.start(h.controller(0))
    time.sleep(0.5)  # the first one is accepted and announced
    second = h.start(h.controller(1))
    summary, recs = h.finish()
    # whichever reached the trainer first is the run's; the other is told and stops
    refused = [o["refused"] for o in (first, second) if "refused" in o]
    assert len(refused) == 1 and "already has a rollout controller" in refused[0], (first, second)
    assert _adds_up(summary) and recs[-1]["counts_add_up"]


def test_a_refused_rollout_controller_never_touches_the_weight_group(tmp_path) -> None:
    """A second controller that comes while the trainer has accepted one is refused
    before it joins the weight group: its servers never register with the trainer's
    sender, so the real servers miss no version waiting for them."""
    h = Harness(tmp_path, 120)  # long enough that the second controller meets a running trainer
    first = h.start(h.controller(0))
    result: dict = {}
    runner = threading.Thread(target=lambda: result.setdefault("summary", h.tc.run()), daemon=True)
    runner.start()
    deadline = time.time() + 30
    while h.tc.peers.accepted is None and time.time() < deadline:
        time.sleep(0.05)
    assert h.tc.peers.accepted is not None
    joined: list[str] = []
    second_ctl = h.controller(1)

    async def join_weights(ann) -> None:  # noqa: ANN001
        joined.append(ann.weight_store)

    second_ctl.weights.join_weights = join_weights
    second = h.start(second_ctl)
    runner.join(120)
    assert not runner.is_alive()
    assert "already has a rollout controller" in second.get("refused", ""), (first, second)
    assert joined == []


def test_a_vanished_rollout_side_is_declared_lost_and_a_new_one_finishes_the_run(tmp_path, caplog) -> None:
    h = Harness(tmp_path, 30)
    def undelivered() -> int:  # what the trainer knows the first one started and has not received
        s = list(h.tc.peers.senders.values())
        return s[0].started - s[0].delivered if s else 0

    # it vanishes once the trainer knows of a group's worth it started and never delivered
    # (not after a fixed time: on a loaded machine it may not have reported a start by then)
    gone = h.start(h.controller(0), vanish_when=lambda: undelivered() >= 4)

    def later() -> None:
        while undelivered() < 4:
            time.sleep(0.05)
        time.sleep(3.0)  # past peer_dead_s=1: the trainer has declared the first one lost
        h.start(h.controller(1))

    threading.Thread(target=later, daemon=True).start()
    with caplog.at_level(logging.WARNING):
        summary, recs = h.finish()
    # it stopped feeding either way: cancelled, or (its thread starved past the cancel on a
    # loaded machine) told by the trainer that another controller took over
    assert gone.get("vanished") or "already has a rollout controller" in gone.get("refused", ""), gone
    assert "declared lost" in caplog.text
    assert h.trainer.version == 30
    assert _adds_up(summary) and recs[-1]["counts_add_up"], summary
    assert summary["cancelled"] > 0  # what the vanished one started and never delivered


class _StuckWeights(FakeWeights):
    """A broadcast that waits for receivers that died with their rollout side: `wait`
    never finishes (as the real sender's wait for known receivers, up to timeout_s)
    until the trainer says they are gone."""

    def __init__(self) -> None:
        self.stuck = True
        self.forgotten_at: float | None = None

    def wait(self, timeout=None):  # noqa: ANN001
        if not self.stuck:
            return None
        time.sleep(timeout or 0)
        raise TimeoutError(f"weight transfer still running after {timeout}s")

    def forget_receivers(self) -> None:
        self.stuck, self.forgotten_at = False, time.time()


def test_a_weight_wait_does_not_delay_declaring_a_dead_rollout_side_lost(tmp_path, caplog) -> None:
    """The trainer waits (up to weight_sync.timeout_s, 60 s) for a broadcast whose
    receivers died with their rollout side. Its verdict must come after
    transport.peer_dead_s (1 s here), not after that wait: a kill -9 was declared only
    after 78 s. The sender is then told to stop waiting, and a new side finishes the run."""
    h = Harness(tmp_path, 30)
    h.tc.weights = weights = _StuckWeights()
    until = time.time() + 1.0
    gone = h.start(h.controller(0), vanish_when=lambda: time.time() >= until)

    def later() -> None:
        while weights.stuck and time.time() < until + 60:
            time.sleep(0.1)
        h.start(h.controller(1))

    threading.Thread(target=later, daemon=True).start()
    with caplog.at_level(logging.INFO):
        summary, recs = h.finish()
    lost = [r for r in caplog.records if "declared lost" in r.getMessage()]
    assert lost and weights.forgotten_at is not None, caplog.text[-3000:]
    assert lost[0].created - gone["vanished_at"] < 1.0 + 5.0, lost[0].created - gone["vanished_at"]
    assert h.trainer.version == 30 and _adds_up(summary) and recs[-1]["counts_add_up"], summary


def test_out_of_vocabulary_token_ids_are_refused_at_the_edge_and_counted(tmp_path, caplog) -> None:
    """An out-of-range token id in a trajectory frame used to kill training (an index past
    the embedding): it is refused where it arrives, its members count as failed."""
    h = Harness(tmp_path)
    h.tc.vocab_size = 10
    origin = Origin(run_id="run-a", epoch=0, sender="r1", started=8)
    bad = _group(origin, "g-bad")
    bad.trajectories[2].response_ids = [99]
    p = DataPusher(h.puller.addr)
    p.send(bad)
    p.send(_group(origin, "g-ok"))
    with caplog.at_level(logging.ERROR):
        for _ in range(20):
            h.tc._drain(timeout_s=0.2)
            if h.buffer_seen():
                break
    p.close()
    assert "outside the vocabulary [0, 10)" in caplog.text
    assert h.tc.buffer.counts["failed"] == 4 and h.tc.buffer.depth == 4
    h.puller.close()
    h.publisher.close()


class _Stragglers(FakeRollout):
    """Every 5th prompt's episodes run 40x longer: the long answers of a real run."""

    async def run_episode(self, row, sampling, eid):  # noqa: ANN001, ANN201
        if int(row["answer"]) % 5 == 0:
            await asyncio.sleep(0.6)
        return await super().run_episode(row, sampling, eid)


def test_the_trainer_waits_for_stragglers_instead_of_dropping_them(tmp_path) -> None:
    """No admitted sample is lost to staleness (docs/design.md §10.4): a step that would push
    a running group past η waits for it; the wait is recorded; over_stale stays 0."""
    h = Harness(tmp_path, 12, "run.checkpoint_every_n_steps=100")
    ctl = h.controller(0)
    slow = _Stragglers(0)
    ctl.episodes.run_episode, ctl.episodes.score = slow.run_episode, slow.score
    ctl.weights.apply = slow.apply_weights
    h.start(ctl)
    summary, recs = h.finish()
    steps = [r for r in recs if r["kind"] == "train_step"]
    assert summary["over_stale"] == 0 and _adds_up(summary), summary
    assert sum(r["straggler_wait_s"] for r in steps) > 0
    assert max(r["max_version_lag"] for r in steps) <= h.cfg.staleness.max_staleness


def test_a_hung_episode_times_out_as_failed_and_frees_the_trainer(tmp_path) -> None:
    h = Harness(tmp_path, 4, "run.checkpoint_every_n_steps=100")
    ctl = h.controller(0)
    ctl.episodes.timeout_s = 1.0
    fake = FakeRollout(0)

    async def hangs_sometimes(row, sampling, eid):  # noqa: ANN001, ANN202
        if eid.endswith("-g0-e0"):  # the first group waits on a hung tool
            await asyncio.sleep(3600)  # a hung tool
        return await fake.run_episode(row, sampling, eid)

    ctl.episodes.run_episode, ctl.episodes.score, ctl.weights.apply = hangs_sometimes, fake.score, fake.apply_weights
    h.start(ctl)
    t0 = time.time()
    summary, recs = h.finish()
    assert time.time() - t0 < 120
    assert summary["failed"] >= 1 and _adds_up(summary), summary


def test_a_frame_resent_after_the_final_report_is_still_taken() -> None:
    """A reset can lose a group whose resend then arrives after the final report (sent
    later, queued earlier): it belongs to the run and is taken; a frame sent after the
    final report is not. Until the lost one arrives, the trainer knows it is missing."""
    from areal_like.core.types import RolloutStats
    from areal_like.orchestration.peers import RolloutPeers

    peers = RolloutPeers("run-a", 0, dead_s=5, timeout_s=60)
    o = Origin(run_id="run-a", epoch=0, sender="ro", started=8)
    assert peers.admit(_group(o.model_copy(update={"seq": 1}), "g1"), stopping=True)
    final = RolloutStats(kind="final", time=0.0, loaded_version=0, started=8, running=0,
                         origin=o.model_copy(update={"seq": 3}))
    assert peers.admit(final, stopping=True)
    assert peers.missing_before_final({"ro": [1, 3]})  # #2 is missing
    assert peers.admit(_group(o.model_copy(update={"seq": 2}), "g2"), stopping=True)  # its resend
    assert not peers.missing_before_final({"ro": [3]})
    assert not peers.admit(_group(o.model_copy(update={"seq": 4}), "g4"), stopping=True)
    assert peers.refused == {"a frame after that controller's final report": 1}
