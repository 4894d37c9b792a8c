"""TRL-style rewards get TRL's arguments; rewards reading moved `extra` keys fail loudly (#30).

TRL's `GRPOTrainer._calculate_rewards` calls a reward as `f(prompts=..., completions=...,
completion_ids=..., **columns)`: every dataset column under its own name except
`prompt` / `completion` / `completion_ids`, plus `trainer_state`, `log_extra`,
`log_metric` (not passed here). The TRL-free tests pin exactly what our side passes; the
parity test runs TRL itself (where `.venv-trl` exists, `bash bench/setup_trl.sh`, or TRL is
importable here) and compares its arguments with ours for the same rows.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from areal_like.core.types import AgentLoopOutput
from areal_like.orchestration.dataset import normalise_row
from rollout_cluster.rewards import RewardError, compute_reward, load_reward, trl_reward_kwargs

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "areal_like" / "assets" / "quickstart_model"

STANDARD = {"prompt": "12+34", "answer": 46, "level": "easy"}
CONVERSATIONAL = {"prompt": [{"role": "user", "content": "12+34"}], "answer": "46", "tags": ["a", "b"]}


def output(final_text: str, ids: list[int], mask: list[int] | None = None) -> AgentLoopOutput:
    mask = mask or [1] * len(ids)
    return AgentLoopOutput(prompt_ids=[1], response_ids=ids, response_mask=mask,
                           response_logprobs=[-0.5 if m else 0.0 for m in mask],
                           response_versions=[0 if m else -1 for m in mask], final_text=final_text)


def score(fn: Any, sample: dict[str, Any], out: AgentLoopOutput) -> float:
    return asyncio.run(compute_reward(load_reward(fn), sample, out, timeout_s=5.0))[0]


# ---- what our side passes (no TRL needed) -------------------------------------------------

def test_standard_row_every_column_by_name_prompt_and_answer_once() -> None:
    sample = normalise_row({"q": "12+34", "answer": 46, "level": "easy"}, "row", prompt_key="q")
    assert trl_reward_kwargs(sample, output("46", [5, 6, 3])) == {
        "q": ["12+34"], "answer": [46], "level": ["easy"],  # the answer as the dataset held it
        "prompts": ["12+34"], "completions": ["46"], "completion_ids": [[5, 6, 3]],
    }
    renamed = normalise_row({"question": "2+2", "solution": "4", "level": 0}, "row",
                            prompt_key="question", answer_key="solution")
    assert trl_reward_kwargs(renamed, output("4", [5])) == {
        "question": ["2+2"], "solution": ["4"], "level": [0],  # no second copy under `answer`
        "prompts": ["2+2"], "completions": ["4"], "completion_ids": [[5]],
    }


def test_conversational_row_prompts_and_completions_are_messages() -> None:
    sample = normalise_row(CONVERSATIONAL, "row")
    assert trl_reward_kwargs(sample, output("46", [5, 6, 3])) == {
        "answer": ["46"], "tags": [["a", "b"]],  # a column named `prompt` is `prompts` only, as in TRL
        "prompts": [CONVERSATIONAL["prompt"]],
        "completions": [[{"role": "assistant", "content": "46"}]],
        "completion_ids": [[5, 6, 3]],
    }


def test_multi_turn_episode_completions_and_ids_are_the_final_answer() -> None:
    sample = normalise_row(STANDARD, "row")
    # turn 1 (a tool call: 5 6 7), the tool's answer (8 9, mask 0), turn 2 (the answer: 4 3)
    out = output("46", [5, 6, 7, 8, 9, 4, 3], [1, 1, 1, 0, 0, 1, 1])
    kwargs = trl_reward_kwargs(sample, out)
    assert kwargs["completions"] == ["46"] and kwargs["completion_ids"] == [[4, 3]]
    cut = output("", [5, 6, 7, 8, 9], [1, 1, 1, 0, 0])  # ended after a tool answer: the last turn
    assert trl_reward_kwargs(sample, cut)["completion_ids"] == [[5, 6, 7]]


def test_the_reported_reward_scores_with_a_renamed_prompt_column(tmp_path: Path) -> None:
    """`KeyError: 'q'` before: the prompt column only arrived as `prompts`."""
    from areal_like.core.config import DatasetConfig
    from areal_like.orchestration.dataset import load_rows

    (tmp_path / "d.jsonl").write_text(json.dumps({"q": "12+34", "answer": "46"}) + "\n")
    [row] = load_rows(DatasetConfig(type="jsonl", path=str(tmp_path / "d.jsonl"), prompt_key="q",
                                    eval_split=0.0), "train", 0)

    def exact(completions, q, answer):  # no **kwargs: gets only what it names
        return [float(sum(map(int, p.split("+"))) == int(a) == int(c)) for p, a, c in zip(q, answer, completions, strict=True)]

    assert score(exact, row, output("46", [5])) == 1.0


def test_a_row_made_by_hand_passes_its_extra_and_answer() -> None:
    row = {"prompt": [{"role": "user", "content": "1+1"}], "prompt_text": "1+1", "answer": "2",
           "extra": {"level": 1}}
    assert trl_reward_kwargs(row, output("2", [5])) == {
        "level": [1], "answer": ["2"], "prompts": ["1+1"], "completions": ["2"], "completion_ids": [[5]]}


# ---- parity with TRL itself --------------------------------------------------------------

_PROBE = r'''
import json, os, sys
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
import torch
from datasets import Dataset
from transformers import Qwen2ForCausalLM
from trl import GRPOConfig, GRPOTrainer
from areal_like.models.tiny_model import load_tokenizer

model_dir, out_dir, rows = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
torch.set_num_threads(1)
seen = {}

class Seen(Exception):
    pass

for name, row in rows.items():
    def spy(prompts, completions, completion_ids, **kwargs):
        seen[name] = {"prompts": prompts[0], "completions": completions[0], "completion_ids": completion_ids[0],
                      "columns": {k: v[0] for k, v in kwargs.items() if isinstance(v, list)},
                      "not_columns": sorted(k for k, v in kwargs.items() if not isinstance(v, list))}
        raise Seen  # the arguments are all we need: no training step

    args = GRPOConfig(output_dir=os.path.join(out_dir, name), per_device_train_batch_size=2, num_generations=2,
                      max_completion_length=6, max_steps=1, report_to="none", use_cpu=True, save_strategy="no",
                      disable_tqdm=True, gradient_checkpointing=False, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=Qwen2ForCausalLM.from_pretrained(model_dir), reward_funcs=[spy], args=args,
                          train_dataset=Dataset.from_list([row, row]), processing_class=load_tokenizer(model_dir, hf=True))
    try:
        trainer.train()
    except Seen:
        pass
print("PROBE " + json.dumps(seen))
'''


def _trl_python() -> str | None:
    if importlib.util.find_spec("trl") is not None:
        return sys.executable
    venv = REPO / ".venv-trl" / "bin" / "python"
    return str(venv) if venv.exists() else None


def test_parity_with_trls_own_reward_call(tmp_path: Path) -> None:
    python = _trl_python()
    if python is None:
        pytest.skip("TRL is not installed here and there is no .venv-trl (bash bench/setup_trl.sh makes it)")
    (tmp_path / "probe.py").write_text(_PROBE)
    rows = {"standard": STANDARD, "conversational": CONVERSATIONAL}
    run = subprocess.run([python, str(tmp_path / "probe.py"), str(MODEL), str(tmp_path), json.dumps(rows)],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    line = next((x for x in run.stdout.splitlines() if x.startswith("PROBE ")), None)
    assert run.returncode == 0 and line, run.stderr[-3000:]
    trl = json.loads(line[len("PROBE "):])
    for name, row in rows.items():
        got = trl[name]
        # TRL's non-column arguments: the ones we document as not passed, nothing new
        assert set(got["not_columns"]) <= {"trainer_state", "log_extra", "log_metric", "environments"}, got
        text = got["completions"] if name == "standard" else got["completions"][0]["content"]
        ours = trl_reward_kwargs(normalise_row(row, name), output(text, got["completion_ids"]))
        expected = {**got["columns"], "prompts": got["prompts"], "completions": got["completions"],
                    "completion_ids": got["completion_ids"]}
        assert json.loads(json.dumps({k: v[0] for k, v in ours.items()})) == expected, name


# ---- rewards written for `output.extra["final_text"]` (item 7) ---------------------------

def test_old_extra_final_text_fails_loudly_naming_the_new_field() -> None:
    sample = normalise_row(STANDARD, "row")
    out = output("46", [5])

    def old(sample, output):
        return float(output.extra["final_text"] == sample["answer"])

    def old_get(sample, output):  # would have scored 0 on every episode, silently
        return float(output.extra.get("final_text", "") == sample["answer"])

    for fn in (old, old_get):
        with pytest.raises(RewardError, match=r"read output\.final_text") as info:
            asyncio.run(compute_reward(fn, sample, out, timeout_s=5.0))
        assert info.value.reason == "raised"


def test_extra_is_otherwise_a_plain_dict() -> None:
    # a loop still writing the old dict: lifted to the field, and the reward reads the field
    out = AgentLoopOutput(prompt_ids=[1], response_ids=[5], response_mask=[1], response_logprobs=[-0.1],
                          response_versions=[0], extra={"final_text": "46", "tool_rewards": [1.0]})
    assert out.final_text == "46" and out.extra == {"tool_rewards": [1.0]}
    assert out.extra.get("missing", 3) == 3 and "final_text" not in out.extra
    with pytest.raises(KeyError, match="^'missing'$"):
        out.extra["missing"]
    out.extra["final_text"] = "mine"  # a loop's own key of that name is its own
    assert out.extra["final_text"] == out.extra.get("final_text") == "mine"
    again = pickle.loads(pickle.dumps(out))
    assert again.extra == out.extra and type(again.extra) is type(out.extra)
    assert type(out.model_dump()["extra"]) is dict
    with pytest.raises(KeyError, match=r"output\.messages"):
        output("", [5]).extra["messages"]
