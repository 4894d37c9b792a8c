"""Megatron-core backend on CPU: conversion round trip, logits vs HF, TP2 == TP1, one train step."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("megatron.core")

from areal_like.core.config import LossConfig, MegatronBackendConfig, TrainConfig  # noqa: E402
from train_cluster.batch import build_batch  # noqa: E402
from train_cluster.megatron import hf_to_megatron, megatron_to_hf  # noqa: E402
from train_cluster.torch_engine import TorchTrainEngine, free_port, init_train_group  # noqa: E402


def _mcfg(tp: int = 1) -> TrainConfig:
    return TrainConfig(lr=1e-2, backend=MegatronBackendConfig(device="cpu", tensor_parallel_size=tp))


@pytest.mark.parametrize("tp", [1, 2])
def test_hf_megatron_round_trip_is_bitwise(tiny_model_dir, tp: int) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    sd = hf.state_dict()
    shards = [hf_to_megatron(sd, hf.config, tp, r) for r in range(tp)]
    if tp == 2:  # vocab is padded to a multiple of tp and split; q/k/v fused per query group
        assert shards[0]["embedding.word_embeddings.weight"].shape[0] * 2 >= hf.config.vocab_size
    back = megatron_to_hf(shards, hf.config)
    assert set(back) == set(sd) - {"lm_head.weight"}
    assert all(torch.equal(back[k], sd[k]) for k in back)


def test_megatron_matches_hf_and_trains(tiny_model_dir, trajs) -> None:
    from train_cluster.megatron import MegatronTrainEngine

    batch = build_batch(trajs(), LossConfig())
    mega = MegatronTrainEngine(tiny_model_dir, _mcfg())
    ref = TorchTrainEngine(tiny_model_dir, _mcfg().model_copy(update={"backend": TrainConfig().backend}))
    assert torch.allclose(mega.compute_logprobs(batch), ref.compute_logprobs(batch), atol=1e-5)
    s_m, s_r = mega.train_step(batch), ref.train_step(batch)
    assert mega.version == 1 and s_m["loss"] == pytest.approx(s_r["loss"], rel=1e-4)
    assert s_m["grad_norm"] == pytest.approx(s_r["grad_norm"], rel=1e-4)
    wm, wr = dict(mega.named_weights()), dict(ref.named_weights())
    assert set(wm) == set(wr)
    assert all(torch.allclose(wm[k], wr[k], atol=0.05 * 1e-2) for k in wr)
    assert any(not torch.equal(wm[k], TorchTrainEngine(tiny_model_dir, TrainConfig())._module.state_dict()[k])
               for k in wm)


def _tp_worker(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    torch.set_num_threads(1)
    from conftest import make_trajectories

    from train_cluster.megatron import MegatronTrainEngine

    init_train_group(rank, 2, f"127.0.0.1:{port}", "cpu", timeout_s=120)
    engine = MegatronTrainEngine(model_dir, _mcfg(tp=2))
    batch = build_batch(make_trajectories(), LossConfig())
    lp = engine.compute_logprobs(batch)
    stats = engine.train_step(batch)
    weights = dict(engine.named_weights())
    if rank == 0:
        torch.save({"lp": lp, "loss": stats["loss"], "grad_norm": stats["grad_norm"], "weights": weights},
                   os.path.join(out_dir, "tp2.pt"))


@pytest.mark.slow
def test_tensor_parallel_2_matches_1(tiny_model_dir, trajs, tmp_path) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_tp_worker, args=(free_port(), str(tiny_model_dir), str(tmp_path)), nprocs=2, join=True)
    got = torch.load(tmp_path / "tp2.pt", weights_only=True)
    ref = TorchTrainEngine(tiny_model_dir, _mcfg().model_copy(update={"backend": TrainConfig().backend}))
    batch = build_batch(trajs(), LossConfig())
    assert torch.allclose(got["lp"], ref.compute_logprobs(batch), atol=1e-5)
    stats = ref.train_step(batch)
    assert got["loss"] == pytest.approx(stats["loss"], rel=1e-4)
    assert got["grad_norm"] == pytest.approx(stats["grad_norm"], rel=1e-4)
    for k, w in ref.named_weights():
        assert torch.allclose(got["weights"][k], w, atol=0.05 * 1e-2), k


def test_megatron_startup_errors(tiny_model_dir) -> None:
    from train_cluster.megatron import MegatronTrainEngine

    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA GPU"):
            MegatronTrainEngine(tiny_model_dir, TrainConfig(backend=MegatronBackendConfig()))
    with pytest.raises(ValueError, match="kl_coef"):
        MegatronTrainEngine(tiny_model_dir, _mcfg().model_copy(update={"loss": LossConfig(kl_coef=0.1)}))
    with pytest.raises(RuntimeError, match="world size|needs a torch.distributed group"):
        MegatronTrainEngine(tiny_model_dir, _mcfg(tp=2))
