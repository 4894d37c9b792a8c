"""`cluster.colocate` on one GPU (docs/design.md §10.17): the trainer keeps its model and
optimizer in host memory between steps, a vLLM server sleeps while it is held, and
each gives the GPU memory back the other needs. The offload test passed on an H200
(2026-11-26); the vLLM sleep test has not run on a GPU yet. Run with `scripts/test.sh
--gpu` or `tests/gpu/device_check.sh` whenever one is lent."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_the_trainer_frees_the_gpu_between_steps_and_trains_the_same(tiny_model_dir) -> None:
    from areal_like.core.config import LossConfig, TorchBackendConfig, TrainConfig
    from tests.train.conftest import make_trajectories
    from train_cluster.batch import build_batch
    from train_cluster.torch_engine import TorchTrainEngine

    cfg = TrainConfig(lr=1e-3, backend=TorchBackendConfig(device="cuda"))
    batch = build_batch(make_trajectories(), LossConfig())
    kept = TorchTrainEngine(tiny_model_dir, cfg, seed=0)
    kept.train_step(batch)
    moved = TorchTrainEngine(tiny_model_dir, cfg, seed=0)
    moved.train_step(batch)
    on_gpu = torch.cuda.memory_allocated()
    moved.offload()
    assert torch.cuda.memory_allocated() < on_gpu  # weights and Adam moments left the GPU
    assert all(p.device.type == "cpu" for p in moved._module.parameters())
    moved.onload()
    assert all(p.device.type == "cuda" for p in moved._module.parameters())
    kept.train_step(batch)
    moved.train_step(batch)  # the optimizer state came back with the weights
    a, b = dict(kept.named_weights()), dict(moved.named_weights())
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


def test_a_held_vllm_server_sleeps_and_its_request_finishes_after() -> None:
    pytest.importorskip("vllm")
    from areal_like.core.config import VLLMEngineConfig
    from areal_like.core.types import SamplingParams
    from tests._vllm_harness import QUICKSTART_MODEL, EngineThread

    h = EngineThread(QUICKSTART_MODEL, VLLMEngineConfig(gpu_memory_utilization=0.4, max_model_len=512,
                                                        enable_sleep_mode=True))
    try:
        engine = h.engine

        async def scenario() -> tuple[int, int, int]:
            sp = SamplingParams(temperature=1.0, max_tokens=200, seed=3)
            task = asyncio.create_task(engine.generate(request_id="r", prompt_ids=h.prompt("count"),
                                                       sampling_params=sp))
            while engine.metrics()["generated_tokens"] < 10:
                await asyncio.sleep(0.01)
            free_before = torch.cuda.mem_get_info()[0]
            await engine.hold(True)
            free_held = torch.cuda.mem_get_info()[0]
            tokens = engine.metrics()["generated_tokens"]
            await asyncio.sleep(0.5)
            assert engine.metrics()["generated_tokens"] == tokens and not task.done()
            await engine.hold(False)
            result = await asyncio.wait_for(task, 120)
            return free_before, free_held, len(result.token_ids)

        free_before, free_held, n = h.run(scenario(), timeout=300)
        assert free_held > free_before  # the KV cache (and the weights) left the GPU
        assert n > 10  # it went on after the hold
    finally:
        h.close()
