"""AsyncEngine: generate returns once across weight updates; arrivals during an update wait."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_like.core.config import EmbeddedEngineConfig
from areal_like.core.types import SamplingParams
from rollout_cluster.engine import AsyncEngine, EmbeddedEngine, EngineClosedError, PromptTooLongError

torch.set_num_threads(1)

CFG = EmbeddedEngineConfig(max_batch_size=8, max_seq_len=96)
PROMPTS = [[5 + (i * 11 + j * 3) % 50 for j in range(3 + i % 9)] for i in range(24)]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def perturbed(model, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + scale * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def gated(weights: dict[str, torch.Tensor], entered: threading.Event, release: threading.Event):
    """A weight iterator that blocks mid-transfer, holding the engine inside its update."""
    items = list(weights.items())
    yield items[0]
    entered.set()
    assert release.wait(30)
    yield from items[1:]


async def wait_for(cond, timeout: float = 30.0) -> None:
    for _ in range(int(timeout / 0.005)):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached")


async def _scenario(model_dir, hf_model, mode: str):
    engine = AsyncEngine(EmbeddedEngine(model_dir, CFG, interrupt_mode=mode, eos_token_ids=[]))
    loop = asyncio.get_running_loop()

    def submit(i: int, max_tokens: int) -> asyncio.Task:
        sp = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=i)
        return asyncio.create_task(
            engine.generate(request_id=f"r{i}", prompt_ids=PROMPTS[i], sampling_params=sp)
        )

    first = [submit(i, 30 + 4 * (i % 4)) for i in range(12)]  # 12 requests, 8 slots: some queue
    await wait_for(lambda: engine.metrics()["generated_tokens"] >= 40)
    entered, release = threading.Event(), threading.Event()
    update = asyncio.create_task(engine.update_weights(gated(perturbed(hf_model, 1), entered, release), 1))
    await loop.run_in_executor(None, entered.wait, 30)
    during = [submit(i, 12) for i in range(12, 16)]  # arrive while the engine is inside the update
    await asyncio.sleep(0.05)
    assert not any(t.done() for t in during)
    release.set()
    await update
    await wait_for(lambda: engine.metrics()["generated_tokens"] >= 200)
    await engine.update_weights(perturbed(hf_model, 2).items(), 2)
    results = await asyncio.gather(*first, *during)
    metrics = engine.metrics()
    await engine.close()
    return results, metrics


def test_generate_returns_once_across_updates_and_arrivals_wait(tiny_model_dir, hf_model):
    results, m = asyncio.run(_scenario(tiny_model_dir, hf_model, "recompute"))
    first, during = results[:12], results[12:]
    assert all(r.stop_reason == "length" for r in results)
    assert any(len(set(r.versions)) >= 2 for r in first), "no single call spans an update"
    assert all(min(r.versions) >= 1 for r in during)  # queued during the update, ran on new weights
    assert m["interrupts"] == 2 and m["recompute_tokens"] > 0
    assert sum(r.num_interrupts > 0 for r in first) >= 2
    assert 0 < m["reprefill_s_total"] <= m["pause_resume_latency_s_total"]


def test_wait_mode_calls_never_mix_versions(tiny_model_dir, hf_model):
    results, m = asyncio.run(_scenario(tiny_model_dir, hf_model, "wait"))
    assert all(len(set(r.versions)) == 1 for r in results)
    assert len({r.versions[0] for r in results}) >= 2  # updates did happen between calls
    assert m["interrupts"] == 0 and m["reprefill_s_total"] == 0


def test_abort_cancel_errors_and_close(tiny_model_dir):
    async def main():
        engine = AsyncEngine(EmbeddedEngine(tiny_model_dir, CFG, eos_token_ids=[]))
        sp = SamplingParams(max_tokens=80, seed=0)
        a = asyncio.create_task(engine.generate(request_id="a", prompt_ids=PROMPTS[0], sampling_params=sp))
        b = asyncio.create_task(engine.generate(request_id="b", prompt_ids=PROMPTS[1], sampling_params=sp))
        await wait_for(lambda: engine.metrics()["generated_tokens"] >= 10)
        (aborted,) = await engine.abort(["a"])
        ra = await a
        assert ra.stop_reason == "abort" and 0 < len(ra.token_ids) < 80 and ra.token_ids == aborted.token_ids
        b.cancel()  # a cancelled call aborts its request
        with pytest.raises(asyncio.CancelledError):
            await b
        await wait_for(lambda: engine.metrics()["requests_aborted"] == 2)
        with pytest.raises(PromptTooLongError, match="max_seq_len"):
            await engine.generate(request_id="long", prompt_ids=[5] * 96)
        many = await engine.generate_n(
            request_id="n", prompt_ids=PROMPTS[2], sampling_params={"n": 3, "max_tokens": 5, "seed": 7}
        )
        assert [r.request_id for r in many] == ["n:0", "n:1", "n:2"]
        assert len({tuple(r.token_ids) for r in many}) > 1
        hang = asyncio.create_task(engine.generate(request_id="c", prompt_ids=PROMPTS[3], sampling_params=sp))
        await asyncio.sleep(0.01)
        await engine.close()
        with pytest.raises(EngineClosedError):
            await hang
        with pytest.raises(EngineClosedError):
            await engine.generate(request_id="d", prompt_ids=PROMPTS[3])

    asyncio.run(main())
