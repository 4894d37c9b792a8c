"""Provenance validation (invariant 2) of trajectories and agent loop outputs."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from areal_like.core.types import AgentLoopOutput, GenerateResult, SamplingParams, Trajectory, TrajectoryGroup


def _kw(**over):
    kw = dict(
        episode_id="e",
        group_id="g",
        prompt_ids=[1, 2],
        response_ids=[5, 6, 7, 8],
        response_mask=[1, 1, 0, 1],
        response_logprobs=[-0.5, -1.0, 0.0, -0.1],
        response_versions=[2, 3, -1, 3],
        reward=1.0,
    )
    kw.update(over)
    return kw


def test_valid_trajectory_and_head_version() -> None:
    t = Trajectory(**_kw())
    assert t.head_version == 2 and sum(t.response_mask) == 3


@pytest.mark.parametrize(
    "over, needle",
    [
        (dict(response_mask=[1, 1, 0]), "lengths disagree"),
        (dict(response_logprobs=[-0.5, math.nan, 0.0, -0.1]), "not finite"),
        (dict(response_logprobs=[-0.5, -math.inf, 0.0, -0.1]), "not finite"),
        (dict(response_versions=[2, -2, -1, 3]), "< -1"),
        (dict(response_versions=[2, -1, -1, 3]), "generated token 1 has version -1"),
        (dict(response_logprobs=[-0.5, -1.0, -0.3, -0.1]), "tool/observation token 2 must have logprob 0"),
        (dict(response_versions=[2, 3, 0, 3]), "tool/observation token 2"),
        (dict(response_mask=[1, 2, 0, 1]), "expected 0 or 1"),
        (dict(response_logprobs=[0.5, -1.0, 0.0, -0.1]), "> 0"),
        (dict(reward=math.nan), "not finite"),
    ],
)
def test_provenance_violations_refused(over, needle) -> None:
    with pytest.raises(ValidationError, match=needle):
        Trajectory(**_kw(**over))


def test_agent_loop_output_checks_too() -> None:
    with pytest.raises(ValidationError, match="lengths disagree"):
        AgentLoopOutput(prompt_ids=[1], response_ids=[1, 2], response_mask=[1], response_logprobs=[0.0], response_versions=[0])


def test_generate_result_lengths() -> None:
    with pytest.raises(ValidationError, match="lengths disagree"):
        GenerateResult(request_id="r", token_ids=[1, 2], logprobs=[-1.0], versions=[0, 0], stop_reason="stop")


def test_sampling_params_bounds() -> None:
    with pytest.raises(ValidationError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValidationError):
        SamplingParams(top_p=0)
    with pytest.raises(ValidationError):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValidationError):
        SamplingParams(bogus=1)
    assert SamplingParams(top_k=5).approximate_logprobs and not SamplingParams().approximate_logprobs


def test_group_head_version_is_min_over_members() -> None:
    a = Trajectory(**_kw(episode_id="a"))
    b = Trajectory(**_kw(episode_id="b", response_versions=[1, 3, -1, 3]))
    g = TrajectoryGroup(group_id="g", trajectories=[a, b], failed=1)
    assert g.head_version == 1 and g.size == 3


def test_agent_loop_output_fields_are_typed_and_old_extra_dicts_still_work():
    from areal_like.core.types import AgentLoopOutput

    base = dict(prompt_ids=[1], response_ids=[2], response_mask=[1], response_logprobs=[-0.1], response_versions=[0])
    out = AgentLoopOutput(**base, final_text="42", stop_reason="stop")
    assert out.final_text == "42" and out.extra == {}
    legacy = AgentLoopOutput(**base, extra={"final_text": "7", "termination": "stop", "mine": [1]})
    assert legacy.final_text == "7" and legacy.termination == "stop" and legacy.extra == {"mine": [1]}
    with pytest.raises(ValueError):
        AgentLoopOutput(**base, stop_reason="exploded")


def test_engine_specific_numbers_reach_the_flat_record_and_the_dashboard_series():
    from areal_like.core.types import RolloutCounters, RolloutStats
    from areal_like.orchestration.dashboard import SERIES

    s = RolloutStats(time=0.0, loaded_version=1, started=2, running=0,
                     counters=RolloutCounters(kv_usage=0.5, engine={"vllm_preemptions": 3.0, "vllm_num_waiting": 2.0}))
    flat = s.flat()
    assert flat["vllm_preemptions"] == 3.0 and flat["vllm_num_waiting"] == 2.0 and flat["kv_usage"] == 0.5
    assert "engine" not in flat
    names = {(name, field) for name, kind, field in SERIES if kind == "rollout"}
    assert {("vllm_preemptions", "vllm_preemptions"), ("vllm_kv_cache_usage", "vllm_kv_cache_usage")} <= names
