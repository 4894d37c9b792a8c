"""Both controllers over real ZMQ channels, with a fake trainer and fake episodes:
the real gate, buffer, channels, run folder and resume (invariants 1 and 5)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest
import torch

from areal_like.core.config import load_config
from areal_like.core.metrics import MetricsLog, read_jsonl
from areal_like.core.staleness import StalenessGate
from areal_like.core.types import Origin, SamplingParams, WeightUpdateMeta
from areal_like.orchestration.channels import ControlPublisher, ControlSubscriber, DataPuller, DataPusher
from areal_like.orchestration.dataset import PromptSource
from areal_like.orchestration.rollout_controller import RolloutController, drive_rollout, make_sender
from areal_like.orchestration.run_dir import RunDir
from areal_like.orchestration.trainer_controller import RunAborted, TrainerController
from tests.test_rollout_controller import FakeRollout, _rows


class FakeTrainer:
    def __init__(self, nan_at: int = -1, nan_times: int = 1, step_s: float = 0.0, gap: float = 0.0) -> None:
        self.version = 0
        self.gap = gap
        self.step_s = step_s
        self.ended_at: list[float] = []
        self.w = torch.zeros(3)
        self.nan_at = nan_at
        self.nan_times = nan_times
        self.seen: list[str] = []
        self.started_at: list[float] = []

    def train_on(self, trajectories, poll=None):
        self.started_at.append(time.time())
        self.seen += [t.episode_id for t in trajectories]
        if poll is not None:
            poll()  # the controller takes in data while the (fake) workers compute
        time.sleep(self.step_s)
        self.ended_at.append(time.time())
        if self.version == self.nan_at and self.nan_times > 0:
            self.nan_times -= 1
            return {"loss": float("nan")}
        self.version += 1
        self.w += 1
        return {"loss": 0.1, "behav_prox_gap": self.gap}

    def named_weights(self):
        yield "w", self.w

    def export_weights(self, path):
        from areal_like.models.hf_folder import write_hf_weights

        return write_hf_weights(path, self.named_weights())

    def save(self, path, extra=None):
        path.mkdir(parents=True, exist_ok=True)
        torch.save({"version": self.version, "w": self.w, "extra": extra}, path / "state.pt")

    def load(self, path):
        st = torch.load(path / "state.pt", weights_only=True)
        self.version, self.w = st["version"], st["w"]
        return st["extra"]


class FakeWeights:
    rendezvous = None

    def publish(self, version, trainer):
        return self.send(version, trainer.named_weights())

    def send(self, version, named_tensors):
        dict(named_tensors)
        return WeightUpdateMeta(version=version, transport="disk", tensors=[], checksum="x")

    def wait(self, timeout=None):
        return None

    def forget_receivers(self) -> None:
        self.forgotten = getattr(self, "forgotten", 0) + 1


class HeldRollout(FakeRollout):
    """Fake servers that can be held (`cluster.colocate`): no token is made while they are."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed, fail_rate=0.05, reject_rate=0.05)
        self.running: asyncio.Event | None = None
        self.token_at: list[float] = []
        self.holds: list[tuple[float, bool]] = []

    async def hold_servers(self, on: bool) -> None:
        if self.running is None:
            self.running = asyncio.Event()
            self.running.set()
        (self.running.clear if on else self.running.set)()
        self.holds.append((time.time(), on))

    async def run_episode(self, row, sampling, eid):
        out = await super().run_episode(row, sampling, eid)
        if self.running is not None:
            await self.running.wait()  # the episode's last token waits for the servers
        self.token_at.append(time.time())
        return out


def _run(tmp_path, steps: int, resume: bool = False, trainer: FakeTrainer | None = None, seed: int = 0,
         eta: int = 1, weights: FakeWeights | None = None, colocate: bool = False,
         rollout: FakeRollout | None = None, extra: tuple[str, ...] = ()):
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", f"train.total_steps={steps}", "train.batch_size=2",
                             "rollout.group_size=4", f"staleness.max_staleness={eta}", "run.record_trajectories=true",
                             "run.checkpoint_every_n_steps=3", f"cluster.colocate={str(colocate).lower()}", *extra])
    rd = RunDir(cfg.run.dir)
    rd.prepare(cfg, resume=resume)
    puller = DataPuller("tcp://127.0.0.1:0")
    publisher = ControlPublisher("tcp://127.0.0.1:0")
    trainer = trainer or FakeTrainer()
    tc = TrainerController(cfg, trainer=trainer, weights=weights or FakeWeights(), puller=puller, publisher=publisher,
                           run_dir=rd, mlog=MetricsLog(rd.metrics), model_path=tmp_path)
    if resume:
        tc.resume()

    fake = rollout or (HeldRollout(seed) if colocate else FakeRollout(seed, fail_rate=0.05, reject_rate=0.05))

    def rollout_thread() -> None:
        async def main() -> None:
            pusher = DataPusher(puller.addr)
            sub = ControlSubscriber(publisher.addr)
            ctl = RolloutController(
                gate=StalenessGate(cfg.samples_per_step, cfg.staleness.max_staleness, 16,
                                   adaptive_lead=cfg.staleness.lead == "adaptive"),
                source=PromptSource(_rows(), seed=seed),
                group_size=cfg.rollout.group_size,
                sampling=SamplingParams(),
                run_episode=fake.run_episode,
                score=fake.score,
                send=make_sender(pusher),
                apply_weights=fake.apply_weights,
                hold_servers=fake.hold_servers if colocate else None,
                loaded_version=0,
                seed=seed,
                stats_every_s=0.1,
            )
            await drive_rollout(ctl, sub)
            pusher.close()
            sub.close()

        asyncio.run(main())

    t = threading.Thread(target=rollout_thread, daemon=True)
    t.start()
    try:
        summary = tc.run()
    finally:
        t.join(30)
    assert not t.is_alive()
    puller.close()
    publisher.close()
    tc.mlog.close()
    trainer.rollout = fake
    return cfg, rd, summary, trainer


def test_colocated_servers_hold_through_every_train_step(tmp_path) -> None:
    """`cluster.colocate`: each step starts only once the rollout side says its servers
    hold, no token is made while it trains, and the servers run again after it."""
    trainer = FakeTrainer(step_s=0.05)
    cfg, rd, summary, _ = _run(tmp_path, steps=6, trainer=trainer, colocate=True)
    assert TrainerControllerCounts.add_up(summary) and trainer.version == 6
    fake = trainer.rollout
    holds = fake.holds
    assert [on for _, on in holds] == [True, False] * (len(holds) // 2) and len(holds) >= 12
    for start, end in zip(trainer.started_at, trainer.ended_at, strict=True):
        held_before = [t for t, on in holds if on and t <= start]
        assert held_before, (start, holds)
        released = [t for t, on in holds if not on and t >= held_before[-1]]
        assert released and released[0] >= end, (start, end, holds)  # still held when the step ended
        assert not [t for t in fake.token_at if start <= t <= end]
    steps = [r for r in read_jsonl(rd.metrics) if r["kind"] == "train_step"]
    assert len(steps) == 6 and all(r["colocate_wait_s"] >= 0 for r in steps)


def test_a_policy_running_away_from_its_sampler_is_said_on_the_console(tmp_path, caplog) -> None:
    """Train steps whose behaviour–proximal gap stays at 0.6 nats: the trainer says so, once,
    with what to lower (the ablation's runs at that gap lost held-out accuracy)."""
    with caplog.at_level(logging.WARNING, logger="areal_like.orchestration.trainer_policies"):
        _run(tmp_path, 8, trainer=FakeTrainer(gap=0.6))
    said = [r.getMessage() for r in caplog.records if "nats per token away" in r.getMessage()]
    assert len(said) == 1 and "lower train.lr" in said[0].lower(), said


class CollapsingRollout(FakeRollout):
    """Episodes right 90 % of the time until the servers load v6, then 5 %: a policy that broke."""

    async def score(self, row, out) -> float:
        return 1.0 if self.rng.random() < (0.9 if self.version < 6 else 0.05) else 0.0


def test_a_collapse_hidden_by_stale_batches_is_said_on_the_console(tmp_path, caplog) -> None:
    """At η = 4 the trained batches lag the servers by up to 4 versions: when the newest
    episodes' reward falls from 0.9 to 0.05, the trainer says so once, with the step to
    resume from, before the trained reward has fallen."""
    with caplog.at_level(logging.WARNING, logger="areal_like.orchestration.trainer_policies"):
        _, rd, summary, _ = _run(tmp_path, 14, eta=4, rollout=CollapsingRollout(0),
                                 extra=("staleness.filter_uniform_groups=false", "staleness.lead=full"))
    said = [r.getMessage() for r in caplog.records if "newest episodes' reward fell" in r.getMessage()]
    assert len(said) == 1, said
    assert "η=4" in said[0] and "or earlier" in said[0], said[0]
    steps = [r for r in read_jsonl(rd.metrics) if r["kind"] == "train_step"]
    assert any(r["reward_mean_all_groups"] < 0.3 for r in steps if "reward_mean_all_groups" in r)


class SlowRollout(FakeRollout):
    """Episodes of ~40 ms: a trainer with nothing to compute waits for every batch."""

    async def run_episode(self, row, sampling, eid):
        await asyncio.sleep(0.04)
        return await super().run_episode(row, sampling, eid)


@pytest.mark.parametrize("lead", ["adaptive", "full"])
def test_eta_is_a_bound_the_lead_follows_the_trainer(tmp_path, lead) -> None:
    """η = 4 with a trainer slower than the servers (docs/design.md §10.50). `full` runs
    4 versions ahead, so the later steps train samples 4 versions old; `adaptive` keeps
    the one version of lead that feeds the trainer, so they are 1 old, and the rollout
    side's records say L = 1."""
    _, rd, summary, _ = _run(tmp_path, steps=14, eta=4, trainer=FakeTrainer(step_s=0.15), rollout=FakeRollout(0),
                             extra=(f"staleness.lead={lead}", "staleness.filter_uniform_groups=false"))
    recs = read_jsonl(rd.metrics)
    late = [r for r in recs if r["kind"] == "train_step"][8:]
    leads = [r["gate_lead"] for r in recs if r["kind"] == "rollout" and "gate_lead" in r]
    if lead == "full":
        assert all(r["mean_version_lag"] >= 3.5 for r in late), [r["mean_version_lag"] for r in late]
        assert set(leads) == {4}
    else:
        assert all(r["max_version_lag"] <= 1 for r in late), [r["max_version_lag"] for r in late]
        assert leads and leads[-1] == 1


def test_a_trainer_that_waits_for_data_gets_the_lead_eta_allows(tmp_path) -> None:
    """The other side of §10.50: with slow episodes and a trainer with nothing to compute,
    every step waits for its data, and the lead rises to η = 3 (one version per wait)."""
    _, rd, summary, _ = _run(tmp_path, steps=8, eta=3, trainer=FakeTrainer(step_s=0.0), rollout=SlowRollout(0),
                             extra=("staleness.filter_uniform_groups=false",))
    recs = read_jsonl(rd.metrics)
    leads = [r["gate_lead"] for r in recs if r["kind"] == "rollout" and "gate_lead" in r]
    assert leads[0] == 1 and max(leads) == 3, leads
    assert all(r["max_version_lag"] <= 3 for r in recs if r["kind"] == "train_step")


def test_without_colocate_nothing_is_held(tmp_path) -> None:
    trainer = FakeTrainer(step_s=0.05)
    _, rd, summary, _ = _run(tmp_path, steps=3, trainer=trainer)
    assert TrainerControllerCounts.add_up(summary)
    assert all("colocate_wait_s" not in r for r in read_jsonl(rd.metrics) if r["kind"] == "train_step")


def test_two_sides_over_zmq_respect_eta_and_count_everything(tmp_path) -> None:
    cfg, rd, summary, trainer = _run(tmp_path, steps=6, trainer=FakeTrainer(nan_at=2))
    assert summary["started"] == sum(summary[k] for k in summary if k != "started")
    assert summary["skipped"] > 0 and trainer.version == 6
    recs = read_jsonl(rd.metrics)
    steps = [r for r in recs if r["kind"] == "train_step"]
    assert all(r["max_version_lag"] <= 1 for r in steps)
    # the sampled reward over every finished group (filtered ones too) beside the trained mean
    alls = [r["reward_mean_all_groups"] for r in steps if "reward_mean_all_groups" in r]
    assert alls and all(0.0 <= x <= 1.0 for x in alls)
    assert recs[-1]["kind"] == "summary" and recs[-1]["counts_add_up"]
    trajs = read_jsonl(rd.trajectories)
    # every trained sample recorded once, none twice
    assert len({t["episode_id"] for t in trajs}) == len(trajs) == summary["trained"]
    assert len(set(trainer.seen)) == len(trainer.seen)


class SlowWeights(FakeWeights):
    """A broadcast that takes TRANSFER_S after `send` returns (rank 0's sender thread)."""

    TRANSFER_S = 0.3

    def __init__(self) -> None:
        self.sent: list[tuple[int, float]] = []
        self.done: list[tuple[int, float]] = []

    def send(self, version, named_tensors):
        self.sent.append((version, time.time()))
        return super().send(version, named_tensors)

    def wait(self, timeout=None):
        if not self.sent or (self.done and self.done[-1][0] == self.sent[-1][0]):
            return None
        version, t0 = self.sent[-1]
        left = t0 + self.TRANSFER_S - time.time()
        if left > (timeout if timeout is not None else left):
            time.sleep(timeout)
            raise RuntimeError(f"weight transfer still running after {timeout}s")
        time.sleep(max(0.0, left))
        self.done.append((version, time.time()))
        return None


def test_the_broadcast_runs_while_the_next_step_trains(tmp_path) -> None:
    """The trainer does not wait for a version's broadcast before training on: the next step
    starts while it runs; the next publish, and the end of the run, wait for it."""
    weights, trainer = SlowWeights(), FakeTrainer()
    _, _, summary, _ = _run(tmp_path, steps=6, trainer=trainer, weights=weights)
    assert TrainerControllerCounts.add_up(summary)
    sent = [v for v, _ in weights.sent]
    assert sent[-1] == 6
    # a step began while a broadcast was still on the wire
    assert any(t0 < t < t0 + SlowWeights.TRANSFER_S for _, t0 in weights.sent for t in trainer.started_at)
    # never two in flight: each send came after the previous version's broadcast ended
    done_at = dict(weights.done)
    for (v, _), (_, t_next) in zip(weights.sent, weights.sent[1:], strict=False):
        assert v in done_at and done_at[v] <= t_next, (v, weights.done, weights.sent)
    assert 6 in done_at  # the last version reached the engines before the run ended


def test_resume_continues_version_and_counts(tmp_path) -> None:
    _run(tmp_path, steps=4)  # checkpoints at v3 and v4
    ckpt = RunDir(tmp_path / "run").latest_checkpoint()
    assert ckpt is not None and ckpt.name.endswith("4")
    cfg, rd, summary, trainer = _run(tmp_path, steps=8, resume=True, seed=1)
    assert trainer.version == 8
    recs = read_jsonl(rd.metrics)
    steps = [r["step"] for r in recs if r["kind"] == "train_step"]
    assert steps == sorted(set(steps)) and steps[-1] == 8
    assert [r["kind"] for r in recs].count("summary") == 1  # the first run's summary was cut back
    assert TrainerControllerCounts.add_up(summary)


class TrainerControllerCounts:
    @staticmethod
    def add_up(summary) -> bool:
        return summary["started"] == sum(v for k, v in summary.items() if k != "started")


def test_silent_rollout_side_stops_the_trainer_with_a_checkpoint(tmp_path) -> None:
    """Split mode: a rollout side that reported once and then vanished (killed without
    a word) must not leave the trainer waiting for data forever."""
    import time

    import pytest

    from areal_like.core.types import RolloutStats
    from areal_like.orchestration.trainer_controller import RunAborted

    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", "train.total_steps=5", "train.batch_size=2",
                             "rollout.group_size=4", "transport.peer_timeout_s=1.5",
                             "transport.peer_dead_s=0.5"])
    rd = RunDir(cfg.run.dir)
    rd.prepare(cfg, resume=False)
    puller = DataPuller("tcp://127.0.0.1:0")
    publisher = ControlPublisher("tcp://127.0.0.1:0")
    tc = TrainerController(cfg, trainer=FakeTrainer(), weights=FakeWeights(), puller=puller, publisher=publisher,
                           run_dir=rd, mlog=MetricsLog(rd.metrics), model_path=tmp_path, run_id="r1")
    pusher = DataPusher(puller.addr)
    pusher.send(RolloutStats(kind="stats", time=time.time(), loaded_version=0, started=0, running=0,
                             origin=Origin(run_id="r1", epoch=0, sender="rollout-a")))
    t0 = time.time()
    with pytest.raises(RunAborted, match="rollout side has sent nothing") as info:
        tc.run()
    assert time.time() - t0 < 60
    assert "--resume" in str(info.value) and "v000000" in str(info.value)
    pusher.close()
    puller.close()
    publisher.close()
    tc.mlog.close()


def test_skipped_steps_free_gate_capacity_even_at_eta_0(tmp_path) -> None:
    """Two non-finite steps in a row at η=0 used to shut the gate for good (the skipped
    samples stayed 'accepted' while the version stood still): the run hung silently."""
    cfg, rd, summary, trainer = _run(tmp_path, steps=4, trainer=FakeTrainer(nan_at=1, nan_times=2), eta=0)
    assert trainer.version == 4 and summary["skipped"] >= 2 * cfg.train.batch_size * 2  # two steps of >= 2 per group
    assert sum(summary[k] for k in summary if k != "started") == summary["started"]


def test_too_many_skipped_steps_in_a_row_stop_the_run(tmp_path) -> None:
    with pytest.raises(RunAborted, match=r"3 train steps in a row .*train.max_consecutive_skips=3"):
        _run(tmp_path, steps=4, trainer=FakeTrainer(nan_at=1, nan_times=99), eta=0)


def test_a_waiting_trainer_announces_often_until_a_rollout_controller_is_accepted(tmp_path) -> None:
    """A starting rollout controller waits for an announcement before its hello (its
    subscriber connects once its servers are up): the waiting trainer announces every 0.1 s
    until one is accepted, then every 0.5 s again (the start-up's wait, docs/benchmarks.md)."""
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", "train.total_steps=2"])
    rd = RunDir(cfg.run.dir)
    rd.prepare(cfg, resume=False)

    class _Pub:
        addr = "tcp://127.0.0.1:1"

        def __init__(self) -> None:
            self.sent: list = []

        def publish(self, ann) -> None:
            self.sent.append(ann)

        def close(self) -> None:
            pass

    puller, pub = DataPuller("tcp://127.0.0.1:0"), _Pub()
    tc = TrainerController(cfg, trainer=FakeTrainer(), weights=FakeWeights(), puller=puller, publisher=pub,
                           run_dir=rd, mlog=MetricsLog(rd.metrics), model_path=tmp_path)
    try:
        tc.announcer.at = time.time() - 0.2  # the last announcement, 0.2 s ago
        tc._while_waiting(0)
        assert len(pub.sent) == 1  # none accepted yet: 0.2 s is long enough
        tc.peers.accepted = "rollout-a"
        tc.announcer.at = time.time() - 0.2
        tc._while_waiting(0)
        assert len(pub.sent) == 1  # one accepted: every 0.5 s, as before
    finally:
        puller.close()
        tc.mlog.close()
