"""The tool loop with long answers: a rollout-bound workload on the small model.

The quickstart model answers in ~15 tokens, so weight updates almost never land while
a sequence is being decoded, and the interrupt → recompute → resume path stays idle.
Real reasoning runs are the opposite: answers of hundreds or thousands of tokens, a
heavy tail of very long ones, decoding that dominates the step. This loop reproduces
that shape: it runs the tool episode, then keeps sampling the same sequence for `k`
more tokens (`ignore_eos`). Those tokens are trained like any other sampled token
(mask 1, the engine's logprobs and per-token versions), so a trajectory whose tail was
decoded across a weight update spans two versions; the reward still reads only the
answer (`final_text`), so what the policy must learn is the quickstart's.

`k` is drawn per episode from its id: `agent.long_answer_tokens` × Pareto(α = 1.5)
(mean 3 × the scale, a long tail), within what the response budget leaves. Chosen per
row (`agent_name: long_answer`, what `dataset.form: long_answer` generates) or as
`agent.default_loop`; `configs/long_answers.yaml` is the shipped run.
"""

from __future__ import annotations

import hashlib
import random
import time
from typing import Any

from areal_like.core.types import AgentLoopOutput, SamplingParams
from rollout_cluster.agent_loop.base import register
from rollout_cluster.agent_loop.tool_agent import ToolAgentLoop

__all__ = ["LongAnswerLoop", "extra_tokens"]

ALPHA = 1.5


def extra_tokens(episode_id: str, scale: int, alpha: float = ALPHA) -> int:
    """This episode's extra tokens: `scale` × a Pareto(α) draw seeded by the episode id."""
    seed = int.from_bytes(hashlib.sha256(episode_id.encode()).digest()[:8], "little")
    return int(scale * random.Random(seed).paretovariate(alpha))


@register("long_answer")
class LongAnswerLoop(ToolAgentLoop):
    async def run(self, sampling_params: SamplingParams, **sample: Any) -> AgentLoopOutput | None:
        out = await super().run(sampling_params, **sample)
        if out is None or out.stop_reason == "abort" or self.config.long_answer_tokens == 0:
            return out
        episode_id = str(out.episode_id or self.episode_id(sample))
        k = min(self.response_length - len(out.response_ids), extra_tokens(episode_id, self.config.long_answer_tokens))
        if k <= 0:
            return out
        start = time.perf_counter()
        try:
            res = await self.server_manager.generate(
                request_id=f"{episode_id}/long",
                session_id=episode_id,
                prompt_ids=out.prompt_ids + out.response_ids,
                sampling_params=sampling_params.model_copy(update={"max_tokens": k, "ignore_eos": True, "n": 1}),
            )
        finally:
            self.server_manager.release_session(episode_id)
        return out.model_copy(update={
            "response_ids": out.response_ids + list(res.token_ids),
            "response_mask": out.response_mask + [1] * len(res.token_ids),
            "response_logprobs": out.response_logprobs + list(res.logprobs),
            "response_versions": out.response_versions + list(res.versions),
            "stop_reason": "abort" if res.stop_reason == "abort" else out.stop_reason,
            "stop_token_id": None if res.stop_reason == "abort" else out.stop_token_id,
            "metrics": {**out.metrics, "long_answer_tokens": float(len(res.token_ids)),
                        "generate_s": out.metrics.get("generate_s", 0.0) + time.perf_counter() - start,
                        "long_answer_interrupts": float(res.num_interrupts)},
        })
