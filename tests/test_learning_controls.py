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


def test_settings_an_override_made_inert_are_said_not_refused(tmp_path) -> None:
    """The quickstart ships a held-out target and group growth; a user (or a test) who
    turns evaluation off or shrinks the batch gets a run, with one line each saying what
    no longer applies (docs/design.md §10.41)."""
    import os
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "areal_like.orchestration.cli", "run",
                        str(ROOT / "configs/quickstart.yaml"), "--set", f"run.dir={run_dir}",
                        "--set", "train.total_steps=1", "--set", "train.batch_size=2", "--set", "rollout.group_size=4",
                        "--set", "eval.every_n_steps=0", "--set", "train.stop_at_eval_accuracy=0.9",
                        "--set", "staleness.grow_groups_to=64"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert out.count("note: train.stop_at_eval_accuracy=0.9 is ignored: nothing evaluates") == 1, out[-3000:]
    assert out.count("note: staleness.grow_groups_to=64: groups grow to 8, since a step holds 8 samples") == 1, out[-3000:]
    assert "WARNING" not in out
    assert [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "train_step"]


def test_group_growth_is_capped_at_what_a_step_holds() -> None:
    cfg = load_config(ROOT / "configs/quickstart.yaml", ["staleness.grow_groups_to=64", "train.batch_size=4",
                                                          "staleness.max_concurrent=128"])
    assert (cfg.samples_per_step, cfg.group_growth) == (32, 32)
    cfg = load_config(ROOT / "configs/quickstart.yaml", ["staleness.grow_groups_to=32", "train.batch_size=1"])
    assert cfg.group_growth == 0 and "groups do not grow" in cfg.notes()[0]
    cfg = load_config(ROOT / "configs/quickstart.yaml", ["staleness.grow_groups_to=32",
                                                          "staleness.filter_uniform_groups=false"])
    assert cfg.group_growth == 0 and "filter_uniform_groups=false" in cfg.notes()[0]
    with pytest.raises(ConfigError, match="rollout.group_size=8 times a power of 2"):
        load_config(ROOT / "configs/quickstart.yaml", ["staleness.grow_groups_to=24"])


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
    """`areal-like run configs/quickstart.yaml`, as shipped: it ends before
    `train.total_steps` at its held-out target, exit 0, says so on the console and in the
    summary, its last evaluation names the best, and once the target is reached groups grow
    (`staleness.grow_groups_to`) so fewer samples are filtered (docs/design.md §10.41)."""
    import os
    import subprocess
    import sys

    run_dir = tmp_path / "qs"
    cfg = load_config(ROOT / "configs/quickstart.yaml")
    target = cfg.train.stop_at_eval_accuracy
    assert target is not None and cfg.group_growth > cfg.rollout.group_size and not cfg.notes()
    p = subprocess.run([sys.executable, "-m", "areal_like.orchestration.cli", "run",
                        str(ROOT / "configs/quickstart.yaml"), "--set", f"run.dir={run_dir}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=540,
                       env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    recs = read_jsonl(run_dir / "metrics.jsonl")
    final = [r for r in recs if r.get("kind") == "summary"][-1]
    assert final["ended"] == "target_reached" and final["counts_add_up"], final
    version, accuracy = final["target_reached"]
    assert accuracy >= target and version < cfg.train.total_steps
    # It ends on the version that reached the target (final/ holds it), and each evaluation
    # scored its version's own weights: no step left an evaluated version before its score.
    evals = [r for r in recs if r.get("kind") == "eval"]
    assert final["trainer_version"] == version == evals[-1]["version"], (final, evals)
    assert all(e["max_token_version"] == e["version"] for e in evals), evals
    assert "reached train.stop_at_eval_accuracy" in out and ", the last evaluation (v0 " in out
    groups = [sum(r["head_lag_hist"].values()) for r in recs if r.get("kind") == "train_step"]
    assert min(groups) < cfg.train.batch_size, groups  # a step of grown groups holds fewer prompts
