"""No starving after saturation (#29 item 5, docs/design.md §10.25): while most groups come
back uniform, `staleness.grow_groups_to` gives later prompts larger groups, so fewer
samples are thrown away per trained one, and a step still trains a full batch.

The sizer and the buffer's batch alone, then two real short runs with a reward that is
1 for ~95 % of episodes whatever the model says (most groups of 4 are uniform): the
grown run trains full batches, generates fewer samples per trained sample than the
same run without growth, keeps η (no over-stale drop, lag ≤ η) and passes the audit.
No timing is asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_like.core.buffer import TrajectoryBuffer
from areal_like.core.config import validate_config
from areal_like.core.types import Trajectory, TrajectoryGroup
from areal_like.orchestration.rollout_policies import GroupSizer

ROOT = Path(__file__).resolve().parents[1]


def _group(gid: str, rewards: list[float], version: int = 0) -> TrajectoryGroup:
    return TrajectoryGroup(group_id=gid, trajectories=[
        Trajectory(episode_id=f"{gid}-{i}", group_id=gid, prompt_ids=[1], response_ids=[2], response_mask=[1],
                   response_logprobs=[-0.1], response_versions=[version], reward=r) for i, r in enumerate(rewards)])


def test_the_sizer_doubles_while_most_groups_are_uniform_and_halves_back() -> None:
    s = GroupSizer(base=4, largest=16, window=4)
    for rewards in ([1.0] * 4, [1.0] * 4, [1.0, 0.0, 1.0, 1.0]):
        s.ended(4, rewards)
    assert s.size == 4  # not before a whole window
    s.ended(4, [0.0, 0.0, 1.0, 1.0])
    assert s.size == 4  # 2 of 4 uniform: half is not enough while the policy still learns
    s.ended(4, [1.0] * 4)
    s.ended(4, [0.0] * 4)
    assert s.size == 4  # still 2 of the last 4
    s.ended(4, [1.0] * 4)
    assert s.size == 8  # 3 of 4 uniform
    s.ended(4, [1.0] * 4)  # a group of the old size says nothing about the new one
    for _ in range(4):
        s.ended(8, [1.0] * 8)
    assert s.size == 16
    for _ in range(8):
        s.ended(16, [1.0] * 16)
    assert s.size == 16  # never past `largest`
    for _ in range(4):
        s.ended(16, [1.0] * 15 + [0.0])
    assert s.size == 8  # none uniform: back down
    off = GroupSizer(base=4)
    for _ in range(40):
        off.ended(4, [1.0] * 4)
    assert off.size == 4


def test_a_grown_group_counts_as_that_many_prompts_of_a_batch() -> None:
    buf = TrajectoryBuffer(max_staleness=2, group_size=4)
    assert buf.put(_group("a", [1, 0, 1, 1, 1, 1, 1, 1])) is None  # 8 = 2 prompts' worth
    assert buf.pop_batch(0, 3) is None
    assert buf.put(_group("b", [1, 0, 1, 1])) is None
    assert buf.num_groups == 2 and buf.prompts == 3
    out = buf.pop_batch(0, 3)
    assert out is not None and [g.group_id for g in out] == ["a", "b"]
    old = TrajectoryBuffer(max_staleness=2)  # without group_size every group is one
    old.put(_group("a", [1, 0, 1, 1, 1, 1, 1, 1]))
    assert [g.group_id for g in old.pop_batch(0, 1) or []] == ["a"]


@pytest.mark.parametrize("grow", [6, 2])
def test_growth_that_is_no_doubling_is_refused(grow: int) -> None:
    """Too large a growth is capped, said at the start (tests/test_learning_controls.py)."""
    with pytest.raises(ValueError, match="power of 2"):
        validate_config({"rollout": {"group_size": 4}, "train": {"batch_size": 4},
                         "staleness": {"grow_groups_to": grow}})


def _run(tiny_model_dir: Path, run_dir: Path, reward: Path, *sets: str) -> list[dict]:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
    args = [sys.executable, "-m", "areal_like.orchestration.cli", "run", "configs/quickstart.yaml"]
    for s in [f"model.path={tiny_model_dir}", f"run.dir={run_dir}", f"agent.reward={reward}:score",
              "train.total_steps=8", "train.batch_size=4", "rollout.group_size=4", "rollout.response_length=16",
              "eval.every_n_steps=0", "eval.num_samples=4", "staleness.max_concurrent=32",
              "run.checkpoint_every_n_steps=1000", "run.record_trajectories=true", "run.record_weights=true", *sets]:
        args += ["--set", s]
    p = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    audit = subprocess.run([sys.executable, "-m", "areal_like.orchestration.cli", "audit", str(run_dir)], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=120)
    assert audit.returncode == 0, audit.stdout[-3000:] + audit.stderr[-3000:]
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


@pytest.mark.slow  # two whole runs (~40 s): the default suite keeps the sizer's own tests and the bench smoke
@pytest.mark.timeout(600)
def test_mostly_uniform_rewards_grown_groups_waste_less_and_fill_every_batch(tiny_model_dir, tmp_path) -> None:
    reward = tmp_path / "mostly_one.py"
    reward.write_text("import random\n\ndef score(sample, output):\n    return float(random.random() < 0.95)\n")
    ratios = {}
    for name, sets in (("plain", ["staleness.grow_groups_to=0"]), ("grown", ["staleness.grow_groups_to=16"])):
        recs = _run(tiny_model_dir, tmp_path / name, reward, *sets)
        steps = [r for r in recs if r["kind"] == "train_step"]
        summary = next(r for r in recs if r["kind"] == "summary")
        assert len(steps) == 8 and summary["counts_add_up"]
        assert all(r["samples"] >= 16 for r in steps), [r["samples"] for r in steps]  # full batches: B = 4 × 4
        assert summary["over_stale"] == 0 and max(r["max_version_lag"] for r in steps) <= 2
        ratios[name] = summary["started"] / summary["trained"]
        if name == "grown":  # groups of 16 reached the trainer (one is a whole batch)
            assert any(sum(r["head_lag_hist"].values()) < 4 for r in steps)  # (one count per group)
    # p = 0.95: a group of 4 is uniform with chance 0.81 (5.3 started per trained), of 16 with 0.44 (1.8);
    # the grown run starts at 4 and needs 16 groups of each size to double (~2.6 over 8 steps)
    assert ratios["grown"] < ratios["plain"], ratios
