"""Which token stopped each answer, seen from outside (#46 item 3).

The model is made here: a tiny random-init chat model whose turns end with `<|im_end|>` while
its eos is `</s>`, with a generation config listing both (as `areal-like model import` writes
one). One column of its (tied) embeddings is set so that every hidden state points the same
way, which makes the column a bias on the logits: `<|im_end|>` about one token in five, `</s>`
never. A run with the embedded engine then records, per sample, the end-of-turn id for an
answer that stopped and null for one the length cut; `areal-like serve` on the same folder
stops where the config's `rollout.stop_token_ids` say, and where the request's own say too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from areal_like.core.types import Trajectory
from areal_like.core.wire import decode, encode
from tests._serve import start_serve

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "areal_like.orchestration.cli"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
RESPONSE_LENGTH = 6


@pytest.fixture(scope="module")
def eot_model(tmp_path_factory) -> tuple[Path, int, int, int]:
    """(folder, eos id, end-of-turn id, vocabulary size)."""
    return _build(tmp_path_factory.mktemp("eot_model"), listed=True)


@pytest.fixture(scope="module")
def eot_unlisted_model(tmp_path_factory) -> tuple[Path, int, int, int]:
    """The same model as a GGUF conversion often leaves it: its config and generation config
    name the plain eos only; the chat template alone says where a turn ends."""
    return _build(tmp_path_factory.mktemp("eot_unlisted"), listed=False)


def _build(out: Path, listed: bool, hidden: int = 32) -> tuple[Path, int, int, int]:
    """`hidden` 128 gives heads of 32 (vLLM's CPU attention takes no smaller)."""
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    from areal_like.models.tiny_model import IM_END, build_tokenizer, tiny_qwen2_config

    tok = build_tokenizer()
    tok.add_special_tokens({"eos_token": "</s>"})  # the eos is no longer the end of a turn
    eos, eot = tok.eos_token_id, tok.convert_tokens_to_ids(IM_END)
    assert eos != eot
    cfg = tiny_qwen2_config(len(tok), tok, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2)
    cfg.eos_token_id = [eos, eot] if listed else eos
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # column 0 dominates every residual: its entries are the logits' bias
        w = model.model.embed_tokens.weight
        w[:, 0] = 8.0
        w[eot, 0] += 0.6  # about 0.2 of the mass
        w[eos, 0] -= 3.0  # never
    model.generation_config = GenerationConfig(eos_token_id=[eos, eot] if listed else eos,
                                               pad_token_id=tok.pad_token_id)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out, eos, eot, len(tok)


@pytest.mark.parametrize("model", ["eot_model", "eot_unlisted_model"])
def test_each_sample_record_names_the_token_that_stopped_it(model, request, tmp_path) -> None:
    """Listed in the generation config or not, an answer stops at the template's end of turn."""
    folder, _eos, eot, _ = request.getfixturevalue(model)
    run_dir = tmp_path / "run"
    sets = [f"model.path={folder}", f"run.dir={run_dir}", "train.total_steps=2", "train.batch_size=2",
            "rollout.group_size=4", f"rollout.response_length={RESPONSE_LENGTH}", "dataset.form=single_turn",
            "agent.default_loop=single_turn", "staleness.filter_uniform_groups=false",
            "run.record_trajectories=true", "eval.num_samples=4"]
    r = subprocess.run([*CLI, "run", "configs/quickstart.yaml", *[a for s in sets for a in ("--set", s)]],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    trajs = [json.loads(x) for x in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    stopped = [t for t in trajs if not t["truncated"]]
    cut = [t for t in trajs if t["truncated"]]
    assert stopped and cut, [(t["response_ids"], t["stop_token_id"]) for t in trajs]
    for t in stopped:  # ended at the template's end of turn, not run on to the length limit
        assert t["stop_token_id"] == eot == t["response_ids"][-1], t
        assert eot not in t["response_ids"][:-1]
    for t in cut:
        assert t["stop_token_id"] is None and len(t["response_ids"]) == RESPONSE_LENGTH, t
        assert eot not in t["response_ids"]


def test_the_stop_token_travels_on_the_wire_and_old_records_load() -> None:
    rec = dict(episode_id="e", group_id="g", prompt_ids=[1, 2], response_ids=[5, 3], response_mask=[1, 1],
               response_logprobs=[-0.5, -0.25], response_versions=[0, 0], reward=1.0)
    assert Trajectory.model_validate(rec).stop_token_id is None  # a record written before the field
    t = Trajectory.model_validate({**rec, "stop_token_id": 3})
    back = decode(encode(t))
    assert isinstance(back, Trajectory) and back.stop_token_id == 3


def _serve(folder: Path, *sets: str) -> tuple[subprocess.Popen[str], str]:
    args = [a for s in (f"model.path={folder}", *sets) for a in ("--set", s)]
    return start_serve([*CLI, "serve", "configs/quickstart.yaml", "--port", "0", *args], ROOT, ENV)


def _complete(url: str, **body) -> list[dict]:
    req = urllib.request.Request(f"{url}/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())["choices"]


def test_serve_stops_at_the_configs_stop_ids_and_at_the_requests(eot_model) -> None:
    """`serve` is given the config's `rollout.stop_token_ids` (half the vocabulary, the
    end-of-turn id left out); a request's own `stop_token_ids` (the other half) add to them."""
    folder, eos, eot, vocab = eot_model
    half = [t for t in range(vocab // 2) if t not in (eos, eot)]
    rest = [t for t in range(vocab // 2, vocab) if t not in (eos, eot)]
    proc, url = _serve(folder, f"rollout.stop_token_ids={half}")
    try:
        body = dict(prompt="12+30=", max_tokens=RESPONSE_LENGTH, n=16, temperature=1.0, seed=5)
        choices = _complete(url, **body)
        ends = {eot, *half}
        for c in choices:
            ids = c["token_ids"]
            assert not ends & set(ids[:-1]), ids  # nothing ran past a stop id
            if c["finish_reason"] == "stop":
                assert ids[-1] in ends and c["stop_token_id"] == ids[-1], c
            else:
                assert c["finish_reason"] == "length" and c["stop_token_id"] is None and len(ids) == RESPONSE_LENGTH
        assert any(c["stop_token_id"] in half for c in choices), choices  # the config's ids reached serve
        assert any(c["stop_token_id"] == eot for c in choices), choices  # and the model's end of turn
        both = _complete(url, **body, stop_token_ids=rest)  # every id now stops: one token each
        assert all(len(c["token_ids"]) == 1 and c["stop_token_id"] == c["token_ids"][0] for c in both), both
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_serve_ends_a_chat_turn_where_the_template_does(eot_unlisted_model) -> None:
    """The folder names the plain eos only: a chat completion still stops at the template's
    end of turn (a plain completion, rendered without the template, does not)."""
    folder, _eos, eot, _ = eot_unlisted_model
    proc, url = _serve(folder)
    try:
        body = dict(messages=[{"role": "user", "content": "12+30="}], max_tokens=RESPONSE_LENGTH, n=16,
                    temperature=1.0, seed=5)
        req = urllib.request.Request(f"{url}/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            choices = json.loads(resp.read())["choices"]
        stopped = [c for c in choices if c["finish_reason"] == "stop"]
        assert stopped and all(c["stop_token_id"] == eot for c in stopped), choices
        plain = _complete(url, prompt="12+30=", max_tokens=RESPONSE_LENGTH, n=16, temperature=1.0, seed=5)
        assert all(c["stop_token_id"] != eot for c in plain), plain
    finally:
        proc.kill()
        proc.wait(timeout=30)
