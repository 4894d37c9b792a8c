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

__all__ = ["KVSlots", "PrefixCache", "PrefixEntry"]


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

    Lookups find the longest cached prefix. Entries are written for every prefilled
    prompt and every finished sequence, so the n samples of a GRPO group and the
    next turn of a multi-turn episode reuse KV.
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
        """Exact entry with logits, else the longest strict prefix; returns (entry, length).

        The length is how many positions of `ids` the entry covers and the model may
        skip: `len(ids)` only for an exact hit with logits (nothing left to compute),
        otherwise at most `len(ids) - 1` (the last position's logits are needed).
        """
        exact = self._entries.get((version, ids))
        if exact is not None and exact.logits is not None:
            self._entries.move_to_end((version, ids))
            return exact, len(ids)
        best: tuple[tuple[int, tuple[int, ...]], PrefixEntry] | None = None
        n = len(ids)
        for key, entry in self._entries.items():
            v, k_ids = key
            m = len(k_ids)
            if v != version or m > n or (best is not None and m <= len(best[0][1])):
                continue
            if ids[:m] == k_ids:
                best = (key, entry)
        if best is None:
            return None, 0
        self._entries.move_to_end(best[0])
        # A full-length hit without logits still needs the last position computed.
        return best[1], min(len(best[0][1]), n - 1)
