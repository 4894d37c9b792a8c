"""Issue #33 item 2's must-show, from the outside: a real run started with
`rollout.num_servers=1` is grown to 3 servers and drained to 2 mid-run by the real
command (`areal-like pool RUN_DIR --servers N`), then `areal-like audit` passes, the
counts add up, over_stale stays 0 and every step's lag is within η (docs/design.md §10.24).

Slow suite: a few dozen seconds on a quiet 2-core machine, minutes on a busy one; the
reconcile logic itself is pinned by the fast `tests/test_elastic_pool.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_like.core.buffer import TrajectoryBuffer
from areal_like.core.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
ETA = 1
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "areal_like.orchestration.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _wait_for(what: str, check, proc: subprocess.Popen[str], timeout_s: float = 300.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) while waiting for {what}")
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def _steps(run_dir: Path) -> list[dict]:
    f = run_dir / "metrics.jsonl"
    return [r for r in read_jsonl(f) if r["kind"] == "train_step"] if f.is_file() else []


def test_a_run_grown_from_one_server_to_three_and_drained_to_two_passes_its_audit(tiny_model_dir, tmp_path) -> None:
    run_dir = tmp_path / "run"
    sets = [f"model.path={tiny_model_dir}", f"run.dir={run_dir}", "rollout.num_servers=1", "train.total_steps=30",
            "train.batch_size=2", "rollout.group_size=4", "rollout.response_length=24",
            f"staleness.max_staleness={ETA}", "staleness.filter_uniform_groups=false", "eval.every_n_steps=0",
            "eval.num_samples=4", "run.record_weights=true", "run.record_trajectories=true",
            "rollout.drain_timeout_s=5", "run.checkpoint_every_n_steps=100"]
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen([sys.executable, "-m", "areal_like.orchestration.cli", "run", "configs/quickstart.yaml",
                             *[x for s in sets for x in ("--set", s)]],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for("the first step", lambda: len(_steps(run_dir)) >= 1, proc)
        grow = _cli("pool", str(run_dir), "--servers", "3", "--timeout", "240")
        assert grow.returncode == 0, grow.stdout + grow.stderr
        assert "the pool has 3 server(s)" in grow.stdout
        grown_at = len(_steps(run_dir))
        _wait_for("two steps on three servers", lambda: len(_steps(run_dir)) >= grown_at + 2, proc)
        drain = _cli("pool", str(run_dir), "--servers", "2", "--timeout", "240")
        assert drain.returncode == 0, drain.stdout + drain.stderr
        assert "the pool has 2 server(s)" in drain.stdout
        drained_at = len(_steps(run_dir))
        shown = _cli("pool", str(run_dir))
        assert shown.returncode == 0 and json.loads(shown.stdout)["pool_size"] == 2
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-4000:]
    assert drained_at < 30, "the drain finished after the last step: not mid-run"

    recs = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in recs if r["kind"] == "train_step"]
    assert len(steps) == 30
    assert all(r["max_version_lag"] <= ETA for r in steps), [r["max_version_lag"] for r in steps]
    assert all(r["over_stale"] == 0 for r in steps)
    summary = next(r for r in recs if r["kind"] == "summary")
    assert summary["counts_add_up"] and TrajectoryBuffer.counts_add_up(summary), summary
    assert summary["over_stale"] == 0
    assert [r["target"] for r in recs if r["kind"] == "pool"] == [3, 2]

    rollout = [r for r in recs if r["kind"] == "rollout"]
    sizes = [int(r["pool_size"]) for r in rollout]
    first3 = sizes.index(3)
    assert sizes[0] == 1 and 2 in sizes[first3:] and sizes[-1] == 2, sizes  # 1 → 3 → 2, in that order
    last = rollout[-1]
    assert (last["servers_added"], last["servers_drained"], last["server_failures"]) == (2, 1, 0)
    assert last["max_concurrent"] == 2 * rollout[0]["max_concurrent"]  # the gate follows the pool's size
    served = {k for r in rollout for k in r if k.startswith("server-") and k.endswith("_version")}
    assert {"server-0_version", "server-1_version", "server-2_version"} <= served

    audit = _cli("audit", str(run_dir), timeout=600)
    assert audit.returncode == 0, audit.stdout[-3000:] + audit.stderr[-3000:]
    report = json.loads(audit.stdout[: audit.stdout.rindex("}") + 1])
    assert report["ok"] and max(int(k) for k in report["lag_histogram"]) <= ETA
