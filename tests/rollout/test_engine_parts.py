"""The embedded engine's parts in isolation (no model): prefix cache, KV slots,
scheduler; the request edge (`validate_request` -> `EngineRequest`); and that a
request going through the server is validated exactly once."""

from __future__ import annotations

import asyncio

import pytest
import torch

from areal_like.core.config import EmbeddedEngineConfig
from areal_like.core.types import SamplingParams
from rollout_cluster.engine import (
    EngineCommand,
    EngineRequest,
    InvalidSamplingParamsError,
    PromptTooLongError,
    RequestError,
    validate_request,
)
from rollout_cluster.engine.embedded.cache import KVSlots, PrefixCache, PrefixEntry
from rollout_cluster.engine.embedded.scheduler import Scheduler, Seq
from rollout_cluster.engine.sampling import mix_seed


def entry(n: int, fill: float = 0.0, logits: bool = False) -> PrefixEntry:
    k = torch.full((1, 1, n, 2), fill)
    return PrefixEntry(k, k.clone(), torch.zeros(4) if logits else None)


def seq(rid: str, ids: list[int], max_tokens: int = 8, params: SamplingParams | None = None) -> Seq:
    params = params or SamplingParams(max_tokens=max_tokens)
    return Seq(rid, list(ids), len(ids), params, 0, len(ids) + params.max_tokens, frozenset())


def small_kv(slots: int = 4) -> KVSlots:
    return KVSlots(1, slots, 1, 16, 2, dtype=torch.float32, device=torch.device("cpu"))


def test_prefix_cache_longest_prefix_exact_hits_versions_and_lru():
    cache = PrefixCache(max_tokens=10)
    cache.insert(0, (1, 2, 3), entry(3))
    cache.insert(0, (1, 2, 3, 4, 5), entry(5, logits=True))
    assert cache.lookup(0, (1, 2, 3, 4, 5, 6))[1] == 5  # longest strict prefix
    assert cache.lookup(0, (1, 2, 3, 4, 5))[1] == 5  # exact hit with logits: nothing to compute
    assert cache.lookup(0, (1, 2, 3))[1] == 2  # exact hit without logits: last position recomputed
    assert cache.lookup(1, (1, 2, 3, 4, 5)) == (None, 0)  # another weight version never hits
    assert cache.lookup(0, (9, 9)) == (None, 0)
    cache.insert(0, (7, 7, 7), entry(3))  # 11 tokens > 10: the least recently used goes
    assert len(cache) == 2 and cache.tokens == 6 and cache.lookup(0, (1, 2, 3, 4, 5, 6))[1] == 3
    cache.insert(0, tuple(range(11)), entry(11))  # larger than the whole cache: not kept
    assert len(cache) == 2
    cache.clear()
    assert len(cache) == 0 and cache.tokens == 0
    cache.insert(0, (1, 2, 3, 4, 5), entry(5, logits=True))
    assert cache.lookup(0, (1, 2, 3, 4, 9))[1] == 4  # a common prefix: the entry need not be one of ids
    assert cache.lookup(0, (1, 2))[1] == 1  # (the last position's logits are still computed)
    assert cache.covered(0, (1, 2, 7)) == 2 and cache.covered(1, (1, 2, 7)) == 0


def test_common_prefix_len():
    from rollout_cluster.engine.embedded.cache import common_prefix_len

    for a, b in [((), ()), ((1,), ()), ((1, 2, 3), (1, 2, 3)), ((1, 2, 3), (1, 2)), ((1, 2, 3), (1, 5, 3)),
                 ((4,), (5,)), (tuple(range(100)), tuple(range(57)) + (0,))]:
        want = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        assert common_prefix_len(a, b) == common_prefix_len(b, a) == want, (a, b)


def test_kv_slots_move_load_and_snapshot():
    kv = small_kv()
    kv.load(1, entry(3, fill=2.0), 3)
    assert kv.k[0, 1, 0, :3].eq(2.0).all() and kv.k[0, 1, 0, 3:].eq(0).all()
    kv.move(0, 1, 2)
    assert kv.v[0, 0, 0, :2].eq(2.0).all() and kv.v[0, 0, 0, 2:].eq(0).all()
    snap = kv.snapshot(1, 3, None)
    kv.k.zero_()
    assert snap.k.eq(2.0).all() and snap.k.shape == (1, 1, 3, 2)  # a copy, not a view


def test_scheduler_admits_within_slots_and_prefill_budget():
    sched = Scheduler(small_kv(), None, max_slots=3, max_prefill_tokens=12)
    for i, n in enumerate([4, 4, 5, 2]):
        sched.add(seq(f"r{i}", [1] * n))
    first = sched.admit()
    assert [s.request_id for s in first] == ["r0", "r1"]  # a third would pad to 3 * 5 > 12
    sched.plan_prefill(first, version=0)
    second = sched.admit()
    assert [s.request_id for s in second] == ["r2"]  # one slot left
    sched.plan_prefill(second, version=0)
    assert sched.admit() == [] and len(sched.waiting) == 1


def test_scheduler_plans_duplicates_and_cache_hits_and_retires_densely():
    kv = small_kv()
    prefix = PrefixCache(max_tokens=100)
    prefix.insert(0, (5, 6, 7), entry(3, fill=1.0, logits=True))
    prefix.insert(0, (1, 2), entry(2, fill=3.0))
    sched = Scheduler(kv, prefix, max_slots=4, max_prefill_tokens=100)
    seqs = [seq("a", [1, 2, 3]), seq("b", [5, 6, 7]), seq("c", [1, 2, 3]), seq("d", [8, 9])]
    for s in seqs:
        sched.add(s)
    plan = sched.plan_prefill(sched.admit(), version=0)
    assert [(s.request_id, n) for s, _, n in plan.compute] == [("a", 2), ("d", 0)]
    assert [s.request_id for s, _ in plan.exact] == ["b"]
    assert [(s.request_id, lead.request_id) for s, lead in plan.copies] == [("c", "a")]
    assert [s.request_id for s in sched.running] == ["a", "d", "b", "c"]  # slot order
    assert plan.computed_tokens == 1 + 2 and plan.hit_tokens == 2 + 3 + 3
    sched.finish_prefill(plan, torch.zeros(4, 4), version=0)
    assert all(s.num_computed == len(s.ids) for s in seqs)
    assert prefix.lookup(0, (8, 9))[1] == 2  # computed prompts are cached with their logits
    # "a" finishes: the last running sequence moves into its slot, KV included.
    outs = sched.append(sched.running, [0, 0, 0, 0], [-1.0] * 4, version=0)
    assert all(not o.finished and o.versions == [0] for o in outs)
    for s in sched.running:  # what a decode step does before sampling the next token
        s.num_computed += 1
    kv.k[0, 3, 0, :4] = 4.0
    outs = sched.append(sched.running, [0, 0, 0, 0], [-1.0] * 4, version=0)
    seqs[0].stop_reason = "stop"
    sched.retire(version=0)
    assert [s.request_id for s in sched.running] == ["c", "d", "b"] and "a" not in sched
    assert kv.k[0, 0, 0, :4].eq(4.0).all()
    assert prefix.lookup(0, (1, 2, 3, 0, 0, 9))[1] == 4  # the finished sequence is remembered


def test_scheduler_preempts_all_to_the_head_of_the_queue_and_aborts():
    sched = Scheduler(small_kv(), None, max_slots=4, max_prefill_tokens=100)
    for rid, n in [("long", 6), ("short", 2), ("queued", 3)]:
        sched.add(seq(rid, [1] * n))
    running = sched.admit(only={id(s) for s in sched.waiting if s.request_id != "queued"})
    sched.finish_prefill(sched.plan_prefill(running, 0), torch.zeros(2, 4), 0)
    preempted = sched.preempt_all()
    assert {s.request_id for s in preempted} == {"long", "short"} and sched.running == []
    assert [s.request_id for s in sched.waiting] == ["short", "long", "queued"]  # shortest first
    assert all(s.num_computed == 0 for s in preempted) and preempted[0].ids == [1] * 6
    aborted = sched.abort("queued")
    assert aborted is not None and aborted.result().stop_reason == "abort" and "queued" not in sched
    assert sched.abort("nope") is None


def test_validate_request_is_the_one_check_and_keeps_clear_messages():
    ok = validate_request("r", [1, 2], {"max_tokens": 3}, max_seq_len=8, vocab_size=10)
    assert ok == EngineRequest("r", (1, 2), SamplingParams(max_tokens=3))
    for args, err, msg in [
        (("", [1], None), RequestError, "request_id"),
        (("r", "ab", None), RequestError, "integer token ids"),
        (("r", [], None), RequestError, "empty"),
        (("r", [1] * 8, None), PromptTooLongError, "max_seq_len is 8"),
        (("r", [1, 10], None), RequestError, "outside the vocabulary"),
        (("r", [1], {"stop_token_ids": [11]}), InvalidSamplingParamsError, "stop_token_ids"),
        (("r", [1], {"temperature": -1}), InvalidSamplingParamsError, "temperature"),
        (("r", [1], {"n": 2}), InvalidSamplingParamsError, "n=2"),
        (("r", [1], 5), InvalidSamplingParamsError, "SamplingParams or a dict"),
    ]:
        with pytest.raises(err, match=msg):
            validate_request(*args, max_seq_len=8, vocab_size=10)
    many = validate_request("g", [1], {"n": 3, "seed": 7}, max_seq_len=8, vocab_size=10, allow_n=True)
    samples = many.samples()
    assert [s.request_id for s in samples] == ["g:0", "g:1", "g:2"]
    assert [s.params.seed for s in samples] == [mix_seed(7, i + 1) for i in range(3)]
    assert all(s.params.n == 1 and s.prompt_ids == (1,) for s in samples)


def test_engine_commands_are_an_enum():
    assert {c.name for c in EngineCommand} == {"ADD", "UPDATE_WEIGHTS", "ABORT", "PAUSE", "RESUME", "CALL", "STOP"}


def test_a_server_request_is_validated_once(tiny_model_dir, monkeypatch):
    import rollout_cluster.engine.async_engine as async_engine
    import rollout_cluster.engine.base as base
    import rollout_cluster.server as server_module

    calls: list[str] = []
    real = base.validate_request

    def counting(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    for module in (base, async_engine, server_module):
        monkeypatch.setattr(module, "validate_request", counting)

    async def main() -> None:
        cfg = EmbeddedEngineConfig(max_batch_size=4, max_seq_len=64)
        server = server_module.RolloutServer(tiny_model_dir, engine_config=cfg, set_threads=False)
        try:
            await server.generate(request_id="one", prompt_ids=[5, 6], sampling_params={"max_tokens": 2})
            await server.generate_n(
                request_id="many", prompt_ids=[5, 6], sampling_params={"max_tokens": 2, "n": 3}
            )
        finally:
            await server.close()

    asyncio.run(main())
    assert calls == ["one", "many"]


def test_a_priority_0_request_is_admitted_before_waiting_priority_1_ones():
    """Evaluations (priority 1) take the slots training episodes leave: a training request
    that arrives later still starts first; within a level, arrival order holds."""
    sched = Scheduler(small_kv(), None, max_slots=2, max_prefill_tokens=100)
    low = SamplingParams(max_tokens=4, priority=1)
    for rid in ("e0", "e1", "e2"):
        sched.add(seq(rid, [1, 2], params=low))
    sched.add(seq("t0", [1, 2]))
    sched.add(seq("e3", [1, 2], params=low))
    sched.add(seq("t1", [1, 2]))
    assert [s.request_id for s in sched.waiting] == ["t0", "t1", "e0", "e1", "e2", "e3"]
    assert [s.request_id for s in sched.admit()] == ["t0", "t1"]
