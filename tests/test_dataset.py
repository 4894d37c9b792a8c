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


# ---- datasets the way users hold them (docs/design.md §9.11) -----------------------------

QA = [{"question": f"{i}+1", "solution": str(i + 1), "level": i % 3} for i in range(20)]


def _cfg(**kw) -> DatasetConfig:
    return DatasetConfig(prompt_key="question", answer_key="solution", eval_split=0.0, **kw)


def _check_qa(rows) -> None:
    assert [r["answer"] for r in rows] == [r["solution"] for r in QA]
    assert rows[0]["prompt"] == [{"role": "user", "content": "0+1"}] and rows[0]["prompt_text"] == "0+1"
    assert rows[3]["extra"] == {"solution": "4", "level": 0}  # other columns reach rewards


def test_column_mapping_for_jsonl_and_parquet(tmp_path) -> None:
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in QA))
    _check_qa(load_rows(_cfg(type="jsonl", path=str(tmp_path / "d.jsonl")), "train", 0))
    pq.write_table(pa.Table.from_pylist(QA), tmp_path / "d.parquet")
    _check_qa(load_rows(_cfg(type="parquet", path=str(tmp_path / "d.parquet")), "train", 0))


def test_a_missing_column_names_it_and_the_row(tmp_path) -> None:
    (tmp_path / "d.jsonl").write_text(json.dumps(QA[0]) + "\n" + json.dumps({"question": "x"}) + "\n")
    with pytest.raises(DatasetError, match=r"d.jsonl:2: missing column\(s\) \['solution'\]: no 'solution' "
                                           r"\(dataset.answer_key\); the row has \['question'\]"):
        load_rows(_cfg(type="jsonl", path=str(tmp_path / "d.jsonl")), "train", 0)
    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1", "answer": "2"}]), tmp_path / "d.parquet")
    with pytest.raises(DatasetError, match=r"d.parquet\[0\]: missing column\(s\) \['question', 'solution'\]"):
        load_rows(_cfg(type="parquet", path=str(tmp_path / "d.parquet")), "train", 0)


def test_hf_saved_dataset_folder_and_data_files(tmp_path) -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(QA)
    ds.save_to_disk(str(tmp_path / "saved"))
    _check_qa(load_rows(_cfg(type="hf_disk", path=str(tmp_path / "saved")), "train", 0))
    _check_qa(load_rows(_cfg(type="hf", path=str(tmp_path / "saved")), "train", 0))  # a saved one, by type hf
    datasets.DatasetDict({"train": ds, "test": ds.select(range(2))}).save_to_disk(str(tmp_path / "dict"))
    assert len(load_rows(_cfg(type="hf", path=str(tmp_path / "dict"), split="test"), "train", 0)) == 2
    with pytest.raises(DatasetError, match=r"no split 'dev' \(dataset.split\); it has \['test', 'train'\]"):
        load_rows(_cfg(type="hf", path=str(tmp_path / "dict"), split="dev"), "train", 0)
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in QA))
    _check_qa(load_rows(_cfg(type="hf", path=str(tmp_path / "files" / "train.jsonl")), "train", 0))
    _check_qa(load_rows(_cfg(type="hf", path=str(tmp_path / "files")), "train", 0))  # a folder of data files
    pq.write_table(pa.Table.from_pylist(QA), tmp_path / "files" / "more.parquet")
    _check_qa(load_rows(_cfg(type="hf", path=str(tmp_path / "files" / "*.parquet")), "train", 0))
    with pytest.raises(DatasetError, match="loading scripts are not supported"):
        load_rows(_cfg(type="hf", path=str(tmp_path / "my_dataset.py")), "train", 0)


def test_hf_without_datasets_names_the_extra(tmp_path, monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(DatasetError, match=r"dataset.type=hf needs the `datasets` package: "
                                           r"pip install 'areal_like\[hf\]'"):
        load_rows(_cfg(type="hf", path=str(tmp_path)), "train", 0)


def test_evaluation_is_held_out_from_the_users_rows(tmp_path, caplog) -> None:
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in QA * 5))  # 100 rows
    cfg = DatasetConfig(type="jsonl", path=str(tmp_path / "data.jsonl"), prompt_key="question",
                        answer_key="solution")
    train = load_rows(cfg, "train", 3, max_eval_rows=128)
    with caplog.at_level("INFO"):
        ev = load_rows(cfg, "eval", 3, max_eval_rows=128)
    assert len(ev) == 5 and len(train) == 95  # default eval_split 0.05, removed from training
    assert "evaluating on 5 rows held out from data.jsonl (dataset.eval_split=0.05)" in caplog.text
    assert all(r["data_source"] != "arithmetic" for r in ev)
    assert len(load_rows(cfg, "eval", 3, max_eval_rows=2)) == 2  # capped at eval.num_samples
    assert len(load_rows(cfg, "train", 3, max_eval_rows=2)) == 98
    (tmp_path / "eval.jsonl").write_text(json.dumps(QA[0]) + "\n")
    with_eval = cfg.model_copy(update={"eval_path": str(tmp_path / "eval.jsonl")})
    assert len(load_rows(with_eval, "train", 3)) == 100 and len(load_rows(with_eval, "eval", 3)) == 1
    none = cfg.model_copy(update={"eval_split": 0.0})
    with caplog.at_level("WARNING"):
        assert load_rows(none, "eval", 3) == [] and len(load_rows(none, "train", 3)) == 100
    assert "no evaluation" in caplog.text


def test_prompts_every_sample_solves_are_skipped_until_all_are() -> None:
    rows = [{"prompt": f"p{i}", "answer": "1"} for i in range(4)]
    src = PromptSource(rows, seed=0, shuffle=False, skip_solved_after=2)
    first = [src.next() for _ in range(4)]
    assert [r["prompt"] for r in first] == ["p0", "p1", "p2", "p3"]
    for _ in range(2):  # p0 solved by all 4 samples twice in a row; p1 once, then a miss
        src.record(rows[0], [1.0] * 4, 4)
    src.record(rows[1], [1.0] * 4, 4)
    src.record(rows[1], [1.0, 0.0, 1.0, 1.0], 4)
    src.record(rows[2], [1.0] * 3, 4)  # a failed episode: not solved
    assert [src.next()["prompt"] for _ in range(6)] == ["p1", "p2", "p3", "p1", "p2", "p3"]
    assert src.skipped_solved == 2 and src.solved == 1
    assert src.state_dict()["skipped_solved"] == 2
    src.record(rows[0], [0.0] * 4, 4)  # it regressed: served again
    assert "p0" in [src.next()["prompt"] for _ in range(4)]
    for r in rows:
        for _ in range(2):
            src.record(r, [1.0] * 4, 4)
    assert len({src.next()["prompt"] for _ in range(8)}) == 4  # all solved: served anyway, never stuck
    off = PromptSource(rows, seed=0, shuffle=False)
    off.record(rows[0], [1.0] * 4, 4)
    assert [off.next()["prompt"] for _ in range(4)] == ["p0", "p1", "p2", "p3"] and off.skipped_solved == 0
