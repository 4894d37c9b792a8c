"""KV storage of the running batch (`KVSlots`) and the version-keyed `PrefixCache`.

Why slots and not pages: a small model on CPU spends its time in Python and tensor
dispatch, not in memory; one preallocated tensor per K and V, one slot per running
sequence, makes a decode step read a plain slice `[:, 0:B]` with no gather. The
scheduler keeps running sequences in slots `0..B-1` (`KVSlots.move` fills the hole a
finished one leaves).

Why the prefix cache is keyed by weight version: KV computed with old weights must
never be reused (docs/design.md §9.1). The engine clears the whole cache on every
weight update, and the version in the key makes a stale hit impossible even if a
caller forgot to.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

__all__ = ["KVSlots", "PrefixCache", "PrefixEntry", "common_prefix_len"]


@dataclass(eq=False)
class PrefixEntry:
    """Cached KV of one token sequence (a copy, so slots can be reused freely)."""

    k: torch.Tensor  # [layers, kv_heads, n, head_dim]
    v: torch.Tensor
    logits: torch.Tensor | None
    """Logits at the last position, when known: an exact hit then skips the model."""


class KVSlots:
    """Preallocated K and V, `[layers, slots, kv_heads, max_seq_len, head_dim]` each.

    The model runner writes new positions straight into `k` / `v` during a forward;
    everything else (filling a slot from the prefix cache, moving a sequence,
    snapshotting one) goes through the methods here.
    """

    def __init__(
        self,
        layers: int,
        slots: int,
        kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (layers, slots, kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.slots = slots
        self.capacity_tokens = slots * max_seq_len

    def move(self, dst: int, src: int, n: int) -> None:
        """Copy the first `n` positions of slot `src` into slot `dst`."""
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]

    def load(self, slot: int, entry: PrefixEntry, n: int) -> None:
        """Fill the first `n` positions of `slot` from a prefix-cache entry."""
        self.k[:, slot, :, :n] = entry.k[:, :, :n]
        self.v[:, slot, :, :n] = entry.v[:, :, :n]

    def snapshot(self, slot: int, n: int, logits: torch.Tensor | None) -> PrefixEntry:
        """A prefix-cache entry holding a copy of the first `n` positions of `slot`."""
        return PrefixEntry(self.k[:, slot, :, :n].clone(), self.v[:, slot, :, :n].clone(), logits)


class PrefixCache:
    """LRU map `(version, token ids) -> PrefixEntry`, bounded in tokens.

    Lookups find the entry sharing the longest prefix. Entries are written for every
    prefilled prompt and every finished sequence, so the n samples of a GRPO group, the
    next turn of a multi-turn episode and every prompt of one chat template reuse KV.
    """

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self._entries: OrderedDict[tuple[int, tuple[int, ...]], PrefixEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = 0

    def insert(self, version: int, ids: tuple[int, ...], entry: PrefixEntry) -> None:
        key = (version, ids)
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        if len(ids) > self.max_tokens:
            return
        self._entries[key] = entry
        self.tokens += len(ids)
        while self.tokens > self.max_tokens:
            (_, old_ids), _ = self._entries.popitem(last=False)
            self.tokens -= len(old_ids)

    def lookup(self, version: int, ids: tuple[int, ...]) -> tuple[PrefixEntry | None, int]:
        """Exact entry with logits, else the entry sharing the longest prefix with `ids`;
        returns (entry, length).

        The length is how many positions of `ids` the entry covers and the model may
        skip: `len(ids)` only for an exact hit with logits (nothing left to compute),
        otherwise at most `len(ids) - 1` (the last position's logits are needed). An entry
        need not be a prefix of `ids`: its first positions' KV depends only on its first
        tokens (causal attention), so a chat template's system turn, common to every
        prompt, is computed once per version.
        """
        exact = self._entries.get((version, ids))
        if exact is not None and exact.logits is not None:
            self._entries.move_to_end((version, ids))
            return exact, len(ids)
        best_key, best = None, 0
        for key in self._entries:
            if key[0] == version:
                m = common_prefix_len(ids, key[1])
                if m > best:
                    best_key, best = key, m
        if best_key is None:
            return None, 0
        self._entries.move_to_end(best_key)
        return self._entries[best_key], min(best, len(ids) - 1)

    def covered(self, version: int, ids: tuple[int, ...]) -> int:
        """How many leading positions of `ids` some entry holds (no LRU change)."""
        return max((common_prefix_len(ids, k) for v, k in self._entries if v == version), default=0)


def common_prefix_len(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the longest common prefix of two token tuples (bisection on slices: C
    comparisons, not a Python loop per token)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo + 1 < hi:  # a[:lo] == b[:lo], a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
