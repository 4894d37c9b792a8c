"""Rollout engines: the step-based `Engine` contract, the embedded engine, the asyncio
driver, and (imported lazily) the vLLM adapter. See `base.py` for the contract."""

from rollout_cluster.engine.async_engine import AsyncEngine
from rollout_cluster.engine.base import (
    INTERRUPT_MODES,
    AsyncGenerateEngine,
    DuplicateRequestError,
    Engine,
    EngineClosedError,
    EngineCounters,
    InterruptMode,
    InvalidSamplingParamsError,
    PromptTooLongError,
    RequestError,
    RequestOutput,
)
from rollout_cluster.engine.embedded import EmbeddedEngine

__all__ = [
    "INTERRUPT_MODES",
    "AsyncEngine",
    "AsyncGenerateEngine",
    "DuplicateRequestError",
    "EmbeddedEngine",
    "Engine",
    "EngineClosedError",
    "EngineCounters",
    "InterruptMode",
    "InvalidSamplingParamsError",
    "PromptTooLongError",
    "RequestError",
    "RequestOutput",
]
