"""configs/long_answers.yaml does what it is shipped for (issue #19 item 2): weight
updates land while answers are decoded, the engine interrupts and recomputes, trained
trajectories span two versions, and nothing admitted is lost to staleness — checked by
running the shipped config (fewer steps, no evaluation) and auditing it token by token."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_like.core.config import load_config
from areal_like.core.metrics import read_jsonl
from areal_like.orchestration.audit import audit_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[1]


def test_updates_land_mid_answer_and_nothing_is_lost(tmp_path) -> None:
    from areal_like.orchestration.launch import run_both

    run_dir = tmp_path / "run"
    cfg = load_config(ROOT / "configs/long_answers.yaml", [
        f"run.dir={run_dir}", "train.total_steps=40", "eval.every_n_steps=0", "run.checkpoint_every_n_steps=100"])
    summary = run_both(cfg)
    recs = read_jsonl(run_dir / "metrics.jsonl")
    final = [r for r in recs if r.get("kind") == "summary"][-1]
    assert final["counts_add_up"] and final["over_stale"] == 0, final
    assert summary["started"] == sum(v for k, v in summary.items() if k != "started")
    rollout = [r for r in recs if r.get("kind") == "rollout"][-1]
    assert rollout["interrupts"] > 0 and rollout["recompute_tokens"] > 0, rollout
    rep = audit_run(run_dir)
    assert rep.ok, rep.as_dict()
    assert rep.multi_version_trajectories > 0 and rep.multi_version_turns > 0, rep.as_dict()
    assert max(rep.lag_histogram) <= cfg.staleness.max_staleness
