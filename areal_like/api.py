"""A Python entry point equivalent to `areal-like run`, shaped like TRL's `GRPOTrainer`.

    from areal_like.api import GRPOTrainer

    def exact(sample, output) -> float:
        return float(output.final_text.strip() == sample["answer"])

    trainer = GRPOTrainer(
        model="areal_like/assets/quickstart_model",
        reward_funcs=exact,                      # a callable, a list of them, or a built-in name
        args={"train": {"total_steps": 50}, "run": {"dir": "runs/api"}},   # dict, YAML path or ExperimentConfig
        train_dataset=[{"prompt": "123+456", "answer": "579"}, ...],      # rows, or None for the config's
    )
    summary = trainer.train()

Classes and callables are passed directly (docs/design.md §9.10): reward functions, tools
(plain functions or `BaseTool` instances) and agent loops (`{"name": Class}`). They reach
the rollout side inside the one Ray cluster `train()` starts, which is the only place
Ray's own serialisation is used (§9.7). Several reward functions are summed, as in TRL.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from areal_like.core.config import ExperimentConfig, load_config
from areal_like.orchestration.dataset import normalise_row

__all__ = ["GRPOTrainer"]


class GRPOTrainer:
    def __init__(
        self,
        model: str | Path,
        reward_funcs: Callable[..., Any] | Sequence[Callable[..., Any]] | str,
        args: ExperimentConfig | dict[str, Any] | str | Path | None = None,
        train_dataset: Sequence[dict[str, Any]] | None = None,
        eval_dataset: Sequence[dict[str, Any]] | None = None,
        *,
        tools: Sequence[Any] | None = None,
        agent_loops: dict[str, Any] | None = None,
    ) -> None:
        if isinstance(args, ExperimentConfig):
            cfg = args.model_copy(deep=True)
        elif isinstance(args, (str, Path)):
            cfg = load_config(args)
        else:
            cfg = ExperimentConfig.model_validate(args or {})
        cfg.model.path = str(model)
        self.cfg = cfg
        self.rows = [normalise_row(r, f"train_dataset[{i}]") for i, r in enumerate(train_dataset or [])] or None
        self.eval_rows = [normalise_row(r, f"eval_dataset[{i}]") for i, r in enumerate(eval_dataset or [])] or None
        self.reward_fn = _combine(reward_funcs)
        self.tools = _tools(tools) if tools else None
        self.agent_loops = agent_loops

    def train(self, resume: bool = False, overwrite: bool = False) -> dict[str, int]:
        """Run both clusters on this machine until `train.total_steps`; returns the outcome counts."""
        from areal_like.orchestration.launch import run_both

        user = {"rows": self.rows, "eval_rows": self.eval_rows, "reward_fn": self.reward_fn,
                "tools": self.tools, "loops": self.agent_loops}
        return run_both(self.cfg, resume=resume, overwrite=overwrite, user=user)


def _combine(funcs: Callable[..., Any] | Sequence[Callable[..., Any]] | str) -> Any:
    if isinstance(funcs, str) or callable(funcs):
        return funcs
    funcs = list(funcs)
    if not funcs:
        raise ValueError("reward_funcs is empty")
    if len(funcs) == 1:
        return funcs[0]

    async def summed(sample: dict[str, Any], output: Any) -> dict[str, float]:
        total, parts = 0.0, {}
        for f in funcs:
            r = f(sample, output)
            if inspect.isawaitable(r):
                r = await r
            value = float(r["reward"] if isinstance(r, dict) else r)
            parts[f"reward_{getattr(f, '__name__', 'fn')}"] = value
            total += value
        return {"reward": total, **parts}

    return summed


def _tools(tools: Sequence[Any]) -> list[Any]:
    from rollout_cluster.tools import BaseTool
    from rollout_cluster.tools.base import FunctionTool

    return [t if isinstance(t, BaseTool) else FunctionTool(t) for t in tools]
