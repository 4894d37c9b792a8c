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
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from areal_like.core.config import ExperimentConfig, dump_config
from areal_like.core.types import TrajectoryGroup

__all__ = ["RunDir", "RunDirError"]

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


class RunDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.config = self.path / "config.yaml"
        self.metrics = self.path / "metrics.jsonl"
        self.trajectories = self.path / "trajectories.jsonl"
        self.weights = self.path / "weights"
        self.checkpoints = self.path / "checkpoints"
        self.final = self.path / "final"

    def check(self, resume: bool = False, overwrite: bool = False) -> bool:
        """Refuse what `prepare` would refuse; True if the folder exists with content."""
        exists = self.path.exists() and any(self.path.iterdir())
        if exists and not (resume or overwrite):
            raise RunDirError(
                f"run folder {self.path} already exists; pass --resume to continue it or --overwrite to replace it"
            )
        if resume and exists and not self.latest_checkpoint():
            raise RunDirError(f"--resume: {self.path} has no checkpoint to resume from")
        return exists

    def prepare(self, cfg: ExperimentConfig, resume: bool = False, overwrite: bool = False) -> None:
        """Create (or reopen for resume) the folder and write the resolved config."""
        exists = self.check(resume, overwrite)
        if overwrite and exists and not resume:
            shutil.rmtree(self.path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.config.write_text(dump_config(cfg))

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
        (ckpt / "orchestrator.json").write_text(json.dumps(meta))
        (ckpt / "COMPLETE").write_text("ok\n")

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
            self.metrics.write_text("".join(k + "\n" for k in keep))
        if self.trajectories.is_file():
            keep = []
            for line in self.trajectories.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if rec.get("consumed_at_version", 0) < version:
                    keep.append(line)
            self.trajectories.write_text("".join(k + "\n" for k in keep))
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
                    }
                    f.write(json.dumps(rec, separators=(",", ":")) + "\n")

    def weights_dir(self, version: int) -> Path:
        return self.weights / f"v{version}"

    def record_weights(self, version: int, state: dict[str, Any], model_path: str | Path) -> Path:
        """Write HF-format weights of `version` (exactly the tensors the engines load)."""
        return save_hf_folder(self.weights_dir(version), state, model_path)


def save_hf_folder(out: Path, state: dict[str, Any], model_path: str | Path) -> Path:
    """An HF folder from a state dict plus the config/tokenizer files of `model_path`."""
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    src = Path(model_path)
    for name in _MODEL_SIDE_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, tmp / name)
    # clone: tied weights share storage, which safetensors refuses to save
    tensors = {k: v.detach().cpu().clone().contiguous() for k, v in state.items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
