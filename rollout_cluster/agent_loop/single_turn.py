"""One prompt, one generation: the simplest agent loop."""

from __future__ import annotations

import time
from typing import Any

from areal_like.core.types import AgentLoopOutput, SamplingParams
from rollout_cluster.agent_loop.base import AgentLoopBase, register

__all__ = ["SingleTurnAgentLoop"]


@register("single_turn")
class SingleTurnAgentLoop(AgentLoopBase):
    """Chat template with the generation header, then one generate call within the budget."""

    async def run(self, sampling_params: SamplingParams, **sample: Any) -> AgentLoopOutput | None:
        episode_id = self.episode_id(sample)
        messages = self.prompt_messages(sample)
        prompt_ids = self.chat.prompt_ids(messages)
        start = time.perf_counter()
        try:
            result = await self.server_manager.generate(
                request_id=episode_id,
                session_id=episode_id,
                prompt_ids=prompt_ids,
                sampling_params=self.turn_params(sampling_params, self.response_length),
            )
        finally:
            self.server_manager.release_session(episode_id)
        generate_s = time.perf_counter() - start
        ids = result.token_ids[: self.response_length]
        text = self.decode(ids)
        truncated = result.stop_reason == "length" or len(result.token_ids) > self.response_length
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=ids,
            response_mask=[1] * len(ids),
            response_logprobs=result.logprobs[: len(ids)],
            response_versions=result.versions[: len(ids)],
            num_turns=1,
            truncated=truncated,
            metrics={"num_interrupts": float(result.num_interrupts), "generate_s": generate_s},
            episode_id=episode_id,
            final_text=text,
            messages=[*messages, {"role": "assistant", "content": text}],
            stop_reason=result.stop_reason,
            stop_token_id=None if truncated else result.stop_token_id,
            termination="length" if truncated else result.stop_reason,
        )
