"""AgentRunner: the controller's entry point — loop choice, scoring, typed failures."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from areal_like.core.config import ExperimentConfig
from areal_like.core.types import AgentLoopOutput, SamplingParams
from rollout_cluster.agent_loop import (
    AgentLoopBase,
    AgentRunner,
    EpisodeAbortedError,
    SingleTurnAgentLoop,
    ToolAgentLoop,
    register,
)
from rollout_cluster.loader import UserCodeError
from rollout_cluster.rewards import RewardError
from rollout_cluster.server_manager import ServerManager

from ._agent_fakes import FakeServer, call_text


def make_runner(tokenizer: Any, script: Any, **kw: Any) -> tuple[AgentRunner, FakeServer]:
    server = FakeServer(tokenizer, script)
    runner = AgentRunner.from_config(
        ExperimentConfig(), server_manager=ServerManager([server]), tokenizer=tokenizer, **kw
    )
    return runner, server


def episode(
    runner: AgentRunner, sample: dict[str, Any], eid: str = "g0-e0"
) -> tuple[AgentLoopOutput | None, float]:
    async def main() -> tuple[AgentLoopOutput | None, float]:
        out = await runner.run_episode(sample, SamplingParams(), eid)
        return out, (await runner.score(sample, out) if out is not None else float("nan"))

    return asyncio.run(main())


def test_rows_choose_their_loop_and_are_scored(tokenizer: Any) -> None:
    runner, server = make_runner(tokenizer, {"t": [call_text("123*45"), "5535"], "s": ["5535"]})
    row = {"prompt": [{"role": "user", "content": "123*45"}], "answer": "5535"}
    out, reward = episode(runner, {**row, "agent_name": "tool_agent"}, "t")
    assert reward == 1.0 and out is not None and out.reward == 1.0 and out.num_turns == 3
    out, reward = episode(runner, {**row, "agent_name": "single_turn"}, "s")
    assert reward == 1.0 and out is not None and out.num_turns == 1 and out.response_mask == [1] * 5
    assert isinstance(runner.loop_for("tool_agent"), ToolAgentLoop)
    assert isinstance(runner.loop_for("single_turn"), SingleTurnAgentLoop)
    assert [c[0] for c in server.calls] == ["t/0", "t/1", "s"]
    assert server.calls[-1][1][-1] == tokenizer.convert_tokens_to_ids("assistant")
    assert runner.server_manager.metrics()["sticky_sessions"] == 0  # sessions released


def test_abort_is_a_typed_error(tokenizer: Any) -> None:
    runner, _ = make_runner(tokenizer, [("12", "abort")])
    with pytest.raises(EpisodeAbortedError) as info:
        episode(runner, {"prompt": "1+1", "answer": "2"})
    assert info.value.output.response_ids == tokenizer.encode("12", add_special_tokens=False)


def test_reward_failure_surfaces_as_reward_error(tokenizer: Any) -> None:
    def broken(sample: dict[str, Any], output: Any) -> float:
        raise ValueError("bad answer key")

    runner, _ = make_runner(tokenizer, ["2"], reward_fn=broken)
    with pytest.raises(RewardError, match="raised ValueError: bad answer key") as info:
        episode(runner, {"prompt": "1+1", "answer": "2"})
    assert info.value.reason == "raised"


def test_dict_reward_metrics_land_in_output(tokenizer: Any) -> None:
    runner, _ = make_runner(tokenizer, ["2"], reward_fn=lambda s, o: {"reward": 0.25, "len": 1})
    out, reward = episode(runner, {"prompt": "1+1", "answer": "2", "agent_name": "single_turn"})
    assert reward == 0.25 and out is not None and out.metrics["len"] == 1.0


def test_loops_by_class_registration_and_rejection(tokenizer: Any) -> None:
    class Rejecting(AgentLoopBase):
        async def run(self, sampling_params: SamplingParams, **sample: Any) -> AgentLoopOutput | None:
            return None

    runner, _ = make_runner(tokenizer, ["x"], loops={"picky": Rejecting})
    out, _ = episode(runner, {"prompt": "1", "answer": "1", "agent_name": "picky"})
    assert out is None
    register("test_rejecting")(Rejecting)
    with pytest.raises(ValueError, match="already registered"):
        register("tool_agent")(Rejecting)
    with pytest.raises(UserCodeError, match="neither registered"):
        runner.loop_for("no_such_loop")
