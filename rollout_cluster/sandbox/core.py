"""Run untrusted Python under bubblewrap; see docs/sandbox.md for the threat model.

One call = one `bwrap` process, started as an unprivileged host uid (nobody when the
parent is root, else the parent's own uid) in new user, mount, pid, net, ipc, uts and
cgroup namespaces, uid/gid 65534 inside. Why each piece:

- Host uid nobody, not root: the kernel skips `RLIMIT_NPROC` for host uid 0, so a
  sandbox mapped to root could fork-bomb the host; under a non-root uid in a fresh user
  namespace the limit counts exactly this call's processes. It is also defence in
  depth: a kernel escape lands as nobody.
- The interpreter under a 0700 `/root` is not readable by nobody, and bwrap resolves
  bind sources by path as the calling uid. So (root only) a hard-linked mirror of the
  interpreter (binary, libpython, stdlib without site-packages/test) is built once in a
  root-owned, world-readable cache and bound read-only at the interpreter's own path.
- The filesystem is a read-only tmpfs root holding only: the interpreter, the shared
  libraries its binary and extension modules link (found with `ldd`), a fresh `/proc`
  of the new pid namespace, a minimal `/dev`, and size-limited tmpfs for `/tmp`
  (scratch and home) and `/dev/shm`. No project tree, no host `/proc`, no sockets.
- The environment is cleared; the code reaches the sandbox through memfds copied in
  by bwrap (`--file`), and stdout/stderr go to memfds bounded by `RLIMIT_FSIZE`, so
  nothing is written to the host filesystem and a print bomb cannot fill memory.
- Limits: `RLIMIT_CPU`, `RLIMIT_AS`, `RLIMIT_FSIZE`, `RLIMIT_NPROC` (per call, see
  above), no core dumps, set by a tiny bootstrap inside before the code runs.
- Kill: bwrap runs in its own process group; on timeout the group is SIGKILLed, the
  sandbox's pid 1 gets SIGKILL through `--die-with-parent`, and the kernel kills
  everything left in the pid namespace. The call returns only once that pid 1 is gone
  (watched through a pidfd), so no process of a call outlives it.

This module holds the limits, results and `Sandbox` (one call); the interpreter runtime
(the mirror) and the seccomp filter are built in `rollout_cluster.sandbox.runtime`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rollout_cluster.sandbox.runtime import SandboxError, _Runtime, _runtime, seccomp_program

logger = logging.getLogger(__name__)

__all__ = [
    "INSTALL_HINT",
    "Sandbox",
    "SandboxError",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "find_bwrap",
]

NOBODY = 65534
BWRAP_ENV = "AREAL_BWRAP"
"""Environment variable naming the bwrap binary (tests point it at a missing path)."""

INSTALL_HINT = (
    "bubblewrap (`bwrap`) is required to run model-written code safely but was not found. "
    "Install it: `apt-get install bubblewrap` (Debian/Ubuntu; `scripts/setup.sh` does this when "
    "run as root), `dnf install bubblewrap` (Fedora/RHEL) or `apk add bubblewrap` (Alpine). "
    "To run the code WITHOUT any isolation instead (trusted code only), set `sandbox: none` "
    "in the tool's config."
)

_SCRATCH = "/tmp"
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*(/[A-Za-z0-9_][A-Za-z0-9_.\-]*)*$")

# Runs inside the sandbox (or the unsandboxed child) as `python -I -c _BOOTSTRAP ...`:
# set the limits, then run the entry file as __main__ in this same interpreter (one
# interpreter start per call, not two). The bootstrap's own frame is cut from tracebacks.
_BOOTSTRAP = """\
def _areal_boot():
    import builtins, os, resource, sys
    cpu, mem, fsize, nproc = (int(x) for x in sys.argv[1:5])
    entry, site_dirs, argv = sys.argv[5], sys.argv[6], sys.argv[7:]
    R = resource
    R.setrlimit(R.RLIMIT_CORE, (0, 0))
    R.setrlimit(R.RLIMIT_CPU, (cpu, cpu + 1))
    R.setrlimit(R.RLIMIT_FSIZE, (fsize, fsize))
    if nproc > 0:
        R.setrlimit(R.RLIMIT_NPROC, (nproc, nproc))
    if site_dirs:
        import site
        for d in site_dirs.split(":"):
            site.addsitedir(d)
    with open(entry, "rb") as f:
        code = compile(f.read(), entry, "exec")
    R.setrlimit(R.RLIMIT_AS, (mem, mem))
    sys.argv = [entry, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(entry)))  # like `python main.py`
    main = sys.modules["__main__"].__dict__
    main.clear()
    main.update(__name__="__main__", __file__=entry, __builtins__=builtins, __doc__=None,
                __spec__=None, __loader__=None, __package__=None)
    try:
        exec(code, main)
    except SystemExit:
        raise
    except BaseException as e:
        import traceback
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        sys.stderr.flush()
        raise SystemExit(1) from None
_areal_boot()
"""


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing; the message says how to install it."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-call limits. CPU, memory and file size are per process; processes per call."""

    wall_s: float = 5.0
    cpu_s: int = 2
    memory_mb: int = 512
    file_size_mb: int = 4
    max_processes: int = 16
    scratch_mb: int = 32
    max_output_bytes: int = 16_000

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_mb", "file_size_mb", "max_processes", "scratch_mb"):
            if getattr(self, name) <= 0:
                raise ValueError(f"sandbox limit {name} must be > 0, got {getattr(self, name)}")
        if self.max_output_bytes < 0:
            raise ValueError("sandbox limit max_output_bytes must be >= 0")


@dataclass
class SandboxResult:
    """What one call produced. `killed_by`: why the call was stopped, if it was."""

    stdout: str
    stderr: str
    exit_code: int | None
    """The program's exit status; None when killed at the wall-clock limit."""
    timed_out: bool
    killed_by: Literal["wall", "cpu", "memory", "file_size", "signal"] | None
    signal: str | None
    """Name of the signal that ended the program (e.g. SIGXCPU), if any."""
    wall_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    sandboxed: bool = True
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


def find_bwrap(path: str | None = None) -> str:
    """The bwrap binary: `path`, else $AREAL_BWRAP, else `bwrap` on PATH; or SandboxUnavailable."""
    candidate = path or os.environ.get(BWRAP_ENV) or shutil.which("bwrap")
    if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
        return candidate
    where = f" (looked for {candidate!r})" if candidate else ""
    raise SandboxUnavailable(INSTALL_HINT + where)


# ---- one call --------------------------------------------------------------------------
def _normalize_files(code_or_files: str | Mapping[str, str | bytes], entry: str) -> dict[str, bytes]:
    files = {entry: code_or_files} if isinstance(code_or_files, str) else dict(code_or_files)
    if entry not in files:
        raise ValueError(f"sandbox: entry file {entry!r} is not among the files {sorted(files)}")
    out = {}
    for name, content in files.items():
        if not _FILE_NAME.match(name) or ".." in name.split("/"):
            raise ValueError(f"sandbox: bad file name {name!r} (relative, [A-Za-z0-9_.-] parts)")
        out[name] = content.encode() if isinstance(content, str) else bytes(content)
    return out


def _memfd(name: str, data: bytes = b"") -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    if data:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _read_head(fd: int, limit: int) -> tuple[str, bool]:
    size = os.fstat(fd).st_size
    data = os.pread(fd, min(size, limit), 0)
    truncated = size > limit
    text = data.decode("utf-8", errors="replace")
    return text, truncated


def _decode_status(rc: int | None, stderr: str) -> tuple[int | None, str | None, str | None]:
    """(exit code, signal name, killed_by) from bwrap's status (128+N for a signal N)."""
    if rc is None:
        return None, None, None
    signo = -rc if rc < 0 else (rc - 128 if 128 < rc < 128 + 65 else 0)
    if signo:
        try:
            name = signal.Signals(signo).name
        except ValueError:
            name = f"SIG{signo}"
        why = {"SIGXCPU": "cpu", "SIGXFSZ": "file_size"}.get(name, "signal")
        return rc, name, why
    if rc != 0 and re.search(r"^MemoryError\b", stderr, re.M):
        return rc, None, "memory"
    if rc != 0 and "File too large" in stderr:  # Python ignores SIGXFSZ: writes fail with EFBIG
        return rc, None, "file_size"
    return rc, None, None


class Sandbox:
    """Runs Python programs in a bubblewrap sandbox (or, with mode 'none', without one).

    Safe to share between concurrent calls (asyncio tasks or threads via `run_sync`):
    every call gets its own namespaces, scratch tmpfs and limits.

    Args:
        mode: "bwrap" (default) or "none" (no isolation at all: trusted code only; only
            the rlimits, a private temp dir and an empty environment remain).
        bwrap: path of the bwrap binary (default: $AREAL_BWRAP or `bwrap` on PATH).
        site_packages: also bind the running interpreter's site-packages read-only.
    """

    def __init__(
        self,
        mode: Literal["bwrap", "none"] = "bwrap",
        *,
        bwrap: str | None = None,
        site_packages: bool = False,
    ) -> None:
        if mode not in ("bwrap", "none"):
            raise ValueError(f"sandbox mode must be 'bwrap' or 'none', got {mode!r}")
        self.mode = mode
        self.site_packages = site_packages
        self.bwrap = find_bwrap(bwrap) if mode == "bwrap" else None
        # Root hands the sandbox to nobody (see the module docstring); others keep their uid.
        self.host_uid = NOBODY if os.geteuid() == 0 else os.geteuid()

    def prepare(self) -> None:
        """Build the read-only runtime now (else the first call does; it may take a second)."""
        if self.mode == "bwrap":
            _runtime(self.site_packages, self.host_uid)

    def run_sync(
        self,
        code_or_files: str | Mapping[str, str | bytes],
        limits: SandboxLimits | None = None,
        *,
        entry: str = "main.py",
        argv: tuple[str, ...] = (),
    ) -> SandboxResult:
        """`run` for synchronous callers (starts its own event loop)."""
        return asyncio.run(self.run(code_or_files, limits, entry=entry, argv=argv))

    async def run(
        self,
        code_or_files: str | Mapping[str, str | bytes],
        limits: SandboxLimits | None = None,
        *,
        entry: str = "main.py",
        argv: tuple[str, ...] = (),
    ) -> SandboxResult:
        """Run `entry` (the code itself when a string is given) with the other files beside it.

        Files land in the scratch folder (`/tmp`, also the working directory and HOME).
        Never leaves a process of the call running, also when cancelled.
        """
        limits = limits or SandboxLimits()
        files = _normalize_files(code_or_files, entry)
        if self.mode == "none":
            return await self._run_unsandboxed(files, limits, entry, argv)
        runtime = await asyncio.to_thread(_runtime, self.site_packages, self.host_uid)
        fds: list[int] = []
        try:
            out_fd, err_fd = _memfd("stdout"), _memfd("stderr")
            fds += [out_fd, err_fd]
            info_r, info_w = os.pipe2(os.O_CLOEXEC)
            fds += [info_r, info_w]
            file_fds = {name: _memfd("file", data) for name, data in files.items()}
            fds += file_fds.values()
            bpf = seccomp_program()
            seccomp_fd = _memfd("seccomp", bpf) if bpf else None
            if seccomp_fd is not None:
                fds.append(seccomp_fd)
            cmd = self._command(runtime, limits, file_fds, info_w, entry, argv, seccomp_fd)
            extra_fds = [*file_fds.values()] + ([seccomp_fd] if seccomp_fd is not None else [])
            return await self._spawn_and_wait(cmd, limits, out_fd, err_fd, info_r, info_w, extra_fds, fds)
        finally:
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _command(
        self,
        rt: _Runtime,
        limits: SandboxLimits,
        file_fds: dict[str, int],
        info_w: int,
        entry: str,
        argv: tuple[str, ...],
        seccomp_fd: int | None,
    ) -> list[str]:
        assert self.bwrap is not None
        mb = 1 << 20
        cmd = [
            self.bwrap,
            "--unshare-all",  # user, ipc, pid, net, uts, cgroup
            "--unshare-user",
            "--disable-userns",  # no nested namespaces from inside
            "--die-with-parent",
            "--new-session",  # no TIOCSTI into a terminal
            "--clearenv",
            "--uid", str(NOBODY), "--gid", str(NOBODY),
            "--hostname", "sandbox",
            "--info-fd", str(info_w),
        ]  # fmt: skip
        if seccomp_fd is not None:
            cmd += ["--seccomp", str(seccomp_fd)]
        for src, dest in rt.binds:
            cmd += ["--ro-bind", src, dest]
        for m in rt.masks:
            cmd += ["--size", "4096", "--tmpfs", m, "--remount-ro", m]
        cmd += [
            "--proc", "/proc",
            "--dev", "/dev",
            "--size", str(limits.scratch_mb * mb), "--tmpfs", "/dev/shm",
            "--remount-ro", "/dev",
            "--size", str(limits.scratch_mb * mb), "--tmpfs", _SCRATCH,
        ]  # fmt: skip
        made: set[str] = set()
        for name, fd in file_fds.items():
            parts = name.split("/")[:-1]
            for i in range(len(parts)):
                d = "/".join(parts[: i + 1])
                if d not in made:
                    made.add(d)
                    cmd += ["--dir", f"{_SCRATCH}/{d}"]
            cmd += ["--perms", "0644", "--file", str(fd), f"{_SCRATCH}/{name}"]
        cmd += [
            "--remount-ro", "/",
            "--chdir", _SCRATCH,
            "--setenv", "HOME", _SCRATCH,
            "--setenv", "TMPDIR", _SCRATCH,
            "--setenv", "LANG", "C.UTF-8",
            "--",
            rt.python, "-I", "-c", _BOOTSTRAP,
            *self._limit_args(limits, in_userns=True),
            entry, ":".join(rt.site_dirs), *argv,
        ]  # fmt: skip
        return cmd

    @staticmethod
    def _limit_args(limits: SandboxLimits, *, in_userns: bool) -> list[str]:
        # +1: bwrap's pid 1 (the reaper) lives in the call's user namespace too.
        nproc = limits.max_processes + 1 if in_userns else 0
        mb = 1 << 20
        return [str(limits.cpu_s), str(limits.memory_mb * mb), str(limits.file_size_mb * mb), str(nproc)]

    async def _spawn_and_wait(
        self,
        cmd: list[str],
        limits: SandboxLimits,
        out_fd: int,
        err_fd: int,
        info_r: int,
        info_w: int,
        pass_fds: list[int],
        owned: list[int],
    ) -> SandboxResult:
        drop = {"user": NOBODY, "group": NOBODY, "extra_groups": []} if os.geteuid() == 0 else {}
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=subprocess.DEVNULL,
            stdout=out_fd,
            stderr=err_fd,
            pass_fds=[info_w, *pass_fds],
            start_new_session=True,
            env={},
            **drop,
        )
        # Now only bwrap holds it: EOF once bwrap wrote (or failed). Dropped from `owned` so
        # the caller does not close the number again (another call may have reused it).
        owned.remove(info_w)
        os.close(info_w)
        pidfd: int | None = None
        timed_out = False
        info = b""
        try:
            deadline = loop.time() + limits.wall_s
            info = await asyncio.wait_for(_read_pipe(info_r), timeout=limits.wall_s)
            if info:
                child = int(json.loads(info)["child-pid"])
                try:
                    pidfd = os.pidfd_open(child)
                except ProcessLookupError:
                    pidfd = None  # already gone: nothing of the call is left to wait for
            try:
                await asyncio.wait_for(proc.wait(), timeout=max(0.0, deadline - loop.time()))
            except TimeoutError:
                timed_out = True
        except TimeoutError:
            timed_out = True
        finally:  # also on cancellation: kill the whole call and wait until it is gone
            await asyncio.shield(self._reap(proc, pidfd))
        wall = time.perf_counter() - start
        if not info and not timed_out:
            stderr, _ = _read_head(err_fd, 4000)
            raise SandboxError(
                f"bubblewrap could not start the sandbox (exit {proc.returncode}): {stderr.strip()}"
            )
        stdout, out_trunc = _read_head(out_fd, limits.max_output_bytes)
        stderr, err_trunc = _read_head(err_fd, limits.max_output_bytes)
        if timed_out:
            code, sig, why = None, None, "wall"
        else:
            code, sig, why = _decode_status(proc.returncode, stderr)
        return SandboxResult(stdout, stderr, code, timed_out, why, sig, wall, out_trunc, err_trunc)  # type: ignore[arg-type]

    async def _reap(self, proc: asyncio.subprocess.Process, pidfd: int | None) -> None:
        """SIGKILL bwrap's group (its pid 1 follows through --die-with-parent, the pid
        namespace with it) unless it already exited; then wait until pid 1 is gone."""
        try:
            if proc.returncode is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                if pidfd is not None:
                    try:
                        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            await proc.wait()
            if pidfd is not None:
                await _wait_pidfd(pidfd, timeout=30.0)
        finally:
            if pidfd is not None:
                os.close(pidfd)

    async def _run_unsandboxed(
        self, files: dict[str, bytes], limits: SandboxLimits, entry: str, argv: tuple[str, ...]
    ) -> SandboxResult:
        """mode 'none': rlimits, an empty environment and a private temp dir; nothing else."""
        with tempfile.TemporaryDirectory(prefix="areal_unsandboxed_") as scratch:
            for name, data in files.items():
                p = Path(scratch, name)
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(data)
            out_fd, err_fd = _memfd("stdout"), _memfd("stderr")
            try:
                cmd = [sys.executable, "-I", "-c", _BOOTSTRAP, *self._limit_args(limits, in_userns=False),
                       entry, "", *argv]  # fmt: skip
                start = time.perf_counter()
                proc = await asyncio.create_subprocess_exec(
                    *cmd, stdin=subprocess.DEVNULL, stdout=out_fd, stderr=err_fd, cwd=scratch, env={},
                    start_new_session=True,
                )  # fmt: skip
                timed_out = False
                try:
                    await asyncio.wait_for(proc.wait(), timeout=limits.wall_s)
                except TimeoutError:
                    timed_out = True
                finally:
                    if proc.returncode is None or timed_out:
                        try:
                            os.killpg(proc.pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    await asyncio.shield(proc.wait())
                wall = time.perf_counter() - start
                stdout, out_trunc = _read_head(out_fd, limits.max_output_bytes)
                stderr, err_trunc = _read_head(err_fd, limits.max_output_bytes)
            finally:
                os.close(out_fd)
                os.close(err_fd)
        if timed_out:
            code, sig, why = None, None, "wall"
        else:
            code, sig, why = _decode_status(proc.returncode, stderr)
        return SandboxResult(stdout, stderr, code, timed_out, why, sig, wall, out_trunc, err_trunc,  # type: ignore[arg-type]
                             sandboxed=False)  # fmt: skip


async def _read_pipe(fd: int) -> bytes:
    """Everything written to the pipe `fd` until EOF, without blocking the event loop."""
    os.set_blocking(fd, False)
    loop = asyncio.get_running_loop()
    chunks: list[bytes] = []
    done = loop.create_future()

    def readable() -> None:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            return
        if chunk:
            chunks.append(chunk)
        elif not done.done():
            done.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await done
    finally:
        loop.remove_reader(fd)
    return b"".join(chunks)


async def _wait_pidfd(pidfd: int, timeout: float) -> None:
    """Wait until the process behind `pidfd` has exited (its pid namespace is then empty).

    Polls the pidfd (readable once the process exits) with a short backoff rather than
    registering it with the event loop, so a slow kill never holds a loop reader."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    deadline = time.monotonic() + timeout
    delay = 0.001
    while not poller.poll(0):
        if time.monotonic() > deadline:
            logger.error("sandbox: pid 1 of a killed call still exists after %.0f s", timeout)
            return
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.02)
