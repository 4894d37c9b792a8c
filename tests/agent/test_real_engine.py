"""The tool loop on the real embedded engine and the real small model (random weights).

A random model rarely calls a tool, so the first turn of one episode is scripted
(a calculator call) and every later turn comes from the real engine. Recomputing the
engine's logprobs with a plain forward pass over prompt + response then shows that
the engine conditioned on exactly the sequence the trajectory records.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from areal_like.core.config import AgentConfig, EmbeddedEngineConfig
from areal_like.core.types import AgentLoopOutput, GenerateResult, SamplingParams
from rollout_cluster.agent_loop import ToolAgentLoop
from rollout_cluster.server_manager import ServerManager
from rollout_cluster.tools import CalculatorTool

from ._agent_fakes import call_text

server_module = pytest.importorskip("rollout_cluster.server")


class ScriptedFirstTurn:
    """Turn 0 is a fixed calculator call; later turns are delegated to the real server."""

    def __init__(self, real: Any, tokenizer: Any) -> None:
        self.real = real
        self.ids = tokenizer.encode(call_text("12*3"), add_special_tokens=False) + [tokenizer.eos_token_id]

    async def generate(
        self, *, request_id: str, prompt_ids: list[int], sampling_params: SamplingParams
    ) -> Any:
        if request_id.endswith("/0"):
            n = len(self.ids)
            return GenerateResult(
                request_id=request_id,
                token_ids=self.ids,
                logprobs=[-1.0] * n,
                versions=[0] * n,
                stop_reason="stop",
            )
        return await self.real.generate(
            request_id=request_id, prompt_ids=prompt_ids, sampling_params=sampling_params
        )


def test_tool_loop_on_the_real_engine(tiny_model_dir: Any, tokenizer: Any) -> None:
    torch.set_num_threads(1)
    cfg = EmbeddedEngineConfig(max_batch_size=8, max_seq_len=160)
    real = server_module.RolloutServer.from_config(tiny_model_dir, cfg, set_threads=False)
    manager = ServerManager({"real": ScriptedFirstTurn(real, tokenizer)})
    loop = ToolAgentLoop(
        server_manager=manager,
        tokenizer=tokenizer,
        config=AgentConfig(max_tool_response_length=32),
        response_length=48,
        tools=[CalculatorTool("calculator")],
    )

    async def main() -> list[AgentLoopOutput | None]:
        try:
            return await asyncio.gather(
                *(
                    loop.run(SamplingParams(temperature=1.0, seed=k), episode_id=f"e{k}", prompt="12*3")
                    for k in range(3)
                )
            )
        finally:
            await real.close()

    outs = [o for o in asyncio.run(main()) if o is not None]
    assert len(outs) == 3
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for out in outs:
        assert out.messages[2] == {"role": "tool", "content": "36", "name": "calculator"}
        assert len(out.response_ids) <= 48 and out.response_mask[-1] == 1
        n_first = len(tokenizer.encode(call_text("12*3"), add_special_tokens=False)) + 1
        engine_part = [
            i
            for i, (m, lp) in enumerate(zip(out.response_mask, out.response_logprobs, strict=True))
            if m == 1 and i >= n_first
        ]
        assert engine_part, "the real engine produced the second turn"
        ids = torch.tensor([out.prompt_ids + out.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        p = len(out.prompt_ids)
        recomputed = [logp[p + i - 1, out.response_ids[i]].item() for i in engine_part]
        recorded = [out.response_logprobs[i] for i in engine_part]
        assert recomputed == pytest.approx(recorded, abs=2e-3)
        assert all(out.response_versions[i] == 0 for i in engine_part)
