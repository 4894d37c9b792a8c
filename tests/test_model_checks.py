"""A model folder that cannot serve the config is refused before anything starts
(docs/real_models.md §8): `run` and `serve` exit 2 in one line that names the folder, what
is wrong and the fix, within seconds, and write no run folder. The folders are made here:
a tiny random-init GPT-2 (an architecture the embedded engine does not compute), and a
copy of the tiny test model without its chat template."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "areal_like.orchestration.cli"]


def _one_line_exit_2(args: list[str], run_dir: Path | None, *must: str) -> None:
    t0 = time.monotonic()
    r = subprocess.run([*CLI, *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    took = time.monotonic() - t0
    assert r.returncode == 2, r.stdout + r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, r.stderr
    for text in must:
        assert text in errors[0], errors[0]
    assert "Traceback" not in r.stderr and "--resume" not in r.stdout + r.stderr
    assert took < 15, f"refused after {took:.1f}s"
    if run_dir is not None:
        assert not run_dir.exists(), sorted(p.name for p in run_dir.iterdir())


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, tiny_model_dir) -> Path:
    import transformers

    out = tmp_path_factory.mktemp("gpt2")
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=128, n_embd=16, n_layer=1, n_head=2)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(out)
    for f in Path(tiny_model_dir).iterdir():  # a tokenizer with a chat template
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def no_template_dir(tmp_path_factory, tiny_model_dir) -> Path:
    out = tmp_path_factory.mktemp("no_template")
    shutil.copytree(tiny_model_dir, out, dirs_exist_ok=True)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    tok = json.loads((out / "tokenizer_config.json").read_text())
    tok.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(tok))
    return out


def test_run_refuses_an_architecture_the_embedded_engine_does_not_compute(gpt2_dir, tmp_path) -> None:
    run_dir = tmp_path / "run"
    _one_line_exit_2(["run", "configs/quickstart.yaml", "--set", f"model.path={gpt2_dir}", "--set", f"run.dir={run_dir}"],
                     run_dir, str(gpt2_dir), "model type 'gpt2'", "rollout.engine.type=vllm")


def test_serve_refuses_it_in_one_line_too(gpt2_dir) -> None:
    _one_line_exit_2(["serve", "configs/quickstart.yaml", "--port", "0", "--set", f"model.path={gpt2_dir}"],
                     None, str(gpt2_dir), "model type 'gpt2'")


def test_run_refuses_a_tokenizer_without_chat_template(no_template_dir, tmp_path) -> None:
    run_dir = tmp_path / "run"
    _one_line_exit_2(["run", "configs/quickstart.yaml", "--set", f"model.path={no_template_dir}",
                      "--set", f"run.dir={run_dir}"], run_dir, str(no_template_dir), "no chat template",
                     "chat_template.jinja")


def test_stop_token_ids_out_of_the_vocabulary_are_refused_before_start(tiny_model_dir, tmp_path) -> None:
    run_dir = tmp_path / "run"
    _one_line_exit_2(["run", "configs/quickstart.yaml", "--set", f"model.path={tiny_model_dir}",
                      "--set", f"run.dir={run_dir}", "--set", "rollout.stop_token_ids=[5,100000]"],
                     run_dir, "rollout.stop_token_ids [100000] are outside the vocabulary")


def test_stop_token_ids_end_every_answer_at_the_first_such_token(tiny_model_dir, tmp_path) -> None:
    """`rollout.stop_token_ids` reaches the engine: with every id of the vocabulary a stop
    id, each answer is one token long, and that token is kept (vLLM's semantics)."""
    import transformers

    vocab = transformers.AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    run_dir = tmp_path / "run"
    sets = [f"model.path={tiny_model_dir}", f"run.dir={run_dir}", "train.total_steps=1", "train.batch_size=2",
            "rollout.group_size=2", "dataset.form=single_turn", "agent.default_loop=single_turn",
            "staleness.filter_uniform_groups=false", "run.record_trajectories=true", "eval.num_samples=4",
            f"rollout.stop_token_ids={list(range(vocab))}"]
    r = subprocess.run([*CLI, "run", "configs/quickstart.yaml", *[a for s in sets for a in ("--set", s)]],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    trajs = [json.loads(x) for x in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    assert trajs and all(len(t["response_ids"]) == 1 for t in trajs), [t["response_ids"] for t in trajs]


def test_a_sequence_limit_past_the_models_positions_is_refused_before_start(tiny_model_dir, tmp_path) -> None:
    import transformers

    longest = transformers.AutoConfig.from_pretrained(tiny_model_dir).max_position_embeddings
    run_dir = tmp_path / "run"
    _one_line_exit_2(["run", "configs/quickstart.yaml", "--set", f"model.path={tiny_model_dir}",
                      "--set", f"run.dir={run_dir}", "--set", f"rollout.engine.max_seq_len={longest + 1}"],
                     run_dir, f"max_seq_len={longest + 1} exceeds the max_position_embeddings ({longest})")


def test_lora_settings_are_refused_before_start(tiny_model_dir, tmp_path) -> None:
    """A LoRA run whose start adapter is not one is one line, exit 2, nothing written (peft
    missing takes the same path: `paths._check_lora`)."""
    run_dir = tmp_path / "run"
    common = ["run", "configs/quickstart.yaml", "--set", f"model.path={tiny_model_dir}", "--set", f"run.dir={run_dir}",
              "--set", "model.lora.rank=8"]
    _one_line_exit_2([*common, "--set", f"model.lora.init_from={tmp_path}"], run_dir, "not a saved adapter")
