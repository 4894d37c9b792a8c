"""Hermes parsing, tool schemas and argument checks, tools from YAML and user code."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from areal_like.core.config import AgentConfig, ToolSpec
from rollout_cluster.loader import UserCodeError, load_object
from rollout_cluster.tool_parser import HermesToolParser, get_tool_parser
from rollout_cluster.tools import (
    CalculatorTool,
    FunctionTool,
    PythonTool,
    build_tools,
    call_tool,
    schema_from_function,
    validate_arguments,
)


def test_hermes_parses_several_calls_and_both_argument_shapes() -> None:
    text = (
        'Let me see <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and '
        '<tool_call>{"name": "b", "arguments": "{\\"y\\": \\"z\\"}"}</tool_call>'
    )
    parsed = HermesToolParser().parse(text)
    assert parsed.content == "Let me see  and"
    assert [(c.name, c.arguments, c.error) for c in parsed.calls] == [
        ("a", {"x": 1}, None),
        ("b", {"y": "z"}, None),
    ]


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ("<tool_call>{oops}</tool_call>", "not valid JSON"),
        ('<tool_call>["a"]</tool_call>', "must be a JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', "no 'name'"),
        ('<tool_call>{"name": "a", "arguments": "{bad"}</tool_call>', "'arguments' string is not valid JSON"),
        ('<tool_call>{"name": "a", "arguments": [1]}</tool_call>', "'arguments' must be a JSON object"),
        ('<tool_call>{"name": "a"', "missing its closing"),
    ],
)
def test_hermes_reports_malformed_calls(body: str, error: str) -> None:
    (call,) = HermesToolParser().parse(body).calls
    assert call.error is not None and error in call.error


def test_no_call_and_unknown_parser() -> None:
    assert get_tool_parser("hermes").parse(" 42 ").calls == []
    assert get_tool_parser("hermes").parse(" 42 ").content == "42"
    with pytest.raises(ValueError, match="unknown tool parser"):
        get_tool_parser("nope")


def test_schema_from_signature_and_docstring() -> None:
    def weather(city: str, days: int = 1, metric: bool = True) -> str:
        """Forecast for a city.

        Longer text that is not part of the description.

        Args:
            city: The city name,
                with its country.
            days (int): How many days.

        Returns:
            The forecast.
        """
        return city

    spec = schema_from_function(weather)
    assert spec["name"] == "weather" and spec["description"] == "Forecast for a city."
    assert spec["parameters"] == {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "The city name, with its country."},
            "days": {"type": "integer", "description": "How many days."},
            "metric": {"type": "boolean"},
        },
        "required": ["city"],
    }
    tool = FunctionTool(weather)
    assert tool.schema["function"]["name"] == "weather"
    assert asyncio.run(call_tool(tool, "weather", {"city": "Oslo"}, "i", ["weather"])).text == "Oslo"


def test_validate_arguments() -> None:
    params = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "u": {"enum": ["c", "f"]}},
        "required": ["n"],
    }
    assert validate_arguments(params, {"n": 3}) is None
    assert "missing required" in validate_arguments(params, {})  # type: ignore[operator]
    assert "unknown argument" in validate_arguments(params, {"n": 1, "z": 2})  # type: ignore[operator]
    assert "type integer" in validate_arguments(params, {"n": True})  # type: ignore[operator]
    assert "one of" in validate_arguments(params, {"n": 1, "u": "k"})  # type: ignore[operator]


def test_call_tool_turns_exceptions_into_messages() -> None:
    def boom(x: str) -> str:
        """Always fails."""
        raise KeyError(x)

    outcome = asyncio.run(call_tool(FunctionTool(boom), "boom", {"x": "k"}, "i", ["boom"]))
    assert outcome.status == "error" and outcome.text == "Error: boom failed: KeyError: 'k'"
    calc = asyncio.run(
        call_tool(CalculatorTool("calculator"), "calculator", {"expression": "012*3"}, "i", [])
    )
    assert (calc.status, calc.text) == ("ok", "36")


USER_TOOLS = """
from rollout_cluster.tools import BaseTool

class Echo(BaseTool):
    description = "Echo back."
    parameters = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}

    async def execute(self, instance_id, arguments):
        return self.config.get("prefix", "") + arguments["text"]

def shout(text: str) -> str:
    \"\"\"Upper-case the text.\"\"\"
    return text.upper()
"""


def test_tools_from_config_yaml_and_user_code(tmp_path: Path) -> None:
    (tmp_path / "user_tools.py").write_text(USER_TOOLS)
    (tmp_path / "tools.yaml").write_text(
        "tools:\n"
        "  - {name: echo, cls: user_tools.py:Echo, config: {prefix: '> '}, timeout_s: 2}\n"
        "  - {name: shout, cls: user_tools.py:shout}\n"
        "  - {name: py, cls: python, config: {cpu_s: 1}}\n"
    )
    cfg = AgentConfig(tools=[ToolSpec(name="calculator")], tools_file="tools.yaml")
    tools = {t.name: t for t in build_tools(cfg, base_dir=tmp_path)}
    assert sorted(tools) == ["calculator", "echo", "py", "shout"]
    assert isinstance(tools["py"], PythonTool) and tools["py"].cpu_s == 1
    assert tools["echo"].timeout_s == 2
    assert asyncio.run(tools["echo"].execute("i", {"text": "hi"})) == "> hi"
    assert asyncio.run(tools["shout"].execute("i", {"text": "hi"})) == "HI"
    with pytest.raises(ValueError, match="duplicate tool names"):
        build_tools(AgentConfig(tools=[ToolSpec(name="calculator"), ToolSpec(name="calculator")]))
    with pytest.raises(UserCodeError, match="neither a built-in"):
        build_tools(AgentConfig(tools=[ToolSpec(name="x", cls="shell")]))


def test_loader_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(UserCodeError, match="file not found"):
        load_object("missing.py:X", base_dir=tmp_path)
    with pytest.raises(UserCodeError, match="cannot import module"):
        load_object("no_such_pkg_xyz.mod:X")
    (tmp_path / "broken.py").write_text("raise RuntimeError('at import')\n")
    with pytest.raises(UserCodeError, match="importing .* failed: RuntimeError: at import"):
        load_object("broken.py:X", base_dir=tmp_path)
    with pytest.raises(UserCodeError, match="expected 'path/to/file.py:Name'"):
        load_object("just_a_name")
    assert load_object("rollout_cluster.tools:CalculatorTool") is CalculatorTool
