"""Shared prompts computed once: a group's samples in one row, their common prefix once.

The samples of a GRPO group start with the same prompt (the same tokens at the same
positions), so through every causal layer the prompt's hidden states are the same for
each of them. Laid out as one row, `[prefix, tail_1, tail_2, ...]`, with each tail's
position ids continuing from the prefix and a mask that lets a tail attend to the prefix
and to its own earlier tokens only, the row gives every sample exactly the logits it
would get alone; the prefix's logits are shared by index, so in the backward pass the
prefix collects the gradients of all its tails (what separate copies would sum to).

On the quickstart (8 samples per group, prompts ~28 tokens, answers ~11), a mini-batch
holding two samples of each group computes ~35 % fewer tokens, and one holding whole
groups ~2.6x fewer. `train_cluster/torch_engine.py:_hf_logits` lays a micro-batch out
this way when the cost model says it is cheaper than the plain packed/padded calls
(docs/design.md §10.29). The mask is dense (one row, T² entries), so clusters are cut
into separate calls when the quadratic attention would outgrow a call's overhead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from train_cluster.batch import TrainBatch

__all__ = ["Cluster", "prefix_clusters", "plan_calls", "plan_cost", "shared_logits", "MASKED_PAIR"]

MASKED_PAIR = 2.5
"""What a score pair costs under the shared layout's explicit mask, relative to the cost model's
pair (causal attention without a mask takes torch's causal kernel). Fitted on the quickstart
model, one thread, forward and backward of one mini-batch (2026-11-26): 8 groups x 2 samples,
shared 133.6 ms against 117.0 ms plain; 2 groups x 8, 67.1 against 120.3 ms. 2.5 reproduces
both ratios (1.14 and 0.54 modelled, 1.14 and 0.56 measured); at 1 the model chose the shared
layout for the first case, where it is slower."""


@dataclass(frozen=True)
class Cluster:
    """Sequences (indices into the micro-batch) sharing their first `prefix` tokens; a
    single sequence is a cluster with `prefix` 0."""

    members: tuple[int, ...]
    prefix: int

    def tokens(self, lens: list[int]) -> int:
        """Tokens in the row: the prefix once, then each member's tail."""
        return self.prefix + sum(lens[i] - self.prefix for i in self.members)


def prefix_clusters(mb: TrainBatch) -> list[Cluster]:
    """The micro-batch's sequences by group, and within a group by common prefix: the first
    unclustered member leads, the members starting with its first token join it, and the
    cluster's prefix is the shortest of their common prefixes with it. A sequence that
    shares nothing is a cluster of its own."""
    lens = mb.seq_lens.tolist()
    offs = mb.offsets().tolist()
    ids = mb.input_ids
    by_group: dict[str, list[int]] = {}
    for i, g in enumerate(mb.group_ids):
        by_group.setdefault(g, []).append(i)
    out: list[Cluster] = []
    for members in by_group.values():
        left = list(members)
        while left:
            lead, rest = left[0], left[1:]
            joined, prefix, left = [lead], lens[lead], []
            for i in rest:
                n = min(lens[lead], lens[i])
                same = ids[offs[lead]:offs[lead] + n] == ids[offs[i]:offs[i] + n]
                common = n if bool(same.all()) else int(torch.nonzero(~same)[0, 0])
                if common:
                    joined.append(i)
                    prefix = min(prefix, common)
                else:
                    left.append(i)
            out.append(Cluster(tuple(joined), prefix if len(joined) > 1 else 0))
    return out


def plan_calls(clusters: list[Cluster], lens: list[int], cost: tuple[float, float], call: float, *,
               max_calls: int | None = None) -> list[list[Cluster]]:
    """Clusters into forward calls, largest first: a cluster joins the current call while
    the attention it adds to it (2·T·u score pairs) costs less than a call of its own."""
    pair = cost[1] * MASKED_PAIR
    calls: list[list[Cluster]] = []
    width = 0
    for c in sorted(clusters, key=lambda c: -c.tokens(lens)):
        u = c.tokens(lens)
        if calls and (max_calls == 1 or pair * 2 * width * u < call):
            calls[-1].append(c)
            width += u
        else:
            calls.append([c])
            width = u
    return calls


def plan_cost(calls: list[list[Cluster]], lens: list[int], cost: tuple[float, float], call: float) -> float:
    """The modelled cost of `calls`: per call its overhead, tokens and dense masked attention."""
    lin, pair = cost[0], cost[1] * MASKED_PAIR
    total = 0.0
    for cs in calls:
        t = sum(c.tokens(lens) for c in cs)
        total += call + lin * t + pair * t * t
    return total


def shared_logits(model: Any, mb: TrainBatch, calls: list[list[Cluster]], device: torch.device,
                  rows: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [N, V] of the micro-batch's packed tokens, computed call by call in the
    shared layout and gathered back in packed order (a prefix row serves every member).
    `rows` (packed positions): only theirs, [len(rows), V], each call projecting only the
    layout positions they need onto the vocabulary (`logits_to_keep`)."""
    offs = mb.offsets().tolist()
    lens = mb.seq_lens.tolist()
    where = torch.full((mb.num_tokens,), -1, dtype=torch.int64)  # -1: laid out by a later call
    parts: list[torch.Tensor] = []
    picked: list[torch.Tensor] = []  # with `rows`: which of them each call computed
    base = 0
    for cs in calls:
        ids: list[torch.Tensor] = []
        pos: list[torch.Tensor] = []
        block: list[torch.Tensor] = []  # which cluster of the call
        member: list[torch.Tensor] = []  # which member; -1 on the shared prefix
        row = 0
        for k, c in enumerate(cs):
            p = c.prefix
            if p:
                first = c.members[0]
                ids.append(mb.input_ids[offs[first]:offs[first] + p])
                pos.append(torch.arange(p))
                block.append(torch.full((p,), k))
                member.append(torch.full((p,), -1))
            prefix_at = row
            row += p
            for m in c.members:
                tail = lens[m] - p
                ids.append(mb.input_ids[offs[m] + p:offs[m + 1]])
                pos.append(torch.arange(p, lens[m]))
                block.append(torch.full((tail,), k))
                member.append(torch.full((tail,), m))
                where[offs[m]:offs[m] + p] = base + prefix_at + torch.arange(p)
                where[offs[m] + p:offs[m + 1]] = base + row + torch.arange(tail)
                row += tail
        b, mm = torch.cat(block), torch.cat(member)
        at = torch.arange(row)
        allowed = ((b[None, :] == b[:, None]) & (at[None, :] <= at[:, None])
                   & ((mm[None, :] == -1) | (mm[None, :] == mm[:, None])))
        kw: dict[str, Any] = {}
        if rows is not None:  # the layout positions this call's rows need
            need = where[rows]
            sel = ((need >= base) & (need < base + row)).nonzero().squeeze(1)
            picked.append(sel)
            kw["logits_to_keep"] = (need[sel] - base).to(device)
        out = model(input_ids=torch.cat(ids).to(device).unsqueeze(0),
                    position_ids=torch.cat(pos).to(device).unsqueeze(0),
                    attention_mask=allowed.to(device)[None, None], use_cache=False, **kw).logits[0]
        parts.append(out)
        base += row
    if rows is None:
        return torch.cat(parts)[where.to(device)]
    order = torch.cat(picked)
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel())
    return torch.cat(parts)[back.to(device)]
