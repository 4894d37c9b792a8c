"""Advantages and the decoupled PPO loss of AReaL, as small pure tensor functions.

Everything here is a function of tensors in and tensors out: no model, no
optimizer, no distributed state, so each piece can be checked against numbers
worked out by hand (tests/train/test_losses.py).

The three policies (docs/design.md §1):
- π_behav: the weights that *sampled* each token (possibly several versions old,
  possibly several versions within one trajectory after an interrupt);
- π_prox: the trainer's weights at the start of the current train step,
  recomputed by the trainer;
- π_θ: the weights being optimised.

Decoupled PPO (Fu et al., "AReaL", 2025) splits the usual PPO ratio in two. The
trust region is taken around π_prox, which is recent and the same for every token,
instead of around π_behav, which may be stale and mixed. The off-policy correction
from π_behav to π_prox is an importance weight that multiplies the clipped
objective and carries no gradient:

    r_t   = π_θ(a_t) / π_prox(a_t)
    w_t   = π_prox(a_t) / π_behav(a_t)          (no gradient)
    L_t   = -w_t · min(r_t A_t, clip(r_t, 1-ε, 1+ε_high) A_t)

w is ALWAYS applied. Large w (the sampler put little mass on a token the proximal
policy likes) is bounded: `cap` clamps w at `behav_weight_cap`, `mask` drops the
token from the loss. When π_prox == π_behav (fully on-policy data), w ≡ 1 and the
loss is exactly PPO-clip.

Two optional terms, both off by default, exist because AReaL, verl and slime have
them (docs/design.md §10.21 compares the objectives term by term):
- `dual_clip_c` (dual-clip PPO, Ye et al. 2019; verl `clip_ratio_c` = 3 by default,
  AReaL `c_clip`, slime `--eps-clip-c`): for A < 0 the per-token objective is bounded
  below by c·A, so a token whose ratio ran far above 1 cannot dominate the step;
- `behav_weight_lower`: a lower bound on w (slime `--tis-clip-low`, AReaL
  `rejection_sampling.lower`, verl's rejection-sampling lower threshold); `cap`
  raises w to it, `mask` drops the token.
One term AReaL, verl and slime do not have, on by default (`neg_behav_clip` = 0.2 in the
config; docs/design.md §10.37): for A < 0 the gradient stops once π_θ/π_behav < 1 − ε_b.
The proximal clip re-opens its window every step, so without it a bad token sampled η
versions ago is pushed down again at every step while it waits; naive PPO's clip stops at
the same bound around π_behav. At η = 0 (π_behav = π_prox) it changes nothing.
And `masked_normalize`, AReaL's `adv_norm` (batch mean and std over the loss
tokens, after the group normalisation), for `train.loss.adv_batch_norm`. The naive ablation uses π_behav as π_old and no w; it is
the baseline the decoupled objective is compared against and is never a default.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "group_advantages",
    "token_logprobs",
    "token_entropy",
    "decoupled_ppo_loss",
    "PPOTerms",
    "kl_k3",
    "aggregate",
    "masked_normalize",
]

logger = logging.getLogger(__name__)


def group_advantages(
    rewards: torch.Tensor,
    group_ids: Sequence[str],
    *,
    std_norm: bool = True,
    leave_one_out: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantages: each reward compared with the other members of its prompt's group.

    A group is the `group_size` samples of one prompt; only their relative quality
    carries signal, so the baseline is the group mean (or, with `leave_one_out`, the
    mean of the *other* members — RLOO, an unbiased baseline). With `std_norm` the
    centred rewards are divided by the group's (unbiased) std, as in GRPO; without it
    (Dr.GRPO) the scale of the reward is kept, which avoids up-weighting groups that are
    almost uniform. A group of one member, or a uniform group, gets advantage 0.

    Groups are found by id, so members need not be adjacent in `rewards`.
    """
    rewards = rewards.to(torch.float64)
    adv = torch.zeros_like(rewards)
    members: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        members.setdefault(g, []).append(i)
    for idx in members.values():
        if len(idx) < 2:
            continue
        r = rewards[idx]
        n = len(idx)
        baseline = (r.sum() - r) / (n - 1) if leave_one_out else r.mean()
        a = r - baseline
        if std_norm:
            a = a / (r.std(unbiased=True) + eps)
        adv[idx] = a
    return adv.to(torch.float32)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """log π(target | prefix) = log_softmax(logits / T)[target], per position.

    The temperature is the one the sampler used for that token's request: the
    behaviour logprobs of docs/design.md §1 are defined at T, so π_prox and π_θ must be
    too, or the importance weight compares different distributions.
    `logits` is [N, V], `targets` and `temperature` are [N].
    """
    scaled = logits.float() / temperature.unsqueeze(-1)
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Entropy of the sampling distribution softmax(logits / T) at each position ([N])."""
    logp = torch.log_softmax(logits.float() / temperature.unsqueeze(-1), dim=-1)
    return -(logp.exp() * logp).sum(-1)


@dataclass
class PPOTerms:
    """Per-token outputs of `decoupled_ppo_loss` ([N] each)."""

    loss: torch.Tensor
    """-w · min(r A, clip(r) A); zero where the token does not count."""
    mask: torch.Tensor
    """Tokens that count (response mask, minus tokens masked for a large w)."""
    clipped: torch.Tensor
    """1 where the clipped branch was taken (the gradient is zero there)."""
    behav_weight: torch.Tensor
    """w after capping (1 in the naive ablation)."""
    capped: torch.Tensor
    """1 where w exceeded the cap and was clamped (mode `cap`)."""
    masked: torch.Tensor
    """1 where w exceeded the cap and the token was dropped (mode `mask`)."""
    dual_clipped: torch.Tensor
    """1 where the dual clip (A < 0, objective below c·A) bound the objective."""
    behav_clipped: torch.Tensor
    """1 where `neg_behav_clip` stopped the gradient (A < 0, π_θ/π_behav below 1 − ε_b)."""


def decoupled_ppo_loss(
    logprobs: torch.Tensor,
    prox_logprobs: torch.Tensor,
    behav_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    behav_weight_cap: float = 5.0,
    behav_weight_mode: Literal["cap", "mask"] = "cap",
    naive_ppo_ablation: bool = False,
    dual_clip_c: float | None = None,
    behav_weight_lower: float | None = None,
    neg_behav_clip: float | None = None,
) -> PPOTerms:
    """Per-token decoupled PPO loss (see the module docstring for the formula).

    `logprobs` carries the gradient (π_θ); `prox_logprobs` and `behav_logprobs` are
    constants. `mask` is 1 on generated tokens. Aggregation over tokens is left to
    `aggregate`, so the same terms serve token-mean and sequence-mean losses and
    sums across micro-batches and data-parallel ranks.

    `naive_ppo_ablation=True` is the ablation of docs/design.md §9.16: π_old = π_behav,
    no importance weight. Callers log it loudly; it is never a default.

    `dual_clip_c` (> 1): for A < 0 the objective is max(min(r A, clip(r) A), c A);
    the gradient is zero where the bound binds (`dual_clipped`). `behav_weight_lower`
    (< 1): w below it is raised to it (`cap`) or its token dropped (`mask`); such
    tokens are counted in `capped` / `masked` like those above the cap.

    `neg_behav_clip` (ε_b in (0, 1)): for A < 0, no gradient once π_θ/π_behav < 1 − ε_b,
    i.e. once the policy has already moved that far away from a bad token since it was
    sampled (`behav_clipped`). The proximal clip alone re-opens its ε-window every step, so
    a stale negative token is pushed down again at each version it waits; naive PPO's clip
    stops at 1 − ε around π_behav. The objective keeps its value (the loss is unchanged),
    only its gradient stops; A > 0 tokens are untouched.
    """
    if neg_behav_clip is not None and not 0.0 < neg_behav_clip < 1.0:
        raise ValueError(f"neg_behav_clip must be in (0, 1), got {neg_behav_clip}")
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    if behav_weight_lower is not None and not 0.0 <= behav_weight_lower < 1.0:
        raise ValueError(f"behav_weight_lower must be in [0, 1), got {behav_weight_lower}")
    mask = mask.to(logprobs.dtype)
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    old = behav_logprobs if naive_ppo_ablation else prox_logprobs
    # Masked positions may hold arbitrary logprobs (e.g. prompt tokens); zero the log-ratio
    # there so exp() cannot overflow into NaN gradients through `where`.
    log_ratio = torch.where(mask > 0, logprobs - old.detach(), torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped_obj = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_high) * advantages
    objective = torch.minimum(unclipped, clipped_obj)
    clipped = ((clipped_obj < unclipped) & (mask > 0)).to(logprobs.dtype)
    if dual_clip_c is not None:
        floor = dual_clip_c * advantages
        binds = (advantages < 0) & (floor > objective)
        objective = torch.where(binds, floor, objective)
        dual_clipped = (binds & (mask > 0)).to(logprobs.dtype)
    else:
        dual_clipped = torch.zeros_like(mask)

    if neg_behav_clip is not None:
        log_to_behav = torch.where(mask > 0, logprobs.detach() - behav_logprobs.detach(), torch.zeros_like(logprobs))
        stop = (advantages < 0) & (log_to_behav < math.log1p(-neg_behav_clip)) & (mask > 0)
        objective = torch.where(stop, objective.detach(), objective)
        behav_clipped = stop.to(logprobs.dtype)
    else:
        behav_clipped = torch.zeros_like(mask)

    zeros = torch.zeros_like(mask)
    if naive_ppo_ablation:
        w = torch.ones_like(mask)
        capped, masked = zeros, zeros
    else:
        log_w = torch.where(mask > 0, (prox_logprobs - behav_logprobs).detach(), torch.zeros_like(mask))
        w = torch.exp(log_w)
        out_of_range = w > behav_weight_cap
        if behav_weight_lower is not None:
            out_of_range = out_of_range | (w < behav_weight_lower)
        over = out_of_range & (mask > 0)
        if behav_weight_mode == "cap":
            capped, masked = over.to(mask.dtype), zeros
            w = torch.clamp(w, min=behav_weight_lower, max=behav_weight_cap)
        else:
            capped, masked = zeros, over.to(mask.dtype)
            mask = mask * (1.0 - masked)
            w = torch.where(over, torch.zeros_like(w), w)
    loss = -(w * objective) * mask
    return PPOTerms(loss=loss, mask=mask, clipped=clipped, behav_weight=w, capped=capped, masked=masked,
                    dual_clipped=dual_clipped, behav_clipped=behav_clipped)


def masked_normalize(x: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-5) -> torch.Tensor:
    """(x − mean) / (std + eps) over the positions where `mask` is 1; 0 elsewhere.

    The population std (÷ n), as AReaL's `masked_normalization` (unbiased=False,
    eps 1e-5). Over the loss tokens of a batch, a sequence's advantage counts once per
    token, so long responses weigh more in the mean, as in AReaL's `adv_norm` with
    `mean_level: batch, std_level: batch`.
    """
    m = mask.to(torch.float64)
    n = m.sum().clamp(min=1.0)
    xd = x.to(torch.float64) * m
    mean = xd.sum() / n
    var = ((xd - mean) ** 2 * m).sum() / n
    return (((x.to(torch.float64) - mean) / (var.sqrt() + eps)) * m).to(x.dtype)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref): exp(q) - q - 1 with q = log π_ref - log π_θ.

    Schulman's "k3" estimator: unbiased for samples from π_θ, always ≥ 0 and low
    variance, the form GRPO uses for its reference penalty.
    """
    q = ref_logprobs.detach() - logprobs
    return torch.exp(q) - q - 1.0


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    seq_index: torch.Tensor,
    *,
    agg: Literal["token_mean", "seq_mean"],
    seq_token_counts: torch.Tensor,
    denominator: float,
) -> torch.Tensor:
    """Sum this micro-batch's share of a loss normalised over the whole mini-batch.

    token_mean: Σ_tokens loss / `denominator` (= generated tokens in the mini-batch,
    across all micro-batches and ranks) — every token weighs the same.
    seq_mean: Σ_seqs (Σ_tokens loss / tokens of that seq) / `denominator` (= sequences
    in the mini-batch) — every sample weighs the same, however long.

    Normalising by the global count (not the micro-batch's) is what makes gradient
    accumulation and data parallelism give the same step as one big batch.
    `seq_index` maps each token to its sequence in this micro-batch and
    `seq_token_counts[s]` is sequence s's count of tokens in the normaliser.
    """
    masked = per_token * mask
    if agg == "token_mean":
        return masked.sum() / denominator
    per_seq = torch.zeros(seq_token_counts.shape[0], dtype=masked.dtype, device=masked.device)
    per_seq = per_seq.index_add(0, seq_index, masked)
    return (per_seq / seq_token_counts.clamp(min=1).to(masked.dtype)).sum() / denominator
