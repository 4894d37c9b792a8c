"""A bubblewrap sandbox for untrusted, model-written code (see docs/sandbox.md).

`Sandbox.run(code_or_files, limits)` runs a Python program in fresh user, mount,
pid, net, ipc and uts namespaces, as uid nobody, with a read-only view of the
interpreter and nothing else, a size-limited tmpfs for scratch, rlimits on CPU,
memory, processes and file size, and the whole call killed on timeout. Tools
(`PythonTool`, `CodeTestTool`) are thin layers over it.
"""

from rollout_cluster.sandbox.core import (
    INSTALL_HINT,
    Sandbox,
    SandboxError,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    find_bwrap,
)

__all__ = [
    "INSTALL_HINT",
    "Sandbox",
    "SandboxError",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "find_bwrap",
]
