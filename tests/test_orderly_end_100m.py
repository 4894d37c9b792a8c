"""The end of a 100M-parameter run as a user meets it (issue #31 item 5): `areal-like run`
with the 100M Qwen2 layout of bench/scale_out.py and two rollout servers, ended once by
`train.total_steps` and once by Ctrl-C. Each ends with its documented exit code, no
traceback, no server restarted once the stop began, and the rollout side's final counts
received (not the "did not report its final counts" line); the wait for the last evaluation
is said on the console when it lasts.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from tests.test_faults import ROOT, Launch, _driver_traceback, _env, _poll, _records, _steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

sys.path.insert(0, str(ROOT / "bench"))


@pytest.fixture(scope="module")
def model_100m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from scale_out import _SIZES  # the benchmark's 100M layout: one definition of "100M"

    from areal_like.models.tiny_model import init_model

    out = tmp_path_factory.mktemp("model_100m") / "model"
    init_model(out, **_SIZES[100], max_position_embeddings=512)
    return out


def _args(model: Path, run_dir: Path, *extra: str) -> list[str]:
    sets = [f"model.path={model}", f"run.dir={run_dir}", "rollout.num_servers=2", "rollout.group_size=2",
            "train.batch_size=1", "train.mini_batches=1", "staleness.max_concurrent=4", "rollout.response_length=8",
            "staleness.filter_uniform_groups=false", "eval.num_samples=8", "eval.every_n_steps=0",
            "run.checkpoint_every_n_steps=1000", *extra]
    return ["run", "configs/quickstart.yaml", "--overwrite", *(x for s in sets for x in ("--set", s))]


def _after(text: str, marker: str) -> str:
    i = text.find(marker)
    assert i >= 0, f"{marker!r} not in the log"
    return text[i:]


def _check_end(out: str, run_dir: Path, stop_marker: str) -> None:
    log = (run_dir / "run.log").read_text(errors="replace")
    assert not _driver_traceback(out), out[-4000:]
    assert "Traceback" not in log, log[-4000:]
    assert "InvalidStateError" not in log + out
    tail = _after(log, stop_marker)
    assert "restarting rollout server" not in tail and "is back in rotation" not in tail, tail[-3000:]
    assert "did not report its final counts" not in log + out, (out[-3000:], tail[-3000:])
    s = [r for r in _records(run_dir) if r["kind"] == "summary"]
    assert s and s[-1]["counts_add_up"], s


def test_a_100m_run_ended_by_total_steps_ends_in_order(model_100m: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    launch = Launch(_args(model_100m, run_dir, "train.total_steps=2"), tmp_path / "out.log", _env())
    try:
        rc, out = launch.wait(timeout=1200)
    finally:
        launch.kill()
    assert rc == 0, out[-4000:]
    _check_end(out, run_dir, "announced the stop")
    log = (run_dir / "run.log").read_text(errors="replace")
    # The long save of the last checkpoint comes after the final report, not before it.
    assert log.index("the run ends at v2") < log.index("saved checkpoint v2"), log[-3000:]
    evals = [r for r in _records(run_dir) if r["kind"] == "eval"]
    assert any(e["version"] == 2 for e in evals), evals  # the last version's evaluation reached the trainer
    assert launch.left_behind() == []


def test_a_100m_run_stopped_by_ctrl_c_ends_in_order(model_100m: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    launch = Launch(_args(model_100m, run_dir, "train.total_steps=1000"), tmp_path / "out.log", _env())
    try:
        _poll("a train step", lambda: _steps(run_dir), launch, timeout=900)
        os.killpg(launch.p.pid, signal.SIGINT)  # Ctrl-C in the run's terminal
        rc, out = launch.wait(timeout=600)
    finally:
        launch.kill()
    assert rc == 130, out[-4000:]
    _check_end(out, run_dir, "announced the stop")
    summary = [r for r in _records(run_dir) if r["kind"] == "summary"][-1]
    assert summary["ended"] == "interrupted", summary
    assert launch.left_behind() == []
