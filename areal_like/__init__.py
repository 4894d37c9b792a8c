"""areal_like: fully asynchronous, decoupled RL for language models.

This package's top level exports the contracts only (types, config, wire codec);
orchestration (controller, launch, CLI, dashboard) is imported by module path, so
`import areal_like` stays light and never imports vLLM, Megatron or torch.
"""

from areal_like.core.config import ConfigError, ExperimentConfig, load_config
from areal_like.core.types import (
    AgentLoopOutput,
    GenerateRequest,
    GenerateResult,
    RolloutStats,
    SamplingParams,
    Trajectory,
    TrajectoryGroup,
    VersionAnnouncement,
    WeightUpdateMeta,
)
from areal_like.core.wire import WireError, decode, encode

__version__ = "0.1.0"

__all__ = [
    "AgentLoopOutput",
    "ConfigError",
    "ExperimentConfig",
    "GenerateRequest",
    "GenerateResult",
    "RolloutStats",
    "SamplingParams",
    "Trajectory",
    "TrajectoryGroup",
    "VersionAnnouncement",
    "WeightUpdateMeta",
    "WireError",
    "decode",
    "encode",
    "load_config",
]
