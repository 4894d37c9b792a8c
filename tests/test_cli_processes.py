"""Whole-command behaviour as a user runs it: two clusters started separately (either
order) meet at configured addresses; Ctrl-C stops a run and leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).parent.parent
CLI = [sys.executable, "-m", "areal_like.orchestration.cli"]


def _common(model: Path, run_dir: Path, base_port: int) -> list[str]:
    sets = [f"model.path={model}", f"run.dir={run_dir}", "train.total_steps=3", "train.batch_size=2",
            "rollout.group_size=4", "staleness.filter_uniform_groups=false", "eval.num_samples=4",
            f"transport.data_addr=tcp://127.0.0.1:{base_port}", f"transport.control_addr=tcp://127.0.0.1:{base_port + 1}",
            f"weight_sync.store_addr=127.0.0.1:{base_port + 2}"]
    return [x for s in sets for x in ("--set", s)]


@pytest.mark.parametrize("rollout_first", [True, False])
def test_separate_clusters_meet_in_either_order(tiny_model_dir, tmp_path, rollout_first) -> None:
    port = 21000 + (0 if rollout_first else 10) + os.getpid() % 500 * 20
    args = _common(tiny_model_dir, tmp_path / "run", port)
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
    first, second = (["rollout"], ["train"]) if rollout_first else (["train"], ["rollout"])
    p1 = subprocess.Popen([*CLI, *first, "configs/quickstart.yaml", *args], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(3)
    p2 = subprocess.Popen([*CLI, *second, "configs/quickstart.yaml", *args], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out1, _ = p1.communicate(timeout=300)
    out2, _ = p2.communicate(timeout=300)
    assert p1.returncode == 0, out1[-3000:]
    assert p2.returncode == 0, out2[-3000:]
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    summary = recs[-1]
    assert summary["kind"] == "summary" and summary["counts_add_up"] and summary["trained"] == 3 * 8


def _session_processes(sid: int) -> list[str]:
    out = subprocess.run(["ps", "-eo", "sid=,pid=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.split(None, 1)[0] == str(sid)]


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_stops_everything(tiny_model_dir, tmp_path, how) -> None:
    run_dir = tmp_path / "run"
    args = _common(tiny_model_dir, run_dir, 0)[:-6]  # keep port-0 addresses: one machine
    args += ["--set", "train.total_steps=1000"]
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
    p = subprocess.Popen([*CLI, "run", "configs/quickstart.yaml", *args], cwd=ROOT, env=env, start_new_session=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    while time.time() < deadline:
        m = run_dir / "metrics.jsonl"
        if m.is_file() and '"train_step"' in m.read_text():
            break
        time.sleep(1)
    else:
        p.kill()
        pytest.fail("the run never reached a train step")
    if how == "ctrl-c":
        os.killpg(p.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
    else:
        os.kill(p.pid, signal.SIGTERM)  # `kill PID` or a scheduler: the CLI alone, after ray.init
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 130, out[-3000:]
    time.sleep(3)
    assert _session_processes(p.pid) == [], _session_processes(p.pid)
    # the stop is a stop, not a crash: a final checkpoint, the summary, and the --resume line
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = recs[-1]
    assert summary["kind"] == "summary" and summary["ended"] == "interrupted" and summary["counts_add_up"], summary
    steps = [r["step"] for r in recs if r["kind"] == "train_step" and not r["skipped"]]
    assert (run_dir / "checkpoints" / f"v{max(steps):06d}" / "COMPLETE").is_file()
    assert "stopped: {" in out and "--resume" in out, out[-3000:]
    assert "ERROR" not in out, out[-3000:]  # an orderly stop is quiet (docs/design.md §10.15)
