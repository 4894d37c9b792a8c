"""The embedded engine: continuous batching over an HF causal LM with our own KV cache.

Parts, after vLLM v1's split (`EngineCore.step` = schedule, run, update):

- `engine.py`: `EmbeddedEngine`, the `Engine` interface; composes the parts below and
  owns the weight version and the interrupt protocol (docs/design.md §9.1);
- `scheduler.py`: waiting / running queues, admission, prefill plans, retirement,
  the per-sequence state;
- `runner.py`: the decoder math over the HF weights, weight loading, sampling;
- `cache.py`: KV slot storage and the version-keyed prefix cache.
"""

from rollout_cluster.engine.embedded.engine import EmbeddedEngine
from rollout_cluster.engine.embedded.runner import SUPPORTED_MODEL_TYPES

__all__ = ["EmbeddedEngine", "SUPPORTED_MODEL_TYPES"]
