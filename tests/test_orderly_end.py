"""The end of a run (issue #31 item 5, docs/design.md §10.7): the rollout side cancels its
training episodes first, reports while its last evaluation runs, skips that evaluation
after Ctrl-C, and no server is restarted once the goodbye came."""

from __future__ import annotations

import asyncio

import pytest

from areal_like.core.staleness import StalenessGate
from areal_like.core.types import (
    AgentLoopOutput,
    GenerateResult,
    Goodbye,
    RolloutStats,
    SamplingParams,
    TrajectoryGroup,
    VersionAnnouncement,
)
from areal_like.orchestration.dataset import PromptSource
from areal_like.orchestration.rollout_controller import RolloutController
from rollout_cluster.server_manager import NoServerAvailableError, ServerManager


def _rows(n: int) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": str(i)}], "answer": str(i)} for i in range(n)]


class SlowEpisodes:
    """Training episodes never end by themselves; evaluation episodes take `eval_s` each and
    record how many training episodes still shared the servers when they finished."""

    def __init__(self, eval_s: float) -> None:
        self.eval_s = eval_s
        self.training = 0
        self.cancelled_training = 0
        self.eval_ended_with_training: list[int] = []

    async def run_episode(self, row, sampling: SamplingParams, eid: str):
        if eid.startswith("eval-"):
            await asyncio.sleep(self.eval_s)
            self.eval_ended_with_training.append(self.training)
        else:
            self.training += 1
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled_training += 1
                raise
            finally:
                self.training -= 1
        return AgentLoopOutput(prompt_ids=[1], response_ids=[5], response_mask=[1], response_logprobs=[-0.5],
                               response_versions=[0], extra={"final_text": row["answer"]})

    async def score(self, row, out) -> float:
        return 1.0


async def _stop_and_collect(final_eval: bool, eval_rows: int = 4, eval_s: float = 0.3):
    fake = SlowEpisodes(eval_s)
    inbox: asyncio.Queue = asyncio.Queue()

    async def send(msg) -> None:
        await inbox.put(msg)

    async def apply_weights(meta) -> int:
        return meta.version

    ctl = RolloutController(gate=StalenessGate(8, 1, max_concurrent=8), source=PromptSource(_rows(20), seed=0),
                            group_size=4, sampling=SamplingParams(temperature=1.0, max_tokens=4),
                            run_episode=fake.run_episode, score=fake.score, send=send, apply_weights=apply_weights,
                            eval_rows=_rows(eval_rows), eval_every=0, stats_every_s=0.05)
    ctl.announcements.put_nowait(VersionAnnouncement(version=0))
    task = asyncio.create_task(ctl.run())
    while fake.training < 8:  # both groups admitted and running
        await asyncio.sleep(0.01)
    ctl.announcements.put_nowait(VersionAnnouncement(version=0, end=Goodbye(final_eval=final_eval)))
    got: list[RolloutStats] = []
    while True:
        msg = await asyncio.wait_for(inbox.get(), 10)
        if isinstance(msg, RolloutStats):
            got.append(msg)
            if msg.kind == "final":
                break
        else:
            assert not isinstance(msg, TrajectoryGroup), "a cancelled training group was delivered"
    await task
    return fake, got


def test_the_last_evaluation_runs_after_the_training_episodes_are_cancelled_and_is_reported_meanwhile() -> None:
    fake, got = asyncio.run(_stop_and_collect(final_eval=True))
    assert fake.cancelled_training == 8
    assert fake.eval_ended_with_training and set(fake.eval_ended_with_training) == {0}
    evals = [m for m in got if m.kind == "eval"]
    assert len(evals) == 1 and evals[0].eval.num_samples == 4
    during = [m for m in got if m.kind == "stats" and m.stopping]
    assert during, "no report while the last evaluation ran: the trainer would take the side for dead"
    assert any(m.eval_progress is not None and m.eval_progress.total == 4 for m in during)
    final = got[-1]
    assert final.kind == "final" and final.cancelled == 8 and final.eval_progress is None


def test_after_ctrl_c_the_last_evaluation_is_skipped() -> None:
    fake, got = asyncio.run(_stop_and_collect(final_eval=False, eval_s=30.0))
    assert fake.eval_ended_with_training == []
    assert [m for m in got if m.kind == "eval"] == []
    assert got[-1].kind == "final" and got[-1].cancelled == 8


class _DyingServer:
    name = "s"

    async def generate(self, **_kw) -> GenerateResult:
        raise ConnectionError("server process exited")


@pytest.mark.parametrize("closing", [False, True])
def test_a_server_failing_once_the_run_ends_is_not_restarted(closing: bool) -> None:
    restarts: list[str] = []

    async def restart(name: str, error: BaseException):
        restarts.append(name)
        return _DyingServer()

    async def main() -> None:
        m = ServerManager({"s0": _DyingServer(), "s1": _DyingServer()}, restart=restart, max_restarts=1,
                          restart_backoff_s=0.0, failure_exceptions=(ConnectionError,))
        if closing:
            m.begin_close()
        with pytest.raises(NoServerAvailableError):
            await m.generate(request_id="r", prompt_ids=[1], sampling_params=SamplingParams(max_tokens=1))
        await asyncio.sleep(0.05)
        await m.close()

    asyncio.run(main())
    assert (restarts == []) if closing else restarts, restarts
