"""`train.backend.type=megatron` through the real launcher (docs/design.md §10.6).

A short `run_both` on the quickstart config with the Megatron engine on CPU, TP 2 over
gloo (two Ray train actors sharing every micro-batch): it finishes with the counts
adding up, versions advance, the rollout side loads each trained version (the audit
recomputes behaviour logprobs from the weights it recorded) and `areal-like audit`
passes. Also: `areal-like train` refuses `device: cuda` without CUDA in one line, and
(slow) the Megatron run learns the quickstart task.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from areal_like.core.config import load_config  # noqa: E402
from areal_like.core.metrics import read_jsonl  # noqa: E402

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parent.parent.parent
CLI = [sys.executable, "-m", "areal_like.orchestration.cli"]
ENV = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
       "PYTHONPATH": str(ROOT)}
MEGATRON_TP2 = ["train.backend.type=megatron", "train.backend.device=cpu", "train.backend.tensor_parallel_size=2",
                "cluster.train_pool.num_cpus=2", "cluster.oversubscribe=true"]
"""As docs/training_backends.md launches it: 3 CPUs asked for, on a 2-core machine too."""


def _run(model: Path, run_dir: Path, extra: list[str]) -> tuple[object, dict[str, int]]:
    from areal_like.orchestration.launch import run_both

    cfg = load_config(ROOT / "configs" / "quickstart.yaml",
                      [f"model.path={model}", f"run.dir={run_dir}", *MEGATRON_TP2, *extra])
    return cfg, run_both(cfg)


@pytest.fixture(scope="module")
def megatron_run(tiny_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("megatron_run") / "run"
    cfg, summary = _run(tiny_model_dir, run_dir, [
        "run.record_trajectories=true", "run.record_weights=true", "train.total_steps=3", "train.batch_size=2",
        "rollout.group_size=4", "rollout.response_length=32", "staleness.max_staleness=1",
        "staleness.filter_uniform_groups=false", "eval.num_samples=4", "run.checkpoint_every_n_steps=3",
    ])
    return cfg, run_dir, summary


def test_megatron_tp2_run_finishes_and_weights_reach_the_rollout_side(megatron_run) -> None:
    from areal_like.core.buffer import TrajectoryBuffer

    cfg, run_dir, summary = megatron_run
    assert TrajectoryBuffer.counts_add_up(summary) and summary["trained"] >= 3 * 8
    recs = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in recs if r["kind"] == "train_step"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["trainer_version"] for r in steps] == [1, 2, 3]
    assert all(r["max_version_lag"] <= 1 for r in steps)
    # the rollout side reported loading trained versions, never lagging more than η allows
    loaded = [r["loaded_version"] for r in recs if r["kind"] == "rollout"]
    assert loaded and max(loaded) >= 2
    for t in read_jsonl(run_dir / "trajectories.jsonl"):
        gen = [v for v, m in zip(t["response_versions"], t["response_mask"], strict=True) if m]
        assert t["consumed_at_version"] - min(gen) <= 1
    assert any(v > 0 for t in read_jsonl(run_dir / "trajectories.jsonl") for v in t["response_versions"])
    assert (run_dir / "final" / "model.safetensors").is_file()
    ckpt = run_dir / "checkpoints" / "v000003" / "trainer"  # both TP ranks wrote their optimizer state
    assert {"COMPLETE", "optimizer_rank0.pt", "optimizer_rank1.pt"} <= {p.name for p in ckpt.iterdir()}


def test_audit_cli_passes_on_the_megatron_run(megatron_run) -> None:
    _, run_dir, _ = megatron_run
    r = subprocess.run([*CLI, "audit", str(run_dir)], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "audit passed" in r.stdout


def test_megatron_run_resumes_from_its_checkpoint(megatron_run) -> None:
    from areal_like.orchestration.launch import run_both

    cfg, run_dir, _ = megatron_run
    cfg2 = cfg.model_copy(deep=True)
    cfg2.train.total_steps = 4
    summary = run_both(cfg2, resume=True)
    steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train_step"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and steps[-1]["trainer_version"] == 4
    assert summary["started"] == sum(v for k, v in summary.items() if k != "started")


def test_train_refuses_cuda_without_cuda_in_one_line(tiny_model_dir, tmp_path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    # the megatron backend's default device is cuda
    r = subprocess.run([*CLI, "train", "configs/quickstart.yaml", "--set", f"model.path={tiny_model_dir}",
                        "--set", f"run.dir={tmp_path / 'run'}", "--set", "train.backend.type=megatron"],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and "train.backend.device=cuda" in lines[0] and "Traceback" not in r.stderr, lines
    assert not (tmp_path / "run").exists()


def test_preflight_names_the_train_pool(tiny_model_dir) -> None:
    from areal_like.core.config import ConfigError
    from areal_like.orchestration.preflight import check_resources

    cfg = load_config(None, [f"model.path={tiny_model_dir}", "train.backend.type=megatron",
                             "train.backend.device=cpu", "train.backend.tensor_parallel_size=2",
                             "train.backend.data_parallel_size=2", "cluster.train_pool.num_cpus=1",
                             "cluster.rollout_pool.num_cpus=1"])
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 × data_parallel_size=2.*needs 4 CPUs.*"
                                          r"cluster.train_pool.num_cpus=1"):
        check_resources(cfg)
    cfg = load_config(None, ["train.backend.type=megatron", "train.backend.tensor_parallel_size=2",
                             "cluster.ray_address=ray://elsewhere:10001", "cluster.train_pool.num_cpus=2",
                             "cluster.train_pool.num_gpus=1"])
    with pytest.raises(ConfigError, match=r"needs 2 GPU\(s\) in the train pool.*cluster.train_pool.num_gpus=1"):
        check_resources(cfg)


@pytest.mark.slow
def test_megatron_run_learns_the_quickstart_task(tmp_path) -> None:
    """The warm-started quickstart model, Megatron TP 2 on CPU: reward rises over 30 steps."""
    run_dir = tmp_path / "run"
    _, summary = _run(ROOT / "areal_like" / "assets" / "quickstart_model", run_dir,
                      ["train.total_steps=30", "eval.every_n_steps=0", "eval.num_samples=16",
                       "run.checkpoint_every_n_steps=1000"])
    steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train_step"]
    assert len(steps) == 30
    first = sum(r["reward_mean"] for r in steps[:8]) / 8
    last = sum(r["reward_mean"] for r in steps[-8:]) / 8
    assert last > first + 0.05, json.dumps({"first": first, "last": last})
