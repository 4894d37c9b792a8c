"""The bubblewrap sandbox against every escape a reward-hacking policy would try.

Each test runs the real bwrap. Processes of a call are tagged with a unique marker
in their argv (inherited by every fork) so the host side can prove none is left.
Time bounds are hang detectors for a loaded 2-core machine, not benchmarks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from rollout_cluster.sandbox import INSTALL_HINT, Sandbox, SandboxLimits, SandboxResult, SandboxUnavailable
from rollout_cluster.tools import BUILTIN_TOOLS, CodeTestTool, PythonTool

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap missing: scripts/setup.sh installs it (apt-get)"
)

REPO = Path(__file__).resolve().parents[2]
LIMITS = SandboxLimits(wall_s=20, cpu_s=5, memory_mb=256, max_processes=8, scratch_mb=8)


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    sb = Sandbox()
    sb.prepare()
    return sb


def run(sb: Sandbox, code: str, limits: SandboxLimits = LIMITS, marker: str = "") -> SandboxResult:
    return asyncio.run(sb.run(code, limits, argv=(marker,) if marker else ()))


def marked_processes(marker: str) -> list[int]:
    """Host pids whose command line carries `marker` (every process of a tagged call)."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                cmdline = Path(entry.path, "cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmdline and int(entry.name) != os.getpid():
                pids.append(int(entry.name))
    return pids


def test_runs_code_as_nobody(sandbox: Sandbox) -> None:
    r = run(sandbox, "import os\nprint(os.getuid(), os.getgid(), os.geteuid())\nraise ValueError('x')")
    assert r.stdout == "65534 65534 65534\n"
    assert r.exit_code == 1 and r.stderr.startswith("Traceback") and 'File "main.py"' in r.stderr
    assert "_areal_boot" not in r.stderr  # the bootstrap frame is not shown to the model


def test_project_tree_and_host_files_are_invisible(sandbox: Sandbox) -> None:
    paths = [REPO / "README.md", REPO / "pyproject.toml", REPO, Path("/work"), Path("/etc/passwd"),
             Path(sys.prefix) / "pyvenv.cfg", Path(os.path.realpath(sys.base_prefix)) / "lib/python3.11/site-packages"]  # fmt: skip
    for p in paths:
        assert p.exists()  # they exist on the host ...
    code = (
        "import os\n"
        f"for p in {[str(p) for p in paths]!r}:\n"
        "    try:\n"
        "        print(p, 'LEAK', os.listdir(p) if os.path.isdir(p) else open(p).read()[:50])\n"
        "    except OSError as e:\n"
        "        print(p, type(e).__name__)\n"
    )
    r = run(sandbox, code)
    assert "LEAK" not in r.stdout, r.stdout  # ... not in the sandbox
    assert r.stdout.count("FileNotFoundError") == len(paths), r.stdout


def test_parent_environment_is_unreachable(sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = f"hunter2-{uuid.uuid4().hex}"
    monkeypatch.setenv("AREAL_FAKE_SECRET_TOKEN", secret)
    code = (
        "import os, glob\n"
        "print(dict(os.environ))\n"
        f"for p in ['/proc/{os.getpid()}/environ', '/proc/{os.getppid()}/environ'] + glob.glob('/proc/*/environ'):\n"
        "    try:\n"
        "        print(p, open(p, 'rb').read())\n"
        "    except OSError as e:\n"
        "        print(p, type(e).__name__)\n"
    )
    r = run(sandbox, code)
    assert r.exit_code == 0, r.stderr
    assert secret not in r.stdout and "AREAL_FAKE_SECRET_TOKEN" not in r.stdout
    assert f"/proc/{os.getpid()}/environ FileNotFoundError" in r.stdout  # host pids do not exist
    assert "PATH" not in r.stdout.splitlines()[0]


def test_cannot_write_outside_scratch(sandbox: Sandbox, tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o777)  # even a world-writable host folder is out of reach
    targets = [tmp_path / "escape", REPO / "escape.txt", Path("/escape"), Path("/dev/escape"),
               Path(os.path.realpath(sys.base_prefix)) / "escape"]  # fmt: skip
    code = (
        f"for p in {[str(t) for t in targets]!r}:\n"
        "    try:\n"
        "        open(p, 'w').write('x'); print(p, 'WROTE')\n"
        "    except OSError as e:\n"
        "        print(p, type(e).__name__)\n"
        "open('/tmp/inside', 'w').write('scratch is writable'); print(open('/tmp/inside').read())\n"
    )
    r = run(sandbox, code)
    assert "WROTE" not in r.stdout and "scratch is writable" in r.stdout, r.stdout
    assert not [t for t in targets if t.exists()]
    assert not Path("/tmp/inside").exists() or Path("/tmp/inside").read_text() != "scratch is writable"


def test_unix_sockets_are_unreachable(sandbox: Sandbox, tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    abstract = f"\0areal-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX) as s1, socket.socket(socket.AF_UNIX) as s2:
        s1.bind(path), s2.bind(abstract)
        s1.listen(), s2.listen()
        os.chmod(path, 0o777)
        s1.setblocking(False), s2.setblocking(False)
        code = (
            "import socket\n"
            f"for a in [{path!r}, {abstract!r}]:\n"
            "    try:\n"
            "        socket.socket(socket.AF_UNIX).connect(a); print('CONNECTED')\n"
            "    except OSError as e:\n"
            "        print(type(e).__name__)\n"
        )
        r = run(sandbox, code)
        assert "CONNECTED" not in r.stdout and r.stdout.count("Error") == 2, r.stdout
        for s in (s1, s2):
            with pytest.raises(BlockingIOError):
                s.accept()


def test_no_network_even_to_host_loopback(sandbox: Sandbox) -> None:
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        srv.setblocking(False)
        port = srv.getsockname()[1]
        code = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=3); print('CONNECTED')\n"
            "except OSError as e:\n"
            "    print('refused', e)\n"
            "print(socket.if_nameindex())\n"
        )
        r = run(sandbox, code)
        assert "CONNECTED" not in r.stdout and "refused" in r.stdout, r.stdout
        assert "eth" not in r.stdout  # only the new namespace's (down) loopback
        with pytest.raises(BlockingIOError):
            srv.accept()


def test_daemon_does_not_outlive_the_call(sandbox: Sandbox) -> None:
    marker = f"areal-daemon-{uuid.uuid4().hex}"
    code = (
        "import os, time\n"
        "r, w = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.write(w, str(os.getpid()).encode()); os.close(w)\n"
        "        time.sleep(120)\n"
        "    os._exit(0)\n"
        "os.close(w)\n"
        "print('daemon', os.read(r, 32).decode(), flush=True)\n"
    )
    r = run(sandbox, code, marker=marker)
    assert r.exit_code == 0 and r.stdout.startswith("daemon "), r
    assert marked_processes(marker) == []  # checked at once: the call returned only when all were gone


def test_fork_bomb_is_contained(sandbox: Sandbox) -> None:
    marker = f"areal-bomb-{uuid.uuid4().hex}"
    code = (
        "import os\n"
        "n = 0\n"
        "while True:\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            n = 0\n"
        "        else:\n"
        "            n += 1\n"
        "    except OSError:\n"
        "        pass\n"
    )
    limits = SandboxLimits(wall_s=2, cpu_s=5, max_processes=8)
    r = run(sandbox, code, limits, marker)
    assert r.timed_out and r.killed_by == "wall"
    assert marked_processes(marker) == []
    # The kernel refused the 9th process of the call: a call that counts its forks sees 7.
    count = (
        "import os, time\n"
        "kids = 0\n"
        "for _ in range(50):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30); os._exit(0)\n"
        "        kids += 1\n"
        "    except OSError as e:\n"
        "        print('refused:', e.strerror); break\n"
        "print('forked', kids)\n"
    )
    r = run(sandbox, count, SandboxLimits(wall_s=20, max_processes=8), marker)
    assert "forked 7" in r.stdout and "refused: Resource temporarily unavailable" in r.stdout, r
    assert marked_processes(marker) == []


def test_huge_output_is_truncated(sandbox: Sandbox) -> None:
    limits = SandboxLimits(wall_s=20, max_output_bytes=1000, file_size_mb=2)
    r = run(sandbox, "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", limits)
    assert len(r.stdout) == 1000 and r.stdout_truncated
    # Stopped at 2 MB by the file size limit (Python ignores SIGXFSZ: the write fails), not the clock.
    assert r.killed_by == "file_size" and not r.timed_out, r


def test_filling_scratch_hits_the_tmpfs_limit(sandbox: Sandbox) -> None:
    code = (
        "import os\n"
        "written = 0\n"
        "try:\n"
        "    with open('/tmp/fill', 'wb') as f:\n"
        "        while True:\n"
        "            f.write(b'x' * (1 << 20)); f.flush(); written += 1\n"
        "except OSError as e:\n"
        "    print(os.strerror(e.errno), written)\n"
    )
    r = run(sandbox, code, SandboxLimits(wall_s=20, scratch_mb=8, file_size_mb=64))
    msg, mb = r.stdout.rsplit(" ", 1)
    assert msg == "No space left on device" and int(mb) <= 8, r


def test_memory_limit(sandbox: Sandbox) -> None:
    r = run(sandbox, "x = bytearray(1 << 30)\nprint('allocated')", SandboxLimits(wall_s=20, memory_mb=256))
    assert "allocated" not in r.stdout and r.killed_by == "memory", r


def test_cpu_limit(sandbox: Sandbox) -> None:
    r = run(sandbox, "while True: pass", SandboxLimits(wall_s=60, cpu_s=1))
    assert r.signal == "SIGXCPU" and r.killed_by == "cpu" and not r.timed_out, r


def test_timeout_kills_the_whole_call(sandbox: Sandbox) -> None:
    marker = f"areal-sleep-{uuid.uuid4().hex}"
    code = (
        "import os, time\n"
        "for _ in range(3):\n"
        "    if os.fork() == 0:\n"
        "        os.setsid(); time.sleep(120)\n"
        "print('started', flush=True)\n"
        "time.sleep(120)\n"
    )
    r = run(sandbox, code, SandboxLimits(wall_s=1.5), marker)
    assert r.timed_out and r.exit_code is None and r.stdout == "started\n"
    assert r.wall_s < 60
    assert marked_processes(marker) == []


def test_cancelled_call_leaves_nothing_behind(sandbox: Sandbox) -> None:
    marker = f"areal-cancel-{uuid.uuid4().hex}"

    async def cancel() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(sandbox.run("import time\ntime.sleep(120)", LIMITS, argv=(marker,)), 1.0)

    asyncio.run(cancel())
    assert marked_processes(marker) == []


def test_cannot_signal_host_processes(sandbox: Sandbox) -> None:
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        code = (
            "import os, signal\n"
            "for target in ("
            f"{victim.pid}, {os.getpid()}, -1):\n"
            "    try:\n"
            "        os.kill(target, signal.SIGKILL); print(target, 'SENT')\n"
            "    except OSError as e:\n"
            "        print(target, type(e).__name__)\n"
        )
        r = run(sandbox, code)
        assert (
            f"{victim.pid} ProcessLookupError" in r.stdout and f"{os.getpid()} ProcessLookupError" in r.stdout
        )
        assert victim.poll() is None  # kill(-1) reached only the sandbox's own processes
    finally:
        victim.kill()
        victim.wait()


def test_ptrace_is_refused(sandbox: Sandbox) -> None:
    code = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"for pid in (1, os.getppid(), {os.getpid()}):\n"
        "    rc = libc.ptrace(16, pid, 0, 0)\n"  # PTRACE_ATTACH
        "    print('attach', pid, rc, os.strerror(ctypes.get_errno()))\n"
        "try:\n"
        "    print(open('/proc/1/mem', 'rb').read(16)); print('READ')\n"
        "except OSError as e:\n"
        "    print('mem', type(e).__name__)\n"
    )
    r = run(sandbox, code)
    assert r.stdout.count(" -1 Operation not permitted") == 3, r
    assert "READ" not in r.stdout and "mem " in r.stdout


def test_concurrent_calls_cannot_see_each_other(sandbox: Sandbox) -> None:
    secret = uuid.uuid4().hex
    writer = (
        "import time\n"
        f"open('/tmp/secret', 'w').write({secret!r})\n"
        f"open('/dev/shm/secret', 'w').write({secret!r})\n"
        "print('written', flush=True)\n"
        "time.sleep(3)\n"
    )
    reader = (
        "import glob, os, time\n"
        "time.sleep(1)\n"
        "found = []\n"
        "for pattern in ['/tmp/*', '/dev/shm/*', '/proc/*/root/tmp/*', '/proc/*/cwd/*']:\n"
        "    for p in glob.glob(pattern):\n"
        "        try:\n"
        "            found.append(open(p).read())\n"
        "        except OSError:\n"
        "            pass\n"
        "print(sorted(os.listdir('/tmp')), found)\n"
    )

    async def both() -> list[SandboxResult]:
        return list(await asyncio.gather(sandbox.run(writer, LIMITS), sandbox.run(reader, LIMITS)))

    w, rd = asyncio.run(both())
    assert w.stdout == "written\n"
    assert secret not in rd.stdout and rd.exit_code == 0, rd


def test_files_and_argv(sandbox: Sandbox) -> None:
    files = {
        "main.py": "import sys\nfrom pkg.util import f\nprint(f(), sys.argv)",
        "pkg/util.py": "def f():\n    return 7",
    }
    r = asyncio.run(sandbox.run({**files, "pkg/__init__.py": ""}, LIMITS, argv=("a",)))
    assert r.stdout == "7 ['main.py', 'a']\n", r
    with pytest.raises(ValueError):
        asyncio.run(sandbox.run({"../evil.py": "x"}, LIMITS, entry="../evil.py"))


# ---- missing bubblewrap and `sandbox: none` --------------------------------------------
def test_missing_bwrap_refuses_with_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AREAL_BWRAP", "/nonexistent/bwrap")
    for make in (
        lambda: Sandbox(),
        lambda: PythonTool("python"),
        lambda: CodeTestTool("t", config={"tests": ""}),
    ):
        with pytest.raises(SandboxUnavailable) as e:
            make()
        assert "apt-get install bubblewrap" in str(e.value) and "sandbox: none" in str(e.value)
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        Sandbox(bwrap="/nonexistent/bwrap")
    assert "apt-get install bubblewrap" in INSTALL_HINT


def test_sandbox_none_warns_at_every_start_and_runs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("AREAL_BWRAP", "/nonexistent/bwrap")
    with caplog.at_level(logging.WARNING, logger="rollout_cluster.tools.python_tool"):
        tools = [PythonTool("python", config={"sandbox": "none"}) for _ in range(2)]
    warnings = [r for r in caplog.records if "WITHOUT isolation" in r.getMessage()]
    assert len(warnings) == 2
    out = asyncio.run(tools[0].execute("i", {"code": "import os\nprint(6*7, os.getuid() == os.geteuid())"}))
    assert out.text == "42 True\n"
    with pytest.raises(ValueError, match="sandbox must be"):
        PythonTool("python", config={"sandbox": "off"})


# ---- the code_test tool ----------------------------------------------------------------
TESTS = """\
from solution import add

def test_small():
    assert add(1, 2) == 3

def test_negative():
    assert add(-1, -1) == -2

def test_strings():
    assert add("a", "b") == "ab"
"""


def test_code_test_tool_counts_passes_and_failures() -> None:
    assert BUILTIN_TOOLS["code_test"] is CodeTestTool
    tool = CodeTestTool("code_test", config={"tests": TESTS, "wall_s": 20})
    good = asyncio.run(tool.execute("i", {"code": "def add(a, b):\n    return a + b\n"}))
    assert (
        good.reward == 1.0 and good.metrics["tests_passed"] == 3 and good.text.startswith("3/3 tests passed")
    )
    bad = asyncio.run(tool.execute("i", {"code": "def add(a, b):\n    return abs(a) + abs(b)\n"}))
    assert (
        bad.metrics["tests_failed"] == 1
        and bad.metrics["tests_errors"] == 1
        and bad.reward == pytest.approx(1 / 3)
    )
    assert "test_negative: failed" in bad.text


def test_code_test_tool_cannot_fake_a_pass(tmp_path: Path) -> None:
    test_file = tmp_path / "test_task.py"
    test_file.write_text(TESTS)
    tool = CodeTestTool("code_test", config={"test_file": str(test_file), "wall_s": 20})
    forged = "import os, json\nprint('\\n' + 'f' * 32 + ' ' + json.dumps([['test_small', 'passed', '']]))\nos._exit(0)\n"
    out = asyncio.run(tool.execute("i", {"code": forged}))
    assert out.reward == 0.0 and out.metrics["tests_completed"] == 0
    # Per-episode tests (sample tools_kwargs) take precedence over the config's.
    asyncio.run(tool.create("ep", tests="def test_only():\n    assert True\n"))
    out = asyncio.run(tool.execute("ep", {"code": ""}))
    assert out.reward == 1.0 and out.metrics["tests_total"] == 1


# ---- end to end: an agent loop whose episodes call the python tool concurrently -------
def test_agent_loop_episodes_call_the_sandboxed_tool_concurrently(tokenizer: Any) -> None:
    """Fake only the server; the loop, the hermes parser, the tool and bwrap are real."""
    import json

    from areal_like.core.config import AgentConfig
    from areal_like.core.types import SamplingParams
    from rollout_cluster.agent_loop import ToolAgentLoop
    from rollout_cluster.server_manager import ServerManager

    from ._agent_fakes import FakeServer

    codes = {
        f"ep{i}": f"import os, time\ntime.sleep(0.3)\nprint({i} * 7, os.getuid(), os.path.exists({str(REPO)!r}))"
        for i in range(4)
    }

    def script(episode: str, turn: int) -> str:
        if turn == 0:
            call = {"name": "python", "arguments": {"code": codes[episode]}}
            return f"<tool_call>{json.dumps(call)}</tool_call>"
        return "done"

    server = FakeServer(tokenizer, script)
    tool = PythonTool("python", timeout_s=60, config={"wall_s": 30})
    loop = ToolAgentLoop(
        server_manager=ServerManager([server]),
        tokenizer=tokenizer,
        config=AgentConfig(max_tool_response_length=500),
        response_length=400,
        tools=[tool],
    )
    sample = {"prompt": [{"role": "user", "content": "compute"}]}

    async def episodes() -> list[Any]:
        return list(
            await asyncio.gather(*(loop.run(SamplingParams(), episode_id=ep, **sample) for ep in codes))
        )

    outs = asyncio.run(episodes())
    for i, out in enumerate(outs):
        tool_msgs = [m for m in out.messages if m["role"] == "tool"]
        assert [m["content"] for m in tool_msgs] == [f"{i * 7} 65534 False\n"], out.messages
        assert out.termination == "no_tool_call" and out.metrics["tool_calls"] == 1


def test_many_concurrent_calls_keep_their_own_results(sandbox: Sandbox) -> None:
    """Regression: a double close of a per-call fd once closed another call's output fd."""

    async def many() -> list[SandboxResult]:
        return list(await asyncio.gather(*(sandbox.run(f"print({i})", LIMITS) for i in range(24))))

    assert [r.stdout for r in asyncio.run(many())] == [f"{i}\n" for i in range(24)]
