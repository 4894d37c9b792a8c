"""The python tool's limits: runaway CPU, memory bombs, sleeps, environment, network."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from rollout_cluster.tools import PythonTool, call_tool, python_tool
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
    # A generous wall clock: on a loaded machine 1 CPU-second can take several seconds.
    tool = PythonTool("python", timeout_s=30, config={"cpu_s": 1, "wall_s": 20})
    start = time.perf_counter()
    out = run("while True: pass", tool)
    assert "CPU time limit" in out  # not the wall-clock limit: the CPU limit fired first
    assert time.perf_counter() - start < 60


def test_memory_bomb_is_refused() -> None:
    out = run("x = bytearray(4 * 1024**3)\nprint('allocated')")
    assert "MemoryError" in out and "allocated" not in out


def test_sleep_is_killed_by_the_wall_clock_limit() -> None:
    tool = PythonTool("python", config={"wall_s": 0.5})
    start = time.perf_counter()
    assert "wall-clock limit" in run("import time; time.sleep(60)", tool)
    assert time.perf_counter() - start < 30  # killed, not slept out (generous: loaded machines)


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


# ---- process-count limit: fork bombs are bounded per call and cleaned up ---------------
def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _system_python() -> str | None:
    """An interpreter other uids can run (for the per-call-uid mode), if this host has one."""
    for exe in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(exe) and python_tool._world_reachable(exe):
            return exe
    return None


MODES = ["native", "watchdog"] + (["uid"] if os.geteuid() == 0 and _system_python() else [])


@pytest.fixture(params=MODES)
def limit_mode(request, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each way of enforcing the process limit this host supports: what the host picks by
    itself, the non-root watchdog, and (as root with a world-readable interpreter) per-call uids."""
    if request.param == "watchdog":
        monkeypatch.setattr(python_tool, "_limit_mode", ("watchdog", None))
    elif request.param == "uid":
        monkeypatch.setattr(python_tool.sys, "executable", _system_python())
        monkeypatch.setattr(python_tool, "_drop_ok", True)
        monkeypatch.setattr(python_tool, "_limit_mode", ("uid", None))
    return python_tool.process_limit_mode()[0]


@pytest.fixture
def pid_log():
    """A file every process of the call can append its pid to (it may run under its own uid)."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="areal_pid_log_")
    os.chmod(d, 0o777)
    yield os.path.join(d, "log")
    shutil.rmtree(d, ignore_errors=True)


def _logged(log: str) -> set[int]:
    if not os.path.exists(log):
        return set()
    return {int(x) for x in open(log).read().split() if x.strip().isdigit()}


def test_process_count_is_limited_per_call(pid_log: str, limit_mode: str) -> None:
    """Children that sleep (and leave the session with setsid) count against the call's
    limit; the call returns and none of them outlives it."""
    log = pid_log
    code = (
        "import os, time\n"
        "n = 0\n"
        "for _ in range(64):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        "        os.setsid()\n"
        f"        open({log!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
        "        time.sleep(60)\n"
        "        os._exit(0)\n"
        "    n += 1\n"
        "    time.sleep(0.01)\n"
        "print('forked', n, flush=True)\n"
        "time.sleep(60)\n"
    )
    tool = PythonTool("python", config={"wall_s": 3, "max_processes": 6, "cpu_s": 2})
    start = time.perf_counter()
    out = run(code, tool)
    assert time.perf_counter() - start < 50  # the children sleep 60 s: they were killed
    if limit_mode == "watchdog":  # killed when the count went over
        assert "more than 6 processes" in out, out
    else:  # the kernel refused the 7th process of the call
        assert "forked 5" in out, out
    time.sleep(0.3)
    pids = _logged(log)
    assert pids
    assert not [p for p in pids if _alive(p)], "children of the call outlived it"


def test_fork_bomb_is_survived_and_cleaned_up(pid_log: str, limit_mode: str) -> None:
    log = pid_log
    code = (
        "import os\n"
        "while True:\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        f"            open({log!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
        "    except OSError:\n"
        "        pass\n"
    )
    tool = PythonTool("python", config={"wall_s": 2, "max_processes": 8, "cpu_s": 2})
    start = time.perf_counter()
    out = run(code, tool)
    # A hang detector, not a timing claim: on a loaded 2-core machine the watchdog mode
    # took 31 s to win against the bomb (wall limit 2 s), so only "it ends" is pinned.
    assert time.perf_counter() - start < 180
    assert "killed" in out, out
    time.sleep(0.3)
    assert _logged(log), "the bomb never forked"
    assert not [p for p in _logged(log) if _alive(p)], "fork bomb processes survived the call"
    assert run("print(1)", tool) == "1\n"  # the tool still works afterwards


def test_concurrent_calls_do_not_share_the_process_budget(limit_mode: str) -> None:
    code = (
        "import os, time\n"
        "kids = []\n"
        "for _ in range(3):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        time.sleep(0.5); os._exit(0)\n"
        "    kids.append(pid)\n"
        "for k in kids: os.waitpid(k, 0)\n"
        "print('ok')\n"
    )
    tool = PythonTool("python", config={"wall_s": 8, "max_processes": 4})

    async def many() -> list[str]:
        return [r.text for r in await asyncio.gather(*(tool.execute(str(i), {"code": code}) for i in range(6)))]

    assert asyncio.run(many()) == ["ok\n"] * 6


def test_cgroup_is_removed_after_the_call() -> None:
    mode, base = python_tool.process_limit_mode()
    if mode != "cgroup":
        pytest.skip(f"this host enforces the process limit by {mode}")
    run("import os\nif os.fork() == 0:\n    import time; time.sleep(30)\nprint('x')")
    assert not [p for p in base.iterdir() if p.name.startswith(f"areal_py_{os.getpid()}_")]


def test_file_size_limit() -> None:
    tool = PythonTool("python", config={"file_size_mb": 1, "wall_s": 5})
    out = run("f = open('big', 'wb')\nf.write(b'x' * (2 << 20))\nf.close()\nprint('wrote')", tool)
    assert "wrote" not in out and ("SIGXFSZ" in out or "File too large" in out), out


def test_non_string_code_is_refused() -> None:
    assert "must be a string" in asyncio.run(TOOL.execute("i", {"code": ["print(1)"]})).text
