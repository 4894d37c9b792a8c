"""Refused frames during a real run are counted once and said once (issue #31 item 4).

A real `areal-like run` with a fixed data port; while it trains, a stranger writes to that
port: 64 KiB of junk over a plain TCP connection (ZMQ reads some of it as frames), junk
frames over ZMQ, frames of another run, and frames of a second rollout controller of this
run. The run must end as configured, say each kind of refusal once on the console and in
run.log (not once per frame), and count every refused frame in the summary's
`refused_frames`."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).parent.parent
CLI = [sys.executable, "-m", "areal_like.orchestration.cli"]
N_JUNK, N_OTHER_RUN, N_SECOND = 30, 20, 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _poll(what: str, cond, timeout: float, p: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert p.poll() is None, f"the run ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f}s"
        time.sleep(0.1)


def _stranger(port: int, run_id: str, epoch: int) -> None:
    import zmq

    from areal_like.core.types import Origin, RolloutStats
    from areal_like.core.wire import encode

    with socket.create_connection(("127.0.0.1", port)) as s:  # not ZMQ at all
        s.sendall(random.Random(0).randbytes(64 << 10))
        time.sleep(0.5)
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 5000)
    push.connect(f"tcp://127.0.0.1:{port}")
    for i in range(N_JUNK):
        push.send(b"junk frame %d" % i)

    def stats(origin: Origin) -> bytes:
        return encode(RolloutStats(time=time.time(), loaded_version=0, started=0, running=0, origin=origin))

    for _ in range(N_OTHER_RUN):
        push.send(stats(Origin(run_id="someone-elses-run", epoch=0, sender="stranger")))
    for _ in range(N_SECOND):
        push.send(stats(Origin(run_id=run_id, epoch=epoch, sender="second-controller")))
    push.close()  # lingers until every frame is out


def test_strangers_on_a_real_runs_data_port_are_said_once_and_all_counted(tiny_model_dir, tmp_path) -> None:
    run_dir = tmp_path / "run"
    port = _free_port()
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
    sets = [f"model.path={tiny_model_dir}", f"run.dir={run_dir}", "train.total_steps=14", "train.batch_size=2",
            "rollout.group_size=4", "rollout.response_length=24", "staleness.filter_uniform_groups=false",
            "eval.every_n_steps=0", f"transport.data_addr=tcp://127.0.0.1:{port}"]
    p = subprocess.Popen([*CLI, "run", str(ROOT / "configs/quickstart.yaml"), *[x for s in sets for x in ("--set", s)]],
                         cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    assert p.stdout is not None
    reader = threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    try:
        run_log = run_dir / "run.log"
        _poll("rollout controller joining", lambda: run_log.is_file() and " joined (trainer epoch" in run_log.read_text(),
              120, p)
        identity = json.loads((run_dir / "run.json").read_text())
        _stranger(port, identity["run_id"], identity["epoch"])
        p.wait(timeout=240)
    finally:
        if p.poll() is None:
            p.kill()
    reader.join(5)
    console = "".join(lines)
    assert p.returncode == 0, console[-3000:]

    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    summary = recs[-1]
    assert summary["kind"] == "summary" and summary["counts_add_up"], summary
    refused = summary["refused_frames"]
    assert refused.get("a frame of another run") == N_OTHER_RUN, refused
    assert refused.get("a second rollout controller") == N_SECOND, refused

    said = [x for x in console.splitlines() if x.split(" ", 1)[-1].startswith("refused ")]
    logged = [x for x in run_log.read_text().splitlines() if ": refused " in x]
    # one line per kind (junk, another run, a second controller) and a few summing up the
    # rest (at most one per 30 s, and one as the data channel closes): never one per frame
    assert 3 <= len(said) <= 6, "\n".join(said)
    assert 3 <= len(logged) <= 6, "\n".join(logged)
    assert any("junk" in x or "not valid msgpack" in x for x in said), "\n".join(said)
    assert any("another run" in x for x in said) and any("second rollout controller" in x for x in said)

    junk = refused.get("junk: not a frame of this protocol", 0)
    assert junk >= N_JUNK, refused  # the ZMQ junk frames, and what ZMQ made frames of the TCP junk
