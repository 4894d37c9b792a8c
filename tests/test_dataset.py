"""Datasets: formats, bad rows refused with file:line, over-long prompts counted, resumable order."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from areal_like.core.config import DatasetConfig
from areal_like.orchestration.dataset import DatasetError, PromptSource, load_rows


def test_generated_train_and_eval_are_disjoint() -> None:
    cfg = DatasetConfig(num_train=500, num_eval=100)
    train, ev = load_rows(cfg, "train", 0), load_rows(cfg, "eval", 0)
    assert len(ev) == 100 and 0 < len(train) <= 500
    assert not {r["extra"]["expression"] for r in train} & {r["extra"]["expression"] for r in ev}
    assert train[0]["prompt"][0]["role"] == "user" and train[0]["agent_name"] == "tool_agent"


def test_jsonl_and_parquet(tmp_path) -> None:
    rows = [{"prompt": "2+2", "answer": "4"}, {"prompt": [{"role": "user", "content": "3*3"}], "answer": "9", "agent_name": "single_turn"}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    got = load_rows(DatasetConfig(type="jsonl", path=str(tmp_path / "d.jsonl")), "train", 0)
    assert got[0]["prompt"] == [{"role": "user", "content": "2+2"}] and got[1]["agent_name"] == "single_turn"
    pq.write_table(pa.Table.from_pylist([{"prompt": "2+2", "answer": "4"}]), tmp_path / "d.parquet")
    got = load_rows(DatasetConfig(type="parquet", path=str(tmp_path / "d.parquet")), "train", 0)
    assert got[0]["answer"] == "4"


@pytest.mark.parametrize(
    "line, needle",
    [
        ('{"answer": "4"}', r"d.jsonl:2: missing column\(s\) \['prompt'\]"),
        ('{"prompt": "  ", "answer": "4"}', "d.jsonl:2: empty prompt"),
        ('{"prompt": [{"role": "robot", "content": "x"}], "answer": "4"}', r"prompt\[0\] must be a chat message"),
        ('{"prompt": 5, "answer": "4"}', "must be a non-empty string"),
        ("{not json", "d.jsonl:2: not valid JSON"),
    ],
)
def test_bad_rows_refused_with_location(tmp_path, line, needle) -> None:
    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n' + line + "\n")
    with pytest.raises(DatasetError, match=needle):
        load_rows(DatasetConfig(type="jsonl", path=str(tmp_path / "d.jsonl")), "train", 0)


def test_missing_file(tmp_path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        load_rows(DatasetConfig(type="jsonl", path=str(tmp_path / "nope.jsonl")), "train", 0)


def test_prompt_source_filters_counts_and_resumes() -> None:
    rows = [{"prompt": [{"role": "user", "content": "x" * n}], "answer": str(n)} for n in range(1, 11)]
    src = PromptSource(rows, seed=1, prompt_len=lambda r: len(r["prompt"][0]["content"]), max_prompt_len=7)
    assert src.filtered_too_long == 3
    first = [src.next()["answer"] for _ in range(12)]  # crosses an epoch boundary
    assert set(first[:7]) == {str(n) for n in range(1, 8)}
    state = src.state_dict()
    more = [src.next()["answer"] for _ in range(5)]
    again = PromptSource(rows, seed=1, prompt_len=lambda r: len(r["prompt"][0]["content"]), max_prompt_len=7)
    again.load_state_dict(state)
    assert [again.next()["answer"] for _ in range(5)] == more
    with pytest.raises(DatasetError, match="no usable rows"):
        PromptSource(rows, seed=1, prompt_len=lambda r: 100, max_prompt_len=7)
