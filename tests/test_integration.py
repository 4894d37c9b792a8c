"""The real loop on 2 cores: embedded Ray, separate pools, the embedded engine, the torch
trainer, gloo weight sync, ZMQ channels (docs/design.md §3, issue 'asynchronous orchestration').

One short run (η = 1) is shared by the tests below; they assert from what it recorded.
"""

from __future__ import annotations

import json

import pytest

from areal_like.core.config import load_config
from areal_like.core.metrics import read_jsonl

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def real_run(tiny_model_dir, tmp_path_factory):
    from areal_like.orchestration.launch import run_both

    run_dir = tmp_path_factory.mktemp("integration") / "run"
    cfg = load_config(
        "configs/quickstart.yaml",
        [
            f"model.path={tiny_model_dir}",
            f"run.dir={run_dir}",
            "run.record_trajectories=true",
            "run.record_weights=true",
            "train.total_steps=6",
            "train.batch_size=2",
            "rollout.group_size=8",
            "rollout.response_length=96",
            "rollout.engine.max_batch_size=2",  # generation slower than training: updates land mid-turn
            "staleness.max_staleness=1",
            "staleness.filter_uniform_groups=false",
            "eval.every_n_steps=3",
            "eval.num_samples=8",
            "run.checkpoint_every_n_steps=3",
        ],
    )
    summary = run_both(cfg)
    return cfg, run_dir, summary


def test_lag_bound_and_counts(real_run) -> None:
    cfg, run_dir, summary = real_run
    assert summary["started"] == sum(v for k, v in summary.items() if k != "started")
    assert summary["trained"] >= 6 * 16
    trajs = read_jsonl(run_dir / "trajectories.jsonl")
    assert len(trajs) == summary["trained"]
    for t in trajs:
        gen = [v for v, m in zip(t["response_versions"], t["response_mask"], strict=True) if m]
        assert t["consumed_at_version"] - min(gen) <= 1, t["episode_id"]
        # per-token versions never go backwards within a response
        assert gen == sorted(gen)
        # provenance: tool tokens carry logprob 0 and version -1
        for m, lp, v in zip(t["response_mask"], t["response_logprobs"], t["response_versions"], strict=True):
            assert m == 1 or (lp == 0.0 and v == -1)


def test_interrupts_happened_inside_single_turns(real_run) -> None:
    _, run_dir, _ = real_run
    from areal_like.orchestration.audit import _spans_versions_within_turn

    trajs = read_jsonl(run_dir / "trajectories.jsonl")
    spanning = [t for t in trajs if _spans_versions_within_turn(t["response_mask"], t["response_versions"])]
    assert spanning, "no single LLM turn held tokens of two versions: no interrupt was exercised"
    rollout = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "rollout"]
    assert max(r.get("recompute_tokens", 0) for r in rollout) > 0


def test_metrics_summary_eval_and_final_export(real_run) -> None:
    _, run_dir, _ = real_run
    recs = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in recs if r["kind"] == "train_step"]
    assert [r["step"] for r in steps] == list(range(1, 7))
    for r in steps:
        assert {"time", "kind", "trainer_version", "step", "reward_mean", "loss", "samples", "max_version_lag"} <= r.keys()
    assert recs[-1]["kind"] == "summary" and recs[-1]["counts_add_up"]
    # every step publishes a version and records its size: here the whole model's fp32 weights
    from safetensors.torch import load_file

    full = sum(t.numel() * t.element_size() for t in load_file(str(run_dir / "final" / "model.safetensors")).values())
    assert {r.get("weight_bytes") for r in steps} == {full}
    assert any(r["kind"] == "eval" and "accuracy" in r for r in recs)
    assert (run_dir / "final" / "model.safetensors").is_file()
    assert sorted(p.name for p in (run_dir / "weights").iterdir())[:2] == ["v0", "v1"]


def test_audit_passes_on_the_run(real_run) -> None:
    from areal_like.orchestration.audit import audit_run

    _, run_dir, _ = real_run
    rep = audit_run(run_dir, tol=1e-3)
    assert rep.ok, json.dumps(rep.as_dict())[:2000]
    assert rep.tokens_checked > 0 and rep.multi_version_turns > 0


def test_run_dir_refused_then_resumed(real_run) -> None:
    from areal_like.orchestration.launch import run_both
    from areal_like.orchestration.run_dir import RunDirError

    cfg, run_dir, _ = real_run
    with pytest.raises(RunDirError, match="already exists"):
        run_both(cfg)
    cfg2 = cfg.model_copy(deep=True)
    cfg2.train.total_steps = 8
    summary = run_both(cfg2, resume=True)
    recs = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r["step"] for r in recs if r["kind"] == "train_step"]
    assert steps == list(range(1, 9))
    assert [r["kind"] for r in recs].count("summary") == 1
    assert summary["started"] == sum(v for k, v in summary.items() if k != "started")
    trajs = read_jsonl(run_dir / "trajectories.jsonl")
    assert len({t["episode_id"] for t in trajs}) == len(trajs)
    assert all(t["consumed_at_version"] - min(v for v in t["response_versions"] if v >= 0) <= 1 for t in trajs)
