"""Torch engine: versions, non-finite skips, checkpoints, schedules, start-up errors."""

from __future__ import annotations

import logging

import pytest
import torch

from areal_like.core.config import LossConfig, MegatronBackendConfig, TorchBackendConfig, TrainConfig
from train_cluster.batch import build_batch
from train_cluster.engine import STAT_KEYS, lr_factor
from train_cluster.torch_engine import TorchTrainEngine


def _weights(engine: TorchTrainEngine) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in engine.named_weights()}


def test_neg_behav_clip_is_counted_on_negative_advantage_tokens_only(tiny_model_dir, trajs) -> None:
    """`train.loss.neg_behav_clip` reaches the loss and its share is reported: some tokens with
    A < 0 that the policy had already left since sampling, and never more than those with A < 0."""
    cfg = TrainConfig(token_budget=64, mini_batches=2, loss=LossConfig(neg_behav_clip=0.01))
    engine = TorchTrainEngine(tiny_model_dir, cfg)
    batch = build_batch(trajs(), cfg.loss)
    stats = engine.train_step(batch)
    m = batch.loss_mask > 0
    negative = (batch.advantages[m] < 0).float().mean().item()
    assert 0.0 < stats["neg_behav_clip_frac"] <= negative
    off = TrainConfig(token_budget=64, mini_batches=2, loss=LossConfig(neg_behav_clip=None))
    assert TorchTrainEngine(tiny_model_dir, off).train_step(build_batch(trajs(), off.loss))["neg_behav_clip_frac"] == 0


def test_train_step_advances_version_and_reports_stats(tiny_model_dir, trajs) -> None:
    engine = TorchTrainEngine(tiny_model_dir, TrainConfig(token_budget=64, mini_batches=2))
    batch = build_batch(trajs(), LossConfig())
    before = _weights(engine)
    stats = engine.train_step(batch)
    assert set(stats) == set(STAT_KEYS)
    assert engine.version == 1 and stats["version"] == 1.0 and stats["mini_batches_applied"] == 2
    assert stats["num_loss_tokens"] == batch.num_loss_tokens
    assert stats["behav_prox_gap"] > 0 and stats["entropy"] > 0 and stats["tokens_per_s"] > 0
    # What the objective did (#34): θ moved away from π_prox after the first mini-batch, the
    # advantage scale is that of the batch, and nothing was capped or dual-clipped here.
    m = batch.loss_mask > 0
    assert stats["adv_abs_mean"] == pytest.approx(batch.advantages[m].abs().mean().item(), rel=1e-5)
    assert stats["adv_zero_frac"] == pytest.approx((batch.advantages[m] == 0).float().mean().item())
    assert stats["theta_prox_gap"] > 0 and stats["theta_behav_gap"] > 0
    assert stats["behav_cut_frac"] == stats["behav_capped"] / stats["num_loss_tokens"]
    assert stats["dual_clip_frac"] == 0.0
    assert engine.optimizer.state[next(iter(engine._module.parameters()))]["step"].item() == 2
    after = _weights(engine)
    assert any(not torch.equal(before[n], after[n]) for n in before)


def test_named_weights_load_into_hf_model(tiny_model_dir, trajs) -> None:
    from transformers import AutoModelForCausalLM

    engine = TorchTrainEngine(tiny_model_dir, TrainConfig())
    engine.train_step(build_batch(trajs(), LossConfig()))
    named = dict(engine.named_weights())
    assert "lm_head.weight" not in named and "model.embed_tokens.weight" in named  # tied: yielded once
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    result = hf.load_state_dict(named, strict=False)
    assert result.unexpected_keys == [] and set(result.missing_keys) <= {"lm_head.weight"}
    assert torch.equal(hf.lm_head.weight, named["model.embed_tokens.weight"])
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, engine._module(ids).logits)


def test_nonfinite_step_is_skipped_and_counted(tiny_model_dir, trajs) -> None:
    engine = TorchTrainEngine(tiny_model_dir, TrainConfig())
    batch = build_batch(trajs(), LossConfig())
    bad = batch.with_(advantages=batch.advantages.clone().fill_(float("nan")))
    before = _weights(engine)
    stats = engine.train_step(bad)
    assert stats["skipped"] == 1.0 and stats["skipped_total"] == 1.0 and engine.skipped == 1
    assert engine.version == 0 and stats["version"] == 0.0
    after = _weights(engine)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert engine.optimizer.state == {} or all(
        s["step"].item() == 0 for s in engine.optimizer.state.values())
    assert engine.train_step(batch)["skipped"] == 0.0 and engine.version == 1


def test_checkpoint_resume_is_bitwise(tiny_model_dir, trajs, tmp_path) -> None:
    cfg = TrainConfig(lr_schedule="cosine", warmup_steps=2, total_steps=10)
    batch = build_batch(trajs(), cfg.loss)
    a = TorchTrainEngine(tiny_model_dir, cfg)
    a.train_step(batch)
    a.train_step(batch)
    a.save(tmp_path / "ckpt", extra={"data_pos": 17, "note": "x"})
    ref_stats = a.train_step(batch)
    ref = _weights(a)

    b = TorchTrainEngine(tiny_model_dir, cfg, seed=123)
    extra = b.load(tmp_path / "ckpt")
    assert extra == {"data_pos": 17, "note": "x"} and b.version == 2
    stats = b.train_step(batch)
    assert b.version == 3 and stats["lr"] == ref_stats["lr"] and stats["loss"] == ref_stats["loss"]
    got = _weights(b)
    assert all(torch.equal(ref[n], got[n]) for n in ref)
    # the folder is also a loadable HF model
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt") is not None


def test_incomplete_checkpoint_and_bad_extra_are_refused(tiny_model_dir, tmp_path) -> None:
    engine = TorchTrainEngine(tiny_model_dir, TrainConfig())
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        engine.load(tmp_path)
    with pytest.raises(TypeError, match="JSON"):
        engine.save(tmp_path / "c", extra={"x": object()})


def test_lr_schedules() -> None:
    assert [lr_factor(s, schedule="constant", warmup=2, total=10) for s in range(3)] == [0.5, 1.0, 1.0]
    assert lr_factor(6, schedule="linear", warmup=2, total=10) == pytest.approx(0.5)
    assert lr_factor(6, schedule="cosine", warmup=2, total=10) == pytest.approx(0.5)
    assert lr_factor(10, schedule="cosine", warmup=2, total=10) == pytest.approx(0.0)


def test_kl_penalty_and_naive_ablation_warning(tiny_model_dir, trajs, caplog) -> None:
    batch = build_batch(trajs(), LossConfig())
    kl_engine = TorchTrainEngine(tiny_model_dir, TrainConfig(lr=1e-2, loss=LossConfig(kl_coef=0.1)))
    assert kl_engine.train_step(batch)["kl"] == pytest.approx(0.0, abs=1e-9)  # π_θ == π_ref at step 1
    assert kl_engine.train_step(batch)["kl"] > 0
    with caplog.at_level(logging.WARNING):
        TorchTrainEngine(tiny_model_dir, TrainConfig(loss=LossConfig(naive_ppo_ablation=True)))
    assert "ABLATION" in caplog.text


def test_startup_errors(tiny_model_dir) -> None:
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA GPU"):
            TorchTrainEngine(tiny_model_dir, TrainConfig(backend=TorchBackendConfig(device="cuda")))
    with pytest.raises(RuntimeError, match="torch.distributed group"):
        TorchTrainEngine(tiny_model_dir, TrainConfig(backend=TorchBackendConfig(world_size=2)))
    with pytest.raises(ValueError, match="float16"):
        TorchTrainEngine(tiny_model_dir, TrainConfig(), dtype="float16")
    with pytest.raises(ValueError, match="backend.type=torch"):
        TorchTrainEngine(tiny_model_dir, TrainConfig(backend=MegatronBackendConfig(device="cpu")))


def test_create_engine_picks_the_backend(tiny_model_dir) -> None:
    from train_cluster import create_engine

    engine = create_engine(tiny_model_dir, TrainConfig())
    assert isinstance(engine, TorchTrainEngine) and engine.version == 0


def test_one_mini_batch_takes_prox_from_the_training_forward(tiny_model_dir, trajs, monkeypatch) -> None:
    """With one optimizer step per train step, π_prox is the pre-step policy the training
    forward runs anyway: no second forward, and the same update as with the recompute."""
    batch = build_batch(trajs(), LossConfig())
    ref = TorchTrainEngine(tiny_model_dir, TrainConfig(mini_batches=1))
    ref_batch = batch.with_(prox_logprobs=ref.compute_logprobs(batch))  # the explicit recompute
    monkeypatch.setattr(TorchTrainEngine, "compute_logprobs", lambda self, b: b.prox_logprobs)
    ref_stats = ref.train_step(ref_batch)
    monkeypatch.undo()

    engine = TorchTrainEngine(tiny_model_dir, TrainConfig(mini_batches=1))
    calls = []
    real = TorchTrainEngine.compute_logprobs
    monkeypatch.setattr(TorchTrainEngine, "compute_logprobs", lambda self, b: calls.append(1) or real(self, b))
    stats = engine.train_step(batch)
    assert calls == []  # no second forward
    assert stats["loss"] == pytest.approx(ref_stats["loss"], abs=1e-6)
    assert stats["behav_prox_gap"] == pytest.approx(ref_stats["behav_prox_gap"], abs=1e-6)
    w, w_ref = dict(engine.named_weights()), dict(ref.named_weights())
    assert all(torch.allclose(w[n], w_ref[n], atol=1e-6) for n in w)


def test_a_long_tail_is_split_from_the_short_sequences_with_the_same_logits(tiny_model_dir, trajs) -> None:
    """One long answer among short ones (the long-tailed lengths of reasoning runs): padding
    the short ones to its length would compute several times the tokens, so the micro-batch
    runs as two calls, and every token's logits are those of one packed row, in order."""
    from train_cluster.torch_engine import _cost_model, _hf_logits, _hf_packed_logits, _split_by_cost

    engine = TorchTrainEngine(tiny_model_dir, TrainConfig())
    short = trajs(n_groups=2, group_size=6, prompt_len=(10, 14), response_len=(20, 30), seed=3)
    long = trajs(n_groups=1, group_size=1, prompt_len=(20, 20), response_len=(200, 200), seed=4)
    batch = build_batch([*short[:5], *long, *short[5:]], LossConfig())  # the long one in the middle
    lens = batch.seq_lens.tolist()
    runs = _split_by_cost(lens, _cost_model(engine._model))
    long_run = next(idx for idx, _ in runs if 5 in idx)
    assert len(runs) >= 2 and len(long_run) <= 2, runs  # the short ones are not padded to the long one
    assert sorted(i for idx, _ in runs for i in idx) == list(range(len(lens)))
    with torch.no_grad():
        split = _hf_logits(engine._model, batch, engine.device)
        packed = _hf_packed_logits(engine._model, batch, engine.device)
    torch.testing.assert_close(split, packed, atol=1e-4, rtol=1e-4)


def test_the_split_keeps_even_lengths_in_one_padded_call() -> None:
    """Lengths close to each other (the quickstart's): one padded call, as before the split
    existed; a lone sequence is never padded; only long rows of many sequences pack."""
    from train_cluster.torch_engine import _split_by_cost

    cost = (1e6, 1024.0)  # the quickstart model's: ~974 score pairs cost one token
    assert _split_by_cost([40, 55, 60, 47, 52, 38, 59, 44], cost) == [([0, 1, 2, 3, 4, 5, 6, 7], True)]
    assert _split_by_cost([30, 250], cost) == [([0], True), ([1], True)] or \
        _split_by_cost([30, 250], cost) == [([0, 1], False)]
    runs = _split_by_cost([60] * 12 + [250], cost)
    assert [idx for idx, _ in runs] == [list(range(12)), [12]]


def test_padded_and_packed_forwards_give_the_same_logits(tiny_model_dir, trajs) -> None:
    """A micro-batch of several short sequences runs right-padded (causal attention, 10x less
    than one packed row's block-diagonal mask at the quickstart's shape): same numbers."""
    from train_cluster.torch_engine import _hf_logits, _hf_packed_logits

    engine = TorchTrainEngine(tiny_model_dir, TrainConfig())
    batch = build_batch(trajs(), LossConfig())
    lens = batch.seq_lens.tolist()
    assert len(lens) > 1 and len(lens) * max(lens) ** 2 < sum(lens) ** 2  # the padded path is taken
    with torch.no_grad():
        padded = _hf_logits(engine._model, batch, engine.device)
        packed = _hf_packed_logits(engine._model, batch, engine.device)
    assert padded.shape == packed.shape == (batch.num_tokens, packed.shape[-1])
    torch.testing.assert_close(padded, packed, atol=1e-4, rtol=1e-4)


def test_a_groups_shared_prompt_is_computed_once_with_the_same_logits_and_gradients(
        tiny_model_dir, trajs, monkeypatch) -> None:
    """GRPO samples of one group start with the same prompt: the forward computes it once
    (fewer tokens go through the model) and every token's logits, and a whole train step's
    weights, are what the plain layout gives."""
    from train_cluster import torch_engine
    from train_cluster.shared_prefix import Cluster, prefix_clusters

    groups = trajs(n_groups=3, group_size=4, prompt_len=(20, 30), response_len=(4, 9), seed=5,
                   shared_prompt=True)
    lone = [t.model_copy(update={"group_id": "lone"}) for t in
            trajs(n_groups=1, group_size=1, prompt_len=(12, 12), response_len=(6, 6), seed=6)]
    stray = groups[4].model_copy(update={"episode_id": "stray", "group_id": "g0",  # a member sharing nothing
                                         "prompt_ids": [3] + groups[4].prompt_ids})
    copy = groups[0].model_copy(update={"episode_id": "dup"})  # a sample identical to another
    batch = build_batch([*groups, *lone, copy, stray], LossConfig())
    clusters = prefix_clusters(batch)
    assert sorted(len(c.members) for c in clusters) == [1, 1, 4, 4, 5]
    assert all(c.prefix >= 20 for c in clusters if len(c.members) > 1)

    engine = TorchTrainEngine(tiny_model_dir, TrainConfig(mini_batches=1, token_budget=4096))
    fed: list[int] = []
    real_forward = type(engine._model).forward
    monkeypatch.setattr(type(engine._model), "forward",
                        lambda self, input_ids=None, **kw: fed.append(input_ids.numel()) or
                        real_forward(self, input_ids=input_ids, **kw))
    with torch.no_grad():
        shared = torch_engine._hf_logits(engine._model, batch, engine.device)
        assert 0 < sum(fed) < batch.num_tokens * 0.6  # the prompts went through once per group
        packed = torch_engine._hf_packed_logits(engine._model, batch, engine.device)
    torch.testing.assert_close(shared, packed, atol=1e-4, rtol=1e-4)

    ref = TorchTrainEngine(tiny_model_dir, TrainConfig(mini_batches=1, token_budget=4096))
    stats = engine.train_step(batch)
    monkeypatch.setattr(torch_engine, "prefix_clusters",
                        lambda mb: [Cluster((i,), 0) for i in range(mb.num_seqs)])
    ref_stats = ref.train_step(batch)
    assert stats["loss"] == pytest.approx(ref_stats["loss"], abs=1e-5)
    w, w_ref = dict(engine.named_weights()), dict(ref.named_weights())
    assert all(torch.allclose(w[n], w_ref[n], atol=1e-5) for n in w)


def test_only_the_losss_positions_are_projected_onto_the_vocabulary(tiny_model_dir, trajs, monkeypatch) -> None:
    """The vocabulary's projection and softmax run only where a loss token is predicted (t - 1
    for each token t of the loss mask; prompts and masked answer tokens score nothing), in
    every layout (shared prompts, packed, padded, split runs), with the logits the full
    projection gives there; and a train step lands on the weights that scoring every
    position gives."""
    from train_cluster import engine as base_engine
    from train_cluster.torch_engine import _hf_logits

    engine = TorchTrainEngine(tiny_model_dir, TrainConfig(mini_batches=1, token_budget=4096))
    seen: list[int] = []
    engine._model.lm_head.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[-2]))
    shared = trajs(n_groups=2, group_size=4, prompt_len=(20, 30), response_len=(4, 9), seed=5, shared_prompt=True)
    long = trajs(n_groups=1, group_size=1, prompt_len=(20, 20), response_len=(200, 200), seed=4)
    for name, ts in (("shared", shared), ("padded", trajs()), ("split", [*trajs(seed=3)[:5], *long])):
        batch = build_batch(ts, LossConfig())
        mask = batch.loss_mask.clone()
        mask[batch.offsets()[1:-1] - 2] = 0  # a masked answer token (a tool's output) in each sequence
        batch = batch.with_(loss_mask=mask)
        rows = base_engine._scored_rows(batch)
        want = torch.cat([torch.nonzero(batch.loss_mask[1:] > 0).squeeze(1)])
        assert torch.equal(rows, want[~torch.isin(want + 1, batch.offsets()[:-1])]), name
        assert 0 < rows.numel() < batch.num_tokens
        with torch.no_grad():
            full = _hf_logits(engine._model, batch, engine.device)
            seen.clear()
            part = _hf_logits(engine._model, batch, engine.device, rows=rows)
        torch.testing.assert_close(part, full[rows], atol=1e-5, rtol=1e-5)
        if name == "shared":  # one-row layouts project only the positions asked for
            assert sum(seen) <= rows.numel(), (seen, rows.numel())

    batch = build_batch(shared, LossConfig())
    ref = TorchTrainEngine(tiny_model_dir, TrainConfig(mini_batches=2, token_budget=4096))
    engine = TorchTrainEngine(tiny_model_dir, TrainConfig(mini_batches=2, token_budget=4096))
    stats = engine.train_step(batch)
    monkeypatch.setattr(base_engine, "_scored_rows", lambda mb: torch.arange(mb.num_tokens - 1))
    ref_stats = ref.train_step(batch)
    for k in ("loss", "entropy", "behav_prox_gap", "theta_prox_gap"):
        assert stats[k] == pytest.approx(ref_stats[k], abs=1e-5), k
    w, w_ref = dict(engine.named_weights()), dict(ref.named_weights())
    assert all(torch.allclose(w[n], w_ref[n], atol=1e-6) for n in w)


def test_a_batch_of_only_masked_answers_moves_no_weight(tiny_model_dir, trajs) -> None:
    """`train.loss.mask_truncated` with every answer cut: no loss token, zero gradients, and
    Adam's momentum from the step before must not move the weights either."""
    loss = LossConfig(mask_truncated=True)
    engine = TorchTrainEngine(tiny_model_dir, TrainConfig(token_budget=64, loss=loss))
    engine.train_step(build_batch(trajs(seed=1), loss))  # momentum from a real step
    before = _weights(engine)
    cut = [t.model_copy(update={"truncated": True}) for t in trajs(seed=2)]
    stats = engine.train_step(build_batch(cut, loss))
    assert stats["num_loss_tokens"] == 0 and engine.version == 2 and stats["skipped"] == 0.0
    assert all(torch.equal(t, before[n]) for n, t in engine.named_weights())
