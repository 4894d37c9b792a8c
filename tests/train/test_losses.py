"""Losses against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from train_cluster.losses import (
    aggregate,
    decoupled_ppo_loss,
    group_advantages,
    kl_k3,
    masked_normalize,
    token_logprobs,
)


def test_group_advantages_std_norm_by_hand() -> None:
    # group a: rewards 1, 0, 0, 1 -> mean .5, unbiased std sqrt(1/3); group b: 2, 4 -> mean 3, std sqrt(2)
    rewards = torch.tensor([1.0, 2.0, 0.0, 0.0, 4.0, 1.0])
    gids = ["a", "b", "a", "a", "b", "a"]
    adv = group_advantages(rewards, gids, std_norm=True, eps=0.0)
    s_a, s_b = math.sqrt(1 / 3), math.sqrt(2)
    expected = [0.5 / s_a, -1 / s_b, -0.5 / s_a, -0.5 / s_a, 1 / s_b, 0.5 / s_a]
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)


def test_group_advantages_no_std_and_leave_one_out() -> None:
    rewards = torch.tensor([3.0, 0.0, 0.0])
    assert group_advantages(rewards, ["g"] * 3, std_norm=False).tolist() == pytest.approx([2.0, -1.0, -1.0])
    # RLOO: baseline of member i is the mean of the others: 3-0, 0-1.5, 0-1.5
    loo = group_advantages(rewards, ["g"] * 3, std_norm=False, leave_one_out=True)
    assert loo.tolist() == pytest.approx([3.0, -1.5, -1.5])


def test_group_advantages_singletons_and_uniform_groups_are_zero() -> None:
    adv = group_advantages(torch.tensor([5.0, 1.0, 1.0]), ["solo", "u", "u"])
    assert adv.tolist() == [0.0, 0.0, 0.0]


def _ppo_reference(lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, eps: float) -> torch.Tensor:
    r = torch.exp(lp - old)
    return -torch.minimum(r * adv, torch.clamp(r, 1 - eps, 1 + eps) * adv)


def test_decoupled_equals_plain_ppo_when_prox_is_behaviour() -> None:
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(50, generator=g) * 3
    old = lp + 0.5 * torch.randn(50, generator=g)  # ratios well outside the clip range too
    adv = torch.randn(50, generator=g)
    mask = torch.ones(50)
    terms = decoupled_ppo_loss(lp, old, old.clone(), adv, mask, eps_clip=0.2)
    assert torch.equal(terms.behav_weight, torch.ones(50))
    assert torch.allclose(terms.loss, _ppo_reference(lp, old, adv, 0.2))
    assert 0 < terms.clipped.sum() < 50


def test_gradient_matches_hand_derivation() -> None:
    # One token, unclipped branch: L = -w * exp(lp - prox) * A, dL/dlp = -w * r * A.
    lp = torch.tensor([-1.0], requires_grad=True)
    prox, behav, adv = torch.tensor([-1.1]), torch.tensor([-1.5]), torch.tensor([2.0])
    terms = decoupled_ppo_loss(lp, prox, behav, adv, torch.ones(1), eps_clip=0.2, behav_weight_cap=5.0)
    terms.loss.sum().backward()
    w, r = math.exp(-1.1 + 1.5), math.exp(-1.0 + 1.1)
    assert terms.loss.item() == pytest.approx(-w * r * 2.0, rel=1e-6)
    assert lp.grad.item() == pytest.approx(-w * r * 2.0, rel=1e-6)
    # Clipped branch (r = e^0.5 > 1.2 with A > 0): constant objective, zero gradient.
    lp2 = torch.tensor([-0.6], requires_grad=True)
    t2 = decoupled_ppo_loss(lp2, prox, behav, adv, torch.ones(1), eps_clip=0.2)
    t2.loss.sum().backward()
    assert lp2.grad.item() == 0.0 and t2.clipped.item() == 1.0
    assert t2.loss.item() == pytest.approx(-w * 1.2 * 2.0, rel=1e-6)


def test_eps_clip_high_widens_only_the_upper_side() -> None:
    lp, old, adv = torch.tensor([0.3]), torch.zeros(1), torch.ones(1)  # r = e^.3 = 1.35
    t = decoupled_ppo_loss(lp, old, old, adv, torch.ones(1), eps_clip=0.2, eps_clip_high=0.5)
    assert t.clipped.item() == 0.0 and t.loss.item() == pytest.approx(-math.exp(0.3))


def test_behaviour_weight_cap_and_mask_counts() -> None:
    prox = torch.zeros(4)
    behav = torch.tensor([0.0, -1.0, -2.0, -3.0])  # w = 1, e, e^2 (7.39), e^3 (20.1)
    lp = torch.zeros(4)
    adv = torch.ones(4)
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])  # the last token is not generated: never counted
    capped = decoupled_ppo_loss(lp, prox, behav, adv, mask, behav_weight_cap=5.0, behav_weight_mode="cap")
    assert capped.capped.tolist() == [0, 0, 1, 0] and capped.masked.sum() == 0
    assert capped.behav_weight[:3].tolist() == pytest.approx([1.0, math.e, 5.0])
    assert capped.loss[:3].tolist() == pytest.approx([-1.0, -math.e, -5.0])
    masked = decoupled_ppo_loss(lp, prox, behav, adv, mask, behav_weight_cap=5.0, behav_weight_mode="mask")
    assert masked.masked.tolist() == [0, 0, 1, 0] and masked.capped.sum() == 0
    assert masked.mask.tolist() == [1, 1, 0, 0]
    assert masked.loss.tolist() == pytest.approx([-1.0, -math.e, 0.0, 0.0])


def test_naive_ablation_uses_behaviour_as_old_and_no_weight() -> None:
    lp, prox, behav, adv = torch.tensor([-1.0]), torch.tensor([-0.5]), torch.tensor([-1.05]), torch.ones(1)
    t = decoupled_ppo_loss(lp, prox, behav, adv, torch.ones(1), naive_ppo_ablation=True)
    assert t.behav_weight.item() == 1.0
    assert t.loss.item() == pytest.approx(-math.exp(0.05), rel=1e-6)


def test_aggregate_token_and_seq_mean() -> None:
    per_tok = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0])
    seq = torch.tensor([0, 0, 0, 1, 1])
    counts = torch.tensor([2.0, 2.0])
    assert aggregate(per_tok, mask, seq, agg="token_mean", seq_token_counts=counts, denominator=4).item() == 3.0
    # seq means: (1+2)/2 = 1.5 and (4+5)/2 = 4.5, averaged over 2 sequences
    assert aggregate(per_tok, mask, seq, agg="seq_mean", seq_token_counts=counts, denominator=2).item() == 3.0


def test_token_logprobs_uses_temperature_and_kl_is_zero_at_reference() -> None:
    logits = torch.tensor([[2.0, 0.0, -1.0]])
    lp = token_logprobs(logits, torch.tensor([1]), torch.tensor([2.0]))
    expected = torch.log_softmax(logits / 2.0, -1)[0, 1]
    assert lp.item() == pytest.approx(expected.item())
    assert kl_k3(lp, lp).item() == 0.0
    assert kl_k3(lp, lp - 0.3).item() > 0


def test_dual_clip_bounds_negative_advantages_only() -> None:
    # r = e^1.5 = 4.48 on every token. A = -1: PPO objective min(rA, 1.2A) = -4.48; the dual
    # clip at c = 3 raises it to c·A = -3 (constant: zero gradient). A = +1: the upper clip
    # gives 1.2 and the dual clip never applies. A = -1 with r = e^0.5 = 1.65 < 3: untouched.
    lp = torch.tensor([1.5, 1.5, 0.5], requires_grad=True)
    old = torch.zeros(3)
    adv = torch.tensor([-1.0, 1.0, -1.0])
    t = decoupled_ppo_loss(lp, old, old, adv, torch.ones(3), eps_clip=0.2, dual_clip_c=3.0)
    assert t.loss.tolist() == pytest.approx([3.0, -1.2, math.exp(0.5)], rel=1e-6)
    assert t.dual_clipped.tolist() == [1.0, 0.0, 0.0]
    assert t.clipped.tolist() == [0.0, 1.0, 0.0]
    t.loss.sum().backward()
    assert lp.grad.tolist() == pytest.approx([0.0, 0.0, math.exp(0.5)], rel=1e-6)
    # Off (the default): the first token keeps its unbounded PPO loss r·|A|.
    off = decoupled_ppo_loss(lp.detach(), old, old, adv, torch.ones(3), eps_clip=0.2)
    assert off.loss[0].item() == pytest.approx(math.exp(1.5)) and off.dual_clipped.sum() == 0
    # The behaviour weight multiplies the dual-clipped objective too: w = e^-0.5 on token 0.
    w = decoupled_ppo_loss(lp.detach(), old, torch.tensor([0.5, 0.0, 0.0]), adv, torch.ones(3), dual_clip_c=3.0)
    assert w.loss[0].item() == pytest.approx(3.0 * math.exp(-0.5), rel=1e-6)
    with pytest.raises(ValueError):
        decoupled_ppo_loss(lp, old, old, adv, torch.ones(3), dual_clip_c=1.0)


def test_behaviour_weight_lower_bound_cap_and_mask() -> None:
    prox = torch.zeros(4)
    behav = torch.tensor([0.0, 1.0, 3.0, -3.0])  # w = 1, e^-1 (0.368), e^-3 (0.050), e^3 (20.1)
    lp, adv, mask = torch.zeros(4), torch.ones(4), torch.ones(4)
    capped = decoupled_ppo_loss(lp, prox, behav, adv, mask, behav_weight_cap=5.0, behav_weight_mode="cap",
                                behav_weight_lower=0.2)
    assert capped.behav_weight.tolist() == pytest.approx([1.0, math.exp(-1), 0.2, 5.0], rel=1e-6)
    assert capped.capped.tolist() == [0.0, 0.0, 1.0, 1.0]
    assert capped.loss.tolist() == pytest.approx([-1.0, -math.exp(-1), -0.2, -5.0], rel=1e-6)
    masked = decoupled_ppo_loss(lp, prox, behav, adv, mask, behav_weight_cap=5.0, behav_weight_mode="mask",
                                behav_weight_lower=0.2)
    assert masked.masked.tolist() == [0.0, 0.0, 1.0, 1.0] and masked.mask.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert masked.loss.tolist() == pytest.approx([-1.0, -math.exp(-1), 0.0, 0.0], rel=1e-6)
    # Without a lower bound a small weight is kept as it is (the default).
    plain = decoupled_ppo_loss(lp, prox, behav, adv, mask, behav_weight_cap=5.0)
    assert plain.behav_weight[2].item() == pytest.approx(math.exp(-3), rel=1e-6) and plain.capped[2] == 0
    with pytest.raises(ValueError):
        decoupled_ppo_loss(lp, prox, behav, adv, mask, behav_weight_lower=1.0)


def test_masked_normalize_by_hand() -> None:
    # Loss tokens carry 2, 2, -1, 1 (a 2-token sequence at A=2, two 1-token ones); the rest is prompt.
    # mean = 4/4 = 1, population var = (1+1+4+0)/4 = 1.5 -> (x - 1)/sqrt(1.5); masked positions 0.
    x = torch.tensor([9.0, 2.0, 2.0, 9.0, -1.0, 1.0])
    mask = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    s = math.sqrt(1.5)
    out = masked_normalize(x, mask, eps=0.0)
    assert out.tolist() == pytest.approx([0.0, 1 / s, 1 / s, 0.0, -2 / s, 0.0], rel=1e-6)
    # eps keeps a uniform batch finite: all advantages become 0.
    assert masked_normalize(torch.ones(3), torch.ones(3)).tolist() == [0.0, 0.0, 0.0]


def test_neg_behav_clip_stops_pushing_down_what_the_policy_already_left() -> None:
    # π_θ = π_prox on every token (the step's first mini-batch), so the proximal clip never binds.
    # Token 0: A < 0 and π_θ/π_behav = e^-0.5 = 0.61 < 1 - 0.2: the policy already left this bad token
    # since it was sampled -> no gradient. Token 1: A < 0, π_θ/π_behav = e^-0.1 = 0.90: still pushed.
    # Token 2: A > 0 with the same 0.61: untouched (the clip is for negative advantages only).
    lp = torch.zeros(3, requires_grad=True)
    prox = torch.zeros(3)
    behav = torch.tensor([0.5, 0.1, 0.5])
    adv = torch.tensor([-1.0, -1.0, 1.0])
    off = decoupled_ppo_loss(lp, prox, behav, adv, torch.ones(3), eps_clip=0.2)
    t = decoupled_ppo_loss(lp, prox, behav, adv, torch.ones(3), eps_clip=0.2, neg_behav_clip=0.2)
    assert t.loss.tolist() == pytest.approx(off.loss.tolist())  # the value is kept, only the gradient stops
    assert t.behav_clipped.tolist() == [1.0, 0.0, 0.0] and off.behav_clipped.sum() == 0
    t.loss.sum().backward()
    w = [math.exp(-0.5), math.exp(-0.1), math.exp(-0.5)]
    assert lp.grad.tolist() == pytest.approx([0.0, w[1], -w[2]], rel=1e-6)
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="neg_behav_clip"):
            decoupled_ppo_loss(lp, prox, behav, adv, torch.ones(3), neg_behav_clip=bad)
