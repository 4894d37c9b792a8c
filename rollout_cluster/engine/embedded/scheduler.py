"""Who runs next: waiting and running queues, admission, prefill plans, retirement.

The scheduler decides; it never runs the model. Per step the engine asks it for the
running batch (decode), for the waiting requests that fit (admission under the slot
count and a padded-prefill token budget), and for a `PrefillPlan` saying how each
admitted sequence gets its KV: computed by the model (possibly from a cached
prefix), copied whole from an exact prefix-cache hit, or copied from an identical
sequence in the same batch (the n samples of a GRPO group are prefilled once).
After sampling, `append` records each token with its behaviour logprob and weight
version (invariant 2) and applies the stop conditions; `retire` frees the slots of
finished sequences, keeping slots `0..B-1` dense, and remembers their KV in the
prefix cache so the next turn of the episode reuses it.

It owns the per-sequence state (`Seq`); `num_computed` is the contract with the KV
storage: the slot of a running sequence holds KV for exactly `ids[:num_computed]`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from areal_like.core.types import GenerateResult, SamplingParams, StopReason
from rollout_cluster.engine.base import RequestOutput, finished_result
from rollout_cluster.engine.embedded.cache import KVSlots, PrefixCache, PrefixEntry, common_prefix_len

_MIN_SHARED = 16
"""Positions a prefill stage must save to be worth its model call (~15 ms of dispatch at
135M on one thread; a position of prefill there costs ~2 ms)."""

__all__ = ["PrefillPlan", "Scheduler", "Seq"]


@dataclass(eq=False)
class Seq:
    """One request's state, from admission to retirement (survives interrupts)."""

    request_id: str
    ids: list[int]
    """Prompt followed by every generated token (the sequence as the model sees it)."""
    prompt_len: int
    params: SamplingParams
    stream: int
    """32-bit RNG stream key; noise = hash(stream, position, vocab index)."""
    max_len: int
    """Stop with `length` when `len(ids)` reaches this (prompt + max_tokens, capped)."""
    stop_ids: frozenset[int]
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    num_computed: int = 0
    """Tokens of `ids` whose KV is in the slot; while running it is `len(ids) - 1`."""
    num_interrupts: int = 0
    stop_reason: StopReason | None = None

    @property
    def out_ids(self) -> list[int]:
        return self.ids[self.prompt_len :]

    def result(self) -> GenerateResult:
        assert self.stop_reason is not None
        stop_id = self.ids[-1] if self.stop_reason == "stop" else None  # `append` stopped on this id
        return finished_result(self.request_id, self.out_ids, self.logprobs, self.versions, self.stop_reason,
                               self.num_interrupts, stop_id)


@dataclass(eq=False)
class PrefillPlan:
    """How one admitted batch gets its KV; `order[i]` sits in slot `base + i`.

    `order` is `compute`, then `exact`, then `copies`, so the model runs over the
    contiguous slots `base .. base + len(compute) - 1`.
    """

    base: int
    compute: list[tuple[Seq, PrefixEntry | None, int]]
    """(sequence, cached prefix or None, its length): the model runs `ids[length:]`."""
    exact: list[tuple[Seq, PrefixEntry]]
    """Whole sequence cached with its last logits: no model call at all."""
    copies: list[tuple[Seq, Seq]]
    """(duplicate, its leader in this batch): same ids, so the leader's KV and logits."""
    slot: dict[int, int] = field(default_factory=dict)
    """`id(seq) -> slot` for every sequence of the plan."""

    def __post_init__(self) -> None:
        self.slot = {id(s): self.base + i for i, s in enumerate(self.order)}

    @property
    def order(self) -> list[Seq]:
        return [s for s, _, _ in self.compute] + [s for s, _ in self.exact] + [s for s, _ in self.copies]

    @property
    def computed_tokens(self) -> int:
        """Tokens the model runs (prefix-cache hits excluded)."""
        return sum(len(s.ids) - n for s, _, n in self.compute)

    @property
    def hit_tokens(self) -> int:
        """Tokens whose KV comes from the prefix cache or a duplicate in the batch."""
        return (
            sum(n for _, _, n in self.compute)
            + sum(len(s.ids) for s, _ in self.exact)
            + sum(len(s.ids) for s, _ in self.copies)
        )


class Scheduler:
    """Waiting and running queues over `KVSlots`, with an optional `PrefixCache`."""

    def __init__(
        self, kv: KVSlots, prefix: PrefixCache | None, *, max_slots: int, max_prefill_tokens: int
    ) -> None:
        self.kv = kv
        self.prefix = prefix
        self.max_slots = max_slots
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        """In slot order: `running[i]` owns slot i."""
        self.by_id: dict[str, Seq] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.by_id

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Seq) -> None:
        assert seq.request_id not in self.by_id, seq.request_id
        self.by_id[seq.request_id] = seq
        p = seq.params.priority
        if not self.waiting or self.waiting[-1].params.priority <= p:
            self.waiting.append(seq)
            return
        # before the first waiting request of a larger number (lower priority): stable within a level
        at = next(i for i, w in enumerate(self.waiting) if w.params.priority > p)
        self.waiting.insert(at, seq)

    def abort(self, request_id: str) -> Seq | None:
        """Mark a request aborted; a waiting one leaves now, a running one at `retire`."""
        seq = self.by_id.get(request_id)
        if seq is None:
            return None
        seq.stop_reason = "abort"
        if seq in self.waiting:
            self.waiting.remove(seq)
            del self.by_id[request_id]
        return seq

    def preempt_all(self) -> list[Seq]:
        """Take every running sequence out of its slot and put it at the head of the queue.

        Their tokens, logprobs and versions are kept; their KV is not (`num_computed`
        drops to 0), so admission re-prefills prompt + partial. Shortest first:
        re-prefill batches of similar lengths pad attention least.
        """
        inflight = self.running
        for s in inflight:
            s.num_computed = 0
        self.running = []
        self.waiting.extendleft(sorted(inflight, key=lambda s: len(s.ids), reverse=True))
        return inflight

    def admit(self, only: set[int] | None = None) -> list[Seq]:
        """Pop waiting requests into free slots while the padded prefill stays in budget.

        `only` (ids of `Seq` objects) stops admission at the first request not in it.
        """
        admitted: list[Seq] = []
        longest = 0
        while self.waiting and len(self.running) + len(admitted) < self.max_slots:
            seq = self.waiting[0]
            if only is not None and id(seq) not in only:
                break
            longest_if = max(longest, len(seq.ids))
            if admitted and (len(admitted) + 1) * longest_if > self.max_prefill_tokens:
                break
            self.waiting.popleft()
            admitted.append(seq)
            longest = longest_if
        return admitted

    def prefill_stages(self, admitted: list[Seq], version: int) -> list[list[Seq]]:
        """The admitted sequences in the order their prefills run, so that a prefix they
        share and no cache entry holds is computed once: its first sequence alone, then
        (where several sequences continue one prompt: answers interrupted by a weight
        update) one per prompt, then the rest, each stage finding the ones before it in
        the prefix cache. A stage costs one more model call; it is made only where it
        saves `_MIN_SHARED` positions or more. Without a prefix cache, one stage."""
        if self.prefix is None:
            return [admitted]
        distinct = list({tuple(s.ids): s for s in admitted}.values())
        if len(distinct) < 2:
            return [admitted]
        stages: list[list[Seq]] = []
        first = tuple(distinct[0].ids)
        common = min(common_prefix_len(first, tuple(s.ids)) for s in distinct[1:])
        if (len(distinct) - 1) * (common - self.prefix.covered(version, first)) >= _MIN_SHARED:
            stages.append([distinct[0]])
        by_prompt: dict[tuple[int, ...], list[Seq]] = {}
        for s in distinct[1 if stages else 0:]:
            if len(s.ids) > s.prompt_len:
                by_prompt.setdefault(tuple(s.ids[: s.prompt_len]), []).append(s)
        leaders = []
        for prompt, ss in by_prompt.items():
            have = max(self.prefix.covered(version, prompt), common_prefix_len(prompt, first) if stages else 0)
            if (len(ss) - 1) * (len(prompt) - have) >= _MIN_SHARED:
                leaders.append(ss[0])
        if leaders:
            stages.append(leaders)
        staged = {id(s) for st in stages for s in st}
        stages.append([s for s in admitted if id(s) not in staged])
        return [st for st in stages if st]

    def plan_prefill(self, admitted: list[Seq], version: int) -> PrefillPlan:
        """Dedupe identical sequences, look up cached prefixes, give the batch its slots."""
        leaders: dict[tuple[int, ...], Seq] = {}
        copies: list[tuple[Seq, Seq]] = []
        compute: list[tuple[Seq, PrefixEntry | None, int]] = []
        exact: list[tuple[Seq, PrefixEntry]] = []
        for s in admitted:
            key = tuple(s.ids)
            lead = leaders.get(key)
            if lead is not None:
                copies.append((s, lead))
                continue
            leaders[key] = s
            entry, n = self.prefix.lookup(version, key) if self.prefix is not None else (None, 0)
            if entry is not None and n == len(key):
                exact.append((s, entry))
            else:
                compute.append((s, entry, n))
        plan = PrefillPlan(len(self.running), compute, exact, copies)
        self.running.extend(plan.order)
        return plan

    def finish_prefill(self, plan: PrefillPlan, logits: torch.Tensor, version: int) -> None:
        """Mark the plan's KV as computed and cache each computed prompt with its logits."""
        if self.prefix is not None:
            for i, (s, _, _) in enumerate(plan.compute):
                n = len(s.ids)
                self.prefix.insert(version, tuple(s.ids), self.kv.snapshot(plan.slot[id(s)], n, logits[i]))
        for s in plan.order:
            s.num_computed = len(s.ids)

    def append(
        self, seqs: list[Seq], tokens: list[int], logprobs: list[float], version: int
    ) -> list[RequestOutput]:
        """Record one sampled token per sequence and apply the stop conditions."""
        outs = []
        for s, tok, lp in zip(seqs, tokens, logprobs, strict=True):
            s.ids.append(tok)
            s.logprobs.append(lp)
            s.versions.append(version)
            out = RequestOutput(s.request_id, [tok], [lp], [version])
            if tok in s.stop_ids:
                s.stop_reason = "stop"
            elif len(s.ids) >= s.max_len:
                s.stop_reason = "length"
            if s.stop_reason is not None:
                out.result = s.result()
            outs.append(out)
        return outs

    def retire(self, version: int) -> None:
        """Drop finished requests from the running batch, keeping slots 0..B-1 dense."""
        running = self.running
        if not any(s.stop_reason is not None for s in running):
            return
        holes = [i for i, s in enumerate(running) if s.stop_reason is not None]
        for i in holes:
            s = running[i]
            self.by_id.pop(s.request_id, None)
            if s.stop_reason != "abort":
                self._remember(i, s, version)
        keep = len(running) - len(holes)
        tail = [i for i in range(keep, len(running)) if running[i].stop_reason is None]
        for hole in (h for h in holes if h < keep):
            src = tail.pop()
            self.kv.move(hole, src, running[src].num_computed)
            running[hole] = running[src]
        del running[keep:]

    def _remember(self, slot: int, seq: Seq, version: int) -> None:
        """Cache a finished sequence's KV so the next turn of its episode reuses it."""
        n = seq.num_computed
        if self.prefix is None or n < 2:
            return
        self.prefix.insert(version, tuple(seq.ids[:n]), self.kv.snapshot(slot, n, None))
