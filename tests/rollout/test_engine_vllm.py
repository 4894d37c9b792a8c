"""vLLM adapter: the pure request/response translation (no vLLM needed), the clear
failure when vLLM is missing, and (opt-in, `-m vllm`) a real interrupt run."""

from __future__ import annotations

import asyncio
import importlib.util
from types import SimpleNamespace

import pytest

from areal_like.config import VLLMEngineConfig
from areal_like.types import SamplingParams
from rollout_cluster.engine import InvalidSamplingParamsError
from rollout_cluster.engine.sampling import mix_seed
from rollout_cluster.engine.vllm_engine import (
    VLLMEngine,
    VLLMWeightExtension,
    engine_args_kwargs,
    map_finish_reason,
    parse_completion,
    resubmission,
    vllm_sampling_kwargs,
)

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def test_sampling_kwargs_ask_for_sampled_logprob_only():
    kw = vllm_sampling_kwargs(
        SamplingParams(temperature=0.7, top_k=-1, stop_token_ids=[3]), max_tokens=9, seed=5
    )
    assert kw["logprobs"] == 0 and kw["n"] == 1 and kw["top_k"] == -1
    assert (kw["temperature"], kw["max_tokens"], kw["stop_token_ids"], kw["seed"]) == (0.7, 9, [3], 5)
    with pytest.raises(InvalidSamplingParamsError):
        vllm_sampling_kwargs(SamplingParams(), max_tokens=0, seed=None)
    args = engine_args_kwargs("/m", VLLMEngineConfig(kv_cache_gb=2.0), seed=1)
    assert args["logprobs_mode"] == "processed_logprobs"
    assert args["kv_cache_memory_bytes"] == 2 << 30
    assert args["worker_extension_cls"].endswith("VLLMWeightExtension")


def test_resubmission_continues_prompt_plus_partial_with_remaining_budget():
    sp = SamplingParams(max_tokens=10, seed=7)
    prompt, kw = resubmission([1, 2, 3], [4, 5, 6, 7], sp, seed=7, max_seq_len=100)
    assert prompt == [1, 2, 3, 4, 5, 6, 7] and kw["max_tokens"] == 6
    assert kw["seed"] == mix_seed(7, 7)  # a function of (seed, position)
    _, kw = resubmission([1] * 90, [2] * 4, sp, seed=None, max_seq_len=100)
    assert kw["max_tokens"] == 6 and kw["seed"] is None
    assert resubmission([1], [2] * 10, sp, seed=7, max_seq_len=100) is None


def test_parse_completion_takes_sampled_token_logprobs():
    lp = SimpleNamespace
    comp = SimpleNamespace(
        token_ids=[11, 12],
        logprobs=[{11: lp(logprob=-0.5), 99: lp(logprob=-3.0)}, {12: lp(logprob=-1.25)}],
        finish_reason="length",
    )
    assert parse_completion(comp) == ([11, 12], [-0.5, -1.25], "length")
    comp.logprobs = None
    with pytest.raises(RuntimeError, match="logprobs"):
        parse_completion(comp)
    assert map_finish_reason(None) is None and map_finish_reason("stop") == "stop"
    assert map_finish_reason("error") == "abort"


def test_worker_extension_reties_embeddings_and_redispatches_head():
    calls = []
    embed = SimpleNamespace(weight="E")
    head = SimpleNamespace(
        weight="stale", quant_method=SimpleNamespace(process_weights_after_loading=calls.append)
    )
    model = SimpleNamespace(
        config=SimpleNamespace(tie_word_embeddings=True),
        lm_head=head,
        model=SimpleNamespace(embed_tokens=embed),
    )
    got = []
    runner = SimpleNamespace(
        model=model, reload_weights=lambda weights_iterator: got.extend(weights_iterator)
    )
    ext = VLLMWeightExtension()
    ext.model_runner = runner
    assert ext.areal_load_weights([("a", 1), ("b", 2)]) == 2
    assert got == [("a", 1), ("b", 2)] and head.weight == "E" and calls == [head]


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed")
def test_missing_vllm_fails_at_construction_with_a_clear_message(tiny_model_dir):
    with pytest.raises(RuntimeError, match="needs vLLM"):
        VLLMEngine(tiny_model_dir, VLLMEngineConfig())


@pytest.mark.vllm
def test_real_vllm_interrupt_mixes_versions(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    new = [(n, p.detach() + 0.05 * torch.randn_like(p)) for n, p in hf.named_parameters()]

    async def main():
        engine = VLLMEngine(tiny_model_dir, VLLMEngineConfig(kv_cache_gb=1.0, max_model_len=256))
        sp = SamplingParams(temperature=1.0, max_tokens=200, seed=0, stop_token_ids=[])
        calls = [
            asyncio.create_task(
                engine.generate(request_id=f"r{i}", prompt_ids=[5 + i, 6, 7], sampling_params=sp)
            )
            for i in range(8)
        ]
        await asyncio.sleep(0.5)
        await engine.update_weights(new, 1)
        results = await asyncio.gather(*calls)
        await engine.close()
        return results, engine.metrics()

    results, m = asyncio.run(main())
    assert any(len(set(r.versions)) == 2 for r in results)
    assert m["interrupts"] == 1 and m["recompute_tokens"] > 0
