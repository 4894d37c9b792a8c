"""Datasets (docs/design.md §9.11): rows with a prompt and an answer, from files or the built-in task.

Users bring data the way they hold it: JSONL, parquet, a saved HF dataset
(`hf_disk`), or anything `datasets.load_dataset` reads from a local path (`hf`), with
the prompt and answer columns named by `dataset.prompt_key` / `dataset.answer_key`.

A row is a dict: `prompt` (a list of chat messages; a string prompt becomes one user
message and is also kept as `prompt_text`, so TRL-style rewards see the format the
dataset used), `answer` (ground truth for the reward, a string), optional
`agent_name`, `data_source`, `tools_kwargs`, `extra`: the row's own `extra` object
plus every other column (so rewards can read them), and `columns`: the row as the
dataset held it, every column under its own name (what a TRL-style reward receives,
`rollout_cluster.rewards.as_reward_fn`). Bad rows are refused at load with
the file and line or row number, never half-used. Over-long prompts are filtered and
counted by `PromptSource` (the length depends on the tokenizer and chat template).

Evaluation uses the user's data, never the built-in task (§10.12): `dataset.eval_path`
when given, else `split_eval` holds out `dataset.eval_split` of the train rows (seeded,
removed from training) and says so in one log line.
"""

from __future__ import annotations

import base64
import json
import logging
import random
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from areal_like.core.config import DatasetConfig

__all__ = ["DatasetError", "load_rows", "normalise_row", "split_eval", "PromptSource"]

log = logging.getLogger(__name__)

_ROLES = {"system", "user", "assistant", "tool"}
_KNOWN = {"prompt", "answer", "agent_name", "data_source", "extra", "tools_kwargs", "prompt_text", "columns"}


class DatasetError(ValueError):
    pass


def normalise_row(row: Any, where: str, *, prompt_key: str = "prompt", answer_key: str = "answer") -> dict[str, Any]:
    """Validate one row and turn a string prompt into a one-message chat.

    The prompt and answer are read from `prompt_key` / `answer_key`; columns the pipeline
    does not know go into `extra` (the answer column under its own name too, so a
    TRL-style reward gets it as the keyword it expects)."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: a row must be an object, got {type(row).__name__}")
    missing = [k for k in (prompt_key, answer_key) if k not in row]
    if missing:
        keys = {"prompt": "dataset.prompt_key", "answer": "dataset.answer_key"}
        named = [f"{k!r} ({keys['prompt'] if k == prompt_key else keys['answer']})" for k in missing]
        raise DatasetError(f"{where}: missing column(s) {missing}: no {', '.join(named)}; "
                           f"the row has {sorted(map(str, row))}")
    original = dict(row)
    columns = {k: v for k, v in row.items() if k not in _KNOWN and k not in (prompt_key, answer_key)}
    if answer_key != "answer":
        columns[answer_key] = row[answer_key]
    row = {**{k: v for k, v in row.items() if k in _KNOWN}, "prompt": row[prompt_key], "answer": row[answer_key]}
    prompt = row["prompt"]
    prompt_text = prompt if isinstance(prompt, str) else None
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
        "prompt_text": prompt_text,
        "answer": answer,
        "agent_name": row.get("agent_name"),
        "data_source": row.get("data_source", "unknown"),
        "extra": row.get("extra") or {},
        "columns": original,
    }
    if out["agent_name"] is not None and not isinstance(out["agent_name"], str):
        raise DatasetError(f"{where}: 'agent_name' must be a string")
    if not isinstance(out["data_source"], str):
        raise DatasetError(f"{where}: 'data_source' must be a string")
    if not isinstance(out["extra"], dict):
        raise DatasetError(f"{where}: 'extra' must be an object")
    if columns:
        out["extra"] = {**columns, **out["extra"]}
    if row.get("tools_kwargs") is not None:
        if not isinstance(row["tools_kwargs"], dict):
            raise DatasetError(f"{where}: 'tools_kwargs' must be an object")
        out["tools_kwargs"] = row["tools_kwargs"]
    return out


_HF_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text",
                ".arrow": "arrow"}


def _read_hf(kind: str, path: str, split: str) -> list[tuple[str, Any]]:
    """A saved dataset (`hf_disk`) or what `datasets.load_dataset` reads from a local path (`hf`)."""
    try:
        import datasets  # optional: the `hf` extra
    except ImportError:
        raise DatasetError(f"dataset.type={kind} needs the `datasets` package: pip install 'areal_like[hf]'") from None
    p = Path(path)
    saved = p.is_dir() and any((p / f).is_file() for f in ("dataset_info.json", "state.json", "dataset_dict.json"))
    try:
        if kind == "hf_disk" or saved:
            ds = datasets.load_from_disk(str(p))
        elif p.is_dir():
            ds = datasets.load_dataset(str(p))
        else:
            suffix = next((s for s in _HF_BUILDERS if path.endswith(s)), None)
            if path.endswith(".py"):
                raise DatasetError(f"{path}: dataset loading scripts are not supported by datasets "
                                   f"{datasets.__version__}; point dataset.path at the data files instead")
            if suffix is None:
                raise DatasetError(f"{path}: cannot tell the format; dataset.type=hf reads a dataset folder or "
                                   f"data files ending in {sorted(_HF_BUILDERS)}")
            ds = datasets.load_dataset(_HF_BUILDERS[suffix], data_files=path)
    except DatasetError:
        raise
    except Exception as e:  # missing files, not a dataset, bad data: the library raises many types
        raise DatasetError(f"{path}: cannot load with datasets: {type(e).__name__}: {e}") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DatasetError(f"{path}: no split {split!r} (dataset.split); it has {sorted(ds)}")
        ds = ds[split]
    return [(f"{p}[{i}]", r) for i, r in enumerate(ds)]


def _read_file(kind: str, path: str, split: str = "train") -> list[tuple[str, Any]]:
    p = Path(path)
    if kind in ("hf_disk", "hf"):
        return _read_hf(kind, path, split)
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


def split_eval(
    rows: list[dict[str, Any]], fraction: float, seed: int, max_eval_rows: int | None = None, *,
    name: str = "the data", say: bool = True,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`(train, held_out)`: `fraction` of `rows` (at most `max_eval_rows`, at least one row
    left to train on) chosen with `seed`, so the train and eval calls agree. With `say`,
    logs what it did in one line (the user must know which rows their score is on)."""
    k = int(len(rows) * fraction)
    if max_eval_rows is not None:
        k = min(k, max_eval_rows)
    k = max(0, min(k, len(rows) - 1))
    if k == 0:
        if say:
            log.warning("no evaluation: %d rows of %s with dataset.eval_split=%g hold out none; set "
                        "dataset.eval_path or a larger dataset.eval_split", len(rows), name, fraction)
        return rows, []
    held = set(random.Random(seed + 1_000_000).sample(range(len(rows)), k))
    if say:
        log.info("evaluating on %d rows held out from %s (dataset.eval_split=%g); training on the other %d",
                 k, name, fraction, len(rows) - k)
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


def load_rows(cfg: DatasetConfig, split: str, seed: int, *, max_eval_rows: int | None = None) -> list[dict[str, Any]]:
    """Rows of `split` ('train' or 'eval'), validated.

    For a user's dataset without `eval_path`, 'train' leaves out and 'eval' returns the
    same `split_eval` rows (pass the same `seed` and `max_eval_rows`, normally
    `eval.num_samples`, to both calls)."""
    if cfg.type == "generated":
        from areal_like.tasks.arithmetic import generate_problems

        if split == "eval":
            # held-out accuracy reads the answer only: long answers would only cost time there
            form = "tool" if cfg.form == "long_answer" else cfg.form
            return [normalise_row(r, "generated") for r in generate_problems(cfg.num_eval, seed + 1_000_000, form)]
        eval_exprs = {r["extra"]["expression"] for r in generate_problems(cfg.num_eval, seed + 1_000_000, cfg.form)}
        rows = [r for r in generate_problems(cfg.num_train, seed, cfg.form) if r["extra"]["expression"] not in eval_exprs]
        return [normalise_row(r, "generated") for r in rows]
    held_out = split == "eval" and cfg.eval_path is None
    path = cfg.path if split == "train" or held_out else cfg.eval_path
    assert path is not None  # DatasetConfig requires `path` for every type but `generated`
    rows = [normalise_row(r, where, prompt_key=cfg.prompt_key, answer_key=cfg.answer_key)
            for where, r in _read_file(cfg.type, path, cfg.split)]
    if not rows:
        raise DatasetError(f"dataset {path} has no rows")
    if cfg.eval_path is not None:
        if split == "eval":
            log.info("evaluating on %d rows of %s (dataset.eval_path)", len(rows), Path(path).name)
        return rows
    train, held = split_eval(rows, cfg.eval_split, seed, max_eval_rows, name=Path(path).name, say=split == "eval")
    return held if split == "eval" else train


class PromptSource:
    """Endless, seeded, resumable stream of rows (reshuffled each epoch).

    Rows whose prompt is longer than `max_prompt_len` tokens (as `prompt_len`
    measures them) are dropped and counted in `filtered_too_long`: at load for up to
    `EAGER_MEASURE` rows; a larger set is measured as its rows are first drawn (a chat
    template per row costs ~0.1 ms: 20k rows would hold the start by seconds), and only
    a set with no usable row at all is refused at load.

    Online difficulty filtering (`uniform_after`, docs/design.md §10.41): a row whose last
    `uniform_after` groups were uniform (every sample scored the same: all solved or all
    failed, the groups `staleness.filter_uniform_groups` throws away) is served, when its
    turn comes, with probability `floor` only, until a group of it disagrees again. The
    draw is keyed by (seed, epoch, position), not by a generator's state, so the stream is
    the same given the seed and the recorded groups, and `state_dict` (the streaks
    included) resumes it exactly.
    """

    EAGER_MEASURE = 4096

    def __init__(
        self,
        rows: list[dict[str, Any]],
        seed: int,
        shuffle: bool = True,
        prompt_len: Callable[[dict[str, Any]], int] | None = None,
        max_prompt_len: int | None = None,
        uniform_after: int = 0,
        floor: float = 0.1,
    ) -> None:
        if not 0.0 < floor <= 1.0:
            raise ValueError(f"floor={floor}: a row must keep a chance to be drawn (0 < floor <= 1)")
        self.filtered_too_long = 0
        self.uniform_after = uniform_after
        self.floor = floor
        self.passed_uniform = 0
        """Turns of a uniform row that were passed over (generation not spent)."""
        self._streak: dict[int, int] = {}
        """Row index -> its last groups in a row that were uniform (only rows with a streak)."""
        self._fits: Callable[[dict[str, Any]], bool] | None = None
        self._measured: dict[int, bool] = {}
        if prompt_len is not None and max_prompt_len is not None:
            if len(rows) <= self.EAGER_MEASURE:
                kept = [r for r in rows if prompt_len(r) <= max_prompt_len]
                self.filtered_too_long = len(rows) - len(kept)
                rows = kept
            else:
                self._fits = lambda r: prompt_len(r) <= max_prompt_len  # type: ignore[operator]
                if not any(self._fits(r) for r in rows):
                    self.filtered_too_long, rows = len(rows), []
        if not rows:
            raise DatasetError(
                f"no usable rows: {self.filtered_too_long} prompts were longer than max_prompt_len={max_prompt_len}"
            )
        self.rows = rows
        self._index = {id(r): i for i, r in enumerate(rows)}
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

    def _advance(self) -> int:
        while True:
            if self.pos >= len(self._order):
                self.epoch += 1
                self.pos = 0
                self._order = self._make_order()
            i = self._order[self.pos]
            self.pos += 1
            if self._fits is None:
                return i
            fits = self._measured.get(i)
            if fits is None:
                fits = self._measured[i] = self._fits(self.rows[i])
                if not fits:
                    self.filtered_too_long += 1
                    if self.filtered_too_long in (1, 10, 100, 1000):
                        log.warning("%d prompt(s) longer than rollout.max_prompt_len skipped so far",
                                    self.filtered_too_long)
            if fits:
                return i

    def _served_at_floor(self) -> bool:
        """The draw for the turn just advanced to: the same for the same (seed, epoch, pos)."""
        return random.Random((self.seed * 1_000_003 + self.epoch) * 1_000_003 + self.pos).random() < self.floor

    def next(self) -> dict[str, Any]:
        """The next row; with `uniform_after`, a row uniform that many groups in a row is
        served with probability `floor` and otherwise passed over (counted)."""
        while True:
            i = self._advance()
            k = self.uniform_after
            if not k or self._streak.get(i, 0) < k or self._served_at_floor():
                return self.rows[i]
            self.passed_uniform += 1

    def record(self, row: dict[str, Any], rewards: list[float], size: int) -> None:
        """A group of `row` finished with these rewards (of `size` episodes): uniform when
        every episode finished and all scored the same."""
        i = self._index.get(id(row))
        if i is None or not self.uniform_after:
            return
        if size > 1 and len(rewards) == size and len(set(rewards)) == 1:
            self._streak[i] = self._streak.get(i, 0) + 1
        else:
            self._streak.pop(i, None)

    @property
    def uniform_rows(self) -> int:
        """Rows now served at the floor."""
        k = self.uniform_after
        return sum(1 for n in self._streak.values() if n >= k) if k else 0

    def state_dict(self) -> dict[str, int | str]:
        """Where the stream resumes: its position and, with `uniform_after`, each row's streak
        (one byte a row, zlib, base64: a few kB for 20k rows). The counters ride along for
        the metrics (`data_passed_uniform`, `data_uniform_rows`)."""
        state: dict[str, int | str] = {"epoch": self.epoch, "pos": self.pos}
        if self.uniform_after:
            streaks = bytearray(len(self.rows))
            for i, n in self._streak.items():
                streaks[i] = min(n, 255)
            state.update(passed_uniform=self.passed_uniform, uniform_rows=self.uniform_rows,
                         streaks=base64.b64encode(zlib.compress(bytes(streaks), 6)).decode("ascii"))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._order = self._make_order()
        self.passed_uniform = int(state.get("passed_uniform", 0))
        raw = state.get("streaks")
        if raw is None or not self.uniform_after:
            return
        streaks = zlib.decompress(base64.b64decode(raw))
        if len(streaks) != len(self.rows):  # another dataset: the streaks name other rows
            log.warning("the checkpoint's difficulty streaks are for %d rows, this dataset has %d: starting afresh",
                        len(streaks), len(self.rows))
            self._streak = {}
            return
        self._streak = {i: n for i, n in enumerate(streaks) if n}
