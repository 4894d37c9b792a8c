"""A `code_test` tool: runs a task's test file against model-written code, in the sandbox.

Code-RL tasks reward a solution by the tests it passes. The model submits `code`;
the tool writes it as `solution.py` beside the task's tests (`test_solution.py`)
and a small runner in a fresh bubblewrap sandbox (see docs/sandbox.md), runs every
top-level `test*` function of the test file (pytest-style plain `assert`s; no
fixtures, no pytest needed inside), and answers with the counts and the first
failures. `ToolResult.reward` is the fraction of tests passed, and the metrics carry
`tests_passed`, `tests_failed`, `tests_errors`, `tests_total` for the reward function.

Where the tests come from, first found wins: the episode's `tools_kwargs` for this
tool (`{"tests": "<source>"}`, passed to `create`), the tool config's `tests`
(inline source) or `test_file` (a path, read once at construction).

Limitation: the tests and the solution share one interpreter (tests call the
solution's functions), so a solution that inspects the runner's frames could forge
the summary. The summary line carries a random nonce the code is never given
directly, which stops printing a fake result, not a targeted attack on the runner;
for adversarial training, also grade with hidden tests outside the episode.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

from rollout_cluster.sandbox import SandboxLimits
from rollout_cluster.tools.base import BaseTool, ToolError, ToolResult
from rollout_cluster.tools.python_tool import sandbox_from_config

__all__ = ["CodeTestTool"]

_MAX_CODE_CHARS = 64_000

# The entry point inside the sandbox. It reads and deletes the nonce before any task
# or model code is imported, so that code never sees it in a file or argv.
_RUNNER = """\
def _areal_run_tests():
    import json, os, sys, traceback
    with open("_areal_nonce") as f:
        nonce = f.read().strip()
    os.remove("_areal_nonce")
    sys.path.insert(0, os.getcwd())
    results = []

    def tb_text(e):
        return "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))[-1500:]

    try:
        import test_solution as mod
    except BaseException as e:
        results.append(["<import test_solution>", "error", tb_text(e)])
    else:
        tests = [(n, f) for n, f in list(vars(mod).items())
                 if n.startswith("test") and callable(f) and getattr(f, "__module__", None) == mod.__name__]
        for name, fn in tests:
            try:
                fn()
            except AssertionError as e:
                results.append([name, "failed", tb_text(e)])
            except BaseException as e:
                results.append([name, "error", tb_text(e)])
            else:
                results.append([name, "passed", ""])
    sys.stdout.flush()
    sys.stdout.write("\\n" + nonce + " " + json.dumps(results) + "\\n")
    sys.stdout.flush()
_areal_run_tests()
"""


class CodeTestTool(BaseTool):
    """Runs the task's tests against the submitted code; reward = fraction passed.

    Config keys: `tests` (inline test source) or `test_file` (path), plus the same
    limits and `sandbox` keys as the `python` tool (`wall_s` defaults to 10 here).
    """

    description = "Run the task's unit tests against your Python solution and report which pass."
    parameters = {
        "type": "object",
        "properties": {
            "code": {"type": "string", "description": "The complete solution module (solution.py)."}
        },
        "required": ["code"],
    }

    def __init__(self, name: str, *, timeout_s: float = 20.0, config: dict[str, Any] | None = None) -> None:
        super().__init__(name, timeout_s=timeout_s, config=config)
        c = self.config
        self.max_output_chars = int(c.get("max_output_chars", 2000))
        self.limits = SandboxLimits(
            wall_s=float(c.get("wall_s", min(10.0, timeout_s))),
            cpu_s=int(c.get("cpu_s", 5)),
            memory_mb=int(c.get("memory_mb", 512)),
            file_size_mb=int(c.get("file_size_mb", 4)),
            max_processes=int(c.get("max_processes", 16)),
            scratch_mb=int(c.get("scratch_mb", 32)),
            max_output_bytes=int(c.get("max_output_bytes", 256_000)),
        )
        self.default_tests: str | None = c.get("tests")
        if self.default_tests is None and c.get("test_file"):
            self.default_tests = Path(c["test_file"]).read_text()
        self.sandbox = sandbox_from_config(name, c)
        self._tests: dict[str, str] = {}

    async def create(self, instance_id: str, **kwargs: Any) -> None:
        """Per-episode tests from the sample's `tools_kwargs` (`tests`: source)."""
        if "tests" in kwargs:
            self._tests[instance_id] = str(kwargs["tests"])

    async def release(self, instance_id: str) -> None:
        self._tests.pop(instance_id, None)

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ToolError("'code' must be a string")
        if len(code) > _MAX_CODE_CHARS:
            raise ToolError(f"code longer than {_MAX_CODE_CHARS} characters")
        tests = self._tests.get(instance_id, self.default_tests)
        if tests is None:
            raise ToolError("this task has no tests configured")
        nonce = secrets.token_hex(16)
        files = {
            "_areal_runner.py": _RUNNER,
            "_areal_nonce": nonce,
            "solution.py": code,
            "test_solution.py": tests,
        }
        result = await self.sandbox.run(files, self.limits, entry="_areal_runner.py")
        outcomes: list[list[str]] | None = None
        before = result.stdout
        marker = f"\n{nonce} "
        if marker in result.stdout and not result.stdout_truncated:
            before, _, tail = result.stdout.rpartition(marker)
            try:
                outcomes = json.loads(tail.splitlines()[0])
            except (ValueError, IndexError):
                outcomes = None
        counts = {"passed": 0, "failed": 0, "error": 0}
        for _, status, _ in outcomes or []:
            counts[status] = counts.get(status, 0) + 1
        total = sum(counts.values())
        lines = []
        if outcomes is None:
            why = (
                "timed out"
                if result.timed_out
                else (f"killed by {result.signal}" if result.signal else f"exit code {result.exit_code}")
            )
            lines.append(f"tests did not complete ({why}); 0 passed")
            if result.stderr:
                lines.append(f"[stderr]\n{result.stderr[-self.max_output_chars :]}")
        else:
            lines.append(f"{counts['passed']}/{total} tests passed ({counts['failed']} failed, "
                         f"{counts['error']} errors)")  # fmt: skip
            for name, status, tb in outcomes:
                if status != "passed":
                    lines.append(f"--- {name}: {status}\n{tb.strip()}")
            if before.strip():
                lines.append(f"[stdout]\n{before.strip()}")
        text = "\n".join(lines)
        if len(text) > self.max_output_chars:
            text = text[: self.max_output_chars] + "...(truncated)"
        return ToolResult(
            text,
            reward=(counts["passed"] / total) if total else 0.0,
            metrics={
                "tests_passed": float(counts["passed"]),
                "tests_failed": float(counts["failed"]),
                "tests_errors": float(counts["error"]),
                "tests_total": float(total),
                "tests_completed": float(outcomes is not None),
            },
        )
