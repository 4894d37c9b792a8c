"""Rollout engines: the step-based `Engine` contract, the embedded engine, the asyncio
driver, and (imported lazily) the vLLM adapter. See `base.py` for the contract."""

from rollout_cluster.engine.async_engine import AsyncEngine, EngineCommand
from rollout_cluster.engine.base import (
    INTERRUPT_MODES,
    AsyncGenerateEngine,
    DuplicateRequestError,
    Engine,
    EngineClosedError,
    EngineCounters,
    EngineRequest,
    InterruptMode,
    InvalidSamplingParamsError,
    PromptTooLongError,
    RequestError,
    RequestOutput,
    validate_request,
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
    "EngineCommand",
    "EngineCounters",
    "EngineRequest",
    "InterruptMode",
    "InvalidSamplingParamsError",
    "PromptTooLongError",
    "RequestError",
    "RequestOutput",
    "validate_request",
]
