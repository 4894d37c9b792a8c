"""The run folder (docs/design.md §7, §9.13): what a run writes and what `--resume` reads.

    run.dir/
      config.yaml          resolved config
      metrics.jsonl        one JSON object per line (train_step, eval, rollout, summary, ...)
      trajectories.jsonl   trained trajectories (run.record_trajectories)
      weights/v{N}/        HF weights of every version the engines loaded (run.record_weights)
      checkpoints/         trainer state + buffer/gate counters + data position
      final/               the final HF model

An existing folder is refused unless resuming or overwriting. On resume, records
written after the checkpoint are cut back so the folder reads as if the crash never
happened. Only outputs live here; inputs may live anywhere.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from areal_like.core.config import ExperimentConfig, dump_config
from areal_like.core.types import TrajectoryGroup

__all__ = ["RunDir", "RunDirError", "RunFinished", "write_atomic", "fsync_tree", "export_final_from_checkpoint"]

_MODEL_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


class RunDirError(RuntimeError):
    pass


class RunFinished(RunDirError):
    """`--resume` on a run that already ended as configured: nothing to do."""


def fsync_tree(path: Path) -> None:
    """Flush every file under `path` (and the folders themselves) to disk, so a marker
    written afterwards never points at data still in the page cache."""
    for p in sorted(path.rglob("*"), reverse=True) + [path]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Write-new-then-rename: a crash leaves the old file or the new one, never half."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class RunDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.config = self.path / "config.yaml"
        self.metrics = self.path / "metrics.jsonl"
        self.trajectories = self.path / "trajectories.jsonl"
        self.weights = self.path / "weights"
        self.checkpoints = self.path / "checkpoints"
        self.final = self.path / "final"
        self.identity = self.path / "run.json"

    def has_results(self) -> bool:
        """Anything a run produced (a start that failed before its first record leaves
        only config.yaml and empty logs behind: that folder does not block a retry)."""
        if not self.path.is_dir():
            return False
        for p in self.path.iterdir():
            if p.name in (self.config.name, self.identity.name):
                continue
            if p.is_dir() and any(p.iterdir()):
                return True
            if p.is_file() and p.stat().st_size > 0:
                return True
        return False

    def check(self, resume: bool = False, overwrite: bool = False, total_steps: int | None = None) -> bool:
        """Refuse what `prepare` would refuse (before anything starts); True if the folder
        holds results. Raises `RunFinished` for `--resume` on a run that already reached
        `total_steps`."""
        if resume and overwrite:
            raise RunDirError("--resume and --overwrite contradict each other: --resume continues the run in "
                              f"{self.path}, --overwrite deletes it; pass one")
        exists = self.has_results()
        if exists and not (resume or overwrite):
            raise RunDirError(
                f"run folder {self.path} already exists; pass --resume to continue it or --overwrite to replace it"
            )
        if resume and not self.path.is_dir():
            raise RunDirError(f"--resume: there is no run folder at {self.path}")
        if resume and not self.latest_checkpoint():
            raise RunDirError(f"--resume: {self.path} has no complete checkpoint to resume from")
        if resume and total_steps is not None and self.finished_at(total_steps) is not None:
            raise RunFinished(f"the run in {self.path} already finished at v{self.finished_at(total_steps)} "
                              f"(train.total_steps={total_steps}, or it ended by itself: `ended` in its summary); "
                              "nothing to resume. Raise train.total_steps to train further, or, after a run that "
                              "ended by itself, start a new one from its final/ (model.path)")
        return exists

    def has_final(self) -> bool:
        """`final/` holds the exported model (it is renamed into place only whole)."""
        from areal_like.models.hf_folder import has_hf_weights

        return has_hf_weights(self.final)

    def finished_at(self, total_steps: int) -> int | None:
        """The version a finished run ended at, if its summary is written and it reached
        `total_steps` or ended by itself (`solved`, `target_reached`); a run that was stopped
        early is not finished."""
        ckpt = self.latest_checkpoint()
        if ckpt is None or not self.metrics.is_file():
            return None
        version = int(json.loads((ckpt / "orchestrator.json").read_text())["version"])
        for line in self.metrics.read_text().splitlines()[::-1]:
            if '"kind":"summary"' in line.replace(" ", ""):
                try:
                    ended = json.loads(line).get("ended")
                except ValueError:
                    ended = None
                # a run that ended by itself before total_steps (its task solved, its eval target
                # reached) is finished too: resuming it would only wait for a signal that is gone
                return version if version >= total_steps or ended in ("solved", "target_reached") else None
        return None

    def prepare(self, cfg: ExperimentConfig, resume: bool = False, overwrite: bool = False) -> None:
        """Create (or reopen for resume) the folder and write the resolved config."""
        self.check(resume, overwrite, cfg.train.total_steps)
        if self.path.is_dir() and not resume:
            shutil.rmtree(self.path)  # --overwrite, or a failed start's leftovers
        self.path.mkdir(parents=True, exist_ok=True)
        write_atomic(self.config, dump_config(cfg))
        ckpt = self.latest_checkpoint() if resume else None
        if ckpt is not None:  # before any log is opened: the cut files are replaced, not edited
            self.cut_back(int(json.loads((ckpt / "orchestrator.json").read_text())["version"]))

    def start_epoch(self) -> tuple[str, int]:
        """This run's id (made on its first start) and a new trainer epoch for this start:
        frames of earlier trainer incarnations are then told apart (docs/design.md §10.3)."""
        import uuid

        state = json.loads(self.identity.read_text()) if self.identity.is_file() else {"run_id": uuid.uuid4().hex[:12],
                                                                                        "epoch": -1}
        state["epoch"] = int(state["epoch"]) + 1
        write_atomic(self.identity, json.dumps(state))
        return str(state["run_id"]), state["epoch"]

    def note_dashboard(self, url: str | None) -> None:
        """Name the running trainer's dashboard in run.json (None: it stopped), so commands
        given only the run folder find the run (`areal-like pool`, docs/design.md §10.24)."""
        if not self.identity.is_file():
            return
        state = json.loads(self.identity.read_text())
        if url:
            state["dashboard"] = url
        else:
            state.pop("dashboard", None)
        write_atomic(self.identity, json.dumps(state))

    # ---- checkpoints ------------------------------------------------------------------
    def checkpoint_dir(self, version: int) -> Path:
        return self.checkpoints / f"v{version:06d}"

    def latest_checkpoint(self) -> Path | None:
        if not self.checkpoints.is_dir():
            return None
        done = sorted(p for p in self.checkpoints.iterdir() if (p / "COMPLETE").is_file())
        return done[-1] if done else None

    @staticmethod
    def mark_complete(ckpt: Path, meta: dict[str, Any]) -> None:
        """The completion marker goes last, after everything before it is on disk."""
        write_atomic(ckpt / "orchestrator.json", json.dumps(meta))
        fsync_tree(ckpt)
        write_atomic(ckpt / "COMPLETE", "ok\n")

    def prune_checkpoints(self, keep: int = 2) -> None:
        done = sorted(p for p in self.checkpoints.iterdir() if (p / "COMPLETE").is_file())
        for p in done[:-keep]:
            shutil.rmtree(p, ignore_errors=True)
        for p in self.checkpoints.iterdir():  # incomplete leftovers of a crash
            if not (p / "COMPLETE").is_file() and p not in done:
                shutil.rmtree(p, ignore_errors=True)

    def cut_back(self, version: int) -> None:
        """Remove records written after the checkpoint at `version` (resume)."""
        if self.metrics.is_file():
            keep = []
            for line in self.metrics.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn line from the crash
                if rec.get("kind") == "summary" or rec.get("trainer_version", 0) > version:
                    continue
                if rec.get("kind") == "train_step" and rec.get("step", 0) > version:
                    continue
                keep.append(line)
            write_atomic(self.metrics, "".join(k + "\n" for k in keep))
        if self.trajectories.is_file():
            keep = []
            for line in self.trajectories.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if rec.get("consumed_at_version", 0) < version:
                    keep.append(line)
            write_atomic(self.trajectories, "".join(k + "\n" for k in keep))
        if self.weights.is_dir():
            for p in self.weights.iterdir():
                if p.name.startswith("v") and p.name[1:].isdigit() and int(p.name[1:]) > version:
                    shutil.rmtree(p, ignore_errors=True)

    # ---- records ----------------------------------------------------------------------
    def append_trajectories(self, groups: Iterable[TrajectoryGroup], consumed_at_version: int) -> None:
        with self.trajectories.open("a") as f:
            for g in groups:
                for t in g.trajectories:
                    rec = {
                        "episode_id": t.episode_id,
                        "group_id": t.group_id,
                        "prompt_ids": t.prompt_ids,
                        "response_ids": t.response_ids,
                        "response_mask": t.response_mask,
                        "response_logprobs": t.response_logprobs,
                        "response_versions": t.response_versions,
                        "reward": t.reward,
                        "consumed_at_version": consumed_at_version,
                        "temperature": t.temperature,
                        "truncated": t.truncated,
                        "stop_token_id": t.stop_token_id,
                    }
                    f.write(json.dumps(rec, separators=(",", ":")) + "\n")

    def weights_dir(self, version: int) -> Path:
        return self.weights / f"v{version}"

    def record_weights(self, version: int, source: Any, model_path: str | Path) -> Path:
        """Write HF-format weights of `version` (exactly the tensors the engines load);
        `source` as for `save_hf_folder`."""
        return save_hf_folder(self.weights_dir(version), source, model_path)


def save_hf_folder(out: Path, source: Any, model_path: str | Path) -> Path:
    """An HF folder: the config/tokenizer files of `model_path` plus the weights of `source`.

    A trainer (`TrainerHandle.export_weights`: the train workers, or an engine in this
    process) writes the weights itself: this process hands it a path and never holds the
    model. A mapping of tensors is streamed here, one tensor at a time into bounded shards
    (`areal_like.models.hf_folder`)."""
    from areal_like.models.hf_folder import write_hf_weights

    def weights(tmp: Path) -> None:
        if isinstance(source, Mapping):
            write_hf_weights(tmp, source.items())
        else:
            source.export_weights(tmp)

    return _write_hf_folder(out, model_path, weights)


def _write_hf_folder(out: Path, model_path: str | Path, write_weights: Any) -> Path:
    """Written next to `out`, synced, then renamed: `out` exists only whole. A failed
    write (a full disk) leaves no half folder behind."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        src = Path(model_path)
        for name in _MODEL_SIDE_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / name)
        write_weights(tmp)
        fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def export_final_from_checkpoint(run_dir: RunDir, model_path: str | Path) -> tuple[Path, int] | None:
    """Write `final/` from the last complete checkpoint (what a finished run whose export
    failed — a full disk — still has); None if that checkpoint holds no model file."""
    ckpt = run_dir.latest_checkpoint()
    weights = ckpt / "trainer" / "model.safetensors" if ckpt is not None else None
    if weights is None or not weights.is_file():
        return None
    version = int(json.loads((ckpt / "orchestrator.json").read_text())["version"])  # type: ignore[operator]
    out = _write_hf_folder(run_dir.final, model_path, lambda tmp: shutil.copy2(weights, tmp / "model.safetensors"))
    return out, version
