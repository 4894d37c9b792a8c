"""A Python entry point equivalent to `areal-like run`, shaped like TRL's `GRPOTrainer`.

    from areal_like.api import GRPOTrainer

    def exact(sample, output) -> float:
        return float(output.final_text.strip() == sample["answer"])

    trainer = GRPOTrainer(
        model="areal_like/assets/quickstart_model",
        reward_funcs=exact,                      # a callable, a list of them, or a built-in name
        args={"train": {"total_steps": 50}, "run": {"dir": "runs/api"}},   # dict, YAML path or ExperimentConfig
        train_dataset=[{"prompt": "123+456", "answer": "579"}, ...],      # rows, or None for the config's
        overrides={"train.lr": 1e-4},            # dotted keys, as `--set` (optional)
    )
    summary = trainer.train()

Classes and callables are passed directly (docs/design.md §9.10): reward functions, tools
(plain functions or `BaseTool` instances) and agent loops (`{"name": Class}`), defined
anywhere: in a module, in the calling script's `__main__`, in a notebook cell, as a
lambda or a closure. They reach the rollout side's processes by value (cloudpickle, as
Ray sends them; §10.15), over the local launcher's Unix sockets on one machine (no Ray),
or inside the Ray cluster `train()` starts for GPUs and clusters; never over a network
wire (§9.7). Several reward functions are summed, as in TRL;
each one's value is also recorded as the episode metric `reward_<function name>`.

Reward functions written for TRL (`def f(completions, prompts=None, **kwargs) -> list[float]`)
work as they are (docs/design.md §10.13, `rollout_cluster.rewards.as_reward_fn`), and
`train_dataset` may be a list of dicts or a `datasets.Dataset`, with the columns named by
`dataset.prompt_key` / `dataset.answer_key`. Without `eval_dataset`, `dataset.eval_split`
of the train rows is held out for evaluation (never the built-in arithmetic set).
Relative paths in `args` resolve as in the CLI (`areal_like.orchestration.paths`);
`model` is relative to the current directory.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from areal_like.core.config import ExperimentConfig, load_config
from areal_like.orchestration.dataset import normalise_row, split_eval
from areal_like.orchestration.paths import resolve_paths

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
        overrides: dict[str, Any] | Sequence[str] | None = None,
    ) -> None:
        cfg = _config(args, overrides)
        cfg.model.path = str(Path(model).expanduser().resolve()) if Path(model).expanduser().exists() else str(model)
        self.cfg = resolve_paths(cfg)
        keys = {"prompt_key": cfg.dataset.prompt_key, "answer_key": cfg.dataset.answer_key}
        rows = [normalise_row(r, f"train_dataset[{i}]", **keys) for i, r in enumerate(train_dataset or [])]
        ev = [normalise_row(r, f"eval_dataset[{i}]", **keys) for i, r in enumerate(eval_dataset or [])]
        if rows and eval_dataset is None:
            rows, ev = split_eval(rows, cfg.dataset.eval_split, cfg.run.seed, cfg.eval.num_samples,
                                  name="train_dataset")
        self.rows: list[dict[str, Any]] | None = rows or None
        self.eval_rows: list[dict[str, Any]] | None = ev if rows else (ev or None)
        """`[]` when the user's rows leave none to evaluate on: no evaluation, rather than the
        config's dataset (the built-in arithmetic set by default)."""
        self.reward_fn = _combine(reward_funcs)
        self.tools = _tools(tools) if tools else None
        self.agent_loops = agent_loops

    def train(self, resume: bool = False, overwrite: bool = False, verbose: bool | None = None) -> dict[str, Any]:
        """Run both clusters on this machine until `train.total_steps`; returns the outcome counts,
        and with evaluations `eval_accuracy` / `eval_version` of the last one (also printed).

        Shows the same progress as `areal-like run` (dashboard URL, a line per step with
        reward, eval accuracy and ETA) on stderr; other log lines go to `run.dir/run.log`
        unless `verbose` (or `run.verbose`). Your own logging setup is left alone."""
        import logging

        from areal_like.orchestration.console import Progress, eval_summary, final_evals, setup_console
        from areal_like.orchestration.launch import run_both
        from areal_like.orchestration.trainer_controller import RunAborted

        if verbose is not None:
            self.cfg.run.verbose = verbose
        if not logging.getLogger().handlers:  # nobody configured logging: ours, as in the CLI
            setup_console(self.cfg.run.verbose)
        progress = Progress(self.cfg.train.total_steps)
        user = {"rows": self.rows, "eval_rows": self.eval_rows, "reward_fn": self.reward_fn,
                "tools": self.tools, "loops": self.agent_loops}
        try:
            summary = run_both(self.cfg, resume=resume, overwrite=overwrite, user=user, on_step=progress,
                               on_start=lambda side: progress.start(run_dir=side.cfg.run.dir,
                                                                    dashboard_url=side.dashboard_url),
                               reward_name=_reward_name(self.reward_fn))
        except RunAborted as e:
            # As the CLI says it: the cause first (your file and line when your code raised
            # it), then what the run did. The exception repeats only the first line, and
            # its traceback is this call, not our internals.
            text = str(e)
            for i, line in enumerate(text.splitlines()):
                print(f"error: {line}" if i == 0 else line, file=progress.stream, flush=True)
            raise type(e)(text.splitlines()[0] if text else type(e).__name__) from None
        evals = final_evals(self.cfg.run.dir)
        line = eval_summary(evals)
        if line is not None:  # the end on the console, as the CLI says it
            print(line, file=progress.stream, flush=True)
            summary = {**summary, "eval_accuracy": evals[-1]["accuracy"], "eval_version": evals[-1]["version"]}
        return summary


def _config(args: ExperimentConfig | dict[str, Any] | str | Path | None,
            overrides: dict[str, Any] | Sequence[str] | None) -> ExperimentConfig:
    """`args` (a config object, a dict of sections or a YAML path) with `overrides` on top:
    dotted keys as for `--set` (`{"train.total_steps": 20}` or `["train.total_steps=20"]`),
    validated as the CLI validates them (a `ConfigError` names a wrong key)."""
    import json

    from areal_like.core.config import validate_config

    # JSON is YAML: each value arrives as the type it was given (a string stays a string)
    items = ([f"{k}={json.dumps(v)}" for k, v in overrides.items()] if isinstance(overrides, dict)
             else list(overrides or []))
    if isinstance(args, (str, Path)):
        return load_config(args, items)
    data = args.model_dump(mode="json") if isinstance(args, ExperimentConfig) else dict(args or {})
    source = args.source if isinstance(args, ExperimentConfig) else None
    cfg = validate_config(data, items, "in GRPOTrainer args")
    if source is not None:
        cfg.source = source
    return cfg


def _reward_name(fn: Any) -> str:
    """How the console names the reward: a built-in's name, a function's name, or the
    names of summed functions."""
    if isinstance(fn, str):
        return fn
    names = getattr(fn, "_areal_names", None)
    return " + ".join(names) if names else getattr(fn, "__name__", type(fn).__name__)


def _combine(funcs: Callable[..., Any] | Sequence[Callable[..., Any]] | str) -> Any:
    from rollout_cluster.rewards import as_reward_fn

    if isinstance(funcs, str):
        return funcs
    if callable(funcs):
        return as_reward_fn(funcs)
    funcs = [as_reward_fn(f) for f in funcs]
    if not funcs:
        raise ValueError("reward_funcs is empty")
    if len(funcs) == 1:
        return funcs[0]

    async def summed(sample: dict[str, Any], output: Any) -> dict[str, Any]:
        """Each function in turn; a dict result's extra entries are kept as metrics. A
        `None` (a TRL reward that does not apply) fails the episode, as for one function."""
        total, parts = 0.0, {}
        for f in funcs:
            r = f(sample, output)
            if inspect.isawaitable(r):
                r = await r
            if isinstance(r, dict):
                parts.update({k: v for k, v in r.items() if k != "reward"})
                r = r.get("reward")
            if r is None:
                return {"reward": None}
            value = float(r)
            parts[f"reward_{getattr(f, '__name__', 'fn')}"] = value
            total += value
        return {"reward": total, **parts}

    summed._areal_names = [getattr(f, "__name__", type(f).__name__) for f in funcs]  # type: ignore[attr-defined]
    return summed


def _tools(tools: Sequence[Any]) -> list[Any]:
    from rollout_cluster.tools import BaseTool
    from rollout_cluster.tools.base import FunctionTool

    return [t if isinstance(t, BaseTool) else FunctionTool(t) for t in tools]
