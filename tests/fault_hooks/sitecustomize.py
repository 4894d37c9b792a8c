"""Test-only fault injection for real runs (tests/test_faults.py), loaded by Python at
start-up in every process of a run (driver, Ray workers) because the tests put this
folder first on PYTHONPATH. Nothing here is imported by the package itself.

Each fault is switched on by an environment variable; without them this file only
installs an import hook that does nothing:

- `AREAL_FAULT_ENOSPC_DIR` + `AREAL_FAULT_ENOSPC_FLAG`: while the flag file exists,
  every write under the folder fails with ENOSPC (a full disk, emulated): files opened
  for writing (also ones opened before), `torch.save` and safetensors `save_file`.
- `AREAL_FAULT_KILL_TRAIN_AT=N` (+ `AREAL_FAULT_MARK_DIR`): the train worker kills
  itself with SIGKILL when it is asked for the step that starts at version N, once
  (a marker file in the mark folder says it happened and keeps it from repeating).
- `AREAL_FAULT_KILL_ROLLOUT_AT=N` (+ `AREAL_FAULT_MARK_DIR`): the rollout controller's
  process kills itself with SIGKILL when it starts an episode (others are under way)
  while serving version ≥ N, once (a server actor's death is tests/test_scale_out.py's).
- `AREAL_FAULT_WS_STALL_AT=N` + `AREAL_FAULT_WS_STALL_S=S` + `AREAL_FAULT_MARK_DIR`:
  the dist weight receiver, having joined the transfer of a version ≥ N, sleeps S
  seconds before taking the bytes (past `weight_sync.timeout_s`), once; the marker
  `ws_stalled` holds that version.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import sys
from importlib.abc import MetaPathFinder

_ENOSPC_DIR = os.path.abspath(os.environ["AREAL_FAULT_ENOSPC_DIR"]) if os.environ.get("AREAL_FAULT_ENOSPC_DIR") else None
_ENOSPC_FLAG = os.environ.get("AREAL_FAULT_ENOSPC_FLAG")
_MARK_DIR = os.environ.get("AREAL_FAULT_MARK_DIR")


def _mark(name: str, text: str = "") -> bool:
    """Create the marker `name` (holding `text`); False if it already existed (the fault
    already fired)."""
    if not _MARK_DIR:
        return True
    try:
        fd = os.open(os.path.join(_MARK_DIR, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, text.encode())
    os.close(fd)
    return True


# ---- a full disk -------------------------------------------------------------------------
def _disk_full(path: object) -> bool:
    if not (_ENOSPC_DIR and _ENOSPC_FLAG) or not os.path.exists(_ENOSPC_FLAG):
        return False
    try:
        p = os.path.abspath(os.fspath(path))  # type: ignore[arg-type]
    except TypeError:
        return False
    return p == _ENOSPC_DIR or p.startswith(_ENOSPC_DIR + os.sep)


def _enospc(path: object) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))  # type: ignore[arg-type]


class _FullDiskFile:
    """A file opened for writing under the run folder: writes fail while the disk is full."""

    def __init__(self, f: object, path: object) -> None:
        self._f = f
        self._path = path

    def write(self, data: object) -> object:
        if _disk_full(self._path):
            raise _enospc(self._path)
        return self._f.write(data)  # type: ignore[attr-defined]

    def writelines(self, lines: object) -> None:
        for line in lines:  # type: ignore[attr-defined]
            self.write(line)

    def flush(self) -> None:
        if _disk_full(self._path):
            raise _enospc(self._path)
        self._f.flush()  # type: ignore[attr-defined]

    def __enter__(self) -> _FullDiskFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()  # type: ignore[attr-defined]

    def __iter__(self):  # noqa: ANN204
        return iter(self._f)  # type: ignore[call-overload]

    def __getattr__(self, name: str) -> object:
        return getattr(self._f, name)


_real_open = builtins.open


def _open(file, mode="r", *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
    writing = any(c in mode for c in "wax+")
    if writing and _disk_full(file):
        raise _enospc(file)
    f = _real_open(file, mode, *args, **kwargs)
    if writing and _ENOSPC_DIR and not isinstance(file, int) and _under_run_dir(file):
        return _FullDiskFile(f, file)
    return f


def _under_run_dir(file: object) -> bool:
    try:
        p = os.path.abspath(os.fspath(file))  # type: ignore[arg-type]
    except TypeError:
        return False
    return p == _ENOSPC_DIR or p.startswith(_ENOSPC_DIR + os.sep)  # type: ignore[operator]


def _patch_saver(module: object, name: str, path_arg: int) -> None:
    real = getattr(module, name)

    def save(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        target = args[path_arg] if len(args) > path_arg else kwargs.get("f", kwargs.get("filename"))
        if isinstance(target, (str, os.PathLike)) and _disk_full(target):
            raise _enospc(target)
        return real(*args, **kwargs)

    setattr(module, name, save)


# ---- a train worker killed mid-step ----------------------------------------------------
def _patch_torch_engine(module: object) -> None:
    at = int(os.environ["AREAL_FAULT_KILL_TRAIN_AT"])
    cls = module.TorchTrainEngine  # type: ignore[attr-defined]
    real = cls.train_step

    def train_step(self, batch):  # noqa: ANN001, ANN202
        if self.version == at and _mark("train_killed"):
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, batch)

    cls.train_step = train_step


# ---- the rollout process killed mid-episode ----------------------------------------------
def _patch_rollout_controller(module: object) -> None:
    at = int(os.environ["AREAL_FAULT_KILL_ROLLOUT_AT"])
    cls = module.RolloutController  # type: ignore[attr-defined]
    real = cls._episode

    async def _episode(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if self.loaded_version >= at and _mark("rollout_killed"):  # episodes are under way
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
        return await real(self, *args, **kwargs)

    cls._episode = _episode


# ---- a weight-sync receiver stalled past the timeout -----------------------------------
def _patch_dist(module: object) -> None:
    at = int(os.environ["AREAL_FAULT_WS_STALL_AT"])
    stall_s = float(os.environ["AREAL_FAULT_WS_STALL_S"])
    cls = module.DistWeightReceiver  # type: ignore[attr-defined]
    real = cls._receive_buckets

    def _receive_buckets(self, meta, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if meta.version >= at and _mark("ws_stalled", str(meta.version)):
            import time

            time.sleep(stall_s)
            _mark("ws_resumed")
        return real(self, meta, *args, **kwargs)

    cls._receive_buckets = _receive_buckets


# ---- patch modules when they are first imported ------------------------------------------
_PATCHES = {}
if _ENOSPC_DIR:
    builtins.open = _open
    io.open = _open
    _PATCHES["safetensors.torch"] = lambda m: _patch_saver(m, "save_file", 1)
    _PATCHES["torch"] = lambda m: _patch_saver(m, "save", 1)
if os.environ.get("AREAL_FAULT_KILL_TRAIN_AT"):
    _PATCHES["train_cluster.torch_engine"] = _patch_torch_engine
if os.environ.get("AREAL_FAULT_KILL_ROLLOUT_AT"):
    _PATCHES["areal_like.orchestration.rollout_controller"] = _patch_rollout_controller
if os.environ.get("AREAL_FAULT_WS_STALL_AT"):
    _PATCHES["weight_sync.dist"] = _patch_dist


class _PatchAfterImport(MetaPathFinder):
    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201
        if name not in _PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                break
        else:
            return None
        real_exec = spec.loader.exec_module
        patch = _PATCHES[name]

        def exec_module(module):  # noqa: ANN001, ANN202
            real_exec(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


if _PATCHES:
    sys.meta_path.insert(0, _PatchAfterImport())
