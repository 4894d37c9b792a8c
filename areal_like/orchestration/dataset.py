"""Datasets (docs/design.md §9.11): rows with `prompt` and `answer`, from files or the built-in task.

A row is a dict: `prompt` (a string or a list of chat messages), `answer` (ground truth
for the reward), optional `agent_name`, `data_source`, `extra`. Bad rows are refused
at load with the file and line, never half-used. Over-long prompts are filtered and
counted by `PromptSource` (the length depends on the tokenizer and chat template).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from areal_like.core.config import DatasetConfig

__all__ = ["DatasetError", "load_rows", "normalise_row", "PromptSource"]

_ROLES = {"system", "user", "assistant", "tool"}


class DatasetError(ValueError):
    pass


def normalise_row(row: Any, where: str) -> dict[str, Any]:
    """Validate one row and turn a string prompt into a one-message chat."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: a row must be an object, got {type(row).__name__}")
    missing = [k for k in ("prompt", "answer") if k not in row]
    if missing:
        raise DatasetError(f"{where}: missing column(s) {missing}; rows need 'prompt' and 'answer'")
    prompt = row["prompt"]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DatasetError(f"{where}: empty prompt")
        prompt = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt:
        for i, m in enumerate(prompt):
            if not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(m.get("content", ""), str):
                raise DatasetError(f"{where}: prompt[{i}] must be a chat message with a role in {sorted(_ROLES)}")
        if not any(str(m.get("content", "")).strip() for m in prompt):
            raise DatasetError(f"{where}: empty prompt")
    else:
        raise DatasetError(f"{where}: 'prompt' must be a non-empty string or list of chat messages")
    if row["answer"] is None:
        raise DatasetError(f"{where}: 'answer' is null; rows need a ground-truth answer")
    try:
        answer = row["answer"] if isinstance(row["answer"], str) else json.dumps(row["answer"], allow_nan=False)
    except (TypeError, ValueError) as e:
        raise DatasetError(f"{where}: 'answer' must be a string or plain JSON value: {e}") from None
    out = {
        "prompt": prompt,
        "answer": answer,
        "agent_name": row.get("agent_name"),
        "data_source": row.get("data_source", "unknown"),
        "extra": row.get("extra") or {},
    }
    if out["agent_name"] is not None and not isinstance(out["agent_name"], str):
        raise DatasetError(f"{where}: 'agent_name' must be a string")
    if not isinstance(out["data_source"], str):
        raise DatasetError(f"{where}: 'data_source' must be a string")
    if not isinstance(out["extra"], dict):
        raise DatasetError(f"{where}: 'extra' must be an object")
    return out


def _read_file(kind: str, path: str) -> list[tuple[str, Any]]:
    p = Path(path)
    if kind == "hf_disk":
        try:
            import datasets  # optional: only for local HF datasets
        except ImportError:
            raise DatasetError("dataset.type=hf_disk needs the `datasets` package (pip install datasets)") from None
        try:
            ds = datasets.load_from_disk(str(p))
        except Exception as e:  # missing folder, not a dataset, version mismatch
            raise DatasetError(f"{p}: cannot load a local HF dataset: {e}") from None
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"]
        return [(f"{p}[{i}]", r) for i, r in enumerate(ds)]
    if not p.is_file():
        raise DatasetError(f"dataset file {p} does not exist")
    if kind == "jsonl":
        rows = []
        for n, raw in enumerate(p.read_bytes().splitlines(), 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(f"{p}:{n}: not valid UTF-8: {e}") from None
            if not line.strip():
                continue
            try:
                rows.append((f"{p}:{n}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise DatasetError(f"{p}:{n}: not valid JSON: {e}") from None
            except RecursionError:
                raise DatasetError(f"{p}:{n}: not valid JSON: nested too deeply") from None
        return rows
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(p)
        except Exception as e:  # pyarrow raises several types
            raise DatasetError(f"{p}: cannot read parquet: {e}") from None
        return [(f"{p}[{i}]", r) for i, r in enumerate(table.to_pylist())]
    raise DatasetError(f"unknown dataset type {kind!r}")


def load_rows(cfg: DatasetConfig, split: str, seed: int) -> list[dict[str, Any]]:
    """Rows of `split` ('train' or 'eval'), validated."""
    if cfg.type == "generated":
        from areal_like.tasks.arithmetic import generate_problems

        if split == "eval":
            return [normalise_row(r, "generated") for r in generate_problems(cfg.num_eval, seed + 1_000_000, cfg.form)]
        eval_exprs = {r["extra"]["expression"] for r in generate_problems(cfg.num_eval, seed + 1_000_000, cfg.form)}
        rows = [r for r in generate_problems(cfg.num_train, seed, cfg.form) if r["extra"]["expression"] not in eval_exprs]
        return [normalise_row(r, "generated") for r in rows]
    path = cfg.path if split == "train" else cfg.eval_path
    if path is None:
        return []
    rows = [normalise_row(r, where) for where, r in _read_file(cfg.type, path)]
    if not rows:
        raise DatasetError(f"dataset {path} has no rows")
    return rows


class PromptSource:
    """Endless, seeded, resumable stream of rows (reshuffled each epoch).

    Rows whose prompt is longer than `max_prompt_len` tokens (as `prompt_len`
    measures them) are dropped at load and counted in `filtered_too_long`.
    """

    def __init__(
        self,
        rows: list[dict[str, Any]],
        seed: int,
        shuffle: bool = True,
        prompt_len: Callable[[dict[str, Any]], int] | None = None,
        max_prompt_len: int | None = None,
    ) -> None:
        self.filtered_too_long = 0
        if prompt_len is not None and max_prompt_len is not None:
            kept = [r for r in rows if prompt_len(r) <= max_prompt_len]
            self.filtered_too_long = len(rows) - len(kept)
            rows = kept
        if not rows:
            raise DatasetError(
                f"no usable rows: {self.filtered_too_long} prompts were longer than max_prompt_len={max_prompt_len}"
            )
        self.rows = rows
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.pos = 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next(self) -> dict[str, Any]:
        if self.pos >= len(self._order):
            self.epoch += 1
            self.pos = 0
            self._order = self._make_order()
        row = self.rows[self._order[self.pos]]
        self.pos += 1
        return row

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._order = self._make_order()
