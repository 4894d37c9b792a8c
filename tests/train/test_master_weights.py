"""bf16 training keeps fp32 master weights, on both backends (docs/training_backends.md).

An RMSNorm weight starts at exactly 1.0, where bf16's spacing is 2**-7: an Adam update
of ~lr = 1e-4 applied to a bf16 weight rounds straight back to 1.0, every step, forever.
With fp32 masters the updates accumulate, and after enough steps the bf16 weights that
`named_weights()` hands out move too.
"""

from __future__ import annotations

import pytest
import torch

from areal_like.core.config import LossConfig, MegatronBackendConfig, TrainConfig
from train_cluster.batch import build_batch
from train_cluster.torch_engine import TorchTrainEngine

LR, STEPS = 1e-4, 50


def test_bf16_alone_would_round_the_update_away() -> None:
    one = torch.ones((), dtype=torch.bfloat16)
    assert torch.equal(one - LR, one) and torch.equal(one + LR, one)


def _norms(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """Every RMSNorm weight (HF and Megatron names both say `norm`), as one sorted vector."""
    return torch.sort(torch.cat([w.flatten().float() for n, w in weights.items() if "norm" in n])).values


def _train_and_check(engine, batch, masters) -> None:
    before = dict(engine.named_weights())
    assert all(w.dtype == torch.bfloat16 for w in before.values())
    assert torch.equal(_norms(before), torch.ones_like(_norms(before)))  # the premise: norms start at 1.0
    for _ in range(STEPS):
        stats = engine.train_step(batch)
        assert stats["skipped"] == 0.0
    after = dict(engine.named_weights())
    assert all(w.dtype == torch.bfloat16 for w in after.values())
    m = masters()
    assert m.dtype == torch.float32
    moved = (m - 1.0).abs()
    # the fp32 masters accumulated sub-bf16-spacing updates ...
    assert moved.max() > 2 ** -8 and (moved > 0).float().mean() > 0.5, moved.max()
    # ... and the bf16 weights handed out follow them (round to nearest of the master)
    assert torch.equal(_norms(after), torch.sort(m.to(torch.bfloat16).float()).values)
    assert (_norms(after) != 1.0).any()


def test_torch_engine_bf16_steps_fp32_masters(tiny_model_dir, trajs) -> None:
    cfg = TrainConfig(lr=LR, loss=LossConfig())
    engine = TorchTrainEngine(tiny_model_dir, cfg, dtype="bfloat16")
    batch = build_batch(trajs(), cfg.loss)

    def masters() -> torch.Tensor:
        return _norms({n: p.detach() for n, p in engine._module.named_parameters()})

    _train_and_check(engine, batch, masters)


def test_megatron_engine_bf16_steps_fp32_masters(tiny_model_dir, trajs, tmp_path) -> None:
    pytest.importorskip("megatron.core")
    from train_cluster.megatron import MegatronTrainEngine

    cfg = TrainConfig(lr=LR, backend=MegatronBackendConfig(device="cpu"))
    engine = MegatronTrainEngine(tiny_model_dir, cfg, dtype="bfloat16")
    batch = build_batch(trajs(), cfg.loss)
    assert all(p.dtype == torch.bfloat16 for p in engine._module.parameters())  # bf16 forward/backward
    names = [n for n, _ in engine._module.named_parameters()]

    def masters() -> torch.Tensor:
        # the masters are in the module's parameter order
        return torch.cat([m.flatten() for n, m in zip(names, engine._master, strict=True) if "norm" in n])

    _train_and_check(engine, batch, masters)
    # a checkpoint keeps the masters (the bf16 weights alone would lose what was accumulated)
    engine.save(tmp_path / "ckpt")
    again = MegatronTrainEngine(tiny_model_dir, cfg, dtype="bfloat16")
    again.load(tmp_path / "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(again._master, engine._master, strict=True))
    assert again.version == STEPS
