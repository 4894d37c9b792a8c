"""A `python` tool that runs model-written code in the bubblewrap sandbox.

Model code is untrusted and, in RL, optimised to find every door: it may loop
forever, allocate without bound, print gigabytes, fork without end, read secrets
from the environment or /proc, write outside its folder, talk to sockets, or leave
a daemon behind. Each call therefore runs through `rollout_cluster.sandbox.Sandbox`
(new user/mount/pid/net/ipc/uts namespaces, uid nobody, read-only interpreter and
nothing else, tmpfs scratch, rlimits, the whole call killed at the wall-clock
limit); see docs/sandbox.md. This module only maps the tool config to sandbox
limits and the result to text for the model.

Where bubblewrap is missing, constructing the tool raises `SandboxUnavailable`
with the install command, unless the tool's config says `sandbox: none`, which
runs the code with only rlimits and an empty environment and logs a warning every
time such a tool is created.
"""

from __future__ import annotations

import logging
from typing import Any

from rollout_cluster.sandbox import Sandbox, SandboxLimits, SandboxResult
from rollout_cluster.tools.base import BaseTool, ToolResult

logger = logging.getLogger(__name__)

__all__ = ["PythonTool", "sandbox_from_config", "UNSANDBOXED_WARNING"]

_MAX_CODE_CHARS = 64_000

UNSANDBOXED_WARNING = (
    "tool %r: `sandbox: none` -- model-written code runs WITHOUT isolation: it can read the host "
    "filesystem and /proc (the project tree, other processes' environments), use the network and "
    "leave processes behind; only rlimits, an empty environment and a temp dir apply. Use it for "
    "trusted code only; install bubblewrap (`apt-get install bubblewrap`) and drop `sandbox: none`."
)


def sandbox_from_config(tool_name: str, config: dict[str, Any]) -> Sandbox:
    """The tool's sandbox from its config (`sandbox`, `bwrap`, `site_packages` keys).

    Raises `SandboxUnavailable` (with the install hint) when bubblewrap is missing and
    the config does not say `sandbox: none` explicitly.
    """
    mode = str(config.get("sandbox", "bwrap"))
    if mode not in ("bwrap", "none"):
        raise ValueError(f"tool {tool_name!r}: sandbox must be 'bwrap' or 'none', got {mode!r}")
    if mode == "none":
        logger.warning(UNSANDBOXED_WARNING, tool_name)
    return Sandbox(
        mode,  # type: ignore[arg-type]
        bwrap=config.get("bwrap"),
        site_packages=bool(config.get("site_packages", False)),
    )


class PythonTool(BaseTool):
    """Runs a Python snippet and answers with its (truncated) stdout and stderr.

    Config keys: `cpu_s` (CPU seconds per process, default 2), `memory_mb` (address
    space per process, default 512), `wall_s` (default 5; keep it below the tool's
    `timeout_s`), `max_output_chars` (default 1000), `file_size_mb` (default 4),
    `max_processes` (processes of one call at once, default 16), `scratch_mb` (size
    of the tmpfs scratch folder, default 32), `site_packages` (also offer the
    running interpreter's installed packages, read-only; default false), `sandbox`
    (`bwrap`, the default, or `none`: no isolation, logged as a warning), `bwrap`
    (path of the binary). `isolate_network` is accepted for old configs; the sandbox
    always has no network.
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
        self.max_output_chars = int(c.get("max_output_chars", 1000))
        self.limits = SandboxLimits(
            wall_s=float(c.get("wall_s", min(5.0, timeout_s))),
            cpu_s=int(c.get("cpu_s", 2)),
            memory_mb=int(c.get("memory_mb", 512)),
            file_size_mb=int(c.get("file_size_mb", 4)),
            max_processes=int(c.get("max_processes", 16)),
            scratch_mb=int(c.get("scratch_mb", 32)),
            max_output_bytes=self.max_output_chars * 4 + 4,
        )
        # The old attribute names, kept for callers and configs that read them.
        self.wall_s, self.cpu_s, self.memory_mb = self.limits.wall_s, self.limits.cpu_s, self.limits.memory_mb
        self.file_size_mb, self.max_processes = self.limits.file_size_mb, self.limits.max_processes
        self.sandbox = sandbox_from_config(name, c)

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResult("Error: 'code' must be a string", metrics={"python_refused": 1.0})
        if len(code) > _MAX_CODE_CHARS:
            return ToolResult(
                f"Error: code longer than {_MAX_CODE_CHARS} characters", metrics={"python_refused": 1.0}
            )
        result = await self.sandbox.run(code, self.limits)
        return ToolResult(
            format_result(result, self.limits, self.max_output_chars),
            metrics={
                "python_exit_code": float(result.exit_code or 0),
                "python_killed": float(result.killed_by is not None),
                "python_seconds": result.wall_s,
            },
        )


def _cut(text: str, truncated: bool, max_chars: int) -> str:
    if len(text) > max_chars or truncated:
        return text[:max_chars] + "...(truncated)"
    return text


def format_result(result: SandboxResult, limits: SandboxLimits, max_chars: int) -> str:
    """What the model reads: stdout, then stderr and how the program ended, truncated."""
    stdout = _cut(result.stdout, result.stdout_truncated, max_chars)
    stderr = _cut(result.stderr, result.stderr_truncated, max_chars)
    parts = [stdout] if stdout else []
    if stderr:
        parts.append(f"[stderr]\n{stderr}")
    if result.timed_out:
        parts.append(f"[killed: wall-clock limit of {limits.wall_s:g}s exceeded]")
    elif result.signal is not None:
        why = {"cpu": " (CPU time limit)", "file_size": " (file size limit)"}.get(result.killed_by or "", "")
        parts.append(f"[killed by {result.signal}{why}]")
    elif result.exit_code:
        parts.append(f"[exit code {result.exit_code}]")
    text = "\n".join(parts) if parts else "[no output]"
    if len(text) > max_chars:
        text = text[:max_chars] + "...(truncated)"
    return text
