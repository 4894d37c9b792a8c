"""What a tool is, and how one call to it is made safely.

A tool has an OpenAI function schema (what the model is told) and three async
methods: `create` (per-episode state, e.g. a sandbox), `execute` (one call) and
`release`. Agent loops never call `execute` directly: they go through `call_tool`,
which validates the arguments against the schema, applies the tool's timeout and
turns every failure into an error text for the model. A tool failure is an
observation, never an episode crash.

Plain Python functions become tools through `FunctionTool`, which derives the
schema from the signature and the docstring (Google-style `Args:` section), like
`transformers.utils.get_json_schema` but lenient about missing descriptions.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
import time
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "BaseTool",
    "FunctionTool",
    "ToolError",
    "ToolResult",
    "ToolOutcome",
    "call_tool",
    "schema_from_function",
    "validate_arguments",
]


class ToolError(Exception):
    """An expected tool failure; its message is shown to the model as the tool's answer."""


@dataclass
class ToolResult:
    """A tool's answer: text for the model, an optional per-call reward, numeric metrics."""

    text: str
    reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class BaseTool(ABC):
    """A tool the model can call. Subclasses implement `execute` and describe parameters.

    `name` is what the model calls; `timeout_s` bounds one call (enforced by
    `call_tool`). One tool object serves every episode concurrently, so per-episode
    state belongs in `create`/`release`, keyed by `instance_id`.
    """

    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}}

    def __init__(self, name: str, *, timeout_s: float = 10.0, config: dict[str, Any] | None = None) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self.config = dict(config or {})

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI function-tool schema, passed to the chat template as `tools`."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    async def create(self, instance_id: str, **kwargs: Any) -> None:  # noqa: B027 (optional hook)
        """Set up state for one episode (default: none)."""

    @abstractmethod
    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> str | ToolResult:
        """Run one call. Raise `ToolError` for failures the model should read about."""

    async def release(self, instance_id: str) -> None:  # noqa: B027 (optional hook)
        """Free the episode's state (default: none)."""


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def validate_arguments(parameters: dict[str, Any], arguments: dict[str, Any]) -> str | None:
    """Check call arguments against a JSON-schema `parameters` object; return an error or None.

    Deliberately small: required keys, unknown keys (unless `additionalProperties`
    allows them), top-level JSON types and `enum`. That is what a model gets wrong.
    """
    props: dict[str, Any] = parameters.get("properties", {})
    missing = [k for k in parameters.get("required", []) if k not in arguments]
    if missing:
        return f"missing required argument(s): {', '.join(missing)}"
    if not parameters.get("additionalProperties", False):
        unknown = [k for k in arguments if k not in props]
        if unknown:
            return f"unknown argument(s): {', '.join(unknown)}; expected: {', '.join(props) or 'none'}"
    for key, value in arguments.items():
        prop = props.get(key, {})
        expected = prop.get("type")
        if expected is not None:
            names = expected if isinstance(expected, list) else [expected]
            types = tuple(t for n in names for t in _JSON_TYPES.get(n, (object,)))
            is_bool_as_number = isinstance(value, bool) and "boolean" not in names
            if not isinstance(value, types) or is_bool_as_number:
                return f"argument {key!r} must be of type {'/'.join(names)}, got {type(value).__name__}"
        if "enum" in prop and value not in prop["enum"]:
            return f"argument {key!r} must be one of {prop['enum']}, got {value!r}"
    return None


@dataclass
class ToolOutcome:
    """What one call produced, as the agent loop records it."""

    text: str
    status: str
    """`ok`, `error` (tool raised or bad call), `timeout`, `unknown_tool`, `bad_arguments`, `malformed`."""
    reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0


async def call_tool(
    tool: BaseTool | None, name: str, arguments: dict[str, Any], instance_id: str, tool_names: list[str]
) -> ToolOutcome:
    """Validate, execute with the tool's timeout, and turn any failure into an error text."""
    if tool is None:
        return ToolOutcome(
            f"Error: unknown tool {name!r}; available tools: {', '.join(tool_names)}", "unknown_tool"
        )
    problem = validate_arguments(tool.parameters, arguments)
    if problem is not None:
        return ToolOutcome(f"Error: bad arguments for {name}: {problem}", "bad_arguments")
    start = time.perf_counter()
    try:
        result = await asyncio.wait_for(tool.execute(instance_id, arguments), timeout=tool.timeout_s)
    except TimeoutError:
        return ToolOutcome(
            f"Error: {name} timed out after {tool.timeout_s:g}s",
            "timeout",
            seconds=time.perf_counter() - start,
        )
    except ToolError as e:
        return ToolOutcome(f"Error: {e}", "error", seconds=time.perf_counter() - start)
    except Exception as e:  # a buggy tool must not end the episode; the traceback goes to the log
        logger.warning("tool %s raised", name, exc_info=True)
        return ToolOutcome(
            f"Error: {name} failed: {type(e).__name__}: {e}", "error", seconds=time.perf_counter() - start
        )
    seconds = time.perf_counter() - start
    if isinstance(result, ToolResult):
        return ToolOutcome(result.text, "ok", result.reward, dict(result.metrics), seconds)
    return ToolOutcome(str(result), "ok", seconds=seconds)


_PY_TO_JSON: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    list: "array",
    dict: "object",
}


def _json_type(annotation: Any) -> str | None:
    origin = typing.get_origin(annotation) or annotation
    return _PY_TO_JSON.get(origin)


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """First paragraph as the description; `Args:` entries as parameter descriptions."""
    doc = inspect.cleandoc(doc or "")
    sections = re.split(r"\n\s*(?:Args|Arguments|Parameters)\s*:\s*\n", doc, maxsplit=1)
    description = sections[0].split("\n\n")[0].strip().replace("\n", " ")
    params: dict[str, str] = {}
    if len(sections) == 2:
        lines = [ln for ln in sections[1].splitlines() if ln.strip()]
        base = len(lines[0]) - len(lines[0].lstrip()) if lines else 0
        current = None
        for line in lines:
            indent = len(line) - len(line.lstrip())
            m = re.match(r"(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)", line.strip())
            if indent < base or (indent == base and m is None):
                break  # the next section (Returns:, Raises:, ...)
            if indent == base and m is not None:
                current = m.group(1)
                params[current] = m.group(2).strip()
            elif current is not None:
                params[current] += " " + line.strip()
    return description, params


def schema_from_function(fn: Callable[..., Any], name: str | None = None) -> dict[str, Any]:
    """The `parameters` JSON schema and description of a plain function, from its signature."""
    description, param_docs = _docstring_parts(fn.__doc__ or "")
    hints = typing.get_type_hints(fn)
    props: dict[str, Any] = {}
    required: list[str] = []
    for pname, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        prop: dict[str, Any] = {}
        jtype = _json_type(hints.get(pname, Any))
        if jtype is not None:
            prop["type"] = jtype
        if pname in param_docs:
            prop["description"] = param_docs[pname]
        props[pname] = prop
        if param.default is inspect.Parameter.empty:
            required.append(pname)
    return {
        "name": name or fn.__name__,
        "description": description,
        "parameters": {"type": "object", "properties": props, "required": required},
    }


class FunctionTool(BaseTool):
    """A plain function (sync or async) as a tool; the schema comes from its signature.

    Sync functions run in a worker thread so a slow one does not stall other
    episodes. A timed-out sync function cannot be killed (threads cannot be); use
    a subprocess-based tool like `PythonTool` for untrusted or runaway work.
    """

    def __init__(self, fn: Callable[..., Any], *, name: str | None = None, timeout_s: float = 10.0) -> None:
        spec = schema_from_function(fn, name)
        super().__init__(spec["name"], timeout_s=timeout_s)
        self.fn = fn
        self.description = spec["description"]
        self.parameters = spec["parameters"]

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> str | ToolResult:
        if inspect.iscoroutinefunction(self.fn):
            result = await self.fn(**arguments)
        else:
            result = await asyncio.to_thread(self.fn, **arguments)
        return result if isinstance(result, ToolResult) else str(result)
