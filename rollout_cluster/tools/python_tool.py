"""A `python` tool that runs model-written code in a separate, limited process.

Model code is untrusted: it may loop forever, allocate without bound, print
gigabytes, fork without end, read secrets from the environment or open network
connections. Each call therefore runs in a fresh interpreter with:

- CPU time (`RLIMIT_CPU`), address space (`RLIMIT_AS`) and file size
  (`RLIMIT_FSIZE`) limits, set by a tiny bootstrap in the child before it `exec`s
  the code (no `preexec_fn`, which is unsafe in a threaded parent);
- a process-count limit (`max_processes`, the call's processes at once), enforced
  per call, so concurrent calls never share a budget. One of, chosen once:
  * `uid`: when the parent is root and the interpreter is reachable by other users,
    each call runs under its own unused uid (drawn from a private range) with
    `RLIMIT_NPROC` — the kernel counts processes per uid, so the count is exactly
    this call's; afterwards every process of that uid is killed;
  * `cgroup`: when the parent is root but the interpreter is not reachable by other
    users (e.g. a pyenv under a 0700 `/root`; the child then keeps root's uid, which
    `RLIMIT_NPROC` does not bind), each call gets its own pids cgroup (`pids.max`,
    cgroup v1 or a delegated v2 subtree); afterwards every process in it is killed
    and the cgroup removed;
  * `watchdog` (non-root without a usable pids cgroup, logged once): every 50 ms
    the parent counts the call's processes (its session and every descendant it has
    seen) and kills them all past the limit, with a coarse `RLIMIT_NPROC` backstop
    (the user's current process count + 64 × the limit) against exponential fork
    bombs. Best effort: a process that double-forks away within one poll escapes
    (run such hosts in a container with a pids limit);
- a wall-clock limit enforced by the parent, which kills the child's whole session
  (and, in `uid` / `cgroup` mode, every process of the call, wherever it went);
- an empty environment, `python -I` (no user site, no PYTHON* variables), stdin
  closed, and a scratch temp dir as the working directory, deleted afterwards;
- no network: a new network namespace through `unshare -n` (or `unshare -c -n`
  with a user namespace when not root), probed once. Where neither works the tool
  still runs, best-effort without network isolation, and logs that once.

Output goes to files (bounded by `RLIMIT_FSIZE`), not pipes, so a print bomb
cannot exhaust the parent's memory; the model sees at most `max_output_chars`.
Not a security boundary against a determined attacker (no seccomp, the filesystem
is shared); it keeps training runs safe from accidents and reward-hacking code.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rollout_cluster.tools.base import BaseTool, ToolResult

logger = logging.getLogger(__name__)

__all__ = ["PythonTool", "network_isolation_command", "process_limit_mode"]

_MAX_CODE_CHARS = 64_000

# Runs in the child before the user's code: join the call's cgroup, limits, privilege
# drop to the call's own uid, exec.
_BOOTSTRAP = """\
import os, resource, sys
cpu, mem, fsize, nproc, uid = (int(x) for x in sys.argv[1:6])
cgroup_procs = sys.argv[6]
if cgroup_procs:
    with open(cgroup_procs, "w") as f:
        f.write(str(os.getpid()))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if nproc > 0:
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
if uid > 0 and os.geteuid() == 0:
    os.chown(".", uid, uid)
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
os.execv(sys.executable, [sys.executable, "-I", "main.py"])
"""

# Per-call uids (mode `uid`): a range no real account uses; collisions between processes
# are astronomically unlikely and would only make two calls share one budget.
_UID_BASE, _UID_SPAN = 0x5A000000, 0x01000000

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
    """Root may hand the child to another uid only if that uid can still run the interpreter."""
    global _drop_ok
    if _drop_ok is None:
        _drop_ok = os.geteuid() == 0 and (
            _world_reachable(sys.executable) and _world_reachable(os.path.join(sys.base_prefix, "lib"))
        )
        if os.geteuid() == 0 and not _drop_ok:
            logger.warning("python tool: interpreter not reachable by other users; tool code keeps root's uid")
    return _drop_ok


def _pids_cgroup_root() -> Path | None:
    """A pids-cgroup folder this (root) process may create per-call cgroups in, or None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):  # cgroup v1
            candidates.append(Path("/sys/fs/cgroup/pids") / path.lstrip("/"))
        elif controllers == "":  # cgroup v2: only a subtree delegated with the pids controller
            candidates.append(Path("/sys/fs/cgroup") / path.lstrip("/"))
    for base in candidates:
        probe = base / f"areal_py_probe_{os.getpid()}"
        try:
            probe.mkdir()
        except OSError:
            continue
        try:
            (probe / "pids.max").write_text("4\n")
            return base
        except OSError:
            continue
        finally:
            try:
                probe.rmdir()
            except OSError:
                pass
    return None


_limit_mode: tuple[str, Path | None] | None = None


def process_limit_mode() -> tuple[str, Path | None]:
    """How the per-call process-count limit is enforced here: ('uid'|'cgroup'|'watchdog', cgroup base)."""
    global _limit_mode
    if _limit_mode is None:
        if _can_drop_privileges():
            _limit_mode = ("uid", None)
        elif os.geteuid() == 0 and (base := _pids_cgroup_root()) is not None:
            _limit_mode = ("cgroup", base)
        else:
            _limit_mode = ("watchdog", None)
            logger.warning(
                "python tool: no per-call uid or pids cgroup available; the process limit is a "
                "best-effort watchdog on the call's session"
            )
    return _limit_mode


def _proc_table() -> list[tuple[int, int, int, int]]:
    """(pid, ppid, session id, uid) of every live process, from /proc."""
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] in ("Z", "X"):
                continue
            out.append((int(entry.name), int(fields[1]), int(fields[3]), entry.stat().st_uid))
        except (OSError, IndexError, ValueError):
            continue
    return out


def _call_processes(root: int, known: set[int]) -> set[int]:
    """Watchdog mode: the live processes of a call — its session, the descendants of any
    process seen before (a child that called setsid() is still found by its parent), and
    those seen before that are still alive. `known` is updated in place."""
    table = _proc_table()
    live = {pid for pid, _, _, _ in table}
    known &= live
    known |= {pid for pid, _, sid, _ in table if sid == root}
    known.add(root)
    children: dict[int, list[int]] = {}
    for pid, ppid, _, _ in table:
        children.setdefault(ppid, []).append(pid)
    stack = list(known)
    while stack:
        for c in children.get(stack.pop(), ()):
            if c not in known:
                known.add(c)
                stack.append(c)
    known.discard(os.getpid())
    return known & live


class PythonTool(BaseTool):
    """Runs a Python snippet and answers with its (truncated) stdout and stderr.

    Config keys: `cpu_s` (CPU seconds per process, default 2), `memory_mb` (address
    space per process, default 512), `wall_s` (default 5; keep it below the tool's
    `timeout_s`), `max_output_chars` (default 1000), `file_size_mb` (default 4),
    `max_processes` (processes of one call at once, default 16), `isolate_network`
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
        self.max_processes = int(c.get("max_processes", 16))
        if self.max_processes < 1:
            raise ValueError(f"python tool {name!r}: max_processes must be >= 1")
        self.isolate_network = bool(c.get("isolate_network", True))
        self._known: dict[int, set[int]] = {}  # watchdog mode: processes seen per running call

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResult("Error: 'code' must be a string", metrics={"python_refused": 1.0})
        if len(code) > _MAX_CODE_CHARS:
            return ToolResult(
                f"Error: code longer than {_MAX_CODE_CHARS} characters", metrics={"python_refused": 1.0}
            )
        prefix = await asyncio.to_thread(network_isolation_command) if self.isolate_network else []
        mode, cg_base = await asyncio.to_thread(process_limit_mode)
        with (
            tempfile.TemporaryDirectory(prefix="areal_py_") as scratch,
            tempfile.TemporaryDirectory() as io_dir,
        ):
            Path(scratch, "main.py").write_text(code)
            out_path, err_path = Path(io_dir, "stdout"), Path(io_dir, "stderr")
            uid, nproc, cgroup = 0, 0, None
            if mode == "uid":
                uid = _UID_BASE + secrets.randbelow(_UID_SPAN)
                nproc = self.max_processes
            elif mode == "cgroup":
                assert cg_base is not None
                cgroup = cg_base / f"areal_py_{os.getpid()}_{secrets.token_hex(6)}"
                cgroup.mkdir()
                (cgroup / "pids.max").write_text(f"{self.max_processes}\n")
            else:
                nproc = _user_process_count() + 64 * self.max_processes  # coarse backstop only
            limits = [
                str(self.cpu_s),
                str(self.memory_mb << 20),
                str(self.file_size_mb << 20),
                str(nproc),
                str(uid),
                str(cgroup / "cgroup.procs") if cgroup else "",
            ]
            cmd = [*prefix, sys.executable, "-I", "-c", _BOOTSTRAP, *limits]
            killed_for: str | None = None
            try:
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
                try:
                    killed_for = await self._wait(proc, mode)
                finally:  # also when cancelled by the caller's timeout: never leave anything running
                    known = self._known.pop(proc.pid, set())
                    await asyncio.to_thread(_kill_call, proc.pid, uid, cgroup, known)
                    if proc.returncode is None:
                        await proc.wait()
            finally:
                if cgroup is not None:
                    await asyncio.to_thread(_remove_cgroup, cgroup)
            stdout = _read_head(out_path, self.max_output_chars)
            stderr = _read_head(err_path, self.max_output_chars)
        return ToolResult(
            self._format(stdout, stderr, proc.returncode, killed_for),
            metrics={"python_exit_code": float(proc.returncode or 0),
                     "python_killed": float(killed_for is not None)},
        )

    async def _wait(self, proc: asyncio.subprocess.Process, mode: str) -> str | None:
        """Wait for the child; returns why it was killed ('wall', 'processes') or None."""
        loop = asyncio.get_running_loop()
        known = self._known[proc.pid] = set()
        deadline = loop.time() + self.wall_s
        while True:
            left = deadline - loop.time()
            if left <= 0:
                return "wall"  # the caller's cleanup kills them all
            try:
                await asyncio.wait_for(proc.wait(), timeout=min(left, 0.05) if mode == "watchdog" else left)
                return None
            except asyncio.TimeoutError:
                pass
            if mode == "watchdog":
                n = len(await asyncio.to_thread(_call_processes, proc.pid, known))
                if n > self.max_processes:
                    return "processes"  # the caller's cleanup kills them all

    def _format(self, stdout: str, stderr: str, returncode: int | None, killed_for: str | None) -> str:
        parts = [stdout] if stdout else []
        if stderr:
            parts.append(f"[stderr]\n{stderr}")
        if killed_for == "wall":
            parts.append(f"[killed: wall-clock limit of {self.wall_s:g}s exceeded]")
        elif killed_for == "processes":
            parts.append(f"[killed: more than {self.max_processes} processes]")
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


def _user_process_count() -> int:
    uid = os.getuid()
    return sum(1 for _, _, _, u in _proc_table() if u == uid)


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_call(pid: int, uid: int, cgroup: Path | None, known: set[int]) -> None:
    """Kill every process the call started: its session, and everything of its uid or
    cgroup (which also finds processes that left the session). Loops until none is left;
    the process limit bounds how many can appear meanwhile."""
    if cgroup is None and uid <= 0:
        _kill_tree(pid, known)
        return
    _kill_session(pid)
    for _ in range(200):
        if cgroup is not None:
            try:
                pids = [int(x) for x in (cgroup / "cgroup.procs").read_text().split()]
            except OSError:
                pids = []
        elif uid > 0:
            pids = [p for p, _, _, u in _proc_table() if u == uid]
        else:
            pids = sorted(_call_processes(pid, known))
        if not pids:
            return
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.01)
    logger.error("python tool: processes of a call survived 200 kill rounds (uid %s, cgroup %s)", uid, cgroup)


def _kill_tree(pid: int, known: set[int]) -> None:
    """Watchdog mode: stop the call's processes (no more forks) while the parent links
    that find them are intact, until no new one appears; then kill them all."""
    stopped: set[int] = set()
    for _ in range(50):
        found = _call_processes(pid, known)
        new = found - stopped
        if not new:
            break
        for p in new:
            try:
                os.kill(p, signal.SIGSTOP)
            except (ProcessLookupError, PermissionError):
                pass
        stopped |= new
    _kill_session(pid)
    for p in stopped | known:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _remove_cgroup(cgroup: Path) -> None:
    for _ in range(100):  # a cgroup can be removed once its killed processes are reaped
        try:
            cgroup.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)
    logger.warning("python tool: could not remove %s", cgroup)


def _read_head(path: Path, max_chars: int) -> str:
    with path.open("rb") as f:
        data = f.read(max_chars * 4 + 4)
    text = data.decode("utf-8", errors="replace")
    return text if len(text) <= max_chars else text[:max_chars] + "...(truncated)"
