"""The quickstart's calculator tool: integer `+ - *` arithmetic, parsed, never `eval`ed."""

from __future__ import annotations

from typing import Any

from areal_like.tasks.arithmetic import CalculatorError, calculate
from rollout_cluster.tools.base import BaseTool, ToolError

__all__ = ["CalculatorTool"]


class CalculatorTool(BaseTool):
    """Answers with the integer result as plain text, so the model can copy it verbatim."""

    description = "Evaluate integer arithmetic with + - * and parentheses."
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. 123*45"}},
        "required": ["expression"],
    }

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> str:
        try:
            return str(calculate(arguments["expression"]))
        except CalculatorError as e:
            raise ToolError(str(e)) from None
