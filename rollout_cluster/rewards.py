"""Reward functions: `(sample, output) -> float | dict`, sync or async, run safely.

A reward is user code and may be slow (a verifier, a sandboxed test run), so it
never runs on the event loop that drives every other episode: sync functions run
in a thread, async ones as tasks, both under `agent.reward_timeout_s`. A reward
that raises, times out, returns NaN/inf or something that is not a number fails
*its episode* with a `RewardError` carrying a short `reason`; the controller counts
it under `failed` (invariant 5) and the run goes on.

A dict result needs a `reward` key; its other numeric entries become episode
metrics (`output.metrics`). Built-in rewards are chosen by name from
`BUILTIN_REWARDS`; user code is `file.py:fn` / `pkg.mod:fn` via the loader.

A timed-out sync reward keeps its thread busy until it returns (threads cannot be
killed); it no longer blocks the episode or the loop. Each sync call gets its own
daemon thread, not a slot of the loop's shared executor: rewards that hang forever
can neither starve the other `to_thread` users (tools, weight loading) nor hold up
the loop's or the interpreter's shutdown.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from areal_like.tasks.arithmetic import arithmetic_reward
from rollout_cluster.loader import UserCodeError, is_user_code_spec, load_object

__all__ = ["BUILTIN_REWARDS", "RewardError", "RewardFn", "compute_reward", "load_reward"]

RewardFn = Callable[[dict[str, Any], Any], Any]

BUILTIN_REWARDS: dict[str, RewardFn] = {"arithmetic": arithmetic_reward}


class RewardError(Exception):
    """The reward of one episode could not be computed; count the episode as failed.

    `reason` is one of `raised`, `timeout`, `not_finite`, `bad_value`.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"reward {reason}: {message}")
        self.reason = reason


def load_reward(spec: str | RewardFn, *, base_dir: str | Path | None = None) -> RewardFn:
    """A built-in reward by name, user code by `file.py:fn` / `pkg.mod:fn`, or a callable as-is."""
    if callable(spec):
        return spec
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if not is_user_code_spec(spec):
        raise UserCodeError(
            f"reward {spec!r} is neither a built-in ({sorted(BUILTIN_REWARDS)}) "
            "nor user code ('path/to/file.py:fn' or 'package.module:fn')"
        )
    fn = load_object(spec, base_dir=base_dir, what="reward")
    if not callable(fn):
        raise UserCodeError(f"reward {spec!r} is not callable")
    return fn


async def compute_reward(
    fn: RewardFn, sample: dict[str, Any], output: Any, *, timeout_s: float
) -> tuple[float, dict[str, float]]:
    """Run `fn` off the event loop with a timeout; return `(reward, extra_metrics)`.

    Raises `RewardError` for every way the reward can fail.
    """
    name = getattr(fn, "__name__", repr(fn))
    try:
        if inspect.iscoroutinefunction(fn):
            value = await asyncio.wait_for(fn(sample, output), timeout=timeout_s)
        else:
            value = await asyncio.wait_for(_in_daemon_thread(fn, sample, output), timeout=timeout_s)
    except asyncio.TimeoutError:
        raise RewardError("timeout", f"{name} took longer than {timeout_s:g}s") from None
    except Exception as e:
        raise RewardError("raised", f"{name} raised {type(e).__name__}: {e}") from e
    metrics: dict[str, float] = {}
    if isinstance(value, dict):
        if "reward" not in value:
            raise RewardError("bad_value", f"{name} returned a dict without a 'reward' key: {sorted(value)}")
        metrics = {k: float(v) for k, v in value.items() if k != "reward" and _is_number(v)}
        value = value["reward"]
    if not _is_number(value):
        raise RewardError("bad_value", f"{name} returned {type(value).__name__} {value!r}, expected a number")
    reward = float(value)
    if not math.isfinite(reward):
        raise RewardError("not_finite", f"{name} returned {reward}")
    return reward, metrics


def _is_number(v: Any) -> bool:
    # bool included (a pass/fail reward is a number), numpy scalars too; not complex.
    return isinstance(v, (numbers.Real, np.bool_))


def _in_daemon_thread(fn: RewardFn, *args: Any) -> asyncio.Future:
    """Run `fn(*args)` in a fresh daemon thread; a future for its result."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not fut.done():  # cancelled by the timeout meanwhile
            fut.set_result(value) if ok else fut.set_exception(value)

    def target() -> None:
        try:
            result: Any = fn(*args)
            ok = True
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting episode
            result, ok = e, False
        try:
            loop.call_soon_threadsafe(settle, ok, result)
        except RuntimeError:  # the loop is gone: nobody is waiting any more
            pass

    threading.Thread(target=target, name=f"reward-{getattr(fn, '__name__', 'fn')}", daemon=True).start()
    return fut
