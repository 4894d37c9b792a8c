"""The rollout schedule with fake episodes and a fake trainer: the real gate, buffer
and controller (invariants 1 and 5, docs/design.md §9.3-9.5)."""

from __future__ import annotations

import asyncio
import random

import pytest

from areal_like.core.buffer import TrajectoryBuffer
from areal_like.core.staleness import StalenessGate
from areal_like.core.types import (
    AgentLoopOutput,
    GateCounts,
    Goodbye,
    RolloutStats,
    SamplingParams,
    TrajectoryGroup,
    VersionAnnouncement,
    WeightUpdateMeta,
)
from areal_like.orchestration.dataset import PromptSource
from areal_like.orchestration.rollout_controller import RolloutController


def _rows(n: int = 50) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": str(i)}], "answer": str(i)} for i in range(n)]


class FakeRollout:
    """Episodes take random time and carry the version loaded when each token was made."""

    def __init__(self, seed: int, fail_rate: float = 0.0, reject_rate: float = 0.0) -> None:
        self.rng = random.Random(seed)
        self.version = 0
        self.fail_rate = fail_rate
        self.reject_rate = reject_rate
        self.fail_next_update = False
        self.loaded: list[int] = []

    async def run_episode(self, row, sampling: SamplingParams, eid: str):
        assert sampling.seed is not None
        versions = []
        for _ in range(3):
            await asyncio.sleep(self.rng.expovariate(200.0))
            versions.append(self.version)
        r = self.rng.random()
        if r < self.fail_rate:
            raise RuntimeError("engine died")
        if r < self.fail_rate + self.reject_rate:
            return None
        return AgentLoopOutput(
            prompt_ids=[1],
            response_ids=[5, 6, 7],
            response_mask=[1, 1, 1],
            response_logprobs=[-0.5] * 3,
            response_versions=versions,
            extra={"final_text": row["answer"] if self.rng.random() < 0.5 else "x"},
        )

    async def score(self, row, out) -> float:
        return 1.0 if out.final_text == row["answer"] else 0.0

    async def apply_weights(self, meta: WeightUpdateMeta) -> int:
        await asyncio.sleep(0.002)
        if self.fail_next_update:
            self.fail_next_update = False
            raise TimeoutError("receiver timed out")
        self.version = meta.version
        self.loaded.append(meta.version)
        return meta.version


def _meta(v: int) -> WeightUpdateMeta:
    return WeightUpdateMeta(version=v, transport="disk", tensors=[], checksum="x")


async def _run(eta: int, seed: int, steps: int = 12, fail_rate: float = 0.05, reject_rate: float = 0.05, fail_update_at: int = -1,
               eval_every: int = 4, first_eval_after: int = 0, fake: FakeRollout | None = None):
    n, gps = 4, 2
    fake = fake or FakeRollout(seed, fail_rate, reject_rate)
    gate = StalenessGate(n * gps, eta, max_concurrent=32)
    buf = TrajectoryBuffer(eta)
    inbox: asyncio.Queue = asyncio.Queue()

    async def send(msg):
        await inbox.put(msg)

    ctl = RolloutController(
        gate=gate,
        source=PromptSource(_rows(), seed=seed),
        group_size=n,
        sampling=SamplingParams(temperature=1.0, max_tokens=8),
        run_episode=fake.run_episode,
        score=fake.score,
        send=send,
        apply_weights=fake.apply_weights,
        eval_rows=_rows(6),
        eval_every=eval_every,
        seed=seed,
        stats_every_s=0.05,
        first_eval_after=first_eval_after,
    )
    ctl.announcements.put_nowait(VersionAnnouncement(version=0))
    task = asyncio.create_task(ctl.run())
    v, final, evals, lags = 0, None, [], []
    while True:
        msg = await asyncio.wait_for(inbox.get(), 10)
        if isinstance(msg, TrajectoryGroup):
            buf.put(msg)
        elif isinstance(msg, RolloutStats):
            if msg.kind == "eval":
                evals.append(msg)
            if msg.kind == "final":
                final = msg
                break
        if v < steps:
            batch = buf.pop_batch(v, gps)
            if batch is not None:
                lags += [v - g.head_version for g in batch]
                buf.mark_trained(batch)
                v += 1
                if v == fail_update_at:
                    fake.fail_next_update = True
            ctl.announcements.put_nowait(
                VersionAnnouncement(version=v, weights=_meta(v), counts=GateCounts(consumed=buf.consumed, dropped=buf.dropped_sent), end=Goodbye() if v >= steps else None)
            )
    await task
    return ctl, buf, final, evals, lags


def test_controller_respects_eta_and_counts_add_up() -> None:
    for eta in (0, 1, 3):
        ctl, buf, final, evals, lags = asyncio.run(_run(eta, seed=eta))
        assert max(lags) <= eta
        summary = buf.summary(started=final.started, cancelled=final.cancelled)
        assert TrajectoryBuffer.counts_add_up(summary), summary
        assert summary["trained"] >= 12 * 8 - 12 * 2  # failed members may shrink groups
        assert summary["failed"] > 0 and summary["rejected"] > 0
        assert ctl.gate.s.running == 0


def test_eta_zero_never_has_lag() -> None:
    _, buf, final, _, lags = asyncio.run(_run(0, seed=5, fail_rate=0.0, reject_rate=0.0))
    assert set(lags) == {0} and buf.counts["over_stale"] == 0


def test_failed_weight_update_keeps_old_version_and_next_one_goes_through() -> None:
    ctl, buf, final, _, lags = asyncio.run(_run(1, seed=3, fail_update_at=2))
    assert ctl.loaded_version >= 3
    assert TrajectoryBuffer.counts_add_up(buf.summary(final.started, final.cancelled))


def _due(loaded: list[int], every: int) -> list[int]:
    """The versions that must be evaluated: each multiple of `every` loaded, or the first
    loaded past one the side skipped (updates queued behind a slow one load the newest)."""
    due, previous = [], 0
    for v in loaded:
        if v != previous and (v % every == 0 or v // every > previous // every):
            due.append(v)
        previous = v
    return due


def test_evaluations_reported_per_version() -> None:
    fake = FakeRollout(1, 0.05, 0.05)
    _, _, _, evals, _ = asyncio.run(_run(2, seed=1, fake=fake))
    versions = [e.loaded_version for e in evals]
    assert 0 in versions and set(_due(fake.loaded, 4)) <= set(versions) and len(_due(fake.loaded, 4)) >= 2
    assert 12 in versions  # the last version's evaluation finishes before the rollout side stops
    assert all(0.0 <= e.eval.accuracy <= 1.0 and e.eval.num_samples == 6 for e in evals)


def test_the_start_versions_evaluation_follows_the_first_steps_groups_and_is_scored_on_it_alone() -> None:
    """#43: the version-0 evaluation never holds up the first train step: its episodes
    start once the groups of the first step are in (2 groups with signal here). And it is
    the run's baseline: v1, which the trainer sends as soon as it has that batch, waits
    for it, so every token it scores comes from v0."""

    class Recording(FakeRollout):
        def __init__(self) -> None:
            super().__init__(7, 0.0, 0.0)
            self.started: list[str] = []

        async def run_episode(self, row, sampling: SamplingParams, eid: str):
            self.started.append(eid)
            return await super().run_episode(row, sampling, eid)

    fake = Recording()
    _, _, _, evals, _ = asyncio.run(_run(2, seed=7, fail_rate=0.0, reject_rate=0.0, first_eval_after=2,
                                         fake=fake))
    first_eval = next(i for i, e in enumerate(fake.started) if e.startswith("eval-v0"))
    assert len({e.rsplit("-", 1)[0] for e in fake.started[:first_eval]}) >= 2  # groups started before it
    baseline = next(e for e in evals if e.loaded_version == 0)
    assert baseline.eval.max_token_version == 0


@pytest.mark.parametrize("every", [0, 5])
def test_final_version_is_always_evaluated(every: int) -> None:
    fake = FakeRollout(4, 0.05, 0.05)
    _, _, _, evals, _ = asyncio.run(_run(2, seed=4, eval_every=every, fake=fake))
    expected = sorted({0, 12, *_due(fake.loaded, every)}) if every else [12]
    assert sorted(e.loaded_version for e in evals) == expected


def test_weight_updates_queued_behind_a_slow_failure_are_skipped_to_the_newest() -> None:
    """A weight update that fails after a timeout lets the trainer's announcements pile up;
    the superseded metas among them are not loaded one by one (each slow, each already old:
    the rollout side never caught up), only the newest, and the gate counts of every
    announcement still apply, in order."""
    calls: list[int] = []

    async def apply_weights(meta: WeightUpdateMeta) -> int:
        calls.append(meta.version)
        if meta.version == 1:
            await asyncio.sleep(0.3)  # a receiver waiting out its timeout
            raise TimeoutError("no plan from the weight sender")
        return meta.version

    sent: list = []

    async def main() -> RolloutController:
        async def send(msg) -> None:  # noqa: ANN001
            sent.append(msg)

        ctl = RolloutController(
            gate=StalenessGate(8, 2, max_concurrent=8), source=PromptSource(_rows(), seed=0), group_size=4,
            sampling=SamplingParams(temperature=1.0, max_tokens=8), run_episode=FakeRollout(0).run_episode,
            score=FakeRollout(0).score, send=send, apply_weights=apply_weights, seed=0, stats_every_s=0.05,
        )
        ctl.announcements.put_nowait(VersionAnnouncement(version=0))
        task = asyncio.create_task(ctl.run())
        await asyncio.sleep(0.05)
        ctl.announcements.put_nowait(VersionAnnouncement(version=1, weights=_meta(1)))
        await asyncio.sleep(0.05)  # the update to v1 is under way
        for v in (2, 3, 4):
            ctl.announcements.put_nowait(VersionAnnouncement(version=v, weights=_meta(v)))
        ctl.announcements.put_nowait(VersionAnnouncement(version=4, counts=GateCounts(consumed=0)))
        await asyncio.sleep(0.5)
        ctl.announcements.put_nowait(VersionAnnouncement(version=4, end=Goodbye()))
        await asyncio.wait_for(task, 10)
        return ctl

    ctl = asyncio.run(main())
    assert calls == [1, 4]
    assert ctl.loaded_version == 4
    finals = [m for m in sent if isinstance(m, RolloutStats) and m.kind == "final"]
    assert finals and finals[-1].loaded_version == 4  # it stopped serving the newest version
