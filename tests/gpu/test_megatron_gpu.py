"""Megatron backend on CUDA, one GPU (TP = DP = 1): Megatron's DDP and distributed optimizer
with fp32 main params. Skipped without CUDA (`pytest -m gpu tests/gpu`)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _cfg(lr: float = 1e-3):
    from areal_like.core.config import MegatronBackendConfig, TrainConfig

    return TrainConfig(lr=lr, backend=MegatronBackendConfig(device="cuda"))


def _batch():
    from areal_like.core.config import LossConfig
    from tests.train.conftest import make_trajectories
    from train_cluster.batch import build_batch

    return build_batch(make_trajectories(), LossConfig())


def test_megatron_gpu_matches_torch_and_uses_megatron_optimizer(tiny_model_dir) -> None:
    from megatron.core.optimizer import MegatronOptimizer

    from areal_like.core.config import TorchBackendConfig
    from train_cluster.megatron import MegatronTrainEngine
    from train_cluster.torch_engine import TorchTrainEngine

    batch = _batch()
    mega = MegatronTrainEngine(tiny_model_dir, _cfg())
    assert isinstance(mega.optimizer, MegatronOptimizer)
    ref = TorchTrainEngine(tiny_model_dir, _cfg().model_copy(update={"backend": TorchBackendConfig(device="cuda")}))
    assert torch.allclose(mega.compute_logprobs(batch), ref.compute_logprobs(batch), atol=1e-3)
    s_m, s_r = mega.train_step(batch), ref.train_step(batch)
    assert mega.version == 1 and s_m["skipped"] == 0.0
    assert s_m["loss"] == pytest.approx(s_r["loss"], rel=1e-3, abs=1e-5)
    assert s_m["grad_norm"] == pytest.approx(s_r["grad_norm"], rel=1e-2)
    wm, wr = dict(mega.named_weights()), dict(ref.named_weights())
    assert set(wm) == set(wr)
    for k in wr:  # Adam moves every weight by about lr; allow 5% of it
        assert torch.allclose(wm[k].float().cpu(), wr[k].float().cpu(), atol=0.05 * 1e-3 + 1e-4), k


def test_megatron_gpu_bf16_trains_on_fp32_main_params_and_resumes(tiny_model_dir, tmp_path) -> None:
    from train_cluster.megatron import MegatronTrainEngine

    batch = _batch()
    engine = MegatronTrainEngine(tiny_model_dir, _cfg(lr=1e-4), dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in engine._module.parameters())
    main = [p for g in engine.optimizer.param_groups for p in g["params"]]
    assert main and all(p.dtype == torch.float32 for p in main)  # the optimizer steps fp32 copies
    before = {n: w.clone() for n, w in engine.named_weights()}
    for _ in range(3):
        stats = engine.train_step(batch)
        assert stats["skipped"] == 0.0 and stats["grad_norm"] > 0
    after = dict(engine.named_weights())
    assert all(w.dtype == torch.bfloat16 for w in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in after)
    lp = engine.compute_logprobs(batch)
    engine.save(tmp_path / "ckpt", extra={"pos": 1})
    again = MegatronTrainEngine(tiny_model_dir, _cfg(lr=1e-4), dtype="bfloat16")
    assert again.load(tmp_path / "ckpt") == {"pos": 1} and again.version == 3
    assert torch.allclose(again.compute_logprobs(batch), lp, atol=1e-5)

    def main_params(e) -> list[torch.Tensor]:
        return [p for g in e.optimizer.param_groups for p in g["params"]]

    def adam_state(e, p) -> dict:
        for chained in getattr(e.optimizer, "chained_optimizers", [e.optimizer]):
            if p in chained.optimizer.state:
                return chained.optimizer.state[p]
        raise KeyError("no Adam state for a main param")

    # the fp32 main params, Adam's moments and its step count came back as they were saved
    for p, q in zip(main_params(engine), main_params(again), strict=True):
        assert torch.equal(p, q)
        s, t = adam_state(engine, p), adam_state(again, q)
        assert set(s) == set(t) and {"exp_avg", "exp_avg_sq"} <= set(s)
        assert all(torch.equal(torch.as_tensor(s[k]).cpu(), torch.as_tensor(t[k]).cpu()) for k in s)
    s1, s2 = engine.train_step(batch), again.train_step(batch)
    assert s1["loss"] == pytest.approx(s2["loss"], rel=1e-3)
