"""Built-in verifiable tasks (problem generators and their exact reward functions)."""

from areal_like.tasks.arithmetic import (
    CalculatorError,
    arithmetic_reward,
    calculate,
    extract_answer,
    generate_problems,
    make_problem,
)

__all__ = [
    "CalculatorError",
    "arithmetic_reward",
    "calculate",
    "extract_answer",
    "generate_problems",
    "make_problem",
]
