"""The python tool's limits: runaway CPU, memory bombs, sleeps, environment, network (in the sandbox)."""

from __future__ import annotations

import asyncio
import os
import shutil
import time

import pytest

from rollout_cluster.tools import PythonTool, call_tool

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap missing: scripts/setup.sh")

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
    """The caller's timeout cancels the call; every process of the sandbox is gone at once.
    (The old marker-file check cannot apply: sandboxed code cannot write host files.)"""
    tool = PythonTool("python", timeout_s=0.5, config={"wall_s": 30})
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\ntime.sleep(60)"
    before = _nobody_processes()
    outcome = asyncio.run(call_tool(tool, "python", {"code": code}, "i", ["python"]))
    assert outcome.status == "timeout"
    assert _nobody_processes() <= before  # nothing of the call is left


def test_environment_does_not_leak(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AREAL_SECRET_TOKEN", "hunter2")
    out = run("import os; print(sorted(os.environ)); print(os.getcwd())")
    assert "AREAL_SECRET_TOKEN" not in out and "hunter2" not in out and "PATH" not in out
    assert out.endswith("\n/tmp\n")  # runs in its scratch dir (the sandbox's private tmpfs)


def test_output_is_truncated() -> None:
    out = run("print('x' * 100000)")
    assert len(out) <= 200 + len("...(truncated)")


def test_no_network() -> None:
    """A listener on the host's loopback is unreachable: the sandbox has its own network
    namespace, whose loopback (bwrap brings it up) has nothing listening."""
    import socket

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        srv.setblocking(False)
        port = srv.getsockname()[1]
        code = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "    print('connected')\n"
            "except OSError as e:\n"
            "    print(e.strerror)\n"
        )
        out = run(code)
        assert out in (
            "Connection refused\n",
            "Network is unreachable\n",
            "Cannot assign requested address\n",
        )
        with pytest.raises(BlockingIOError):
            srv.accept()  # nothing reached the host


# ---- process-count limit: fork bombs are bounded per call and cleaned up ---------------
# The sandbox runs every call as host uid nobody in its own user namespace, where
# RLIMIT_NPROC counts exactly that call's processes (the old uid/cgroup/watchdog modes
# are gone); its pid namespace dies with the call, so nothing outlives it.
def _nobody_processes() -> set[int]:
    """Host pids owned by uid nobody, the sandbox's host uid when tests run as root."""
    uid = 65534 if os.geteuid() == 0 else os.geteuid()
    out = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if entry.stat().st_uid == uid and _alive(int(entry.name)):
                    out.add(int(entry.name))
            except OSError:
                continue
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_process_count_is_limited_per_call() -> None:
    """Children that sleep (and leave the session with setsid) count against the call's
    limit; the call returns and none of them outlives it."""
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
        "        time.sleep(60)\n"
        "        os._exit(0)\n"
        "    n += 1\n"
        "    time.sleep(0.01)\n"
        "print('forked', n, flush=True)\n"
        "time.sleep(60)\n"
    )
    tool = PythonTool("python", config={"wall_s": 3, "max_processes": 6, "cpu_s": 2})
    before = _nobody_processes()
    start = time.perf_counter()
    out = run(code, tool)
    assert time.perf_counter() - start < 50  # the children sleep 60 s: they were killed
    assert "forked 5" in out, out  # the kernel refused the 7th process of the call
    assert "wall-clock limit" in out
    assert _nobody_processes() <= before, "children of the call outlived it"


def test_fork_bomb_is_survived_and_cleaned_up() -> None:
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    tool = PythonTool("python", config={"wall_s": 2, "max_processes": 8, "cpu_s": 2})
    before = _nobody_processes()
    start = time.perf_counter()
    out = run(code, tool)
    assert time.perf_counter() - start < 180  # a hang detector, not a timing claim
    assert "killed" in out, out
    assert _nobody_processes() <= before, "fork bomb processes survived the call"
    assert run("print(1)", tool) == "1\n"  # the tool still works afterwards


def test_concurrent_calls_do_not_share_the_process_budget() -> None:
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
        return [
            r.text for r in await asyncio.gather(*(tool.execute(str(i), {"code": code}) for i in range(6)))
        ]

    assert asyncio.run(many()) == ["ok\n"] * 6


def test_file_size_limit() -> None:
    tool = PythonTool("python", config={"file_size_mb": 1, "wall_s": 5})
    out = run("f = open('big', 'wb')\nf.write(b'x' * (2 << 20))\nf.close()\nprint('wrote')", tool)
    assert "wrote" not in out and ("SIGXFSZ" in out or "File too large" in out), out


def test_tool_runs_in_the_sandbox() -> None:
    """The tool is a thin layer on the sandbox: nobody, no project tree, fresh scratch."""
    out = run("import os\nprint(os.getuid(), os.path.exists('/work'), os.listdir('/tmp'))")
    assert out == "65534 False ['main.py']\n"


def test_non_string_code_is_refused() -> None:
    assert "must be a string" in asyncio.run(TOOL.execute("i", {"code": ["print(1)"]})).text
