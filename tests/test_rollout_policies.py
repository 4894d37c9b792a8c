"""The rollout controller's policies (areal_like/orchestration/rollout_policies.py), each
on its own: no channels, no schedule — an announcement or an episode in, a decision out."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from areal_like.core.staleness import StalenessGate
from areal_like.core.types import (
    AgentLoopOutput,
    EvalResult,
    GateCounts,
    Goodbye,
    RolloutCounters,
    RolloutStats,
    SamplingParams,
    TrainerId,
    Trajectory,
    VersionAnnouncement,
    WeightUpdateMeta,
)
from areal_like.orchestration.fail_fast import FailFast
from areal_like.orchestration.rollout_policies import (
    EpisodeBook,
    EpisodeRunner,
    Evaluator,
    Outbox,
    RolloutRefused,
    ServerHold,
    TrainerFollow,
    WeightsIn,
    episode_seed,
    newest_weights_only,
)
from rollout_cluster.server_manager import NoServerAvailableError


def _meta(v: int, epoch: int = 0) -> WeightUpdateMeta:
    return WeightUpdateMeta(version=v, transport="disk", tensors=[], checksum="x", epoch=epoch)


def _ann(v: int = 0, *, run_id: str = "run", epoch: int = 0, rollout_id: str | None = None, consumed: int = 0,
         stop: bool = False, **kw: Any) -> VersionAnnouncement:
    return VersionAnnouncement(version=v, counts=GateCounts(consumed=consumed), end=Goodbye() if stop else None,
                               trainer=TrainerId(run_id=run_id, epoch=epoch, rollout_id=rollout_id), **kw)


def _out(reward_text: str = "1") -> AgentLoopOutput:
    return AgentLoopOutput(prompt_ids=[1], response_ids=[5, 6], response_mask=[1, 1], response_logprobs=[-0.1, -0.2],
                           response_versions=[0, 0], extra={"final_text": reward_text})


def _traj(reward: float) -> Trajectory:
    return Trajectory(episode_id="e", group_id="g", prompt_ids=[1], response_ids=[5], response_mask=[1],
                      response_logprobs=[-0.1], response_versions=[0], reward=reward)


# ---- the pure helpers ---------------------------------------------------------------------
def test_newest_weights_only_keeps_only_the_last_weights_and_every_count() -> None:
    anns = [_ann(1, weights=_meta(1), consumed=8), _ann(2, consumed=16), _ann(3, weights=_meta(3), consumed=24)]
    out = newest_weights_only(anns)
    assert [a.counts.consumed for a in out] == [8, 16, 24]
    assert [a.weights.version if a.weights else None for a in out] == [None, None, 3]
    assert newest_weights_only([_ann(1)]) == [_ann(1)]


def test_episode_seeds_are_stable_and_distinct() -> None:
    assert episode_seed(0, "g0", 1) == episode_seed(0, "g0", 1)
    assert len({episode_seed(0, "g0", i) for i in range(8)} | {episode_seed(1, "g0", 0)}) == 9


# ---- TrainerFollow ------------------------------------------------------------------------
def test_follow_ignores_other_runs_once_older_epochs_quietly_and_sees_newer_ones(caplog) -> None:
    f = TrainerFollow()
    f.begin(_ann(0, epoch=1))
    with caplog.at_level(logging.ERROR):
        assert f.verdict(_ann(0, run_id="other", epoch=1)) == "ignore"
        assert f.verdict(_ann(0, run_id="other", epoch=1)) == "ignore"
    assert sum("another run" in r.message for r in caplog.records) == 1
    assert f.verdict(_ann(0, epoch=0)) == "ignore"
    assert f.verdict(_ann(0, epoch=1)) == "ours"
    assert f.verdict(_ann(0, epoch=2)) == "newer"


def test_follow_refuses_a_second_controller_and_stamps_its_origin() -> None:
    f = TrainerFollow()
    f.begin(_ann(0, epoch=3))
    f.refuse_if_another(_ann(0, rollout_id=None))
    f.refuse_if_another(_ann(0, rollout_id=f.sender))
    with pytest.raises(RolloutRefused, match="already has a rollout controller"):
        f.refuse_if_another(_ann(0, rollout_id="someone-else"))
    o = f.stamp(started=12)
    assert (o.run_id, o.epoch, o.sender, o.started) == ("run", 3, f.sender, 12)


# ---- EpisodeBook --------------------------------------------------------------------------
def test_book_names_groups_uniquely_and_counts_every_outcome() -> None:
    book = EpisodeBook(group_size=4, seed=7)
    book.incarnation = 5
    g0 = book.new_group(epoch=0, loaded_version=5)
    g1 = book.new_group(epoch=2, loaded_version=6)
    assert (g0, g1) == ("s7-r5-g0", "s7-r5e2-g1")
    assert book.started == 8 and book.running == {g0: 5, g1: 6}
    book.count([_traj(1.0), _traj(0.5)], rejected=1, failed=1)
    book.ended(g0)
    assert book.running == {g1: 6}
    snap = book.snapshot()
    assert (snap.sent, snap.rejected, snap.failed, snap.reward_sum) == (2, 1, 1, 1.5)
    book.seek({"group_seq": 40})
    book.restart(incarnation=9)
    assert book.started == 0 and book.outcomes == {"sent": 0, "rejected": 0, "failed": 0} and book.reward_sum == 0
    assert book.new_group(epoch=1, loaded_version=0) == "s7-r9e1-g40"


# ---- EpisodeRunner ------------------------------------------------------------------------
def _runner(run_episode, score=None, timeout_s: float = 5.0, fail_fast: FailFast | None = None,
            woken: list | None = None) -> EpisodeRunner:
    async def by_text(row, out) -> float:  # noqa: ANN001
        return 1.0 if out.final_text == row["answer"] else 0.0

    return EpisodeRunner(run_episode=run_episode, score=score or by_text, sampling=SamplingParams(temperature=0.7),
                         seed=3, timeout_s=timeout_s, fail_fast=fail_fast or FailFast(),
                         wake=lambda: (woken if woken is not None else []).append(1))


def test_an_episode_becomes_a_scored_trajectory_with_its_own_seed() -> None:
    seen: list[SamplingParams] = []

    async def run_episode(row, sampling, eid):  # noqa: ANN001, ANN202
        seen.append(sampling)
        return _out("1")

    t = asyncio.run(_runner(run_episode).one({"answer": "1"}, "g0", 2))
    assert isinstance(t, Trajectory)
    assert (t.episode_id, t.group_id, t.reward, t.temperature) == ("g0-e2", "g0", 1.0, 0.7)
    assert seen[0].seed == episode_seed(3, "g0", 2)


def test_a_rejected_a_failed_and_a_hung_episode_each_end_with_their_reason() -> None:
    async def rejects(row, sampling, eid):  # noqa: ANN001, ANN202
        return None

    async def raises(row, sampling, eid):  # noqa: ANN001, ANN202
        raise KeyError("boom")

    async def hangs(row, sampling, eid):  # noqa: ANN001, ANN202
        await asyncio.sleep(3600)

    ff = FailFast()
    assert asyncio.run(_runner(rejects, fail_fast=ff).one({}, "g", 0)) == "rejected"
    assert asyncio.run(_runner(raises, fail_fast=ff).one({}, "g", 0)) == "KeyError: 'boom'"
    assert asyncio.run(_runner(hangs, timeout_s=0.05, fail_fast=ff).one({}, "g", 0)).startswith("EpisodeTimeout")
    assert ff.failed == 2


def test_a_reward_that_raises_fails_the_episode() -> None:
    async def run_episode(row, sampling, eid):  # noqa: ANN001, ANN202
        return _out()

    async def bad_reward(row, out) -> float:  # noqa: ANN001
        raise ValueError("no number")

    assert asyncio.run(_runner(run_episode, bad_reward).one({}, "g", 0)) == "ValueError: no number"


# ---- WeightsIn ----------------------------------------------------------------------------
def _weights(apply, joined: list | None = None, woken: list | None = None, ff: FailFast | None = None):
    gate = StalenessGate(8, 1, max_concurrent=8)

    async def join(ann) -> None:  # noqa: ANN001
        (joined if joined is not None else []).append(ann.weight_store)

    w = WeightsIn(apply=apply, join=join, gate=gate, fail_fast=ff or FailFast(),
                  wake=lambda: (woken if woken is not None else []).append(1), loaded_version=0)
    return w, gate


def test_weights_load_a_newer_or_the_same_version_never_an_older_one() -> None:
    applied: list[int] = []

    async def apply(meta: WeightUpdateMeta) -> int:
        applied.append(meta.version)
        return meta.version

    async def main() -> None:
        w, gate = _weights(apply)
        assert await w.load(_meta(2)) == 2 and w.version == 2
        assert await w.load(_meta(2)) == 2  # a resend: taken part in, loads nothing new
        assert await w.load(_meta(1)) is None  # older: not taken
        assert applied == [2, 2] and gate.s.version == 2
        w.forget()
        assert w.awaiting and w.version == -1
        assert await w.load(_meta(0, epoch=1)) == 0 and not w.awaiting  # a restarted trainer's lower number

    asyncio.run(main())


def test_a_failed_load_keeps_the_old_version_and_dead_servers_end_the_run(caplog) -> None:
    async def times_out(meta: WeightUpdateMeta) -> int:
        raise TimeoutError("receiver timed out")

    async def all_dead(meta: WeightUpdateMeta) -> int:
        raise NoServerAvailableError("no server left")

    async def main() -> None:
        w, _ = _weights(times_out)
        with caplog.at_level(logging.ERROR):
            assert await w.load(_meta(1)) is None
        assert w.version == 0 and "still serving v0" in caplog.text
        woken: list = []
        ff = FailFast()
        w, _ = _weights(all_dead, woken=woken, ff=ff)
        assert await w.load(_meta(1)) is None
        assert woken and ff.tripped is not None

    asyncio.run(main())


def test_weights_join_only_with_a_join_hook() -> None:
    async def apply(meta: WeightUpdateMeta) -> int:
        return meta.version

    joined: list = []
    w, _ = _weights(apply, joined=joined)
    asyncio.run(w.join(_ann(0, weight_store="tcp://127.0.0.1:1")))
    assert joined == ["tcp://127.0.0.1:1"]
    bare = WeightsIn(apply=apply, join=None, gate=StalenessGate(8, 1, 8), fail_fast=FailFast(), wake=lambda: None,
                     loaded_version=0)
    asyncio.run(bare.join(_ann(0)))  # nothing to join, nothing raised


# ---- ServerHold ---------------------------------------------------------------------------
def test_hold_pauses_once_reports_and_wakes_the_servers_before_weights() -> None:
    calls: list[bool] = []
    reports: list[int] = []

    async def hold_servers(on: bool) -> None:
        calls.append(on)

    async def main() -> None:
        hold = ServerHold(hold_servers, report=lambda: _note(reports))
        await hold.follow(_ann(0, hold=3), before_weights=False)
        await hold.follow(_ann(0, hold=3), before_weights=False)  # the same hold: nothing again
        assert (calls, hold.number, len(reports)) == ([True], 3, 1)
        await hold.follow(_ann(0, hold=4), before_weights=True)  # still held: stays asleep for the weights
        assert calls == [True]
        await hold.follow(_ann(0, hold=0), before_weights=True)  # released: awake before loading
        assert (calls, hold.number) == ([True, False], 0)
        await hold.set(5)
        await hold.follow(_ann(0, hold=5, stop=True), before_weights=True)  # the goodbye releases
        assert calls == [True, False, True, False]

    asyncio.run(main())


async def _note(reports: list[int]) -> None:
    reports.append(1)


def test_a_hold_without_servers_is_said_not_raised(caplog) -> None:
    async def main() -> None:
        hold = ServerHold(None, report=lambda: _note([]))
        with caplog.at_level(logging.WARNING):
            await hold.set(1)
        assert hold.number == 1 and "has none to pause" in caplog.text

    asyncio.run(main())


# ---- Evaluator ----------------------------------------------------------------------------
def _evaluator(rows: list[dict], every: int = 2, hang: bool = False):
    results: list[tuple[int, EvalResult]] = []

    async def run_episode(row, sampling, eid):  # noqa: ANN001, ANN202
        if hang:
            await asyncio.sleep(3600)
        return _out(row["answer"] if int(row["answer"]) % 2 == 0 else "x")

    async def report(version: int, result: EvalResult) -> None:
        results.append((version, result))

    ev = Evaluator(rows=rows, every=every, sampling=SamplingParams(), seed=0, timeout_s=0.2,
                   episodes=_runner(run_episode), report=report)
    return ev, results


def test_evaluations_run_per_version_once_and_report_accuracy() -> None:
    rows = [{"answer": str(i)} for i in range(4)]

    async def main() -> list:
        ev, results = _evaluator(rows)
        ev.first(3)  # the starting version, whatever its number
        ev.loaded(4, previous=3)
        ev.loaded(4, previous=4)  # a resend of a version already loaded
        ev.loaded(5, previous=4)  # not a multiple of every=2
        ev.loaded(7, previous=5)  # 6 was skipped (updates queued behind a slow one): 7 stands for it
        ev.start(4)  # already evaluated
        await asyncio.gather(*ev.tasks)
        return results

    results = asyncio.run(main())
    assert [v for v, _ in results] == [3, 4, 7]
    assert all(r.accuracy == 0.5 and r.num_samples == 4 for _, r in results)


def test_the_last_evaluation_is_waited_for_within_its_timeout_and_reports_progress() -> None:
    async def main() -> None:
        ev, results = _evaluator([{"answer": "0"}], hang=True)
        ev.start(7)
        await asyncio.sleep(0.01)
        p = ev.progress()
        assert p is not None and (p.version, p.done, p.total) == (7, 0, 1)
        told: list[int] = []
        await ev.finish(may_wait=True, announce=lambda: _note(told))
        assert told == [1]  # the trainer hears what it waits for
        await asyncio.gather(*ev.cancel(), return_exceptions=True)
        assert results == [] and ev.progress() is None
        ev2, _ = _evaluator([{"answer": "0"}], hang=True)
        ev2.start(1)
        ev2.skip = True  # Ctrl-C on the trainer: waits for nothing
        await ev2.finish(may_wait=True, announce=lambda: _note(told))
        assert told == [1]
        await asyncio.gather(*ev2.cancel(), return_exceptions=True)

    asyncio.run(main())


# ---- Outbox -------------------------------------------------------------------------------
def test_outbox_stamps_every_frame_and_times_sends_and_waits() -> None:
    sent: list[Any] = []

    async def transport(msg) -> None:  # noqa: ANN001
        await asyncio.sleep(0.01)
        sent.append(msg)

    follow = TrainerFollow()
    follow.begin(_ann(0, epoch=2))
    book = EpisodeBook(4, 0)
    book.new_group(epoch=2, loaded_version=0)
    box = Outbox(transport, follow, book, lambda: RolloutCounters(generated_tokens=5.0))
    asyncio.run(box.send(RolloutStats(time=0.0, loaded_version=0, started=0, running=0)))
    box.waited("wait_gate", 1.5)
    assert sent[0].origin.sender == follow.sender and sent[0].origin.epoch == 2 and sent[0].origin.started == 4
    budget = box.budget()
    assert budget.generated_tokens == 5.0 and budget.seconds.wait_gate == 1.5
    assert budget.seconds.send >= 0.01


# ---- ServerWeights (server_pool.py): a version onto the pool, and the servers that miss it ----
class _FakePool:
    def __init__(self) -> None:
        self.results: dict[str, int | BaseException] = {}
        self.restarted: list[tuple[str, int]] = []
        self.dead: set[str] = set()
        """Servers whose process is gone: `gone` (a metrics call) fails for them."""
        self.versions: dict[str, int] = {}
        self.copied: list[tuple[str, int]] = []
        self.during_restart: Any = None

    async def gone(self, name: str) -> BaseException | None:
        from areal_like.launcher import ActorDied

        return ActorDied(f"{name} is gone") if name in self.dead else None

    async def receive(self, meta: WeightUpdateMeta):
        ok = {n: r for n, r in self.results.items() if isinstance(r, int)}
        failed = {n: r for n, r in self.results.items() if isinstance(r, BaseException)}
        return ok, failed

    def _adapter(self, name: str) -> str:
        return f"adapter-{name}"

    async def restart(self, name: str, error: BaseException, version: int) -> str:
        self.restarted.append((name, version))
        self.versions[name] = version
        if self.during_restart is not None:
            await self.during_restart()
        return self._adapter(name)

    async def copy_version(self, name: str, version: int) -> bool:
        """A live sibling serves `version`: copied."""
        self.copied.append((name, version))
        self.versions[name] = version
        return True


class _FakeManager:
    def __init__(self, names: list[str]) -> None:
        self.server_names = list(names)
        self.failed: list[str] = []

    def mark_failed(self, name: str, error: BaseException) -> None:
        self.failed.append(name)

    def remove_server(self, name: str) -> None:
        self.server_names.remove(name)

    def add_server(self, server: Any, name: str) -> None:
        self.server_names.append(name)

    def none_left(self):  # noqa: ANN201
        return None


def test_a_server_that_misses_a_version_leaves_rotation_until_it_catches_up(caplog) -> None:
    from areal_like.launcher import ActorDied
    from areal_like.orchestration.server_pool import ServerWeights

    async def main() -> None:
        pool, manager = _FakePool(), _FakeManager(["a", "b", "c"])
        w = ServerWeights(pool)  # type: ignore[arg-type]
        w.manager = manager
        pool.results = {"a": 1, "b": TimeoutError("slow receiver"), "c": ActorDied("gone")}
        with caplog.at_level(logging.WARNING):
            assert await w.apply(_meta(1)) == 1
        assert manager.server_names == ["a", "c"] and manager.failed == ["c"]  # b lags, c is restarted
        assert "missed v1" in caplog.text
        pool.results = {"a": 2, "b": 2}
        assert await w.apply(_meta(2)) == 2
        assert "b" in manager.server_names  # caught up: back in rotation
        await w.restart("c", RuntimeError("dead"))
        assert pool.restarted == [("c", 2)]  # a restarted server serves what the others serve
        pool.results = {"a": 0}
        assert await w.apply(_meta(0, epoch=1)) == 0  # a resumed trainer's numbers start again

    asyncio.run(main())


def test_a_restarted_server_catches_up_with_a_version_that_loaded_while_it_started() -> None:
    """Seen in the suite: a restarted server copied v1 while the others loaded v3, went into
    rotation behind them, and every group it touched was over-stale. It now catches up,
    between two versions, before it takes a call."""
    from areal_like.orchestration.server_pool import ServerWeights

    async def main() -> None:
        pool, manager = _FakePool(), _FakeManager(["a", "b"])
        w = ServerWeights(pool)  # type: ignore[arg-type]
        w.manager = manager
        pool.results = {"a": 1, "b": 1}
        assert await w.apply(_meta(1)) == 1

        async def v3_loads_meanwhile() -> None:
            pool.results = {"a": 3}
            assert await w.apply(_meta(3)) == 3

        pool.during_restart = v3_loads_meanwhile
        await w.restart("b", RuntimeError("dead"))
        assert pool.restarted == [("b", 1)] and pool.copied == [("b", 3)] and pool.versions["b"] == 3

    asyncio.run(main())


def test_a_server_that_failed_a_version_and_no_longer_answers_is_dead_not_behind() -> None:
    """Ray's memory monitor killed the server during the update: the call failed with an
    error that is not an actor death (`ActorCallError` with Ray's `OutOfMemoryError` text,
    before the launcher read it as one). The server no longer answers, so it is restarted,
    not left waiting for a later version that it would fail too (issue #46: every version
    failed, the trainer sent each one again, nothing restarted, nothing stopped)."""
    from areal_like.launcher import ActorCallError
    from areal_like.orchestration.server_pool import ServerWeights

    async def main() -> None:
        pool, manager = _FakePool(), _FakeManager(["a", "b"])
        w = ServerWeights(pool)  # type: ignore[arg-type]
        w.manager = manager
        oom = ActorCallError("Task was killed due to the node running low on memory.")
        pool.results, pool.dead = {"a": 1, "b": oom}, {"b"}
        assert await w.apply(_meta(1)) == 1
        assert manager.failed == ["b"] and "b" not in w._lagging  # restarted by the manager
        pool.results, pool.dead = {"a": 2, "b": TimeoutError("slow receiver")}, set()
        assert await w.apply(_meta(2)) == 2
        assert manager.failed == ["b"] and "b" in w._lagging  # alive and answering: only behind

    asyncio.run(main())


def test_a_version_no_server_loaded_is_an_error_the_controller_survives() -> None:
    from areal_like.orchestration.server_pool import ServerWeights
    from weight_sync.meta import WeightSyncError

    async def main() -> None:
        pool = _FakePool()
        w = ServerWeights(pool)  # type: ignore[arg-type]
        w.manager = _FakeManager(["a"])
        pool.results = {"a": TimeoutError("slow receiver")}
        with pytest.raises(WeightSyncError, match="no rollout server loaded v1: .*slow receiver"):
            await w.apply(_meta(1))
        assert w.version == 0

    asyncio.run(main())
