"""A `python` tool that runs model-written code in a separate, limited process.

Model code is untrusted: it may loop forever, allocate without bound, print
gigabytes, read secrets from the environment or open network connections. Each
call therefore runs in a fresh interpreter with:

- CPU time (`RLIMIT_CPU`), address space (`RLIMIT_AS`) and file size
  (`RLIMIT_FSIZE`) limits, set by a tiny bootstrap in the child before it `exec`s
  the code (no `preexec_fn`, which is unsafe in a threaded parent);
- a wall-clock limit enforced by the parent, which kills the child's whole session;
- an empty environment, `python -I` (no user site, no PYTHON* variables), stdin
  closed, and a scratch temp dir as the working directory, deleted afterwards;
- no network: a new network namespace through `unshare -n` (or `unshare -c -n`
  with a user namespace when not root), probed once. Where neither works the tool
  still runs, best-effort without network isolation, and logs that once;
- when the parent runs as root, the child drops to uid/gid 65534 (nobody) before
  running the code, provided the interpreter and its standard library are
  reachable by other users (a pyenv under a 0700 `/root` is not; then the child
  keeps root's uid, which is logged once).

Output goes to files (bounded by `RLIMIT_FSIZE`), not pipes, so a print bomb
cannot exhaust the parent's memory; the model sees at most `max_output_chars`.
Not a security boundary against a determined attacker (no seccomp, no process
count limit, which is per-user and would break concurrent calls); it keeps
training runs safe from accidents and reward-hacking code.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rollout_cluster.tools.base import BaseTool, ToolResult

logger = logging.getLogger(__name__)

__all__ = ["PythonTool", "network_isolation_command"]

_MAX_CODE_CHARS = 64_000

# Runs in the child before the user's code: limits, privilege drop (to nobody, 65534), exec.
_BOOTSTRAP = """\
import os, resource, sys
cpu, mem, fsize, drop = (int(x) for x in sys.argv[1:5])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if drop and os.geteuid() == 0:
    os.chown(".", 65534, 65534)
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
os.execv(sys.executable, [sys.executable, "-I", "main.py"])
"""

_drop_ok: bool | None = None
_net_cmd: list[str] | None = None
_net_probed = False


def network_isolation_command() -> list[str]:
    """The command prefix that puts a child in a fresh network namespace, or [] if none works."""
    global _net_cmd, _net_probed
    if not _net_probed:
        _net_probed = True
        unshare = shutil.which("unshare")
        for flags in (["-n"], ["-c", "-n"], ["-r", "-n"]):
            if unshare is None:
                break
            cmd = [unshare, *flags, "--"]
            try:
                ok = subprocess.run([*cmd, "true"], capture_output=True, timeout=10).returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                ok = False
            if ok:
                _net_cmd = cmd
                break
        if _net_cmd is None:
            logger.warning(
                "python tool: `unshare -n` is unavailable; tool code runs WITHOUT network isolation"
            )
    return list(_net_cmd or [])


def _world_reachable(path: str) -> bool:
    """True when every directory up to `path` is searchable and `path` readable by others."""
    p = Path(os.path.realpath(path))
    try:
        if not p.stat().st_mode & stat.S_IROTH:
            return False
        return all(d.stat().st_mode & stat.S_IXOTH for d in p.parents)
    except OSError:
        return False


def _can_drop_privileges() -> bool:
    """Root may hand the child to `nobody` only if `nobody` can still run the interpreter."""
    global _drop_ok
    if _drop_ok is None:
        _drop_ok = os.geteuid() != 0 or (
            _world_reachable(sys.executable) and _world_reachable(os.path.join(sys.base_prefix, "lib"))
        )
        if os.geteuid() == 0 and not _drop_ok:
            logger.warning("python tool: interpreter not reachable by 'nobody'; tool code runs as root")
    return _drop_ok


class PythonTool(BaseTool):
    """Runs a Python snippet and answers with its (truncated) stdout and stderr.

    Config keys: `cpu_s` (CPU seconds, default 2), `memory_mb` (address space,
    default 512), `wall_s` (default 5; keep it below the tool's `timeout_s`),
    `max_output_chars` (default 1000), `file_size_mb` (default 4), `isolate_network`
    (default true).
    """

    description = "Run a Python program and return what it prints."
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "Python source; print the result."}},
        "required": ["code"],
    }

    def __init__(self, name: str, *, timeout_s: float = 10.0, config: dict[str, Any] | None = None) -> None:
        super().__init__(name, timeout_s=timeout_s, config=config)
        c = self.config
        self.cpu_s = int(c.get("cpu_s", 2))
        self.memory_mb = int(c.get("memory_mb", 512))
        self.wall_s = float(c.get("wall_s", min(5.0, timeout_s)))
        self.max_output_chars = int(c.get("max_output_chars", 1000))
        self.file_size_mb = int(c.get("file_size_mb", 4))
        self.isolate_network = bool(c.get("isolate_network", True))

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        code = arguments["code"]
        if len(code) > _MAX_CODE_CHARS:
            return ToolResult(
                f"Error: code longer than {_MAX_CODE_CHARS} characters", metrics={"python_refused": 1.0}
            )
        prefix = await asyncio.to_thread(network_isolation_command) if self.isolate_network else []
        with (
            tempfile.TemporaryDirectory(prefix="areal_py_") as scratch,
            tempfile.TemporaryDirectory() as io_dir,
        ):
            Path(scratch, "main.py").write_text(code)
            out_path, err_path = Path(io_dir, "stdout"), Path(io_dir, "stderr")
            drop = await asyncio.to_thread(_can_drop_privileges)
            limits = [
                str(self.cpu_s),
                str(self.memory_mb << 20),
                str(self.file_size_mb << 20),
                str(int(drop)),
            ]
            cmd = [*prefix, sys.executable, "-I", "-c", _BOOTSTRAP, *limits]
            with out_path.open("wb") as out_f, err_path.open("wb") as err_f:
                proc = await asyncio.create_subprocess_exec(
                    *cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=out_f,
                    stderr=err_f,
                    cwd=scratch,
                    env={},
                    start_new_session=True,
                )
            killed_for_wall = False
            try:
                await asyncio.wait_for(proc.wait(), timeout=self.wall_s)
            except asyncio.TimeoutError:
                killed_for_wall = True
                _kill_session(proc.pid)
                await proc.wait()
            except BaseException:  # cancelled by the caller's timeout: never leave the child running
                _kill_session(proc.pid)
                raise
            stdout = _read_head(out_path, self.max_output_chars)
            stderr = _read_head(err_path, self.max_output_chars)
        return ToolResult(
            self._format(stdout, stderr, proc.returncode, killed_for_wall),
            metrics={"python_exit_code": float(proc.returncode or 0)},
        )

    def _format(self, stdout: str, stderr: str, returncode: int | None, killed_for_wall: bool) -> str:
        parts = [stdout] if stdout else []
        if stderr:
            parts.append(f"[stderr]\n{stderr}")
        if killed_for_wall:
            parts.append(f"[killed: wall-clock limit of {self.wall_s:g}s exceeded]")
        elif returncode is not None and returncode < 0:
            sig = signal.Signals(-returncode)
            why = " (CPU time limit)" if sig == signal.SIGXCPU else ""
            parts.append(f"[killed by {sig.name}{why}]")
        elif returncode:
            parts.append(f"[exit code {returncode}]")
        text = "\n".join(parts) if parts else "[no output]"
        if len(text) > self.max_output_chars:
            text = text[: self.max_output_chars] + "...(truncated)"
        return text


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _read_head(path: Path, max_chars: int) -> str:
    with path.open("rb") as f:
        data = f.read(max_chars * 4 + 4)
    text = data.decode("utf-8", errors="replace")
    return text if len(text) <= max_chars else text[:max_chars] + "...(truncated)"
