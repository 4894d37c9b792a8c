"""Train-test fixtures: random trajectories for the tiny model, one torch thread."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from areal_like.core.types import Trajectory


def make_trajectories(
    n_groups: int = 2,
    group_size: int = 4,
    *,
    vocab: int = 60,
    seed: int = 0,
    prompt_len: tuple[int, int] = (3, 8),
    response_len: tuple[int, int] = (2, 10),
    temperature: float = 1.0,
    logprob: float = -2.0,
    shared_prompt: bool = False,
) -> list[Trajectory]:
    """Trajectories with random tokens, a tool-token gap in some responses and distinct rewards
    (`shared_prompt`: a group's samples start with one prompt, as GRPO's do)."""
    rng = random.Random(seed)
    out = []
    for g in range(n_groups):
        group_prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(*prompt_len))]
        for k in range(group_size):
            p = rng.randint(*prompt_len)
            r = rng.randint(*response_len)
            mask = [1] * r
            if r > 4 and k % 2:
                mask[2] = 0  # a tool/observation token inside the response
            out.append(
                Trajectory(
                    episode_id=f"e{g}-{k}",
                    group_id=f"g{g}",
                    prompt_ids=list(group_prompt) if shared_prompt else [rng.randrange(4, vocab) for _ in range(p)],
                    response_ids=[rng.randrange(4, vocab) for _ in range(r)],
                    response_mask=mask,
                    response_logprobs=[logprob + 0.1 * rng.random() if m else 0.0 for m in mask],
                    response_versions=[0 if m else -1 for m in mask],
                    reward=float(rng.random() < 0.5) + 0.01 * k,
                    temperature=temperature,
                )
            )
    return out


@pytest.fixture
def trajs() -> Callable[..., list[Trajectory]]:
    """The `make_trajectories` builder (fixtures cannot be imported across test folders)."""
    torch.set_num_threads(1)
    return make_trajectories
