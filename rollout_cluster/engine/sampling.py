"""Batched sampling whose randomness is a function of (request seed, token position).

Why counter-based: after a weight update the engine re-prefills a request and goes
on decoding (docs/design.md §9.1). With a stateful generator the resumed request would
draw different numbers than it would have uninterrupted; here the token at position p
of a request with seed s is drawn with the uniform number `hash(s, p)`, so an
interrupted and an uninterrupted run draw identical numbers, and a whole batch of
requests with different seeds is sampled with a handful of tensor ops.

Inverse CDF: the first token whose cumulative probability under `softmax(logits / T)`
exceeds u ~ U(0, 1) is an exact sample. One number per row: the cumulative sum (in float64)
and a binary search cost a few passes over the vocabulary, where Gumbel-max hashed every
vocabulary entry (about a fifth of a decode step at 135M parameters, 49k entries).
Top-k / top-p set the excluded logits to -inf first (probability 0: never drawn). The
behaviour logprob is always `log_softmax(logits / T)` of the chosen token with top-k/top-p
NOT applied (docs/design.md §1); greedy (T = 0) reports T = 1.
"""

from __future__ import annotations

import torch

__all__ = ["mix_seed", "uniform_draws", "sample_tokens", "SamplingBatch"]

_M32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons) on uint32 values held in int64 (products wrap, low bits exact)."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _hash32_int(x: int) -> int:
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def mix_seed(seed: int, salt: int) -> int:
    """A 32-bit stream key for (seed, salt); used for per-sample seeds of n > 1 requests."""
    lo, hi = seed & _M32, (seed >> 32) & _M32
    return _hash32_int(_hash32_int(_hash32_int(lo) ^ hi) ^ _hash32_int(salt + 0x9E3779B9))


def uniform_draws(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[N] float64 in [0, 1), 53 bits; row n depends only on (seeds[n], positions[n])."""
    key = _hash32(_hash32(seeds) ^ _hash32(positions * 0x27D4EB2F + 0x165667B1))
    hi = _hash32(key ^ 0x68E31DA4) >> 5  # 27 bits
    lo = _hash32(key ^ 0xB5297A4D) >> 6  # 26 bits
    return (hi * 67108864 + lo).to(torch.float64) * (1.0 / 9007199254740992.0)


def _inverse_cdf(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of cumulative (unnormalised) weights, the first index whose sum exceeds
    u·total (a token of weight 0 is never the answer: the sum does not rise there)."""
    target = (u * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)


class SamplingBatch:
    """Per-row sampling settings of one step, as tensors (built once per step)."""

    __slots__ = ("temperature", "greedy", "top_k", "top_p", "seeds", "positions", "any_sampled", "any_trunc")

    def __init__(
        self,
        temperature: list[float],
        top_k: list[int],
        top_p: list[float],
        seeds: list[int],
        positions: list[int],
        device: torch.device,
    ) -> None:
        self.temperature = torch.tensor(temperature, dtype=torch.float32, device=device)
        self.greedy = self.temperature == 0
        self.any_sampled = any(t > 0 for t in temperature)
        self.any_trunc = any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p)
        self.top_k = torch.tensor(top_k, dtype=torch.int64, device=device) if self.any_trunc else None
        self.top_p = torch.tensor(top_p, dtype=torch.float32, device=device) if self.any_trunc else None
        self.seeds = torch.tensor(seeds, dtype=torch.int64, device=device)
        self.positions = torch.tensor(positions, dtype=torch.int64, device=device)


def _truncate(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k / nucleus to -inf (rows with k<=0, p=1 untouched)."""
    vocab = scaled.shape[-1]
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    ranks = torch.arange(vocab, device=scaled.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    drop = ranks >= k[:, None]
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose mass reaches p: drop a token when the mass before it >= p.
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False
    masked_sorted = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, order, masked_sorted)


def sample_tokens(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (token ids [N], behaviour logprobs [N]).

    `logits` are float32 [N, V] (one row per request). Greedy rows take the argmax. Four
    passes over the vocabulary: the row's max, exp, the float64 cumulative sum (whose last
    entry is also the log-softmax's normaliser), and the truncation where asked for.
    """
    logits = logits.float()
    temp = torch.where(batch.greedy, torch.ones_like(batch.temperature), batch.temperature)
    scaled = logits / temp[:, None]
    top = scaled.amax(dim=-1, keepdim=True)
    weights = torch.exp(scaled - top)  # unnormalised softmax(scaled)
    cdf = torch.cumsum(weights, dim=-1, dtype=torch.float64)
    if batch.any_sampled:
        u = uniform_draws(batch.seeds, batch.positions)
        if batch.any_trunc:
            assert batch.top_k is not None and batch.top_p is not None
            kept = torch.exp(_truncate(scaled, batch.top_k, batch.top_p) - top)
            sampled = _inverse_cdf(torch.cumsum(kept, dim=-1, dtype=torch.float64), u)
        else:
            sampled = _inverse_cdf(cdf, u)
        tokens = torch.where(batch.greedy, torch.argmax(logits, dim=-1), sampled)
    else:
        tokens = torch.argmax(logits, dim=-1)
    picked = scaled.gather(-1, tokens[:, None]).squeeze(-1) - top.squeeze(-1)
    return tokens, picked - torch.log(cdf[:, -1]).to(picked.dtype)
