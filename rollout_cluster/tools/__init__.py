"""Tools an agent loop can offer the model, and how a config turns into tool objects.

`build_tools(agent_config)` is the one constructor: tools listed in
`agent.tools` plus those in `agent.tools_file` (YAML with a `tools:` list of the same
`ToolSpec` entries). A spec's `cls` is a built-in name from `BUILTIN_TOOLS` or user
code (`file.py:Name` / `pkg.mod:Name`, resolved by `rollout_cluster.loader`): a
`BaseTool` subclass is constructed with `(name, timeout_s=..., config=...)`; a plain
function becomes a `FunctionTool`. Python callers may pass tool objects or functions
directly with `as_tool`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from areal_like.core.config import AgentConfig, ToolSpec
from rollout_cluster.loader import UserCodeError, is_user_code_spec, load_object
from rollout_cluster.tools.base import (
    BaseTool,
    FunctionTool,
    ToolError,
    ToolOutcome,
    ToolResult,
    call_tool,
    schema_from_function,
    validate_arguments,
)
from rollout_cluster.tools.calculator import CalculatorTool
from rollout_cluster.tools.code_test import CodeTestTool
from rollout_cluster.tools.python_tool import PythonTool

__all__ = [
    "BUILTIN_TOOLS",
    "BaseTool",
    "CalculatorTool",
    "CodeTestTool",
    "FunctionTool",
    "PythonTool",
    "ToolError",
    "ToolOutcome",
    "ToolResult",
    "as_tool",
    "build_tool",
    "build_tools",
    "call_tool",
    "load_tools_file",
    "schema_from_function",
    "validate_arguments",
]

BUILTIN_TOOLS: dict[str, type[BaseTool]] = {
    "calculator": CalculatorTool,
    "python": PythonTool,
    "code_test": CodeTestTool,
}


def as_tool(
    obj: BaseTool | Callable[..., Any], *, name: str | None = None, timeout_s: float = 10.0
) -> BaseTool:
    """A tool object as-is, or a plain function wrapped as a `FunctionTool`."""
    if isinstance(obj, BaseTool):
        return obj
    if callable(obj) and not isinstance(obj, type):
        return FunctionTool(obj, name=name, timeout_s=timeout_s)
    raise TypeError(f"expected a BaseTool instance or a function, got {obj!r}")


def build_tool(spec: ToolSpec, *, base_dir: str | Path | None = None) -> BaseTool:
    """One tool from its config entry."""
    if spec.cls in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[spec.cls](spec.name, timeout_s=spec.timeout_s, config=spec.config)
    if not is_user_code_spec(spec.cls):
        raise UserCodeError(
            f"tool {spec.name!r}: cls {spec.cls!r} is neither a built-in ({sorted(BUILTIN_TOOLS)}) "
            "nor user code ('path/to/file.py:Name' or 'package.module:Name')"
        )
    obj = load_object(spec.cls, base_dir=base_dir, what=f"tool {spec.name!r}")
    if isinstance(obj, type) and issubclass(obj, BaseTool):
        return obj(spec.name, timeout_s=spec.timeout_s, config=spec.config)
    if isinstance(obj, type) or not callable(obj):
        raise UserCodeError(f"tool {spec.name!r}: {spec.cls!r} is neither a BaseTool subclass nor a function")
    if spec.config:
        raise UserCodeError(f"tool {spec.name!r}: a function tool takes no `config` (got {spec.config})")
    return FunctionTool(obj, name=spec.name, timeout_s=spec.timeout_s)


def load_tools_file(path: str | Path, *, base_dir: str | Path | None = None) -> list[ToolSpec]:
    """Tool specs from a YAML file `{tools: [{name, cls, config, timeout_s}, ...]}`.

    A relative user-code file in an entry's `cls` is the tools file's neighbour when it
    exists there (made absolute, so the spec means the same file in every process), else
    it is left to `base_dir` and the current directory like any other spec.
    """
    p = Path(path)
    if not p.is_absolute() and base_dir is not None and (Path(base_dir) / p).is_file():
        p = Path(base_dir) / p
    if not p.is_file():
        raise FileNotFoundError(f"tools file {path} not found (base dir {base_dir})")
    data = yaml.safe_load(p.read_text()) or {}
    entries = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"tools file {p}: expected a mapping with a `tools:` list")
    specs = []
    for i, entry in enumerate(entries):
        try:
            spec = ToolSpec.model_validate(entry)
        except ValidationError as e:
            raise ValueError(f"tools file {p}: tools[{i}] is invalid: {e}") from None
        if is_user_code_spec(spec.cls):
            target, _, name = spec.cls.rpartition(":")
            beside = p.parent / target
            if not Path(target).is_absolute() and target.endswith(".py") and beside.is_file():
                spec = spec.model_copy(update={"cls": f"{beside.resolve()}:{name}"})
        specs.append(spec)
    return specs


def build_tools(
    config: AgentConfig,
    *,
    base_dir: str | Path | None = None,
    extra: Iterable[BaseTool | Callable[..., Any]] = (),
) -> list[BaseTool]:
    """Every tool of `agent.tools` and `agent.tools_file`, plus `extra` objects/functions.

    Tool names must be unique: the model addresses tools by name.
    """
    specs = list(config.tools)
    if config.tools_file:
        specs += load_tools_file(config.tools_file, base_dir=base_dir)
    tools = [build_tool(s, base_dir=base_dir) for s in specs] + [as_tool(t) for t in extra]
    names = [t.name for t in tools]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"duplicate tool names: {dupes}")
    return tools
