"""Megatron-core backend (GPU path for large models; CPU for tests). Imports megatron lazily."""

from train_cluster.megatron.convert import hf_to_megatron, megatron_to_hf, padded_vocab_size

__all__ = ["hf_to_megatron", "megatron_to_hf", "padded_vocab_size", "MegatronTrainEngine", "build_gpt_model"]


def __getattr__(name: str):  # keep `import train_cluster.megatron` free of megatron-core itself
    if name in ("MegatronTrainEngine", "build_gpt_model"):
        from train_cluster.megatron import engine

        return getattr(engine, name)
    raise AttributeError(name)
