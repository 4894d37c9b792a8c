"""`areal-like rollout` on a machine of its own (issue #31 item 3), as a user meets it: the
real command, the real controller and servers, real sockets, no trainer anywhere.

A second machine has no run folder: the rollout side must start without one (no thread
lending, nothing written there), and with no trainer answering it must give up after
`transport.peer_timeout_s` with one `error:` line and exit 1, never wait forever."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]  # ~35 s of Ray start and waiting: the slow suite

ROOT = Path(__file__).parent.parent
CLI = [sys.executable, "-m", "areal_like.orchestration.cli"]


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def test_a_rollout_side_with_no_run_folder_and_no_trainer_exits_1_after_peer_timeout(tiny_model_dir, tmp_path) -> None:
    timeout_s = 30.0  # above the servers' start-up (~20 s under Ray), which counts in it
    data, control = _free_ports(2)  # nobody listens there
    run_dir = tmp_path / "run"  # absent: a second machine
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
    sets = [f"model.path={tiny_model_dir}", f"run.dir={run_dir}", "eval.num_samples=4",
            f"transport.data_addr=tcp://127.0.0.1:{data}", f"transport.control_addr=tcp://127.0.0.1:{control}",
            f"transport.peer_timeout_s={timeout_s:g}"]
    t0 = time.monotonic()
    p = subprocess.Popen([*CLI, "rollout", str(ROOT / "configs/quickstart.yaml"), *[x for s in sets for x in ("--set", s)]],
                         cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []
    assert p.stdout is not None
    for line in p.stdout:  # time-stamped as they come
        lines.append((time.monotonic() - t0, line.rstrip("\n")))
    rc = p.wait(timeout=60)
    took = time.monotonic() - t0
    out = "\n".join(f"{t:6.1f} {x}" for t, x in lines)

    assert rc == 1, out
    errors = [x for _, x in lines if x.startswith("error:")]
    assert len(errors) == 1, out
    assert f"no trainer answered at tcp://127.0.0.1:{control}" in errors[0] and "transport.peer_timeout_s" in errors[0]
    assert "Traceback" not in out and ".cores" not in out, out
    # peer_timeout_s counts from the command's start (not from when the servers are up):
    # it exits within 10 s of it
    assert took < timeout_s + 10.0, out
    assert not run_dir.exists(), "a rollout machine must not create the trainer's run folder"
