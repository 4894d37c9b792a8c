"""Learning controls a user expects (issue #19 item 5), through real short runs on the
warm-started quickstart model: the run ends once held-out accuracy reaches
`train.stop_at_eval_accuracy` (exit 0, the summary says why), prompts whose groups every
sample solved (or failed) are drawn at `dataset.difficulty_floor` on their next turns
(`dataset.uniform_after`), and the quickstart as shipped ends by itself (#44 item 6)."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_like.core.config import ConfigError, load_config
from areal_like.core.metrics import read_jsonl

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "areal_like" / "assets" / "quickstart_model"


def _cfg(run_dir: Path, *extra: str):
    return load_config(ROOT / "configs/quickstart.yaml", [
        f"model.path={MODEL}", f"run.dir={run_dir}", "train.batch_size=2", "rollout.group_size=4",
        "run.checkpoint_every_n_steps=100", *extra])


def test_the_run_ends_at_the_target_accuracy(tmp_path) -> None:
    from areal_like.orchestration.launch import run_both

    run_dir = tmp_path / "run"
    summary = run_both(_cfg(run_dir, "train.total_steps=200", "train.stop_at_eval_accuracy=0.3",
                            "eval.every_n_steps=2", "eval.num_samples=16"))
    recs = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in recs if r.get("kind") == "train_step"]
    final = [r for r in recs if r.get("kind") == "summary"][-1]
    assert final["ended"] == "target_reached" and final["counts_add_up"], final
    version, accuracy = final["target_reached"]
    assert accuracy >= 0.3
    assert len(steps) < 200 and summary["started"] == sum(v for k, v in summary.items() if k != "started")
    assert (run_dir / "final" / "config.json").is_file()


def test_target_accuracy_without_evaluations_is_refused(tmp_path) -> None:
    with pytest.raises(ConfigError, match="train.stop_at_eval_accuracy=0.9 needs evaluations"):
        _cfg(tmp_path / "run", "train.stop_at_eval_accuracy=0.9", "eval.every_n_steps=0")


def test_uniform_prompts_are_passed_over_on_a_small_dataset(tmp_path) -> None:
    """16 prompts, 2 per step: each comes back every 8 steps; the warm-started model
    solves many of them with every sample, and those are mostly passed over next time."""
    from areal_like.orchestration.launch import run_both

    run_dir = tmp_path / "run"
    summary = run_both(_cfg(run_dir, "train.total_steps=20", "dataset.num_train=16", "dataset.uniform_after=1",
                            "eval.every_n_steps=0", "staleness.filter_uniform_groups=false"))
    recs = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "data_passed_uniform" in r]
    assert recs and recs[-1]["data_passed_uniform"] > 0, recs[-1] if recs else "no rollout report"
    assert all("data_streaks" not in r for r in read_jsonl(run_dir / "metrics.jsonl"))  # state, not a metric
    assert summary["started"] == sum(v for k, v in summary.items() if k != "started")


@pytest.mark.slow
def test_the_quickstart_ends_by_itself(tmp_path) -> None:
    """`areal-like run configs/quickstart.yaml --set train.stop_at_eval_accuracy=0.95`: it
    ends before `train.total_steps` at the held-out target, exit 0, says so on the console
    and in the summary (docs/design.md §10.41)."""
    import os
    import subprocess
    import sys

    run_dir = tmp_path / "qs"
    cfg = load_config(ROOT / "configs/quickstart.yaml")
    target = 0.95
    p = subprocess.run([sys.executable, "-m", "areal_like.orchestration.cli", "run",
                        str(ROOT / "configs/quickstart.yaml"), "--set", f"run.dir={run_dir}",
                        "--set", f"train.stop_at_eval_accuracy={target}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=540,
                       env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    recs = read_jsonl(run_dir / "metrics.jsonl")
    final = [r for r in recs if r.get("kind") == "summary"][-1]
    assert final["ended"] == "target_reached" and final["counts_add_up"], final
    version, accuracy = final["target_reached"]
    assert accuracy >= target and version < cfg.train.total_steps
    assert "reached train.stop_at_eval_accuracy" in p.stdout + p.stderr
