"""The embedded engine's sampler (rollout_cluster/engine/sampling.py): exact samples of the
tempered (and truncated) distribution, drawn with numbers that depend only on (seed, position)."""

from __future__ import annotations

import torch

from rollout_cluster.engine.sampling import SamplingBatch, sample_tokens

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def _draw(n: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, position: int = 0):
    batch = SamplingBatch([temperature] * n, [top_k] * n, [top_p] * n, list(range(n)), [position] * n,
                          torch.device("cpu"))
    return sample_tokens(LOGITS.expand(n, -1).clone(), batch)


def _freq(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=LOGITS.numel()).double() / tokens.numel()


def test_draws_follow_the_tempered_distribution_and_report_its_logprob() -> None:
    n = 40_000
    tokens, logp = _draw(n, temperature=0.7)
    want = torch.softmax(LOGITS.double() / 0.7, dim=-1)
    assert (_freq(tokens) - want).abs().max() < 0.01, (_freq(tokens), want)  # ~4 sigma at n = 40k
    assert torch.allclose(logp, torch.log_softmax(LOGITS / 0.7, dim=-1)[tokens])


def test_truncated_tokens_are_never_drawn_and_the_rest_keep_their_ratios() -> None:
    n = 40_000
    tokens, logp = _draw(n, top_k=2)
    f = _freq(tokens)
    assert f[2:].sum() == 0
    assert abs(f[0] / f[1] - float(torch.exp(LOGITS[0] - LOGITS[1]))) < 0.1
    assert torch.allclose(logp, torch.log_softmax(LOGITS, dim=-1)[tokens])  # the logprob is untruncated
    tokens, _ = _draw(n, top_p=0.5)  # token 0 alone holds 0.56 of the mass
    assert set(tokens.tolist()) == {0}


def test_a_draw_depends_on_seed_and_position_only() -> None:
    a, _ = _draw(64, position=3)
    b, _ = _draw(64, position=3)
    c, _ = _draw(64, position=4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    # a row's draw does not depend on the batch around it
    one = SamplingBatch([1.0], [0], [1.0], [17], [3], torch.device("cpu"))
    assert sample_tokens(LOGITS[None].clone(), one)[0].item() == a[17].item()


def test_the_two_level_search_picks_the_token_one_running_sum_picks() -> None:
    """`_inverse_cdf` searches block sums, then one block: the token a float64 running sum
    over the whole vocabulary gives, for any vocabulary size (padded to the block), tokens
    of weight 0 (truncated, or a whole block of them) and draws at the ends of [0, 1)."""
    from rollout_cluster.engine.sampling import _inverse_cdf

    g = torch.Generator().manual_seed(0)
    for vocab in (6, 256, 1000, 49152):
        w = torch.rand(64, vocab, generator=g) ** 8
        w[::3, : vocab // 2] = 0  # a truncated half, whole blocks of zeros
        w[1::5, 1:] = 0  # a row of one token
        w[w.sum(-1) == 0, -1] = 1.0  # (rows both made all zero: none is sampled from)
        u = torch.rand(64, generator=g, dtype=torch.float64)
        u[:4] = torch.tensor([0.0, 1e-12, 1 - 1e-12, 0.5])
        cdf = torch.cumsum(w, dim=-1, dtype=torch.float64)
        want = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1).clamp(max=vocab - 1)
        got = _inverse_cdf(w, u)
        assert torch.equal(got, want), (vocab, (got != want).nonzero()[:5])
        assert bool((w.gather(1, got[:, None]) > 0).all()), vocab


def test_few_rows_draw_the_numbers_many_rows_do() -> None:
    """A step of up to `_FEW_ROWS` rows hashes its draws in Python: the same numbers, bit for
    bit, as the tensor hash of a bigger step (a request's tokens must not depend on how many
    others decode beside it), over seeds and positions up to the 32-bit and past-the-context ends."""
    from rollout_cluster.engine.sampling import _FEW_ROWS, _uniform_draw, mix_seed, uniform_draws

    g = torch.Generator().manual_seed(1)
    seeds = [0, 1, 2**32 - 1, mix_seed(7, 3)] + torch.randint(0, 2**32, (500,), generator=g).tolist()
    positions = [0, 1, 2**20, 5] + torch.randint(0, 70_000, (500,), generator=g).tolist()
    want = uniform_draws(torch.tensor(seeds), torch.tensor(positions))
    got = torch.tensor([_uniform_draw(s, p) for s, p in zip(seeds, positions, strict=True)], dtype=torch.float64)
    assert torch.equal(got, want)
    few = SamplingBatch([1.0] * _FEW_ROWS, [0] * _FEW_ROWS, [1.0] * _FEW_ROWS, seeds[:_FEW_ROWS],
                        positions[:_FEW_ROWS], torch.device("cpu"))
    many = SamplingBatch([1.0] * 40, [0] * 40, [1.0] * 40, seeds[:40], positions[:40], torch.device("cpu"))
    assert few.u is not None and many.u is not None and torch.equal(few.u, many.u[:_FEW_ROWS])
