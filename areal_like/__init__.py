"""areal_like: fully asynchronous, decoupled RL for language models.

This package's top level exports the contracts only (types, config, wire codec);
orchestration (controller, launch, CLI, dashboard) is imported by module path, so
`import areal_like` stays light and never imports vLLM, Megatron or torch.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_HOME = {"ConfigError": "config", "ExperimentConfig": "config", "load_config": "config", "WireError": "wire",
         "decode": "wire", "encode": "wire"}


def __getattr__(name: str) -> Any:
    """The exports load on first use (PEP 562): `import areal_like.<anything>` runs this
    package first, and the CLI starts its zygote before pydantic and numpy are imported."""
    if name not in __all__:
        raise AttributeError(f"module 'areal_like' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"areal_like.core.{_HOME.get(name, 'types')}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
