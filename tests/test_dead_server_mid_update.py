"""A rollout server SIGKILLed while a weight transfer to it is in flight (issue #46 item 4):
real `areal-like run` processes, a real signal, under the local launcher and under Ray.

The transfer is held open by the test fault hook `AREAL_FAULT_WS_STALL_AT` (the server's
dist receiver, having joined the transfer of v2, sleeps before taking the bytes: the moment
is certain, not a race), and the test kills the server's process there. With a restart left
the run restarts it, trains on to its last step, and `audit` passes; with none left it stops
within 30 s of the kill, exit 1, the root cause on the first `error:` line and no `--resume`
advice. Before, a death the launcher did not call one (Ray's memory monitor) left the run
sending every version again to a dead server, with nothing restarted and nothing stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.test_faults import Launch, _audit, _env, _poll, _sets

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

LAUNCHERS = ["local", "ray"]


def _server_pids(sid: int) -> list[int]:
    """The run's server processes (its session): `areal-server-N` (local launcher), or Ray's
    `ray::ServerActor` workers."""
    out = subprocess.run(["ps", "-eo", "pid=,sid=,comm=,args="], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines()
            if line.split()[1] == str(sid) and ("areal-server" in line or "ServerActor" in line)]


def _kill_mid_transfer(tmp_path: Path, model: Path, launcher: str, restarts: int) -> tuple[Launch, Path, float]:
    """Start the run, wait until a server is inside the v2 transfer, SIGKILL it; returns the
    launch, the run folder and when the kill was sent."""
    marks = tmp_path / "marks"
    marks.mkdir()
    run_dir = tmp_path / "run"
    args = ["run", "configs/quickstart.yaml", *_sets(
        model, run_dir, f"cluster.launcher={launcher}", "rollout.num_servers=1", f"rollout.server_restarts={restarts}",
        "rollout.server_restart_backoff_s=0.2", "weight_sync.timeout_s=10", "eval.every_n_steps=0")]
    env = _env(AREAL_FAULT_WS_STALL_AT="2", AREAL_FAULT_WS_STALL_S="60", AREAL_FAULT_MARK_DIR=str(marks))
    launch = Launch(args, tmp_path / "out.log", env)
    _poll("the v2 transfer to reach the server", lambda: (marks / "ws_stalled").exists(), launch, every=0.1)
    pids = _server_pids(launch.p.pid)
    assert len(pids) == 1, pids
    os.kill(pids[0], signal.SIGKILL)
    return launch, run_dir, time.monotonic()


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_server_killed_mid_transfer_is_restarted_and_the_run_trains_on(tiny_model_dir, tmp_path,
                                                                          launcher) -> None:
    launch, run_dir, _ = _kill_mid_transfer(tmp_path, tiny_model_dir, launcher, restarts=1)
    rc, out = launch.wait(timeout=400)
    assert rc == 0, out[-4000:]
    log = (run_dir / "run.log").read_text()
    assert "rollout server server-0 failed" in log and "is back in rotation (restart 1)" in log, log[-4000:]
    # the dead server was not sent versions for ever: the restarted one loaded the current one
    assert log.count("sending v") <= 5, log[-4000:]
    assert "done:" in out and "'failed': 0" in out, out[-2000:]
    rc, text = _audit(run_dir)
    assert rc == 0, text[-3000:]
    assert not launch.left_behind(), "processes of the run are left behind"


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_the_last_server_killed_mid_transfer_stops_the_run_within_30s(tiny_model_dir, tmp_path, launcher) -> None:
    launch, run_dir, killed_at = _kill_mid_transfer(tmp_path, tiny_model_dir, launcher, restarts=0)
    rc, out = launch.wait(timeout=120)
    took = time.monotonic() - killed_at
    assert rc == 1, out[-4000:]
    assert took < 30, f"stopped {took:.0f}s after the kill:\n{out[-3000:]}"
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert errors, out[-3000:]
    # the root cause first: the server's process is gone (whichever launcher's words)
    assert "ActorDied" in errors[0], errors
    assert any("no rollout server is left" in line for line in errors), errors
    assert "--resume" not in out, out[-3000:]
    assert not launch.left_behind(), "processes of the run are left behind"
