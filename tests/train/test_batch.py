"""Batch building, packing, sharding; packed logprobs equal unpacked ones."""

from __future__ import annotations

import pytest
import torch

from areal_like.core.config import LossConfig, TrainConfig
from train_cluster.batch import (
    balanced_partition,
    build_batch,
    pack_sequences,
    shard_batch,
    split_mini_batches,
)


def test_build_batch_alignment(trajs) -> None:
    ts = trajs(n_groups=2, group_size=3)
    b = build_batch(ts, LossConfig())
    assert b.num_seqs == 6 and b.seq_lens.tolist() == [len(t.prompt_ids) + len(t.response_ids) for t in ts]
    offs = b.offsets().tolist()
    for i, t in enumerate(ts):
        seg = slice(offs[i], offs[i + 1])
        assert b.input_ids[seg].tolist() == t.prompt_ids + t.response_ids
        assert b.loss_mask[seg].tolist() == [0] * len(t.prompt_ids) + t.response_mask
        assert b.behav_logprobs[seg].tolist() == pytest.approx([0.0] * len(t.prompt_ids) + t.response_logprobs)
        assert b.position_ids()[seg].tolist() == list(range(offs[i + 1] - offs[i]))
        assert len(set(b.advantages[seg].tolist())) == 1
    # advantages are per group: zero mean within each group
    adv = torch.tensor([b.advantages[o].item() for o in offs[:-1]])
    assert adv[:3].sum().item() == pytest.approx(0.0, abs=1e-5)
    assert adv[3:].sum().item() == pytest.approx(0.0, abs=1e-5)


def test_adv_batch_norm_normalises_over_the_loss_tokens(trajs) -> None:
    ts = trajs(n_groups=2, group_size=3)
    plain, normed = build_batch(ts, LossConfig()), build_batch(ts, LossConfig(adv_batch_norm=True))
    m = plain.loss_mask > 0
    a = plain.advantages[m].double()
    expected = (a - a.mean()) / (a.std(unbiased=False) + 1e-5)  # AReaL's adv_norm, batch level
    assert normed.advantages[m].double().tolist() == pytest.approx(expected.tolist(), rel=1e-5, abs=1e-6)
    assert normed.advantages[m].mean().item() == pytest.approx(0.0, abs=1e-5)
    assert not torch.allclose(normed.advantages[m], plain.advantages[m])


def test_packing_keeps_every_sequence_once_within_budget() -> None:
    lengths = [5, 17, 3, 9, 30, 1, 12, 12, 8]
    bins = pack_sequences(lengths, token_budget=20)
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(len(lengths)))
    for b in bins:
        assert sum(lengths[i] for i in b) <= 20 or len(b) == 1  # the 30-token one stands alone
    assert len(bins) <= 6


def test_balanced_partition_and_shards(trajs) -> None:
    parts = balanced_partition([10, 9, 8, 7, 6, 5], 3)
    assert sorted(i for p in parts for i in p) == list(range(6))
    assert [sum([10, 9, 8, 7, 6, 5][i] for i in p) for p in parts] == [15, 15, 15]
    b = build_batch(trajs(n_groups=2, group_size=4), LossConfig())
    shards = shard_batch(b, 2)
    assert sum(s.num_tokens for s in shards) == b.num_tokens
    assert sorted(tok for s in shards for tok in s.input_ids.tolist()) == sorted(b.input_ids.tolist())
    assert abs(shards[0].num_tokens - shards[1].num_tokens) <= max(b.seq_lens.tolist())
    minis = split_mini_batches(b, 3)
    assert sum(m.num_seqs for m in minis) == b.num_seqs
    with pytest.raises(ValueError, match="cannot feed"):
        shard_batch(b, 9)


def test_mini_batches_by_groups_keep_each_group_whole(trajs) -> None:
    """`mini_batch_split: groups` deals whole groups (token-balanced) to the mini-batches,
    every sample once; with fewer groups than mini-batches it deals samples, as `tokens`."""
    b = build_batch(trajs(n_groups=8, group_size=4, seed=2), LossConfig())
    minis = split_mini_batches(b, 4, "groups")
    assert len(minis) == 4
    assert sorted(e for m in minis for e in m.input_ids.tolist()) == sorted(b.input_ids.tolist())
    seen = [set(m.group_ids) for m in minis]
    assert all(len(s) == 2 for s in seen) and not set.intersection(*seen)
    assert all(m.group_ids.count(g) == 4 for m in minis for g in set(m.group_ids))
    spread = split_mini_batches(b, 4)  # tokens: a group's samples land in several mini-batches
    assert any(len(set(m.group_ids)) > 2 for m in spread)
    few = build_batch(trajs(n_groups=2, group_size=4), LossConfig())
    assert [m.num_seqs for m in split_mini_batches(few, 4, "groups")] == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="by must be"):
        split_mini_batches(b, 2, "prompts")


def test_packed_logprobs_equal_unpacked(tiny_model_dir, trajs) -> None:
    from train_cluster.torch_engine import TorchTrainEngine

    b = build_batch(trajs(n_groups=2, group_size=4, temperature=0.7, prompt_len=(9, 12)), LossConfig())
    packer = TorchTrainEngine(tiny_model_dir, TrainConfig(token_budget=10_000))
    assert len(packer._plan(b)) == 1
    packed = packer.compute_logprobs(b)
    single = TorchTrainEngine(tiny_model_dir, TrainConfig(token_budget=16))  # one sequence per micro-batch
    assert len(single._plan(b)) == b.num_seqs
    unpacked = single.compute_logprobs(b)
    assert torch.allclose(packed, unpacked, atol=1e-5)
    # And both equal a plain HF forward of each sequence alone, at T = 0.7.
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    offs = b.offsets().tolist()
    for i in range(b.num_seqs):
        ids = b.input_ids[offs[i]:offs[i + 1]]
        with torch.no_grad():
            logits = hf(ids[None]).logits[0] / 0.7
        ref = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
        assert torch.allclose(packed[offs[i] + 1:offs[i + 1]], ref, atol=1e-5)
        assert packed[offs[i]].item() == 0.0
