"""Torch backend on CUDA: a train step in this process (fp32 and bf16 over fp32 masters) and
through a `TrainWorkerGroup` under each launcher (one worker holding the GPU; DDP and FSDP2 over NCCL when
the machine has two GPUs). Skipped without CUDA (`pytest -m gpu tests/gpu`)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _batch():
    from areal_like.core.config import LossConfig
    from tests.train.conftest import make_trajectories
    from train_cluster.batch import build_batch

    return build_batch(make_trajectories(), LossConfig())


def _cfg(**backend):
    from areal_like.core.config import TorchBackendConfig, TrainConfig

    return TrainConfig(lr=1e-3, backend=TorchBackendConfig(device="cuda", **backend))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_engine_step_on_cuda(tiny_model_dir, dtype: str) -> None:
    from train_cluster.torch_engine import TorchTrainEngine

    engine = TorchTrainEngine(tiny_model_dir, _cfg(), dtype=dtype)
    assert engine.device.type == "cuda"
    assert all(p.dtype == torch.float32 for p in engine._module.parameters())  # masters
    before = {n: w.clone() for n, w in engine.named_weights()}
    stats = engine.train_step(_batch())
    assert engine.version == 1 and stats["skipped"] == 0.0 and stats["grad_norm"] > 0
    after = dict(engine.named_weights())
    assert all(w.dtype == getattr(torch, dtype) for w in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in after)


@pytest.fixture(params=["local", "ray"])
def launcher(request):
    """The train workers under each launcher (`areal_like.launcher`): plain processes from
    the local launcher's zygote (each picks `cuda:rank % gpus`), and Ray actors given a GPU
    each (where Ray is installed)."""
    if request.param == "local":
        from areal_like.launcher.local import Zygote

        zygote = Zygote.start()
        yield zygote
        zygote.close()
        return
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, num_gpus=torch.cuda.device_count(), include_dashboard=False, log_to_driver=False)
    yield None  # TrainWorkerGroup connects to the Ray this process started
    ray.shutdown()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_worker_group_step_on_cuda(launcher, tiny_model_dir, strategy: str) -> None:
    from train_cluster.worker_group import TrainWorkerGroup

    world = 2 if torch.cuda.device_count() >= 2 else 1  # DDP/FSDP2 over NCCL need a GPU per rank
    group = TrainWorkerGroup(tiny_model_dir, _cfg(world_size=world, strategy=strategy), dtype="bfloat16",
                             log_level="WARNING", launcher=launcher)
    try:
        batch = _batch()
        lp = group.compute_logprobs(batch)
        assert lp.shape == (batch.num_tokens,) and torch.isfinite(lp).all()
        stats = group.train_step(batch)
        assert group.version == 1 and stats["skipped"] == 0.0 and stats["grad_norm"] > 0
        weights = dict(group.named_weights())
        assert weights and all(w.dtype == torch.bfloat16 and w.device.type == "cpu" for w in weights.values())
    finally:
        group.shutdown()
