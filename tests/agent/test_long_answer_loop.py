"""The `long_answer` loop: the tool episode, then extra sampled tokens that are trained
(mask 1, the engine's logprobs and versions) but never read by the reward."""

from __future__ import annotations

import asyncio
from typing import Any

from areal_like.core.config import AgentConfig
from areal_like.core.types import GenerateResult, SamplingParams
from rollout_cluster.agent_loop import AGENT_LOOPS, LongAnswerLoop
from rollout_cluster.agent_loop.long_answer import extra_tokens
from rollout_cluster.server_manager import ServerManager
from rollout_cluster.tools import CalculatorTool

from ._agent_fakes import FakeServer, call_text

SAMPLE = {"prompt": [{"role": "user", "content": "123*45"}], "answer": "5535"}


class _LongServer(FakeServer):
    """Scripted turns; the long continuation is decoded across a weight update (v3 → v4)."""

    async def generate(self, *, request_id: str, prompt_ids: list[int], sampling_params: SamplingParams) -> Any:
        if not request_id.endswith("/long"):
            return await super().generate(request_id=request_id, prompt_ids=prompt_ids,
                                          sampling_params=sampling_params)
        self.calls.append((request_id, list(prompt_ids), sampling_params))
        n = sampling_params.max_tokens
        half = n // 2
        return GenerateResult(request_id=request_id, token_ids=[7] * n, logprobs=[-0.5] * n,
                              versions=[3] * half + [4] * (n - half), stop_reason="length", num_interrupts=1)


def _run(tokenizer: Any, scale: int, response_length: int = 400) -> tuple[Any, _LongServer]:
    server = _LongServer(tokenizer, [call_text("123*45"), "5535"], version=3)
    loop = LongAnswerLoop(server_manager=ServerManager([server]), tokenizer=tokenizer,
                          config=AgentConfig(long_answer_tokens=scale), response_length=response_length,
                          tools=[CalculatorTool("calculator")])
    out = asyncio.run(loop.run(SamplingParams(), episode_id="ep", **SAMPLE))
    return out, server


def test_the_long_tail_is_trained_spans_versions_and_leaves_the_answer_alone(tokenizer: Any) -> None:
    assert AGENT_LOOPS["long_answer"] is LongAnswerLoop
    out, server = _run(tokenizer, scale=20)
    short, _ = _run(tokenizer, scale=0)  # scale 0: the plain tool episode
    k = len(out.response_ids) - len(short.response_ids)
    assert k == min(400 - len(short.response_ids), extra_tokens("ep", 20)) and k >= 20
    # the episode as the tool loop made it, then k trained tokens with the engine's numbers
    assert out.response_ids[: len(short.response_ids)] == short.response_ids
    assert out.response_mask == short.response_mask + [1] * k
    assert out.response_logprobs[-k:] == [-0.5] * k
    assert out.response_versions[-k:] == [3] * (k // 2) + [4] * (k - k // 2)
    assert out.final_text == "5535"  # what the reward reads
    assert out.metrics["long_answer_tokens"] == k and out.metrics["long_answer_interrupts"] == 1
    # the continuation runs past end-of-turn, on the episode's exact sequence
    rid, prompt, params = server.calls[-1]
    assert rid == "ep/long" and params.ignore_eos and params.max_tokens == k
    assert prompt == short.prompt_ids + short.response_ids


def test_the_tail_stays_within_the_response_budget(tokenizer: Any) -> None:
    short, _ = _run(tokenizer, scale=0)
    out, _ = _run(tokenizer, scale=1000, response_length=len(short.response_ids) + 5)
    assert len(out.response_ids) == len(short.response_ids) + 5


def test_the_tail_length_is_heavy_tailed_and_fixed_per_episode() -> None:
    draws = [extra_tokens(f"ep-{i}", 48) for i in range(2000)]
    assert draws == [extra_tokens(f"ep-{i}", 48) for i in range(2000)]
    assert min(draws) >= 48
    mean = sum(draws) / len(draws)
    assert 100 < mean < 200  # Pareto(1.5) × 48: mean 144
    assert max(draws) > 10 * 48  # a long tail: stragglers
