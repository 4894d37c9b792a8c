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


def test_uniform_prompts_are_drawn_at_the_floor_until_a_group_disagrees() -> None:
    """Online difficulty filtering (docs/design.md §10.41): a row whose last 2 groups all
    scored the same (all solved or all failed) is served only at `floor`; partial groups
    and mixed ones reset it."""
    rows = [{"prompt": f"p{i}", "answer": "1"} for i in range(4)]
    src = PromptSource(rows, seed=0, shuffle=False, uniform_after=2, floor=0.25)
    assert [src.next()["prompt"] for _ in range(4)] == ["p0", "p1", "p2", "p3"]
    for _ in range(2):  # p0 solved by all 4 samples twice in a row, p3 failed by all twice
        src.record(rows[0], [1.0] * 4, 4)
        src.record(rows[3], [0.0] * 4, 4)
    src.record(rows[1], [1.0] * 4, 4)
    src.record(rows[1], [1.0, 0.0, 1.0, 1.0], 4)  # mixed: the streak is over
    src.record(rows[2], [1.0] * 4, 4)
    src.record(rows[2], [1.0] * 3, 4)  # a failed episode: not uniform
    assert src.uniform_rows == 2
    served = [src.next()["prompt"] for _ in range(4000)]
    share = served.count("p0") / (served.count("p1") or 1)  # p1 and p2 are served at every turn
    assert 0.18 < share < 0.32, share  # the floor (0.25), not 0 and not 1
    assert 0.18 < served.count("p3") / served.count("p2") < 0.32 and src.passed_uniform > 0
    src.record(rows[0], [1.0, 0.0, 0.0, 0.0], 4)  # it disagrees again: back to every turn
    assert src.uniform_rows == 1
    assert [src.next()["prompt"] for _ in range(8)].count("p0") == 2
    off = PromptSource(rows, seed=0, shuffle=False)
    off.record(rows[0], [1.0] * 4, 4)
    off.record(rows[0], [1.0] * 4, 4)
    assert [off.next()["prompt"] for _ in range(4)] == ["p0", "p1", "p2", "p3"] and off.passed_uniform == 0
    assert set(off.state_dict()) == {"epoch", "pos"}
    with pytest.raises(ValueError, match="keep a chance"):
        PromptSource(rows, seed=0, floor=0.0)


def test_the_floor_holds_when_every_prompt_is_uniform() -> None:
    """All rows saturated: the stream never stops, and each row is still served."""
    rows = [{"prompt": f"p{i}", "answer": "1"} for i in range(10)]
    src = PromptSource(rows, seed=3, uniform_after=1, floor=0.05)
    for r in rows:
        src.record(r, [1.0] * 8, 8)
    served = [src.next()["prompt"] for _ in range(400)]
    assert set(served) == {r["prompt"] for r in rows}
    assert 400 / (400 + src.passed_uniform) == pytest.approx(0.05, abs=0.015)


def test_difficulty_state_round_trips_and_the_stream_is_deterministic() -> None:
    """`state_dict` holds the position and every row's streak: a source loaded from it
    serves what the original serves next, with the same floor draws (a `--resume`)."""
    rows = [{"prompt": f"p{i}", "answer": "1"} for i in range(50)]

    def make() -> PromptSource:
        return PromptSource(rows, seed=7, uniform_after=2, floor=0.2)

    def play(src: PromptSource, n: int) -> list[str]:
        out = []
        for _ in range(n):
            row = src.next()
            i = int(row["prompt"][1:])
            src.record(row, [1.0] * 4 if i % 3 else [1.0, 0.0, 1.0, 1.0], 4)  # 2 of 3 rows always uniform
            out.append(row["prompt"])
        return out

    a, b = make(), make()
    assert play(a, 300) == play(b, 300)  # same seed, same groups: the same stream
    state = json.loads(json.dumps(a.state_dict()))  # it travels as JSON in the reports and the checkpoint
    assert state["uniform_rows"] == a.uniform_rows > 0 and isinstance(state["streaks"], str)
    assert len(state["streaks"]) < 200
    resumed = PromptSource(rows, seed=7, uniform_after=2, floor=0.2)
    resumed.load_state_dict(state)
    assert resumed.passed_uniform == a.passed_uniform and resumed.uniform_rows == a.uniform_rows
    assert play(resumed, 300) == play(a, 300)
    fresh = make()  # without the streaks (an old checkpoint): the position only
    fresh.load_state_dict({"epoch": state["epoch"], "pos": state["pos"]})
    assert fresh.uniform_rows == 0
    other = PromptSource(rows[:40], seed=7, uniform_after=2, floor=0.2)
    other.load_state_dict(state)  # streaks of another dataset are not applied to these rows
    assert other.uniform_rows == 0
