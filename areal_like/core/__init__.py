"""Contracts: the words every layer shares (docs/design.md §4, "Layers").

Types and messages, the config models, the msgpack wire codec, the staleness gate,
the trajectory buffer and the metrics registry. This package imports nothing of the
clusters, the weight path or orchestration, and nothing heavy (no torch, Ray, ZMQ,
vLLM or Megatron): a test checks it.
"""
