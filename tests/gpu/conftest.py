"""The GPU tests: everything under tests/gpu is marked `gpu` (so the default suite,
`-m 'not ... gpu'`, never collects it to run) and skipped where no CUDA GPU is
visible. Run them with `scripts/test.sh --gpu` (`-m gpu`, in .venv-vllm-gpu from
scripts/setup_vllm_gpu.sh), or `python -m pytest -m gpu tests/gpu` in any venv with a
CUDA torch (and the GPU `vllm` for the vLLM tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def cuda_gpus() -> int:
    """CUDA devices visible to this process (0 without a CUDA torch)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpus: int | None = None
    for item in items:
        if _HERE not in Path(str(item.path)).resolve().parents:
            continue
        item.add_marker(pytest.mark.gpu)
        if gpus is None:
            gpus = cuda_gpus()
        if gpus == 0:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (none visible)"))
