"""Reward functions: `(sample, output) -> float | dict`, sync or async, run safely.

A reward is user code and may be slow (a verifier, a sandboxed test run), so it
never runs on the event loop that drives every other episode: sync functions run
in a thread, async ones as tasks, both under `agent.reward_timeout_s`. A reward
that raises, times out, returns NaN/inf or something that is not a number fails
*its episode* with a `RewardError` carrying a short `reason`; the controller counts
it under `failed` (invariant 5) and the run goes on.

A dict result needs a `reward` key; its other numeric entries become episode
metrics under their own names (`{"reward": 1.0, "format_ok": 1.0}` gives
`output.metrics["format_ok"]`, and so `Trajectory.metrics`); entries that are not
numbers are dropped with a warning once per key. Built-in rewards are chosen by name
from `BUILTIN_REWARDS`; user code is `file.py:fn` / `pkg.mod:fn` via the loader.

Reward functions written for TRL (docs/design.md §10.13) — `f(completions, prompts=None,
completion_ids=None, **kwargs) -> list[float]`, recognised by a parameter named
`completions` or `prompts` — are adapted by `as_reward_fn` and called as TRL's
`GRPOTrainer` calls them (`_calculate_rewards`), with one-element lists since each
episode is scored on its own:

- every column of the dataset row under its own name, as the dataset held it (the row's
  `columns`, kept by `normalise_row`): a prompt column named by `dataset.prompt_key`
  (`q`) arrives as `q`, the answer column once, under its name, with its value
  unconverted. As in TRL, columns named `prompt`, `completion` or `completion_ids` are
  not passed by name (the prompt is `prompts`);
- `prompts`: the prompt as the dataset held it: a string for a standard dataset, the
  list of chat messages for a conversational one;
- `completions`: the agent's final answer (`output.final_text`, the last assistant turn
  with tool calls removed): the string for a standard dataset, and for a conversational
  one `[{"role": "assistant", "content": ...}]`, as TRL does;
- `completion_ids`: the token ids of that same last assistant turn (the last run of
  generated tokens, its end-of-turn token included). For a single-turn episode these are
  all of the response, as in TRL. For a multi-turn tool episode `completions` and
  `completion_ids` cover the same text, the final answer, not the tool calls and results
  before it (TRL, whose own tool loop returns the whole exchange, has no standard-dataset
  equivalent); a reward that needs the whole exchange takes `(sample, output)` and reads
  `output.messages` or `output.response_ids`.

TRL's `trainer_state`, `log_extra`, `log_metric` and `environments` are not passed. A
row not made by `normalise_row` (no `columns`) passes its `extra` entries and `answer`.
A `None` entry is a failed reward (`bad_value`).

A timed-out sync reward keeps its thread busy until it returns (threads cannot be
killed); it no longer blocks the episode or the loop. Each sync call gets its own
daemon thread, not a slot of the loop's shared executor: rewards that hang forever
can neither starve the other `to_thread` users (tools, weight loading) nor hold up
the loop's or the interpreter's shutdown.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from areal_like.tasks.arithmetic import arithmetic_reward, last_integer_reward
from rollout_cluster.loader import UserCodeError, is_user_code_spec, load_object

__all__ = ["BUILTIN_REWARDS", "RewardError", "RewardFn", "as_reward_fn", "compute_reward", "is_trl_reward",
           "last_turn_ids", "load_reward", "trl_reward_kwargs"]

log = logging.getLogger(__name__)

RewardFn = Callable[[dict[str, Any], Any], Any]

BUILTIN_REWARDS: dict[str, RewardFn] = {"arithmetic": arithmetic_reward, "last_integer": last_integer_reward}


class RewardError(Exception):
    """The reward of one episode could not be computed; count the episode as failed.

    `reason` is one of `raised`, `timeout`, `not_finite`, `bad_value`.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"reward {reason}: {message}")
        self.reason = reason


def load_reward(spec: str | RewardFn, *, base_dir: str | Path | None = None) -> RewardFn:
    """A built-in reward by name, user code by `file.py:fn` / `pkg.mod:fn`, or a callable
    (TRL-style functions adapted by `as_reward_fn`)."""
    if callable(spec):
        return as_reward_fn(spec)
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
    return as_reward_fn(fn)


def is_trl_reward(fn: Callable[..., Any]) -> bool:
    """True for a TRL-style reward: it has a parameter named `completions` or `prompts`
    (ours are `(sample, output)`, so the two shapes cannot be confused)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # some builtins have no signature: not TRL-shaped
        return False
    return "completions" in params or "prompts" in params


def as_reward_fn(fn: Callable[..., Any]) -> RewardFn:
    """`fn` itself when it is `(sample, output)`-shaped; a TRL-style reward wrapped so it is.

    Called once per episode (not batched per group): each call has its own timeout and a
    slow or failing completion fails only its own episode, as for every other reward.
    """
    if getattr(fn, "_areal_trl", False) or not is_trl_reward(fn):
        return fn
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    def arguments(sample: dict[str, Any], output: Any) -> dict[str, Any]:
        kwargs = trl_reward_kwargs(sample, output)
        return kwargs if takes_any else {k: v for k, v in kwargs.items() if k in params}

    def one(value: Any) -> Any:
        if isinstance(value, (list, tuple, np.ndarray)):
            if len(value) != 1:
                raise ValueError(f"returned {len(value)} rewards for 1 completion")
            return value[0]  # None stays None: compute_reward counts it as bad_value
        return value

    if inspect.iscoroutinefunction(fn):
        async def trl_reward(sample: dict[str, Any], output: Any) -> Any:
            return one(await fn(**arguments(sample, output)))
    else:
        def trl_reward(sample: dict[str, Any], output: Any) -> Any:  # type: ignore[misc]
            return one(fn(**arguments(sample, output)))

    trl_reward.__name__ = getattr(fn, "__name__", type(fn).__name__)
    trl_reward._areal_trl = True  # type: ignore[attr-defined]
    return trl_reward


_TRL_NOT_BY_NAME = ("prompt", "completion", "completion_ids")
"""Columns TRL's `GRPOTrainer` does not pass under their own name."""


def trl_reward_kwargs(sample: dict[str, Any], output: Any) -> dict[str, Any]:
    """The keyword arguments a TRL-style reward gets for one episode (see the module
    docstring): every row column by name, `prompts`, `completions`, `completion_ids`,
    each a one-element list."""
    text = sample.get("prompt_text")
    chat = text is None
    columns = sample.get("columns")
    if columns is None:  # a row built by hand rather than by normalise_row
        columns = {**(sample.get("extra") or {}), "answer": sample.get("answer")}
    kwargs: dict[str, Any] = {k: [v] for k, v in columns.items() if k not in _TRL_NOT_BY_NAME}
    completion: Any = [{"role": "assistant", "content": output.final_text}] if chat else output.final_text
    kwargs.update(prompts=[sample.get("prompt") if chat else text], completions=[completion],
                  completion_ids=[last_turn_ids(output.response_ids, output.response_mask)])
    return kwargs


def last_turn_ids(ids: list[int], mask: list[int]) -> list[int]:
    """The ids of the last run of generated tokens (mask 1): the last assistant turn."""
    end = len(mask)
    while end and mask[end - 1] != 1:
        end -= 1
    start = end
    while start and mask[start - 1] == 1:
        start -= 1
    return list(ids[start:end])


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
    except TimeoutError:
        raise RewardError("timeout", f"{name} took longer than {timeout_s:g}s") from None
    except Exception as e:
        raise RewardError("raised", f"{name} raised {type(e).__name__}: {e}") from e
    metrics: dict[str, float] = {}
    if isinstance(value, dict):
        if "reward" not in value:
            raise RewardError("bad_value", f"{name} returned a dict without a 'reward' key: {sorted(value)}")
        metrics = {k: float(v) for k, v in value.items() if k != "reward" and _is_number(v)}
        for k in value.keys() - metrics.keys() - {"reward"} - _warned:
            _warned.add(k)
            log.warning("reward %s: dict entry %r is %s, not a number; not recorded as a metric",
                        name, k, type(value[k]).__name__)
        value = value["reward"]
    if not _is_number(value):
        raise RewardError("bad_value", f"{name} returned {type(value).__name__} {value!r}, expected a number")
    reward = float(value)
    if not math.isfinite(reward):
        raise RewardError("not_finite", f"{name} returned {reward}")
    return reward, metrics


_warned: set[str] = set()


def _is_number(v: Any) -> bool:
    # bool included (a pass/fail reward is a number), numpy scalars too; not complex.
    return isinstance(v, (numbers.Real, np.bool_))


def _in_daemon_thread(fn: RewardFn, *args: Any) -> asyncio.Future:
    """Run `fn(*args)` on one of `_THREADS`' daemon threads; a future for its result."""
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

    _THREADS.submit(target)
    return fut


class _DaemonThreads:
    """Daemon threads that are reused: a task goes to an idle thread, or to a new one when
    none is idle, so a reward that hangs (past its timeout, still running) keeps only its
    own thread and never delays the next. Starting a thread per reward cost the rollout
    controller ~12 % of its CPU on the quickstart (py-spy); an idle thread ends after
    `idle_s`."""

    def __init__(self, name: str = "reward", idle_s: float = 30.0) -> None:
        self._name = name
        self._idle_s = idle_s
        self._tasks: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._started = 0

    def submit(self, task: Callable[[], None]) -> None:
        with self._lock:
            spawn = self._idle == 0
            if spawn:
                self._started += 1
            else:
                self._idle -= 1  # this task takes one idle thread
        self._tasks.put(task)
        if spawn:
            threading.Thread(target=self._work, name=f"{self._name}-{self._started}", daemon=True).start()

    def _work(self) -> None:
        while True:
            try:
                task = self._tasks.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    if self._idle == 0:  # a submit counted on this thread meanwhile: serve it
                        continue
                    self._idle -= 1
                return
            task()
            with self._lock:
                self._idle += 1


_THREADS = _DaemonThreads()
