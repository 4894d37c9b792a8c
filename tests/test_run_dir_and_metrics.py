"""Run folder rules (refuse, resume cut-back) and metrics outputs."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from areal_like.core.config import ExperimentConfig
from areal_like.core.metrics import MetricsLog, MetricsRegistry, read_jsonl
from areal_like.orchestration.run_dir import RunDir, RunDirError


def test_existing_run_dir_is_refused(tmp_path) -> None:
    rd = RunDir(tmp_path / "run")
    rd.prepare(ExperimentConfig())
    (rd.path / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(RunDirError, match="already exists; pass --resume"):
        RunDir(rd.path).prepare(ExperimentConfig())
    with pytest.raises(RunDirError, match="no complete checkpoint"):
        RunDir(rd.path).prepare(ExperimentConfig(), resume=True)
    RunDir(rd.path).prepare(ExperimentConfig(), overwrite=True)
    assert not (rd.path / "metrics.jsonl").exists() and rd.config.is_file()


def test_cut_back_removes_records_after_checkpoint(tmp_path) -> None:
    rd = RunDir(tmp_path / "run")
    rd.prepare(ExperimentConfig())
    log = MetricsLog(rd.metrics)
    for v in range(1, 6):
        log.write("train_step", v, step=v, reward_mean=0.1 * v)
    log.write("summary", 5, started=1)
    log.close()
    with rd.metrics.open("a") as f:
        f.write('{"torn": ')
    with rd.trajectories.open("w") as f:
        for v in range(5):
            f.write(json.dumps({"consumed_at_version": v}) + "\n")
    for v in range(6):
        (rd.weights / f"v{v}").mkdir(parents=True)
    rd.cut_back(3)
    recs = read_jsonl(rd.metrics)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert [json.loads(x)["consumed_at_version"] for x in rd.trajectories.read_text().splitlines()] == [0, 1, 2]
    assert sorted(p.name for p in rd.weights.iterdir()) == ["v0", "v1", "v2", "v3"]


def test_metrics_jsonl_lines_have_required_fields(tmp_path) -> None:
    log = MetricsLog(tmp_path / "m.jsonl")
    log.write("train_step", 1, step=1, loss=float("nan"), reward_mean=0.5)
    log.close()
    (rec,) = read_jsonl(tmp_path / "m.jsonl")
    assert {"time", "kind", "trainer_version"} <= rec.keys() and rec["loss"] is None


def test_prometheus_exposition_parses() -> None:
    m = MetricsRegistry()
    m.versions.trainer_version.set(3)
    m.versions.server_version.labels(server="0").set(2)
    m.versions.head_lag.observe(1)
    m.samples.gate.labels(state="running").set(5)
    names = {f.name for f in text_string_to_metric_families(m.exposition().decode())}
    assert {"areal_like_trainer_version", "areal_like_server_version", "areal_like_version_lag_head"} <= names
