"""vLLM on a GPU, as users run it: the trainer's weights straight into vLLM's worker in
the middle of generation, and the interrupt audit (every token carries the version
that produced it: its behaviour logprob is a fresh forward under that version's
weights).

vLLM runs with the GPU defaults of `VLLMEngineConfig`: `kv_cache_gb` unset (vLLM sizes
the KV cache from `gpu_memory_utilization`) and `enforce_eager` unset (CUDA graphs on),
so the audit also shows that the in-place weight reload reaches the captured graphs.

The transports:
- One GPU (`test_weight_group_into_vllm_on_one_gpu_over_gloo`): the trainer side (this
  test process) and vLLM would share the device, and NCCL between two processes on
  one GPU does not work. So the sender runs the weight group on the CPU
  (`DistWeightSender(device="cpu")`, gloo); the vLLM worker, a `DistWeightReceiver` on
  cuda:0, follows the sender's device (the group's plan says `cpu`), receives over
  gloo and loads into its GPU model (`weight_sync.device=cpu` in a run).
- Two GPUs or more (`test_weight_group_into_vllm_over_nccl`): NCCL between the sender
  on cuda:1 and vLLM's worker on cuda:0.

Opt-in: `scripts/test.sh --gpu` (tests/gpu/conftest.py skips all of it without CUDA).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tests.gpu.conftest import cuda_gpus  # noqa: E402

pytestmark = [pytest.mark.gpu]

GPU_TOL = 5e-3
"""fp32 on the GPU against an fp32 HF forward on the CPU: reductions run in another
order (and vLLM's attention kernels differ from HF's), so a little looser than the CPU
tests' 1e-3; a stale version misses by far more (checked below)."""


@pytest.fixture(scope="module")
def gpu_engine():
    from areal_like.core.config import VLLMEngineConfig
    from tests._vllm_harness import QUICKSTART_MODEL, EngineThread

    if cuda_gpus() < 1:
        pytest.skip("needs a CUDA GPU")
    config = VLLMEngineConfig(gpu_memory_utilization=0.4, max_model_len=512)
    assert config.kv_cache_gb is None and config.enforce_eager is None  # the GPU defaults
    h = EngineThread(QUICKSTART_MODEL, config)  # vLLM on cuda:0; the HF audit model on the CPU
    yield h
    h.close()


def _sender(device: str):
    from areal_like.core.config import DistWeightSyncConfig
    from weight_sync.dist import DistWeightSender

    return DistWeightSender(DistWeightSyncConfig(timeout_s=60.0, bucket_mb=4.0), device=device)


def _deliver_and_audit(h, sender, name: str) -> None:
    from tests._vllm_harness import receive_mid_generation

    eng = h.engine
    assert h.run(eng.join_weights(sender.store_addr, name, 60.0)) == [f"{name}-w0"]
    assert sender.wait_for_receivers(1, timeout=60.0) == [f"{name}-w0"]
    v = eng.version
    new = h.perturbed(v, seed=v + 1)
    before = eng.metrics()
    outcome, results, prompts = receive_mid_generation(h, sender, name, v + 1, new, n_prompts=8, n_tok=200,
                                                       timeout_s=60.0)
    assert outcome == v + 1 == eng.version, outcome
    h.weights[v + 1] = new
    stats = sender.wait(120)
    assert stats.ok and stats.accepted == 1 and stats.receivers == [f"{name}-w0"], stats
    after = eng.metrics()
    assert after["weight_updates"] == before["weight_updates"] + 1
    assert after["interrupts"] == before["interrupts"] + 1
    mixed = 0
    for p, r in zip(prompts, results, strict=True):
        assert len(r.token_ids) == len(r.logprobs) == len(r.versions) == 200 and r.stop_reason == "length"
        assert r.num_interrupts == 1 and r.versions == sorted(r.versions) and set(r.versions) <= {v, v + 1}
        assert h.audit(p, r) < GPU_TOL, r.request_id
        k = r.versions.count(v)
        if 0 < k < len(r.versions):
            mixed += 1
            # the check can fail: the old weights do not explain the new version's tokens
            import torch

            stale = h.hf_logprobs(v, p, r.token_ids)[k:]
            assert float((torch.tensor(r.logprobs[k:]) - stale).abs().max()) > 10 * GPU_TOL
    assert mixed >= 1, "no call returned tokens of two versions: the receive did not interrupt"
    late = h.run(eng.generate(request_id=f"after-{name}", prompt_ids=prompts[0],
                              sampling_params={"max_tokens": 20, "seed": 1, "ignore_eos": True}))
    assert late.versions == [v + 1] * 20 and h.audit(prompts[0], late) < GPU_TOL


def test_weight_group_into_vllm_on_one_gpu_over_gloo(gpu_engine) -> None:
    sender = _sender("cpu")  # one GPU: NCCL between this process and vLLM's would not work
    try:
        _deliver_and_audit(gpu_engine, sender, "gpu-gloo")
    finally:
        sender.close()


def test_weight_group_into_vllm_over_nccl(gpu_engine) -> None:
    if cuda_gpus() < 2:
        pytest.skip("NCCL between two processes needs a GPU each: this machine has one")
    sender = _sender("cuda:1")  # vLLM's worker is on cuda:0
    try:
        _deliver_and_audit(gpu_engine, sender, "gpu-nccl")
    finally:
        sender.close()
