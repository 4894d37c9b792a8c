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


def test_reward_threads_are_reused_and_a_hung_reward_blocks_no_other() -> None:
    """Many rewards run on a few reused threads; one that hangs past its timeout keeps its
    own thread while the next rewards run at once on others."""
    release = threading.Event()
    local = threading.local()
    fresh_threads: list[str] = []

    def hangs(sample: dict[str, Any], output: Any) -> float:
        release.wait(30)
        return 0.0

    def quick(sample: dict[str, Any], output: Any) -> float:
        if not getattr(local, "seen", False):  # a thread's locals start empty
            local.seen = True
            fresh_threads.append(threading.current_thread().name)
        return 1.0

    async def main() -> list[float]:
        with pytest.raises(RewardError, match="timeout"):
            await compute_reward(hangs, SAMPLE, OUT, timeout_s=0.05)
        out = []
        for _ in range(40):  # one after another: an idle thread takes each
            out.append((await compute_reward(quick, SAMPLE, OUT, timeout_s=5.0))[0])
        out += [r for r, _ in await asyncio.gather(*(compute_reward(quick, SAMPLE, OUT, timeout_s=5.0)
                                                     for _ in range(8)))]
        return out

    start = time.perf_counter()
    try:
        assert asyncio.run(main()) == [1.0] * 48
    finally:
        release.set()
    assert time.perf_counter() - start < 10  # never waited for the hung reward
    assert len(fresh_threads) <= 9  # reused, not one thread per reward (48)


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


# ---- TRL-style reward functions (docs/design.md §10.13) ----------------------------------

TEXT_ROW = {"prompt": [{"role": "user", "content": "40+2"}], "prompt_text": "40+2", "answer": "42",
            "extra": {"difficulty": "easy"}}
CHAT_ROW = {**TEXT_ROW, "prompt_text": None}


def trl_score(fn: Any, sample: dict[str, Any]) -> tuple[float, dict[str, float]]:
    return asyncio.run(compute_reward(load_reward(fn), sample, OUT, timeout_s=1.0))


def test_trl_reward_gets_one_element_lists_and_dataset_columns() -> None:
    seen: dict[str, Any] = {}

    def accuracy(completions, prompts=None, completion_ids=None, **kwargs) -> list[float]:
        seen.update(completions=completions, prompts=prompts, completion_ids=completion_ids, **kwargs)
        return [float(c == a) for c, a in zip(completions, kwargs["answer"], strict=True)]

    assert trl_score(accuracy, TEXT_ROW) == (1.0, {})
    assert seen == {"completions": ["42"], "prompts": ["40+2"], "completion_ids": [[2]], "answer": ["42"],
                    "difficulty": ["easy"]}
    assert trl_score(accuracy, CHAT_ROW) == (0.0, {})  # a chat prompt: completions are messages, as in TRL
    assert seen["completions"] == [[{"role": "assistant", "content": "42"}]]
    assert seen["prompts"] == [CHAT_ROW["prompt"]]


def test_trl_reward_without_kwargs_gets_only_what_it_names() -> None:
    def strict(completions, answer):
        return [1.0 if completions[0] == answer[0] else 0.0]

    async def asynchronous(prompts, completions, **kwargs):
        return [0.5]

    assert trl_score(strict, TEXT_ROW) == (1.0, {})
    assert trl_score(asynchronous, TEXT_ROW) == (0.5, {})


@pytest.mark.parametrize(
    ("value", "reason"),
    [([None], "bad_value"), ([1.0, 0.0], "raised"), ([math.inf], "not_finite")],
)
def test_trl_reward_none_or_wrong_length_fails_the_episode(value: Any, reason: str) -> None:
    def fn(completions, **kwargs):
        return value

    with pytest.raises(RewardError) as info:
        trl_score(fn, TEXT_ROW)
    assert info.value.reason == reason


def test_trl_reward_by_file_and_ours_left_alone(tmp_path: Path) -> None:
    (tmp_path / "trl_rewards.py").write_text(
        "def format_reward(completions, **kwargs):\n    return [float(c.isdigit()) for c in completions]\n"
    )
    fn = load_reward("trl_rewards.py:format_reward", base_dir=tmp_path)
    assert fn.__name__ == "format_reward"
    assert asyncio.run(compute_reward(fn, TEXT_ROW, OUT, timeout_s=1.0)) == (1.0, {})

    def ours(sample, output):
        return 1.0

    assert load_reward(ours) is ours and load_reward(fn) is fn  # not wrapped twice


def test_non_numeric_dict_entries_are_dropped_with_a_warning(caplog) -> None:
    def fn(sample, output):
        return {"reward": 1.0, "format_ok": 1.0, "why": "text"}

    with caplog.at_level("WARNING"):
        assert score(fn) == (1.0, {"format_ok": 1.0})
    assert "'why' is str, not a number" in caplog.text
