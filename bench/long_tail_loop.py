"""The quickstart tool loop with a long-tailed response-length distribution (benchmarks).

The quickstart model answers in ~15 tokens, so every episode costs about the same.
Reasoning workloads do not: a few episodes run many times longer than the median,
and a synchronous step waits for the slowest one. This loop runs the normal
calculator episode and then keeps decoding the same sequence for `k` more tokens
(`ignore_eos`), `k ~ min(cap, scale · Pareto(α))`, drawn per episode from its id.
Those "thinking" tokens are real decode work on the rollout side and real sequence
length on the train side (forward/backward over them), but they carry mask 0, so
the learning signal is the quickstart's: reward and advantages are unchanged.

Distribution knobs (environment, read at import): `LONG_TAIL_ALPHA` (1.2),
`LONG_TAIL_SCALE` (12 tokens), `LONG_TAIL_CAP` (192 tokens). Used as
`agent.default_loop=bench/long_tail_loop.py:LongTailToolLoop`.
"""

from __future__ import annotations

import hashlib
import os
import random
from typing import Any

from areal_like.core.types import AgentLoopOutput, SamplingParams
from rollout_cluster.agent_loop.tool_agent import ToolAgentLoop

ALPHA = float(os.environ.get("LONG_TAIL_ALPHA", "1.2"))
SCALE = float(os.environ.get("LONG_TAIL_SCALE", "12"))
CAP = int(os.environ.get("LONG_TAIL_CAP", "192"))


def tail_length(episode_id: str, alpha: float = ALPHA, scale: float = SCALE, cap: int = CAP) -> int:
    """Extra tokens for this episode: a Pareto draw seeded by the episode id."""
    seed = int.from_bytes(hashlib.sha256(episode_id.encode()).digest()[:8], "little")
    draw = random.Random(seed).paretovariate(alpha)  # >= 1, heavy tail
    return max(1, min(cap, int(scale * draw)))


class LongTailToolLoop(ToolAgentLoop):
    async def run(self, sampling_params: SamplingParams, **sample: Any) -> AgentLoopOutput | None:
        out = await super().run(sampling_params, **sample)
        if out is None:
            return None
        episode_id = str(out.episode_id or self.episode_id(sample))
        k = tail_length(episode_id)
        seq = out.prompt_ids + out.response_ids
        res = await self.server_manager.generate(
            request_id=f"{episode_id}-tail",
            prompt_ids=seq,
            sampling_params=sampling_params.model_copy(update={"max_tokens": k, "ignore_eos": True, "n": 1}),
            session_id=episode_id,
        )
        self.server_manager.release_session(episode_id)
        n = len(res.token_ids)
        return out.model_copy(
            update={
                "response_ids": out.response_ids + list(res.token_ids),
                "response_mask": out.response_mask + [0] * n,
                "response_logprobs": out.response_logprobs + [0.0] * n,
                "response_versions": out.response_versions + [-1] * n,
                "metrics": {**out.metrics, "tail_tokens": float(n)},
            }
        )
