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


def _uniform_draw(seed: int, position: int) -> float:
    """`uniform_draws` of one row, in Python's integers: the same number, bit for bit."""
    key = _hash32_int(_hash32_int(seed) ^ _hash32_int(position * 0x27D4EB2F + 0x165667B1))
    hi = _hash32_int(key ^ 0x68E31DA4) >> 5
    lo = _hash32_int(key ^ 0xB5297A4D) >> 6
    return (hi * 67108864 + lo) * (1.0 / 9007199254740992.0)


_FEW_ROWS = 16
"""Up to this many rows a step's draws are hashed in Python: ~3 µs a row, against ~60 µs of
tensor ops whatever the rows (a decode step of the quickstart's model at one row: ~0.5 ms)."""


_BLOCK = 256
"""Tokens per block of `_inverse_cdf`'s two-level search."""


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of unnormalised weights, the first index whose running sum exceeds u·total;
    never a token of weight 0.

    Two levels instead of one float64 running sum over the whole vocabulary (a sequential
    pass, and 8 bytes per entry written: ~10 % of a 135M model's decode step at 32 rows):
    the blocks' sums (float32, 256 tokens each) and their running sum (float64), the block
    where u·total falls, then the running sum inside that block only. The token is the full
    running sum's except where sums in another order differ (~1e-7 of the total); where
    rounding puts u·total past the block's own sum, its last token of weight > 0."""
    n, vocab = weights.shape
    if vocab <= _BLOCK:  # one block: its running sum alone
        cdf = weights.cumsum(-1, dtype=torch.float64)
        i = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
        last = torch.where(weights > 0, torch.arange(vocab, device=weights.device), -1).amax(-1, keepdim=True)
        return torch.minimum(i, last).squeeze(-1)
    pad = -vocab % _BLOCK
    w = torch.nn.functional.pad(weights, (0, pad)) if pad else weights
    blocks = w.view(n, -1, _BLOCK)
    sums = torch.cumsum(blocks.sum(-1).double(), dim=-1)  # [n, vocab / 256]
    target = (u * sums[:, -1])[:, None]
    b = torch.searchsorted(sums, target, right=True).clamp_(max=sums.shape[1] - 1)  # [n, 1]
    before = torch.where(b > 0, sums.gather(1, (b - 1).clamp(min=0)), torch.zeros_like(target))
    block = blocks[torch.arange(n, device=w.device), b.squeeze(1)]  # [n, 256]
    i = torch.searchsorted(block.cumsum(-1, dtype=torch.float64) + before, target, right=True)
    last = torch.where(block > 0, torch.arange(_BLOCK, device=w.device), -1).amax(-1, keepdim=True)
    return (b * _BLOCK + torch.minimum(i, last)).squeeze(-1).clamp_(max=vocab - 1)


class SamplingBatch:
    """Per-row sampling settings of one step, as tensors (built once per step)."""

    __slots__ = ("temperature", "greedy", "top_k", "top_p", "u", "any_sampled", "any_greedy", "any_trunc",
                 "unit_temperature")

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
        self.any_greedy = any(t == 0 for t in temperature)
        self.unit_temperature = all(t in (0.0, 1.0) for t in temperature)
        self.any_trunc = any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p)
        self.top_k = torch.tensor(top_k, dtype=torch.int64, device=device) if self.any_trunc else None
        self.top_p = torch.tensor(top_p, dtype=torch.float32, device=device) if self.any_trunc else None
        self.u: torch.Tensor | None = None
        """Each row's uniform draw (float64), where any row samples."""
        if self.any_sampled and len(seeds) <= _FEW_ROWS:
            self.u = torch.tensor([_uniform_draw(s, p) for s, p in zip(seeds, positions, strict=True)],
                                  dtype=torch.float64, device=device)
        elif self.any_sampled:
            self.u = uniform_draws(torch.tensor(seeds, dtype=torch.int64, device=device),
                                   torch.tensor(positions, dtype=torch.int64, device=device))


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

    `logits` are float32 [N, V] (one row per request). Greedy rows take the argmax. A few
    passes over the vocabulary: the row's max, exp, its sum (the log-softmax's normaliser),
    the blocks' sums of `_inverse_cdf`, and the truncation where asked for.
    """
    logits = logits.float()
    if batch.unit_temperature:  # T = 1 (or greedy, scored at 1) everywhere: x / 1 is x, a pass saved
        scaled = logits
    else:
        temp = torch.where(batch.greedy, torch.ones_like(batch.temperature), batch.temperature)
        scaled = logits / temp[:, None]
    top = scaled.amax(dim=-1, keepdim=True)
    weights = (scaled - top).exp_()  # unnormalised softmax(scaled)
    total = weights.sum(-1)
    if batch.any_sampled:
        u = batch.u
        assert u is not None
        if batch.any_trunc:
            assert batch.top_k is not None and batch.top_p is not None
            kept = torch.exp(_truncate(scaled, batch.top_k, batch.top_p) - top)
            sampled = _inverse_cdf(kept, u)
        else:
            sampled = _inverse_cdf(weights, u)
        tokens = torch.where(batch.greedy, torch.argmax(logits, dim=-1), sampled) if batch.any_greedy else sampled
    else:
        tokens = torch.argmax(logits, dim=-1)
    picked = scaled.gather(-1, tokens[:, None]).squeeze(-1) - top.squeeze(-1)
    return tokens, picked - torch.log(total).to(picked.dtype)
