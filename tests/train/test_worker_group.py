"""Ray train worker group: 2-worker DDP (and FSDP2) over gloo take the same steps as 1 worker."""

from __future__ import annotations

import pytest
import torch

from areal_like.core.config import LoraConfig, LossConfig, TorchBackendConfig, TrainConfig
from train_cluster.batch import build_batch
from train_cluster.torch_engine import TorchTrainEngine
from train_cluster.worker_group import TrainWorkerGroup


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _run_pair(tiny_model_dir, trajs, strategy: str, agg: str, tmp_path, lora: LoraConfig | None = None) -> None:
    # grad_norm equality pins the gradient itself (Adam would hide a uniform scale error).
    cfg = TrainConfig(token_budget=48, lr=1e-2, loss=LossConfig(agg=agg))
    batches = [build_batch(trajs(n_groups=2, group_size=4, seed=s), cfg.loss) for s in range(2)]
    single = TorchTrainEngine(tiny_model_dir, cfg, lora=lora)
    ref_stats = [single.train_step(b) for b in batches]
    ref = dict(single.named_weights())

    cfg2 = cfg.model_copy(update={"backend": TorchBackendConfig(world_size=2, strategy=strategy)})
    group = TrainWorkerGroup(tiny_model_dir, cfg2, log_level="WARNING", lora=lora)
    try:
        assert torch.allclose(group.compute_logprobs(batches[0]), TorchTrainEngine(
            tiny_model_dir, cfg, lora=lora).compute_logprobs(batches[0]), atol=1e-5)
        stats = [group.train_step(b) for b in batches]
        assert group.version == 2
        for s, r in zip(stats, ref_stats, strict=True):
            assert s["loss"] == pytest.approx(r["loss"], rel=1e-4, abs=1e-6)
            assert s["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4)
            assert s["num_loss_tokens"] == r["num_loss_tokens"]
        got = dict(group.named_weights())
        assert set(got) == set(ref)
        for n in ref:
            # Adam divides by sqrt(v): float-noise-sized gradients move by up to lr; allow 5% of lr.
            assert torch.allclose(got[n], ref[n], atol=0.05 * cfg.lr), n
        group.save(tmp_path / "ckpt", extra={"pos": 3})
        assert group.load(tmp_path / "ckpt") == {"pos": 3} and group.version == 2
    finally:
        group.shutdown()


def test_ddp_two_workers_match_one(ray_local, tiny_model_dir, trajs, tmp_path) -> None:
    _run_pair(tiny_model_dir, trajs, "ddp", "seq_mean", tmp_path)


@pytest.mark.slow
def test_fsdp_two_workers_match_one(ray_local, tiny_model_dir, trajs, tmp_path) -> None:
    _run_pair(tiny_model_dir, trajs, "fsdp", "token_mean", tmp_path)


def test_ddp_lora_two_workers_match_one(ray_local, tiny_model_dir, trajs, tmp_path) -> None:
    """LoRA under DDP: the adapters' gradients are averaged like any (the frozen base has none)."""
    _run_pair(tiny_model_dir, trajs, "ddp", "seq_mean", tmp_path, LoraConfig(rank=4, alpha=8))


@pytest.mark.slow
def test_fsdp_lora_two_workers_match_one(ray_local, tiny_model_dir, trajs, tmp_path) -> None:
    """LoRA under FSDP2: frozen base and trainable adapters sharded in one unit per layer."""
    _run_pair(tiny_model_dir, trajs, "fsdp", "token_mean", tmp_path, LoraConfig(rank=4, alpha=8))


def test_the_caller_polls_while_the_workers_train(tiny_model_dir, trajs) -> None:
    """The trainer takes in data during a step through `poll` (docs/design.md §10.16): it is
    called, on the caller's thread, while a real worker process computes, and the step is
    the same step."""
    import threading

    from areal_like.launcher.local import Zygote

    cfg = TrainConfig(token_budget=48, lr=1e-2)
    trajectories = trajs(n_groups=4, group_size=8, seed=0)
    ref = TorchTrainEngine(tiny_model_dir, cfg).train_step(build_batch(trajectories, cfg.loss))
    zygote = Zygote.start()
    try:
        group = TrainWorkerGroup(tiny_model_dir, cfg, log_level="WARNING", launcher=zygote)
        try:
            polls: list[int] = []
            stats = group.train_on(trajectories, poll=lambda: polls.append(threading.get_ident()))
            assert polls and set(polls) == {threading.get_ident()}
            assert group.version == 1
            assert stats["loss"] == pytest.approx(ref["loss"], rel=1e-4, abs=1e-6)
        finally:
            group.shutdown()
    finally:
        zygote.close()
