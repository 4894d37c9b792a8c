"""`model.dtype`: `auto` picks bfloat16 only where the device multiplies it natively, and the
dtype reaches both sides (the trainer's compute and the embedded engine's weights)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from areal_like.core import precision
from areal_like.core.config import ExperimentConfig
from areal_like.core.types import GenerateResult, SamplingParams
from areal_like.orchestration.audit import BF16_MEAN_TOL, BF16_TOL, audit_run
from rollout_cluster.server import build_engine

ROOT = Path(__file__).parent.parent
CLI = [sys.executable, "-m", "areal_like.orchestration.cli"]

AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma\n"
ZEN4 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw avx512_bf16 avx512_vnni\n"
SAPPHIRE = "processor\t: 0\nflags\t\t: avx2 avx512f amx_bf16 amx_tile amx_int8\n"


@pytest.mark.parametrize(("cpuinfo", "want"), [(AVX2_ONLY, ()), (ZEN4, ("avx512_bf16",)), (SAPPHIRE, ("amx_bf16",))])
def test_the_cpu_flags_that_make_bf16_native(tmp_path, cpuinfo, want) -> None:
    f = tmp_path / "cpuinfo"
    f.write_text(cpuinfo)
    assert precision.cpu_bf16_flags(str(f)) == want
    assert precision.cpu_bf16_flags(str(tmp_path / "absent")) == ()


def test_auto_is_bf16_only_on_a_cpu_with_native_bf16(monkeypatch) -> None:
    monkeypatch.setattr(precision, "cpu_bf16_flags", lambda: ("avx512_bf16",))
    assert precision.resolve_dtype("auto", "cpu") == "bfloat16"
    monkeypatch.setattr(precision, "cpu_bf16_flags", lambda: ())
    assert precision.resolve_dtype("auto", "cpu") == "float32"
    assert precision.resolve_dtype("bfloat16", "cpu") == "bfloat16"  # as set, whatever the CPU
    with pytest.raises(ValueError, match="model.dtype='float16' is not supported: use one of auto, float32, bfloat16"):
        precision.resolve_dtype("float16", "cpu")


@pytest.mark.parametrize("native", [True, False])
def test_auto_on_a_gpu_asks_cuda_for_native_bf16(monkeypatch, native) -> None:
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: asked.append(
        including_emulation) or native)
    assert precision.resolve_dtype("auto", "cuda:1") == ("bfloat16" if native else "float32")
    assert asked == [False]  # emulated bf16 (pre-Ampere) is not fast


def test_a_config_asking_for_float16_is_refused_at_load() -> None:
    with pytest.raises(ValueError, match="model.dtype"):
        ExperimentConfig.model_validate({"model": {"dtype": "float16"}})


@pytest.mark.parametrize(("flags", "want"), [(("avx512_bf16",), torch.bfloat16), ((), torch.float32)])
def test_the_embedded_engine_holds_its_weights_in_the_resolved_dtype(tiny_model_dir, monkeypatch, flags, want) -> None:
    monkeypatch.setattr(precision, "cpu_bf16_flags", lambda: flags)
    engine = build_engine(tiny_model_dir, set_threads=False, dtype="auto")
    assert {p.dtype for p in engine.engine.runner.model.parameters()} == {want}

    async def answer() -> GenerateResult:
        try:
            return await engine.generate(request_id="r", prompt_ids=[5, 6, 7],
                                         sampling_params=SamplingParams(max_tokens=4, ignore_eos=True))
        finally:
            await engine.close()

    out = asyncio.run(answer())
    assert len(out.token_ids) == 4 and all(lp <= 0 for lp in out.logprobs)


def test_a_bf16_run_trains_in_bf16_and_its_servers_serve_bf16(tiny_model_dir, tmp_path) -> None:
    run_dir = tmp_path / "run"
    sets = [f"model.path={tiny_model_dir}", f"run.dir={run_dir}", "model.dtype=bfloat16", "train.total_steps=2",
            "eval.every_n_steps=0", "staleness.filter_uniform_groups=false", "run.record_weights=true",
            "run.record_trajectories=true"]
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
    p = subprocess.run([*CLI, "run", str(ROOT / "configs/quickstart.yaml"), *[x for s in sets for x in ("--set", s)]],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    log = (run_dir / "run.log").read_text()
    said = [line for line in log.splitlines() if "model.dtype bfloat16: bfloat16 on cpu" in line]
    assert any(" train[0] " in line for line in said), log[-3000:]
    assert any(" server-0 " in line for line in said), log[-3000:]
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["kind"] == "train_step" for r in steps) == 2
    sent = load_file(str(run_dir / "weights" / "v2" / "model.safetensors"))  # what the servers were sent
    assert {t.dtype for t in sent.values()} == {torch.bfloat16}

    # the audit holds a bf16 run to bf16's rounding, and still catches a wrong logprob
    rep = audit_run(run_dir)
    assert rep.ok and rep.dtype == "bfloat16" and rep.tokens_checked > 100, rep.as_dict()
    assert 0 < rep.mean_logprob_error <= BF16_MEAN_TOL and rep.max_logprob_error <= BF16_TOL
    trajs = run_dir / "trajectories.jsonl"
    honest = trajs.read_text()
    rows = [json.loads(x) for x in honest.splitlines()]
    rows[0]["response_logprobs"][0] -= 1.0  # one token scored far off
    trajs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert not audit_run(run_dir).ok
    rows = [json.loads(x) for x in honest.splitlines()]
    for r in rows:  # every token a little off: within the per-token bound, not on average
        r["response_logprobs"] = [lp - 0.2 if m else lp for lp, m in zip(r["response_logprobs"], r["response_mask"],
                                                                          strict=True)]
    trajs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rep = audit_run(run_dir)
    assert not rep.ok and any("on average" in x for x in rep.problems), rep.problems


def test_a_bf16_engine_computes_as_the_trainers_autocast_does(tmp_path) -> None:
    """bf16 weights, but the residual stream, norms, rotary and softmax in fp32, as under the
    trainer's autocast: its behaviour logprobs sit nearer the trainer's recompute than a
    forward that is bf16 throughout (the engine before 2026-11-29) would."""
    from transformers import AutoModelForCausalLM

    from areal_like.models.tiny_model import init_model

    # deep and wide enough that bf16 rounding of the residual stream shows (SmolLM2 has 30 layers)
    model_dir = init_model(tmp_path / "deep", seed=0, num_hidden_layers=16, hidden_size=256, intermediate_size=512)
    engine = build_engine(model_dir, set_threads=False, dtype="bfloat16")
    prompts = [[1, 10 + i, 20 + i, 30, 40, 50 + i] for i in range(8)]

    async def answers() -> list[GenerateResult]:
        try:
            return await asyncio.gather(*[
                engine.generate(request_id=f"r{i}", prompt_ids=p, sampling_params=SamplingParams(max_tokens=24, ignore_eos=True))
                for i, p in enumerate(prompts)])
        finally:
            await engine.close()

    outs = asyncio.run(answers())
    fp32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    bf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()

    def logprobs(model: torch.nn.Module, autocast: bool) -> torch.Tensor:
        got = []
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            for p, o in zip(prompts, outs, strict=True):
                logits = model(torch.tensor([p + o.token_ids])).logits.float()[0, len(p) - 1 : -1]
                got.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(o.token_ids)[:, None])[:, 0])
        return torch.cat(got)

    with torch.no_grad():  # the weights the engine holds, in fp32 modules
        for t in fp32.parameters():
            t.copy_(t.to(torch.bfloat16).float())
    trainer = logprobs(fp32, autocast=True)  # the trainer's arithmetic: fp32 modules under bf16 autocast
    ours = (torch.tensor([x for o in outs for x in o.logprobs]) - trainer).abs().mean().item()
    all_bf16 = (logprobs(bf16, autocast=False) - trainer).abs().mean().item()
    assert ours < 0.75 * all_bf16, (ours, all_bf16)


def test_a_rollout_server_bounds_onednns_primitive_cache_unless_the_user_set_it(tiny_model_dir) -> None:
    """oneDNN keeps one primitive per matmul shape (1024 by default) and a server's shapes
    change every step: the SmolLM2 recipe's server grew by ~550 MB over 20 steps until the
    cache was bounded. oneDNN reads the bound at its first primitive, so it must be in the
    server's environment by the time its engine is built; a user's own value stands."""
    code = (f"import os\nfrom rollout_cluster.server import build_engine\n"
            f"build_engine({str(tiny_model_dir)!r}, dtype='bfloat16', set_threads=False)\n"
            "print('cache', os.environ.get('ONEDNN_PRIMITIVE_CACHE_CAPACITY'), flush=True)\nos._exit(0)\n")
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    for given, expected in ((None, precision.ONEDNN_CACHE), ("7", "7")):
        run_env = env if given is None else {**env, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": given}
        p = subprocess.run([sys.executable, "-c", code], env=run_env, cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 0, p.stderr[-2000:]
        assert f"cache {expected}" in p.stdout
