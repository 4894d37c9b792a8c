"""One episode end to end: choose the loop, run it, score it.

This is what the rollout controller calls. `AgentRunner.from_config` builds the
tools, the reward function and (lazily) one instance of each agent loop from
`ExperimentConfig.agent`. `run_episode(row, sampling, episode_id)` runs one copy of
one prompt and returns an `AgentLoopOutput` (`None` for a workflow rejection);
`score(row, output)` computes its reward. Both raise typed exceptions the
controller counts:

- `RewardError` (`.reason`): the reward raised, timed out or was not finite → `failed`;
- `EpisodeAbortedError`: the engine aborted the request (shutdown, explicit abort)
  → `cancelled`;
- `NoServerAvailableError` (from the manager): no server is left → `failed`.

Any other exception is a bug in a loop or tool code; count it as `failed` too.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from areal_like.core.config import AgentConfig, ExperimentConfig
from areal_like.core.types import AgentLoopOutput, SamplingParams
from rollout_cluster.agent_loop.base import AGENT_LOOPS, AgentLoopBase
from rollout_cluster.loader import UserCodeError, is_user_code_spec, load_object
from rollout_cluster.openai_client import make_openai_agent_loop
from rollout_cluster.rewards import RewardError, RewardFn, compute_reward, load_reward
from rollout_cluster.tools import BaseTool, build_tools

__all__ = ["AgentRunner", "EpisodeAbortedError", "resolve_agent_loop"]


class EpisodeAbortedError(Exception):
    """The engine aborted the episode's request; its partial output is not a sample."""

    def __init__(self, episode_id: str, output: AgentLoopOutput) -> None:
        super().__init__(f"episode {episode_id} was aborted by the engine")
        self.output = output


class AgentRunner:
    """Holds what episodes share (manager, tokenizer, tools, reward, loop instances)."""

    def __init__(
        self,
        *,
        server_manager: Any,
        tokenizer: Any,
        config: AgentConfig,
        response_length: int,
        tools: Sequence[BaseTool] | None = None,
        reward_fn: str | RewardFn | None = None,
        loops: Mapping[str, str | type[AgentLoopBase] | Callable[..., Any]] | None = None,
        base_dir: str | Path | None = None,
    ) -> None:
        self.server_manager = server_manager
        self.tokenizer = tokenizer
        self.config = config
        self.response_length = response_length
        self.base_dir = base_dir
        self.tools = list(tools) if tools is not None else build_tools(config, base_dir=base_dir)
        self.reward_fn = load_reward(reward_fn if reward_fn is not None else config.reward, base_dir=base_dir)
        self._loop_specs = dict(loops or {})
        self._loops: dict[str, AgentLoopBase] = {}
        self.seconds = {"agent_loop": 0.0, "tools": 0.0, "reward": 0.0}
        """Cumulative seconds summed over episodes, for the step's time budget (docs/design.md
        §10.19): in the agent loop outside generate and tool calls (loops that report
        `generate_s` in their metrics), in tool calls (`tool_s`), in the reward."""

    @classmethod
    def from_config(
        cls, cfg: ExperimentConfig, *, server_manager: Any, tokenizer: Any, **overrides: Any
    ) -> AgentRunner:
        """Everything from `cfg.agent` and `cfg.rollout.response_length`; user code paths
        resolve against the config file's folder."""
        base_dir = Path(cfg.source).parent if cfg.source else None
        kwargs: dict[str, Any] = dict(
            server_manager=server_manager,
            tokenizer=tokenizer,
            config=cfg.agent,
            response_length=cfg.rollout.response_length,
            base_dir=base_dir,
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    def loop_for(self, name: str) -> AgentLoopBase:
        """The (cached) loop instance for an `agent_name`."""
        loop = self._loops.get(name)
        if loop is None:
            loop_cls = resolve_agent_loop(self._loop_specs.get(name, name), base_dir=self.base_dir)
            loop = loop_cls(
                server_manager=self.server_manager,
                tokenizer=self.tokenizer,
                config=self.config,
                response_length=self.response_length,
                tools=self.tools,
            )
            self._loops[name] = loop
        return loop

    async def run_episode(
        self, sample: dict[str, Any], sampling_params: SamplingParams, episode_id: str
    ) -> AgentLoopOutput | None:
        """Run one episode with the row's loop (unscored). Matches the controller's
        `RunEpisode(row, sampling, episode_id)`; raises `EpisodeAbortedError` on abort."""
        loop = self.loop_for(sample.get("agent_name") or self.config.default_loop)
        t0 = time.perf_counter()
        output = await loop.run(sampling_params, **{**sample, "episode_id": episode_id})
        if output is None:
            return None
        self._time_episode(time.perf_counter() - t0, output.metrics)
        if output.episode_id is None:
            output.episode_id = episode_id
        if output.stop_reason == "abort":
            raise EpisodeAbortedError(episode_id, output)
        return output

    async def score(self, sample: dict[str, Any], output: AgentLoopOutput) -> float:
        """The episode's reward (off the event loop, with the timeout); extra metrics of a
        dict reward land in `output.metrics`. A reward the loop already set is kept.
        Matches the controller's `Score(row, output)`; raises `RewardError`."""
        if output.reward is None:
            t0 = time.perf_counter()
            try:
                reward, metrics = await compute_reward(
                    self.reward_fn, sample, output, timeout_s=self.config.reward_timeout_s
                )
            finally:
                self.seconds["reward"] += time.perf_counter() - t0
            output.reward = reward
            output.metrics.update(metrics)
        elif not math.isfinite(output.reward):
            raise RewardError("not_finite", f"agent loop set reward {output.reward}")
        return output.reward

    def _time_episode(self, seconds: float, metrics: Mapping[str, float]) -> None:
        tools = float(metrics.get("tool_s", 0.0))
        self.seconds["tools"] += tools
        if "generate_s" in metrics:  # the rest of the episode is the loop's own (and its turn on the event loop)
            self.seconds["agent_loop"] += max(0.0, seconds - float(metrics["generate_s"]) - tools)


def resolve_agent_loop(
    spec: str | type[AgentLoopBase] | Callable[..., Any], *, base_dir: str | Path | None = None
) -> type[AgentLoopBase]:
    """A loop class from a registered name, a class, user code, or an OpenAI-shaped agent function."""
    obj: Any = spec
    if isinstance(spec, str):
        if spec in AGENT_LOOPS:
            return AGENT_LOOPS[spec]
        if not is_user_code_spec(spec):
            raise UserCodeError(
                f"agent loop {spec!r} is neither registered ({sorted(AGENT_LOOPS)}) "
                "nor user code ('path/to/file.py:Name' or 'package.module:Name')"
            )
        obj = load_object(spec, base_dir=base_dir, what="agent loop")
    if isinstance(obj, type) and issubclass(obj, AgentLoopBase):
        return obj
    if callable(obj) and not isinstance(obj, type):
        return make_openai_agent_loop(obj)
    raise UserCodeError(f"agent loop {spec!r} is neither an AgentLoopBase subclass nor an agent function")
