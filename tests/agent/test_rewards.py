"""Rewards run off the loop with a timeout; every failure is a typed RewardError."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from areal_like.core.types import AgentLoopOutput
from rollout_cluster.loader import UserCodeError
from rollout_cluster.rewards import RewardError, compute_reward, load_reward

OUT = AgentLoopOutput(
    prompt_ids=[1],
    response_ids=[2],
    response_mask=[1],
    response_logprobs=[-0.1],
    response_versions=[0],
    extra={"final_text": "42"},
)
SAMPLE = {"prompt": "40+2", "answer": "42"}


def score(fn: Any, timeout_s: float = 1.0) -> tuple[float, dict[str, float]]:
    return asyncio.run(compute_reward(fn, SAMPLE, OUT, timeout_s=timeout_s))


def test_builtin_arithmetic_reward() -> None:
    assert score(load_reward("arithmetic")) == (1.0, {})


def test_sync_reward_runs_off_the_event_loop() -> None:
    loop_thread: list[int] = []

    def fn(sample: dict[str, Any], output: Any) -> float:
        loop_thread.append(threading.get_ident())
        return 0.5

    assert score(fn) == (0.5, {})
    assert loop_thread[0] != threading.get_ident()


def test_async_and_dict_rewards() -> None:
    async def fn(sample: dict[str, Any], output: Any) -> dict[str, Any]:
        return {"reward": 1, "format_ok": True, "note": "ignored"}

    assert score(fn) == (1.0, {"format_ok": 1.0})


@pytest.mark.parametrize(
    ("fn", "reason"),
    [
        (lambda s, o: 1 / 0, "raised"),
        (lambda s, o: math.nan, "not_finite"),
        (lambda s, o: {"score": 1.0}, "bad_value"),
        (lambda s, o: "1.0", "bad_value"),
        (lambda s, o: time.sleep(0.5), "timeout"),
    ],
)
def test_reward_failures_are_reward_errors(fn: Any, reason: str) -> None:
    with pytest.raises(RewardError) as info:
        score(fn, timeout_s=0.05)
    assert info.value.reason == reason


def test_async_reward_timeout() -> None:
    async def fn(sample: dict[str, Any], output: Any) -> float:
        await asyncio.sleep(30)
        return 1.0

    start = time.perf_counter()
    with pytest.raises(RewardError, match="timeout"):
        score(fn, timeout_s=0.05)
    assert time.perf_counter() - start < 15  # cut at the timeout, not slept out


def test_user_code_reward_by_file(tmp_path: Path) -> None:
    (tmp_path / "my_reward.py").write_text(
        "def length(sample, output):\n    return len(output.final_text)\n"
    )
    fn = load_reward("my_reward.py:length", base_dir=tmp_path)
    assert score(fn) == (2.0, {})
    with pytest.raises(UserCodeError, match="neither a built-in"):
        load_reward("nonexistent")
    with pytest.raises(UserCodeError, match="no attribute 'nope'"):
        load_reward("my_reward.py:nope", base_dir=tmp_path)
