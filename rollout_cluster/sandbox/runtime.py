"""What each sandbox call is built from: the read-only interpreter runtime and the seccomp filter.

The runtime is the interpreter binary, libpython, the stdlib (without site-packages and
tests) and the shared libraries they link (found with `ldd`), as bind mounts for bwrap.
When root drops to nobody and the interpreter sits where nobody cannot read it (under a
0700 `/root`), a hard-linked, world-readable mirror is built once in a root-owned cache
(`$AREAL_SANDBOX_CACHE`, default /var/cache/areal_like/sandbox) and bound at the
interpreter's own path. Built once per (site_packages, host uid) per process.

`rollout_cluster.sandbox.core` (limits, results, `Sandbox`) uses it; see docs/sandbox.md.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import shutil
import stat
import struct
import subprocess
import sys
import sysconfig
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

CACHE_ENV = "AREAL_SANDBOX_CACHE"
"""Where root builds the interpreter mirror (default /var/cache/areal_like/sandbox)."""


# Here, not in core (which re-exports it, as does the package): runtime imports nothing of core.
class SandboxError(RuntimeError):
    """bubblewrap could not set the sandbox up (not a failure of the code inside)."""


@dataclass(frozen=True)
class _Runtime:
    python: str
    binds: tuple[tuple[str, str], ...]
    masks: tuple[str, ...]
    site_dirs: tuple[str, ...]


_runtime_lock = threading.Lock()
_runtimes: dict[tuple[bool, int], _Runtime] = {}


def _reachable_by_others(path: str) -> bool:
    """True when a uid with no special rights can reach and read `path`."""
    p = Path(os.path.realpath(path))
    try:
        mode = p.stat().st_mode
        if not mode & stat.S_IROTH or (stat.S_ISDIR(mode) and not mode & stat.S_IXOTH):
            return False
        return all(d.stat().st_mode & stat.S_IXOTH for d in p.parents)
    except OSError:
        return False


def _elf_deps(files: list[str]) -> set[str]:
    """Absolute paths of the shared libraries (and loader) these ELF files need."""
    ldd = shutil.which("ldd")
    if ldd is None:
        raise SandboxError("`ldd` not found: cannot tell which shared libraries the interpreter needs")
    out = subprocess.run([ldd, *files], capture_output=True, text=True, timeout=60).stdout
    deps = set()
    for line in out.splitlines():
        m = re.search(r"=>\s+(/\S+)", line) or re.match(r"\s+(/\S+)\s+\(", line)
        if m:
            deps.add(m.group(1))
    return deps


def _safe_cache_dir(root: Path) -> Path:
    """Create `root` (and parents) as root-owned, not group/other writable; refuse otherwise."""
    root.mkdir(parents=True, exist_ok=True, mode=0o755)
    for d in [root, *root.parents]:
        st = d.lstat()
        if (
            stat.S_ISLNK(st.st_mode)
            or st.st_uid != 0
            or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX)
        ):
            raise SandboxError(f"sandbox cache {root}: {d} is not a root-owned, non-writable directory")
    if root.stat().st_mode & 0o022:
        raise SandboxError(f"sandbox cache {root} is writable by others")
    return root


def _mirror(src: str, dst: str, skip: set[str]) -> None:
    """Hard-link (or copy, across filesystems) the tree `src` into `dst`, world-readable."""
    for dirpath, dirnames, filenames in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        out = dst if rel == "." else os.path.join(dst, rel)
        os.makedirs(out, mode=0o755, exist_ok=True)
        if rel == ".":
            dirnames[:] = [d for d in dirnames if d not in skip]
        for name in list(dirnames) + filenames:
            s, d = os.path.join(dirpath, name), os.path.join(out, name)
            if os.path.islink(s):
                os.symlink(os.readlink(s), d)
                if name in dirnames:
                    dirnames.remove(name)
            elif name in filenames:
                _link_or_copy(s, d)


def _link_or_copy(s: str, d: str) -> None:
    try:
        os.link(s, d)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
        shutil.copy2(s, d)
    if not os.stat(d).st_mode & stat.S_IROTH:
        raise SandboxError(f"{s} is not world-readable; the sandbox (uid nobody) could not read it")


def _build_runtime(site_packages: bool, host_uid: int) -> _Runtime:
    base = os.path.realpath(sys.base_prefix)
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    exe = os.path.realpath(os.path.join(base, "bin", ver))
    if not os.path.isfile(exe):
        raise SandboxError(f"interpreter {exe} not found under sys.base_prefix {base}")
    stdlib = os.path.realpath(os.path.dirname(os.__file__))
    libdir = sysconfig.get_config_var("LIBDIR") or os.path.join(base, "lib")
    ldlib = sysconfig.get_config_var("INSTSONAME") or ""
    libpython = os.path.join(libdir, ldlib) if ldlib and os.path.isfile(os.path.join(libdir, ldlib)) else None
    dynload = os.path.join(stdlib, "lib-dynload")
    elf = [exe] + ([libpython] if libpython else [])
    if os.path.isdir(dynload):
        elf += sorted(os.path.join(dynload, f) for f in os.listdir(dynload) if f.endswith(".so"))
    mine = [exe, stdlib] + ([libpython] if libpython else [])
    system_libs = sorted(d for d in _elf_deps(elf) if os.path.realpath(d) not in mine)
    binds: list[tuple[str, str]] = [(lib, lib) for lib in system_libs]
    masks: list[str] = []
    hidden = {"site-packages", "test", "idlelib", "turtledemo"}
    if host_uid != os.geteuid() and not all(_reachable_by_others(p) for p in mine):
        # Root dropping to nobody, interpreter in a private place: bind a mirror instead.
        h = hashlib.sha256(f"{base}|{os.stat(exe).st_mtime_ns}|{stdlib}".encode()).hexdigest()[:16]
        cache = _safe_cache_dir(Path(os.environ.get(CACHE_ENV, "/var/cache/areal_like/sandbox")))
        tree = cache / f"{ver}-{h}"
        if not tree.is_dir():
            logger.info("sandbox: building a world-readable mirror of %s in %s (once)", base, tree)
            tmp = Path(tempfile.mkdtemp(prefix=f".{tree.name}.", dir=cache))
            os.chmod(tmp, 0o755)
            _link_or_copy(exe, str(tmp / "python"))
            if libpython:
                _link_or_copy(libpython, str(tmp / "libpython"))
            _mirror(stdlib, str(tmp / "stdlib"), hidden)
            try:
                os.rename(tmp, tree)
            except OSError:  # another process won the race; its tree is identical
                shutil.rmtree(tmp, ignore_errors=True)
        binds += [(str(tree / "python"), exe), (str(tree / "stdlib"), stdlib)]
        if libpython:
            binds.append((str(tree / "libpython"), libpython))
    else:
        for p in [*system_libs, *mine]:
            if host_uid != os.geteuid() and not _reachable_by_others(p):
                raise SandboxError(f"{p} is not readable by uid {host_uid}; the sandbox could not use it")
        binds += [(exe, exe), (stdlib, stdlib)] + ([(libpython, libpython)] if libpython else [])
        masks = [os.path.join(stdlib, d) for d in sorted(hidden) if os.path.isdir(os.path.join(stdlib, d))]
    site_dirs: list[str] = []
    if site_packages:
        for key in ("purelib", "platlib"):
            d = os.path.realpath(sysconfig.get_paths()[key])
            if d in site_dirs or not os.path.isdir(d):
                continue
            if host_uid != os.geteuid() and not _reachable_by_others(d):
                raise SandboxError(
                    f"site-packages {d} is not readable by uid {host_uid} (sandbox: site_packages)"
                )
            site_dirs.append(d)
            binds.append((d, d))
    return _Runtime(exe, tuple(binds), tuple(masks), tuple(site_dirs))


def _runtime(site_packages: bool, host_uid: int) -> _Runtime:
    with _runtime_lock:
        key = (site_packages, host_uid)
        if key not in _runtimes:
            _runtimes[key] = _build_runtime(site_packages, host_uid)
        return _runtimes[key]


# ---- seccomp: syscalls that reach other processes or the kernel's sharper edges -----
# Namespaces already hide other processes; this also refuses them inside the sandbox
# (ptrace of the sandbox's own pid 1 would freeze the call) and shrinks the kernel
# attack surface. Refused with EPERM, not killed, so the code sees an ordinary error.
_DENY = {
    # AUDIT_ARCH_X86_64: ptrace, process_vm_readv/writev, add_key, request_key, keyctl,
    # perf_event_open, bpf, userfaultfd, io_uring_setup/enter/register, unshare, setns, mount
    0xC000003E: (101, 310, 311, 248, 249, 250, 298, 321, 323, 425, 426, 427, 272, 308, 165),
    # AUDIT_ARCH_AARCH64: the same calls
    0xC00000B7: (117, 270, 271, 217, 218, 219, 241, 280, 282, 425, 426, 427, 97, 268, 40),
}
_MACHINE_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}


def seccomp_program() -> bytes | None:
    """A classic-BPF seccomp filter (as `bwrap --seccomp` reads it) for this machine, or None."""
    arch = _MACHINE_ARCH.get(os.uname().machine)
    if arch is None:
        return None
    deny = _DENY[arch]
    ret_errno, ret_allow = 0x00050000 | errno.EPERM, 0x7FFF0000
    ins: list[tuple[int, int, int, int]] = [
        (0x20, 0, 0, 4),  # ld arch
        (0x15, 1, 0, arch),  # jeq arch -> skip the next
        (0x06, 0, 0, ret_errno),  # another ABI: refuse everything
        (0x20, 0, 0, 0),  # ld syscall number
    ]
    checks = [(0x35, 0x40000000)] if arch == 0xC000003E else []  # jge: x32 ABI (bit 30) refused
    checks += [(0x15, nr) for nr in deny]  # jeq nr
    deny_at = len(ins) + len(checks) + 1  # after the allow
    for op, k in checks:
        ins.append((op, deny_at - len(ins) - 1, 0, k))
    ins.append((0x06, 0, 0, ret_allow))
    ins.append((0x06, 0, 0, ret_errno))
    return b"".join(struct.pack("=HBBI", *i) for i in ins)
