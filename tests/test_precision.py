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
            "eval.every_n_steps=0", "staleness.filter_uniform_groups=false", "run.record_weights=true"]
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
