"""Turning an assistant turn's text into tool calls.

Parsers work on decoded text and are only used to *read* what the model asked for;
the token ids the model produced are kept untouched in the trajectory (invariant 4),
so a parser may be lossy about whitespace without any effect on training.

A malformed call is not dropped: it comes back as a `ToolCall` with `error` set, so
the agent loop can answer it with a tool message describing the problem. The model
then learns from the consequence of its mistake instead of the episode crashing or
the call silently vanishing.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ToolCall", "ParsedTurn", "ToolParser", "HermesToolParser", "TOOL_PARSERS", "get_tool_parser"]


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for. `error` is set (and `name` may be empty) when malformed."""

    name: str
    arguments: dict[str, Any]
    raw: str
    error: str | None = None


@dataclass
class ParsedTurn:
    """An assistant turn split into its free text and its tool calls, in order."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)


class ToolParser(ABC):
    """Reads tool calls out of the decoded text of one assistant turn."""

    @abstractmethod
    def parse(self, text: str) -> ParsedTurn: ...


class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per turn.

    `arguments` may be a JSON object or a string holding a JSON object (both shapes
    occur in the wild). An opening tag without a closing one is reported as a
    malformed call: the model meant to call something and should hear that it failed.
    """

    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        calls = []
        for m in self._CALL.finditer(text):
            closed = m.group(0).endswith("</tool_call>")
            calls.append(self._parse_one(m.group(1), closed))
        content = self._CALL.sub("", text).strip()
        return ParsedTurn(content=content, calls=calls)

    @staticmethod
    def _parse_one(body: str, closed: bool) -> ToolCall:
        raw = body.strip()
        if not closed:
            return ToolCall("", {}, raw, "tool call is missing its closing </tool_call> tag")
        try:
            obj = _loads(raw)
        except json.JSONDecodeError as e:
            return ToolCall("", {}, raw, f"tool call is not valid JSON: {e.msg} at position {e.pos}")
        except (RecursionError, ValueError) as e:  # adversarial nesting, NaN/Infinity
            return ToolCall("", {}, raw, f"tool call is not valid JSON: {_why(e)}")
        if not isinstance(obj, dict):
            return ToolCall("", {}, raw, "tool call must be a JSON object with 'name' and 'arguments'")
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            return ToolCall("", {}, raw, "tool call has no 'name' string")
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = _loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                return ToolCall(name, {}, raw, f"'arguments' string is not valid JSON: {e.msg}")
            except (RecursionError, ValueError) as e:
                return ToolCall(name, {}, raw, f"'arguments' string is not valid JSON: {_why(e)}")
        if not isinstance(args, dict):
            return ToolCall(name, {}, raw, "'arguments' must be a JSON object")
        return ToolCall(name, args, raw)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in JSON")


def _loads(text: str) -> Any:
    """Strict JSON: no NaN/Infinity (model output is untrusted; deep nesting is caught by callers)."""
    return json.loads(text, parse_constant=_no_constant)


def _why(e: Exception) -> str:
    return "nested too deeply" if isinstance(e, RecursionError) else str(e)


TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser}


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered under `name` (config key `agent.tool_parser`)."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; known: {sorted(TOOL_PARSERS)}") from None
