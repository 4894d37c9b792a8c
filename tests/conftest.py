"""Shared fixtures: the real small model (random init) and its tokenizer, made locally."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """An HF folder with the quickstart architecture, randomly initialised (seed 0)."""
    import torch

    torch.set_num_threads(1)
    from areal_like.models.tiny_model import init_model

    return init_model(tmp_path_factory.mktemp("tiny_model"), seed=0)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from areal_like.models.tiny_model import load_tokenizer

    return load_tokenizer(tiny_model_dir)
