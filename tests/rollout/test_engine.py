"""Embedded engine, driven step by step: exactness vs HF, sampling, limits, interrupts.

The interrupt tests pin docs/design.md invariant 3 / §9.2: a weight update mid-flight
gives single responses with tokens of two versions, the pre-update tokens are those
an uninterrupted run produces, recompute counters move, and every token's logprob
equals a fresh forward pass of the weights of its recorded version.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_like.core.config import EmbeddedEngineConfig
from areal_like.core.types import GenerateResult, SamplingParams
from rollout_cluster.engine import (
    DuplicateRequestError,
    EmbeddedEngine,
    InvalidSamplingParamsError,
    PromptTooLongError,
    RequestError,
)

torch.set_num_threads(1)

CFG = EmbeddedEngineConfig(max_batch_size=16, max_seq_len=128)


def make_engine(model_dir, **kw) -> EmbeddedEngine:
    cfg = kw.pop("config", CFG)
    return EmbeddedEngine(model_dir, cfg, **kw)


def run_all(engine: EmbeddedEngine, max_steps: int = 10_000) -> dict[str, GenerateResult]:
    results: dict[str, GenerateResult] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.result is not None:
                results[out.request_id] = out.result
    return results


def steps(engine: EmbeddedEngine, n: int, into: dict[str, GenerateResult]) -> None:
    for _ in range(n):
        for out in engine.step():
            if out.result is not None:
                into[out.request_id] = out.result


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def perturbed(model: torch.nn.Module, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """New weights (named_parameters: tied lm_head is not listed separately)."""
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + scale * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def reference_model(model_dir, weights: dict[str, torch.Tensor] | None) -> torch.nn.Module:
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if weights:
        with torch.no_grad():
            for name, t in weights.items():
                m.get_parameter(name).copy_(t)
    return m


@torch.inference_mode()
def forward_logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / t, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def max_logprob_error(
    models: dict[int, torch.nn.Module], prompt, result: GenerateResult, temperature
) -> float:
    """Largest |engine logprob - fresh forward of the token's recorded version|."""
    worst = 0.0
    for v in set(result.versions):
        ref = forward_logprobs(models[v], prompt, result.token_ids, temperature)
        for i, (lp, tv) in enumerate(zip(result.logprobs, result.versions, strict=True)):
            if tv == v:
                worst = max(worst, abs(lp - ref[i].item()))
    return worst


PROMPTS = [[5 + (i * 7 + j * 3) % 50 for j in range(4 + (i * 5) % 13)] for i in range(12)]


def test_greedy_matches_hf_generate_and_forward(tiny_model_dir, hf_model):
    engine = make_engine(tiny_model_dir)
    prompts = PROMPTS[:4]
    for i, p in enumerate(prompts):
        engine.add_request(f"g{i}", p, SamplingParams(temperature=0.0, max_tokens=16))
    results = run_all(engine)
    for i, p in enumerate(prompts):
        r = results[f"g{i}"]
        ref = hf_model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p) :].tolist()
        assert r.token_ids == ref[: len(r.token_ids)]
        assert r.stop_reason == ("stop" if len(r.token_ids) < 16 else "length")
        lp = forward_logprobs(hf_model, p, r.token_ids, 1.0)
        assert torch.allclose(lp, torch.tensor(r.logprobs), atol=1e-4)
        assert r.versions == [0] * len(r.token_ids)


def test_sampled_logprobs_are_temperature_scaled_and_untruncated(tiny_model_dir, hf_model):
    engine = make_engine(tiny_model_dir, eos_token_ids=[])
    params = [
        SamplingParams(temperature=0.7, max_tokens=12, seed=1),
        SamplingParams(temperature=1.3, top_k=5, max_tokens=12, seed=2),
        SamplingParams(temperature=1.0, top_p=0.5, max_tokens=12, seed=3),
    ]
    for i, sp in enumerate(params):
        engine.add_request(f"s{i}", PROMPTS[i], sp)
    results = run_all(engine)
    for i, sp in enumerate(params):
        r = results[f"s{i}"]
        assert len(r.token_ids) == 12 and r.stop_reason == "length"
        lp = forward_logprobs(hf_model, PROMPTS[i], r.token_ids, sp.temperature)
        assert torch.allclose(lp, torch.tensor(r.logprobs), atol=1e-4)
    # top-k 5: every sampled token is among the 5 most likely at its position.
    with torch.inference_mode():
        r = results["s1"]
        logits = hf_model(torch.tensor([PROMPTS[1] + r.token_ids])).logits[0, len(PROMPTS[1]) - 1 : -1]
        top5 = logits.topk(5, dim=-1).indices
        assert all(t in top5[i].tolist() for i, t in enumerate(r.token_ids))


def test_seeded_sampling_is_reproducible_and_independent_of_batch(tiny_model_dir):
    sp = SamplingParams(temperature=1.0, max_tokens=20, seed=1234)
    alone = make_engine(tiny_model_dir, eos_token_ids=[])
    alone.add_request("a", PROMPTS[0], sp)
    ref = run_all(alone)["a"].token_ids
    crowd = make_engine(tiny_model_dir, eos_token_ids=[])
    for i in range(6):
        crowd.add_request(f"o{i}", PROMPTS[i + 1], SamplingParams(temperature=1.0, max_tokens=5 + i, seed=i))
    steps(crowd, 3, {})
    crowd.add_request("a", PROMPTS[0], sp)  # joins a running batch mid-way
    assert run_all(crowd)["a"].token_ids == ref
    other = make_engine(tiny_model_dir, eos_token_ids=[])
    other.add_request("a", PROMPTS[0], sp.model_copy(update={"seed": 99}))
    assert run_all(other)["a"].token_ids != ref


def test_stop_tokens_max_tokens_and_max_seq_len(tiny_model_dir):
    engine = make_engine(tiny_model_dir, eos_token_ids=[])
    engine.add_request("free", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=10))
    free = run_all(engine)["free"]
    stop_tok = free.token_ids[3]
    first = free.token_ids.index(stop_tok)
    engine.add_request(
        "stop", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_tok])
    )
    long_prompt = [5 + i % 50 for i in range(120)]
    engine.add_request("cap", long_prompt, SamplingParams(temperature=0.0, max_tokens=100))
    res = run_all(engine)
    assert res["stop"].stop_reason == "stop" and res["stop"].token_ids == free.token_ids[: first + 1]
    assert free.stop_reason == "length" and len(free.token_ids) == 10
    assert res["cap"].stop_reason == "length" and len(res["cap"].token_ids) == 128 - 120
    # the result names the id that stopped it; none when the length cut it
    assert res["stop"].stop_token_id == stop_tok and free.stop_token_id is None is res["cap"].stop_token_id


def test_ignore_eos_decodes_past_the_models_eos(tiny_model_dir):
    free = make_engine(tiny_model_dir, eos_token_ids=[])
    free.add_request("free", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12))
    ref = run_all(free)["free"].token_ids
    eos = ref[2]  # pretend the model's eos is a token greedy decoding emits early
    engine = make_engine(tiny_model_dir, eos_token_ids=[eos])
    engine.add_request("eos", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12))
    engine.add_request("ign", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    res = run_all(engine)
    assert res["eos"].stop_reason == "stop" and res["eos"].token_ids == ref[: ref.index(eos) + 1]
    assert res["ign"].stop_reason == "length" and res["ign"].token_ids == ref
    assert res["eos"].stop_token_id == eos and res["ign"].stop_token_id is None  # the model's eos stopped it


def test_abort_returns_partial_tokens(tiny_model_dir):
    engine = make_engine(tiny_model_dir, eos_token_ids=[])
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=50, seed=0))
    engine.add_request("b", PROMPTS[1], SamplingParams(max_tokens=50, seed=0))
    engine.add_request("queued", PROMPTS[2], SamplingParams(max_tokens=50))
    done: dict[str, GenerateResult] = {}
    engine.pause()
    assert engine.step() == []  # paused: nothing scheduled
    engine.resume()
    steps(engine, 5, done)
    (ra,) = engine.abort(["a", "unknown"])
    assert ra.stop_reason == "abort" and len(ra.token_ids) == 5 == len(ra.logprobs) == len(ra.versions)
    assert ra.stop_token_id is None
    res = run_all(engine)
    assert "a" not in res and len(res["b"].token_ids) == 50
    assert engine.metrics()["requests_aborted"] == 1


def test_bad_requests_are_refused_with_clear_errors(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    with pytest.raises(PromptTooLongError, match="max_seq_len is 128"):
        engine.add_request("long", [5] * 128, SamplingParams())
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.add_request("oov", [5, engine.vocab_size], SamplingParams())
    with pytest.raises(InvalidSamplingParamsError, match="n=2"):
        engine.add_request("n", [5, 6], SamplingParams(n=2))
    engine.add_request("dup", [5, 6], SamplingParams())
    with pytest.raises(DuplicateRequestError):
        engine.add_request("dup", [5, 6], SamplingParams())
    assert issubclass(PromptTooLongError, ValueError)


def test_prefix_cache_shares_prompts_and_reuses_previous_turns(tiny_model_dir, hf_model):
    engine = make_engine(tiny_model_dir)
    nocache = make_engine(tiny_model_dir, config=CFG.model_copy(update={"prefix_cache": False}))
    prompt = PROMPTS[5]
    for e in (engine, nocache):
        for i in range(4):  # a GRPO group: same prompt, different seeds
            e.add_request(f"g{i}", prompt, SamplingParams(temperature=1.0, max_tokens=8, seed=i))
    got, want = run_all(engine), run_all(nocache)
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in want.items()}
    m = engine.metrics()
    assert m["prefill_tokens"] == len(prompt)  # computed once for four requests
    # Next turn of an episode: previous sequence + observation tokens.
    prev = got["g0"]
    turn2 = prompt + prev.token_ids + [7, 8, 9]
    engine.add_request("t2", turn2, SamplingParams(temperature=0.0, max_tokens=6))
    r = run_all(engine)["t2"]
    assert engine.metrics()["prefill_tokens"] - m["prefill_tokens"] < len(turn2) - 5
    lp = forward_logprobs(hf_model, turn2, r.token_ids, 1.0)
    assert torch.allclose(lp, torch.tensor(r.logprobs), atol=1e-4)


def test_a_shared_preamble_and_an_interrupted_groups_prompt_are_computed_once(tiny_model_dir, hf_model):
    """Prompts of one chat template share their first tokens: a prefix one computed is found
    in the cache by the next (a common prefix, not a whole entry). And when a weight update
    interrupts GRPO groups, each group's prompt is recomputed once with the new weights,
    not once per answer: same tokens as an engine without a prefix cache, and the logprobs
    HF gives under each token's version."""
    preamble = [9 + i % 40 for i in range(24)]
    prompts = [preamble + p for p in PROMPTS[:3]]
    engine = make_engine(tiny_model_dir, eos_token_ids=[])
    nocache = make_engine(tiny_model_dir, eos_token_ids=[], config=CFG.model_copy(update={"prefix_cache": False}))
    new = perturbed(hf_model, seed=7)
    for e in (engine, nocache):
        for g, p in enumerate(prompts):
            for i in range(4):
                e.add_request(f"g{g}-{i}", p, SamplingParams(temperature=1.0, max_tokens=12, seed=10 * g + i))
    done: dict[str, dict[str, GenerateResult]] = {"c": {}, "n": {}}
    steps(engine, 4, done["c"])
    steps(nocache, 4, done["n"])
    first = engine.metrics()["prefill_tokens"]
    assert first < sum(map(len, prompts)) - 2 * len(preamble) + 3  # the preamble once, not three times
    for e in (engine, nocache):
        e.update_weights(new.items(), version=1)
    recomputed = engine.metrics()["prefill_tokens"] - first
    in_flight = 12 * (len(preamble) + 3)  # every answer's prompt and its 4 tokens, at least
    assert recomputed < in_flight / 2, (recomputed, in_flight)
    done["c"].update(run_all(engine))
    done["n"].update(run_all(nocache))
    assert {k: r.token_ids for k, r in done["c"].items()} == {k: r.token_ids for k, r in done["n"].items()}
    ref = reference_model(tiny_model_dir, new)
    for g, p in enumerate(prompts):
        r = done["c"][f"g{g}-1"]
        assert r.versions[:4] == [0] * 4 and set(r.versions[4:]) == {1}
        lp = forward_logprobs(ref, p + r.token_ids[:4], r.token_ids[4:], 1.0)
        assert torch.allclose(lp, torch.tensor(r.logprobs[4:]), atol=1e-4)


def test_load_weights_keeps_embeddings_tied_and_rejects_unknown_names(tiny_model_dir, hf_model):
    engine = make_engine(tiny_model_dir)
    new = perturbed(hf_model, seed=3)
    assert "lm_head.weight" not in new
    engine.load_weights(new.items(), version=1)
    m = engine.model
    assert torch.equal(m.lm_head.weight, new["model.embed_tokens.weight"])
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    with pytest.raises(KeyError, match="unknown weight"):
        engine.load_weights([("model.nope", torch.zeros(1))], version=2)
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights([("model.norm.weight", torch.zeros(3))], version=2)
    assert engine.version == 1  # a refused load changes nothing


def _interrupted_run(model_dir, mode: str, updates: list[dict[str, torch.Tensor]], gap: int = 6):
    """16 sampled requests; a weight update every `gap` steps while they decode."""
    engine = make_engine(model_dir, interrupt_mode=mode, eos_token_ids=[])
    params = {
        f"r{i}": SamplingParams(temperature=1.0, max_tokens=10 + 2 * i, seed=100 + i) for i in range(16)
    }
    for i, (rid, sp) in enumerate(params.items()):
        engine.add_request(rid, PROMPTS[i % len(PROMPTS)], sp)
    done: dict[str, GenerateResult] = {}
    for v, weights in enumerate(updates, start=1):
        steps(engine, gap, done)
        for out in engine.update_weights(weights.items(), version=v):
            if out.result is not None:
                done[out.request_id] = out.result
        assert engine.version == v
    done.update(run_all(engine))
    prompts = {f"r{i}": PROMPTS[i % len(PROMPTS)] for i in range(16)}
    return engine, done, params, prompts


@pytest.fixture(scope="module")
def versions(tiny_model_dir, hf_model):
    w1 = perturbed(hf_model, seed=1)
    w2 = perturbed(hf_model, seed=2)
    models = {0: hf_model, 1: reference_model(tiny_model_dir, w1), 2: reference_model(tiny_model_dir, w2)}
    return [w1, w2], models


def test_recompute_interrupt_keeps_tokens_and_matches_fresh_forward(tiny_model_dir, versions):
    updates, models = versions
    engine, done, params, prompts = _interrupted_run(tiny_model_dir, "recompute", updates)
    ref_engine, ref, _, _ = _interrupted_run(tiny_model_dir, "recompute", [])
    assert set(done) == set(params)
    mixed = [r for r in done.values() if len(set(r.versions)) >= 2]
    assert mixed, "no single response spans a weight update"
    assert any(len(set(r.versions)) == 3 for r in done.values())
    for rid, r in done.items():
        assert len(r.token_ids) == params[rid].max_tokens
        assert r.versions == sorted(r.versions)
        n0 = r.versions.count(0)
        # Tokens sampled before the first update are exactly the uninterrupted run's.
        assert r.token_ids[:n0] == ref[rid].token_ids[:n0]
        assert r.logprobs[:n0] == ref[rid].logprobs[:n0]
        assert max_logprob_error(models, prompts[rid], r, 1.0) < 1e-4
    m = engine.metrics()
    assert m["interrupts"] == 2 and m["recompute_tokens"] > 0 and m["interrupted_tokens"] > 0
    assert m["pause_resume_latency_s_max"] > 0
    assert sum(r.num_interrupts for r in done.values()) == m["interrupted_requests"]


def test_keep_mode_uses_stale_kv_and_measurably_differs(tiny_model_dir, versions):
    updates, models = versions
    engine, done, params, prompts = _interrupted_run(tiny_model_dir, "keep", updates)
    errors = [max_logprob_error(models, prompts[rid], r, 1.0) for rid, r in done.items()]
    assert max(errors) > 1e-3  # stale KV: logprobs no longer what the recorded version gives
    assert engine.metrics()["recompute_tokens"] == 0 and engine.metrics()["interrupts"] == 2


def test_wait_mode_never_mixes_versions(tiny_model_dir, versions):
    updates, models = versions
    engine, done, params, prompts = _interrupted_run(tiny_model_dir, "wait", updates)
    assert set(done) == set(params)
    assert all(len(set(r.versions)) == 1 for r in done.values())
    for rid, r in done.items():
        assert max_logprob_error(models, prompts[rid], r, 1.0) < 1e-4
    assert engine.metrics()["interrupts"] == 0


def test_failed_update_leaves_inflight_requests_on_the_old_version(tiny_model_dir, hf_model):
    engine = make_engine(tiny_model_dir, eos_token_ids=[])
    for i in range(4):
        engine.add_request(f"r{i}", PROMPTS[i], SamplingParams(temperature=1.0, max_tokens=12, seed=i))
    done: dict[str, GenerateResult] = {}
    steps(engine, 4, done)
    bad = [*perturbed(hf_model, seed=5).items(), ("model.nope", torch.zeros(1))]
    with pytest.raises(KeyError, match="unknown weight"):
        engine.update_weights(bad, version=1)
    done.update(run_all(engine))
    assert engine.version == 0 and engine.metrics()["interrupts"] == 0
    for i in range(4):
        r = done[f"r{i}"]
        assert r.versions == [0] * 12 and r.num_interrupts == 0
        assert max_logprob_error({0: hf_model}, PROMPTS[i], r, 1.0) < 1e-4


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_each_architecture_it_claims_matches_hf(arch, tmp_path):
    """Qwen3 (q/k norms before rotary, no biases) and Llama, as the quickstart's Qwen2 above:
    the engine's sampled tokens score as HF's forward scores them, in batches of several."""
    from transformers import AutoConfig

    kw = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)
    if arch == "qwen3":
        kw["head_dim"] = 16
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **kw)).eval()
    model.save_pretrained(tmp_path)
    engine = make_engine(str(tmp_path))
    for i, p in enumerate(PROMPTS[:6]):
        engine.add_request(f"a{i}", p, SamplingParams(temperature=1.0, max_tokens=12, seed=i))
    results = run_all(engine)
    with torch.no_grad():
        for i, p in enumerate(PROMPTS[:6]):
            r = results[f"a{i}"]
            lp = forward_logprobs(model, p, r.token_ids, 1.0)
            torch.testing.assert_close(torch.tensor(r.logprobs), lp, atol=1e-4, rtol=0)
