"""Staleness gate and trajectory buffer with fake versions (invariants 1 and 5)."""

from __future__ import annotations

import random

import pytest

from areal_like.core.buffer import OUTCOMES, TrajectoryBuffer
from areal_like.core.staleness import StalenessGate
from areal_like.core.types import Trajectory, TrajectoryGroup


def _group(gid: str, version: int, rewards: list[float], failed: int = 0, rejected: int = 0) -> TrajectoryGroup:
    trajs = [
        Trajectory(
            episode_id=f"{gid}-{i}",
            group_id=gid,
            prompt_ids=[1],
            response_ids=[2, 3],
            response_mask=[1, 1],
            response_logprobs=[-0.1, -0.2],
            response_versions=[version, version + 1],
            reward=r,
        )
        for i, r in enumerate(rewards)
    ]
    return TrajectoryGroup(group_id=gid, trajectories=trajs, failed=failed, rejected=rejected)


def test_gate_formula() -> None:
    g = StalenessGate(samples_per_step=4, max_staleness=1, max_concurrent=100)
    # capacity (η + v + 1)·B = 8 at v = 0
    assert g.try_admit(4) and g.try_admit(4)
    assert not g.try_admit(1)
    g.on_group_done(4, 4)
    assert not g.try_admit(1)  # finished samples still count as accepted
    g.set_loaded_version(1)
    assert g.try_admit(4) and not g.try_admit(1)


def test_gate_max_concurrent_and_whole_groups() -> None:
    g = StalenessGate(samples_per_step=100, max_staleness=5, max_concurrent=10)
    assert g.try_admit(8)
    assert not g.try_admit(4)  # a group of 4 does not fit in 2 free slots: never split
    assert g.try_admit(2)


def test_drops_free_capacity_and_gate_never_stays_shut() -> None:
    g = StalenessGate(samples_per_step=4, max_staleness=0, max_concurrent=100)
    assert g.try_admit(4)
    g.on_group_done(4, 4)
    assert not g.try_admit(4)
    # the trainer filtered the group: its slots come back although the version did not move
    g.on_trainer_counts(consumed=0, dropped=4)
    assert g.try_admit(4)
    # failures release running slots without counting as accepted
    g.on_group_done(4, 1)
    assert g.accepted == 1 and g.s.running == 0


def test_eta_zero_is_synchronous() -> None:
    g = StalenessGate(samples_per_step=8, max_staleness=0, max_concurrent=100)
    admitted = 0
    while g.try_admit(1):
        admitted += 1
    assert admitted == 8  # exactly one batch per version


def test_announcements_are_idempotent() -> None:
    g = StalenessGate(4, 1, 100)
    g.on_trainer_counts(8, 2)
    g.on_trainer_counts(4, 1)  # an older announcement arriving late changes nothing
    assert (g.s.consumed, g.s.dropped) == (8, 2)


def test_gate_state_round_trip_drops_running() -> None:
    g = StalenessGate(4, 2, 100)
    g.try_admit(4)
    g.on_group_done(4, 4)
    g.try_admit(4)
    g.set_loaded_version(3)
    h = StalenessGate(4, 2, 100)
    h.load_state_dict(g.state_dict())
    assert h.s.version == 3 and h.accepted == 4 and h.s.running == 0


def test_buffer_arrival_outcomes() -> None:
    b = TrajectoryBuffer(max_staleness=1)
    assert b.put(_group("a", 0, [1.0, 0.0, 1.0])) is None
    assert b.put(_group("b", 0, [1.0, 1.0])) == "filtered"
    assert b.put(_group("c", 0, [1.0], failed=2)) == "failed"
    assert b.put(_group("d", 0, [0.0, 1.0], failed=1, rejected=1)) is None
    assert b.put(TrajectoryGroup(group_id="e", trajectories=[], rejected=3)) == "rejected"
    assert b.counts["filtered"] == 2 and b.counts["failed"] == 1 + 2 + 1 and b.counts["rejected"] == 4
    assert b.dropped_sent == 2 + 1
    assert b.depth == 5 and b.num_groups == 2


def test_buffer_rechecks_eta_oldest_first() -> None:
    b = TrajectoryBuffer(max_staleness=1)
    b.put(_group("old", 0, [0.0, 1.0]))
    b.put(_group("new", 2, [0.0, 1.0]))
    b.put(_group("newer", 3, [1.0, 0.0]))
    assert b.pop_batch(trainer_version=1, num_groups=4) is None  # not enough yet, nothing lost
    assert b.num_groups == 3
    batch = b.pop_batch(trainer_version=2, num_groups=1)
    assert batch is not None and [g.group_id for g in batch] == ["new"]
    assert b.counts["over_stale"] == 2 and b.dropped_sent == 2
    assert b.lag_history == [0]


def test_a_step_takes_every_group_it_would_push_past_eta() -> None:
    """Three long groups of one head arrive together (after a straggler wait) at the last
    version that may train them: the step takes all three, not the batch's two, and the
    next step drops nothing (the slow suite's long-answers run lost 8 samples this way)."""
    b = TrajectoryBuffer(max_staleness=2)
    for gid in ("a", "b", "c"):
        b.put(_group(gid, 1, [0.0, 1.0]))
    b.put(_group("fresh", 3, [0.0, 1.0]))
    batch = b.pop_batch(trainer_version=3, num_groups=2)
    assert batch is not None and [g.group_id for g in batch] == ["a", "b", "c"]
    assert b.pop_batch(trainer_version=4, num_groups=1) is not None
    assert b.counts["over_stale"] == 0 and b.num_groups == 0


def test_buffer_put_back_when_stale_group_hides_behind_fresh_head() -> None:
    b = TrajectoryBuffer(max_staleness=0)
    b.put(_group("fresh", 5, [0.0, 1.0]))
    b.put(_group("stale", 1, [0.0, 1.0]))
    assert b.pop_batch(trainer_version=5, num_groups=2) is None
    assert b.num_groups == 1 and b.counts["over_stale"] == 2
    assert [g.group_id for g in b.pop_batch(5, 1)] == ["fresh"]


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("eta", [0, 1, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_simulated_async_run_respects_bound_and_counts_add_up(eta: int, seed: int, adaptive: bool) -> None:
    """A fake rollout side (random durations, failures, uniform groups) and a fake
    trainer (random step times) exchanging counts like the real channels do; with the
    adaptive lead, the trainer's waits and spare steps move it."""
    rng = random.Random(seed)
    n, groups_per_step = 4, 2
    B = n * groups_per_step
    gate = StalenessGate(B, eta, max_concurrent=6 * n, adaptive_lead=adaptive)
    starved = spare = 0
    waiting_since: float | None = None
    leads = set()
    buf = TrajectoryBuffer(eta)
    loaded = trainer_v = 0
    running: list[tuple[float, int, str]] = []  # (finish time, start version, id)
    started = 0
    t = 0.0
    next_train = 1.0
    sync_lag = 0.3
    pending_loads: list[tuple[float, int]] = []
    while trainer_v < 20:
        t += 0.05
        while gate.try_admit(n):
            gid = f"g{started}"
            started += n
            running.append((t + rng.expovariate(1.0), loaded, gid))
        for item in [r for r in running if r[0] <= t]:
            running.remove(item)
            _, v0, gid = item
            failed = 1 if rng.random() < 0.1 else 0
            rewards = [float(rng.random() < 0.5) for _ in range(n - failed)]
            gate.on_group_done(n, n - failed)
            buf.put(_group(gid, v0, rewards, failed=failed))
        if t >= next_train:
            batch = buf.pop_batch(trainer_v, groups_per_step)
            if batch is not None:
                assert all(trainer_v - g.head_version <= eta for g in batch)
                starved += int(waiting_since is not None and t - waiting_since > 0.1)
                spare += int(buf.prompts >= groups_per_step)
                waiting_since = None
                buf.mark_trained(batch)
                trainer_v += 1
                pending_loads.append((t + sync_lag, trainer_v))
            elif waiting_since is None and trainer_v > 0:
                waiting_since = t
            gate.on_trainer_counts(buf.consumed, buf.dropped_sent, trainer_version=trainer_v,
                                   starved=starved, spare=spare)
            leads.add(gate.lead)
            next_train = t + (rng.uniform(0.2, 1.5) if batch is not None else 0.05)
        for item in [p for p in pending_loads if p[0] <= t]:
            pending_loads.remove(item)
            loaded = max(loaded, item[1])
            gate.set_loaded_version(loaded)
        assert t < 10_000, "gate stayed shut while the trainer waited"
    cancelled = sum(n for _ in running)
    summary = buf.summary(started=started, cancelled=cancelled)
    assert TrajectoryBuffer.counts_add_up(summary), summary
    assert set(summary) == set(OUTCOMES) | {"started"}
    assert max(buf.lag_history) <= eta
    assert max(leads) <= eta and min(leads) >= min(1, eta)
    if not adaptive:
        assert leads == {eta}


def test_the_adaptive_lead_rises_with_each_wait_and_falls_after_calm_versions() -> None:
    """docs/design.md §10.50 at the gate: L starts at 1, takes one more version (up to η)
    when the trainer says a step waited and another did within 4 versions, and gives one
    back after 4 versions in a row whose steps each began with the next batch buffered.
    Capacity is (L + v + 1) · B; repeated announcements of one version move nothing."""
    B = 8
    g = StalenessGate(B, 4, max_concurrent=1000, adaptive_lead=True)
    assert g.lead == 1 and g.capacity == 2 * B
    g.on_trainer_counts(0, 0, trainer_version=1, starved=0)
    g.on_trainer_counts(8, 0, trainer_version=2, starved=1)
    assert g.lead == 1  # one wait: a burst
    g.on_trainer_counts(8, 0, trainer_version=7, starved=2)
    assert g.lead == 1  # another, 5 versions later: still a burst
    g.on_trainer_counts(8, 0, trainer_version=9, starved=3)
    assert g.lead == 2  # within 4 versions of the last: a pattern
    g.on_trainer_counts(8, 0, trainer_version=9, starved=3)  # a heartbeat: the same count
    assert g.lead == 2
    for starved in (4, 5, 6, 7):
        g.on_trainer_counts(8, 0, trainer_version=9, starved=starved)
    assert g.lead == 4  # η caps it
    g.set_loaded_version(9)
    assert g.capacity == (4 + 9 + 1) * B
    spare = 0
    for v in range(10, 13):  # three spare versions: not yet
        spare += 1
        g.on_trainer_counts(8 * v, 0, trainer_version=v, starved=7, spare=spare)
    assert g.lead == 4
    g.on_trainer_counts(8 * 13, 0, trainer_version=13, starved=7, spare=spare)  # v13's step was not spare
    assert g.lead == 4
    for v in range(14, 18):
        spare += 1
        g.on_trainer_counts(8 * v, 0, trainer_version=v, starved=7, spare=spare)
    assert g.lead == 3
    # step 18 began spare, said first by a drop announcement within it (still v17), then by
    # v18's own: one spare version, not lost; v19–v21 spare too make four: one less
    spare += 1
    g.on_trainer_counts(8 * 17, 4, trainer_version=17, starved=7, spare=spare)
    g.on_trainer_counts(8 * 18, 4, trainer_version=18, starved=7, spare=spare)
    for v in range(19, 22):
        spare += 1
        g.on_trainer_counts(8 * v, 4, trainer_version=v, starved=7, spare=spare)
    assert g.lead == 2
    for v in range(22, 100):
        spare += 1
        g.on_trainer_counts(8 * v, 4, trainer_version=v, starved=7, spare=spare)
    assert g.lead == 1  # never below one version
    g.rebase()  # a new trainer: its counts start again, and so does L
    assert g.lead == 1
    g.on_trainer_counts(0, 0, trainer_version=0, starved=0)
    g.on_trainer_counts(16, 0, trainer_version=2, starved=2)  # two steps waited since the last word
    assert g.lead == 2
    # a rollout controller that joins a trainer which has waited 7 times takes that as it is
    j = StalenessGate(B, 4, max_concurrent=1000, adaptive_lead=True)
    j.on_trainer_counts(80, 0, trainer_version=10, starved=7, spare=2)
    assert j.lead == 1


@pytest.mark.parametrize("eta", [0, 3])
def test_the_full_lead_is_eta_whatever_the_trainer_says(eta: int) -> None:
    g = StalenessGate(4, eta, max_concurrent=100)
    for v in range(1, 20):
        g.on_trainer_counts(4 * v, 0, trainer_version=v, starved=v % 3, spare=v)
    assert g.lead == eta
    h = StalenessGate(4, 0, max_concurrent=100, adaptive_lead=True)
    h.on_trainer_counts(0, 0, trainer_version=1, starved=3)
    assert h.lead == 0  # η = 0 is synchronous either way


def test_buffer_state_round_trip() -> None:
    b = TrajectoryBuffer(2)
    b.put(_group("a", 0, [0.0, 1.0]))
    b.put(_group("b", 1, [1.0, 1.0]))
    c = TrajectoryBuffer(2)
    c.load_state_dict(b.state_dict())
    assert c.counts == b.counts and c.depth == b.depth and c.dropped_sent == b.dropped_sent
    assert c.pop_batch(0, 1)[0].group_id == "a"


def test_gate_after_resume_counts_samples_sent_before() -> None:
    """A resumed trainer at v=3 with 8 samples buffered: the fresh rollout gate must not
    admit (η+v+1)·B at once."""
    g = StalenessGate(samples_per_step=4, max_staleness=1, max_concurrent=100)
    g.set_loaded_version(3)
    # trainer consumed 12, dropped 4, buffered 8 before the crash: 24 sent in all
    g.on_trainer_counts(consumed=12, dropped=4, sent_base=24)
    assert g.accepted == 20
    assert g.capacity == 20 and not g.try_admit(1)


def test_a_step_that_trains_more_than_b_samples_opens_the_gate_by_as_much() -> None:
    """The slow lifecycle test's hang: a trainer resumed at v4 with 32 samples buffered
    (B = 8, η = 2) trained all of them in step 5 (every group step 6 would push past η).
    The gate at v5 allowed (η + v + 1)·B = 64, all of it accepted, and stayed shut while the
    trainer waited for step 6's data. What was consumed beyond v·B waits for no later step."""
    g = StalenessGate(samples_per_step=8, max_staleness=2, max_concurrent=128)
    g.set_loaded_version(5)
    g.on_trainer_counts(consumed=64, dropped=0, sent_base=64)
    assert g.free_slots() == 0  # without the trainer's version: the old bound
    g.on_trainer_counts(consumed=64, dropped=0, sent_base=64, trainer_version=5)
    assert g.capacity == 64 + 24 and g.try_admit(8)
    g.on_trainer_counts(consumed=32, dropped=0, sent_base=64, trainer_version=4)  # late and older: ignored
    assert g.capacity == 88
