"""The python tool's limits: runaway CPU, memory bombs, sleeps, environment, network."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from rollout_cluster.tools import PythonTool, call_tool
from rollout_cluster.tools.python_tool import network_isolation_command

TOOL = PythonTool(
    "python", timeout_s=10, config={"cpu_s": 1, "wall_s": 3, "memory_mb": 256, "max_output_chars": 200}
)


def run(code: str, tool: PythonTool = TOOL) -> str:
    return asyncio.run(tool.execute("i", {"code": code})).text


def test_prints_stdout_and_stderr() -> None:
    assert run("print(6*7)") == "42\n"
    out = run("import sys; print('a'); sys.exit('bad')")
    assert out.startswith("a\n") and "[stderr]\nbad" in out and "[exit code 1]" in out


def test_infinite_loop_is_killed_by_the_cpu_limit() -> None:
    start = time.perf_counter()
    out = run("while True: pass")
    assert "CPU time limit" in out
    assert time.perf_counter() - start < 3.0


def test_memory_bomb_is_refused() -> None:
    out = run("x = bytearray(4 * 1024**3)\nprint('allocated')")
    assert "MemoryError" in out and "allocated" not in out


def test_sleep_is_killed_by_the_wall_clock_limit() -> None:
    tool = PythonTool("python", config={"wall_s": 0.5})
    start = time.perf_counter()
    assert "wall-clock limit" in run("import time; time.sleep(30)", tool)
    assert time.perf_counter() - start < 3.0


def test_caller_timeout_kills_the_child() -> None:
    tool = PythonTool("python", timeout_s=0.5, config={"wall_s": 30})
    marker = f"/tmp/areal_py_marker_{os.getpid()}"
    code = f"import time\ntime.sleep(1.5)\nopen({marker!r}, 'w').write('alive')"
    outcome = asyncio.run(call_tool(tool, "python", {"code": code}, "i", ["python"]))
    assert outcome.status == "timeout"
    time.sleep(1.5)
    assert not os.path.exists(marker)


def test_environment_does_not_leak(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AREAL_SECRET_TOKEN", "hunter2")
    out = run("import os; print(sorted(os.environ)); print(os.getcwd())")
    assert "AREAL_SECRET_TOKEN" not in out and "hunter2" not in out and "PATH" not in out
    assert "areal_py_" in out  # runs in its scratch dir


def test_output_is_truncated() -> None:
    out = run("print('x' * 100000)")
    assert len(out) <= 200 + len("...(truncated)")


@pytest.mark.skipif(not network_isolation_command(), reason="unshare -n unavailable here (best-effort mode)")
def test_no_network() -> None:
    code = (
        "import socket\n"
        "try:\n"
        "    socket.create_connection(('127.0.0.1', 22), timeout=1)\n"
        "except OSError as e:\n"
        "    print(e.strerror)\n"
    )
    out = run(code)
    # In a fresh network namespace even loopback is down: unreachable, not refused.
    assert "Network is unreachable" in out or "Cannot assign requested address" in out
