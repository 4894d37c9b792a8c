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


def test_mask_truncated_drops_only_the_truncated_answers_from_the_loss(trajs) -> None:
    """TRL's `mask_truncated_completions`: a truncated answer's tokens leave the loss; the
    group's advantages are those of the whole group, as without the option."""
    ts = trajs(n_groups=2, group_size=3)
    ts = [t.model_copy(update={"truncated": i in (1, 4)}) for i, t in enumerate(ts)]
    plain, masked = build_batch(ts, LossConfig()), build_batch(ts, LossConfig(mask_truncated=True))
    offs = plain.offsets().tolist()
    for i, t in enumerate(ts):
        seg = slice(offs[i], offs[i + 1])
        want = [0] * (offs[i + 1] - offs[i]) if t.truncated else plain.loss_mask[seg].tolist()
        assert masked.loss_mask[seg].tolist() == want
    assert torch.equal(masked.advantages, plain.advantages)
    assert masked.num_loss_tokens == plain.num_loss_tokens - sum(sum(t.response_mask) for t in ts if t.truncated)


def test_overlong_penalty_is_dapos_linear_ramp() -> None:
    from train_cluster.batch import overlong_penalty

    # limit 16, buffer 4: nothing up to 12 tokens, then -0.25 per token to -1 at 16 (and past it)
    assert [overlong_penalty(n, 16, 4) for n in (1, 12, 13, 14, 16, 20)] == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert overlong_penalty(14, 16, 4, factor=0.5) == -0.25


def test_overlong_penalty_shapes_the_advantages_not_the_recorded_reward(trajs) -> None:
    ts = trajs(n_groups=1, group_size=2, response_len=(3, 3))
    long_one = ts[1].model_copy(update={"response_ids": ts[1].response_ids * 4, "response_mask": [1] * 12,
                                        "response_logprobs": [-1.0] * 12, "response_versions": [0] * 12})
    same = [ts[0].model_copy(update={"reward": 1.0}), long_one.model_copy(update={"reward": 1.0})]
    loss = LossConfig(overlong_buffer=4, overlong_max_len=12)
    b = build_batch(same, loss)
    offs = b.offsets().tolist()
    first, second = b.advantages[offs[0]].item(), b.advantages[offs[1]].item()
    assert first > 0 > second  # both right, the one that ran to the limit is the worse of the two
    assert b.rewards.tolist() == [1.0, 1.0]
    assert torch.equal(build_batch(same, LossConfig()).advantages, torch.zeros_like(b.advantages))


def test_overlong_buffer_takes_its_limit_from_the_response_length_when_the_workers_get_it() -> None:
    from areal_like.core.config import ExperimentConfig

    cfg = ExperimentConfig.model_validate({"rollout": {"response_length": 16}, "train": {"loss": {"overlong_buffer": 4}}})
    assert cfg.train.loss.overlong_max_len is None  # never written back: a later override counts
    assert cfg.train_for_workers().loss.overlong_max_len == 16
    again = ExperimentConfig.model_validate({**cfg.model_dump(), "rollout": {"response_length": 64}})
    assert again.train_for_workers().loss.overlong_max_len == 64
    with pytest.raises(ValueError, match="overlong_buffer=16 must be less than the limit it counts to"):
        ExperimentConfig.model_validate({"rollout": {"response_length": 16},
                                         "train": {"loss": {"overlong_buffer": 16}}})
    with pytest.raises(ValueError, match="at most rollout.response_length=16"):
        ExperimentConfig.model_validate({"rollout": {"response_length": 16},
                                         "train": {"loss": {"overlong_buffer": 4, "overlong_max_len": 32}}})


def test_the_chat_form_holds_out_fewer_than_its_problems() -> None:
    from areal_like.core.config import CHAT_FORM_PROBLEMS, ExperimentConfig
    from areal_like.tasks.arithmetic import CHAT_PROBLEMS

    assert CHAT_FORM_PROBLEMS == len(CHAT_PROBLEMS)
    with pytest.raises(ValueError, match="the chat form has 162 problems"):
        ExperimentConfig.model_validate({"dataset": {"form": "chat"}})  # num_eval 256 by default
    ExperimentConfig.model_validate({"dataset": {"form": "chat", "num_eval": 64}})
