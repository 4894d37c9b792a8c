"""Disk transport: safetensors in `v{N}/`, a marker written last, readers load complete versions only.

The fallback when no weight group can be formed (separate clusters without a
reachable store, a receiver that joined late) and the way to record versions.
prime-rl's filesystem transport does the same: the sender writes
`v{N}/model.safetensors`, flushes it, then writes the marker `v{N}/COMPLETE` by an
atomic rename. A folder without the marker is a version being written or one whose
writer crashed; no reader ever loads it. The marker holds the wire-encoded
`WeightUpdateMeta`, so a reader that missed the control message (a late joiner)
can still find and verify the newest version with `latest()`.

Old versions are removed marker first, so a folder is never both marked and
incomplete; a reader racing with the removal gets a clear `WeightSyncError`.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from areal_like.core import wire
from areal_like.core.config import DiskWeightSyncConfig
from areal_like.core.types import TensorMeta, WeightUpdateMeta
from weight_sync.base import NamedTensors, TransferStats, WeightReceiver, WeightSender
from weight_sync.meta import WeightSyncError, check_spec, checksum, spec_of, tensor_digest

__all__ = ["DiskWeightSender", "DiskWeightReceiver", "MARKER", "WEIGHTS_FILE"]

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
WEIGHTS_FILE = "model.safetensors"
_VERSION_DIR = re.compile(r"^v(\d+)$")


def _root(cfg: DiskWeightSyncConfig, path: str | os.PathLike[str] | None) -> Path:
    root = path if path is not None else cfg.disk_path
    if root is None:
        raise WeightSyncError("disk transport needs weight_sync.disk_path (or a path from the run folder)")
    return Path(root)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _versions(root: Path) -> list[tuple[int, Path]]:
    """Version folders under root, oldest first (complete or not)."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _VERSION_DIR.match(p.name))]
    return sorted(found)


def _remove_version(folder: Path) -> None:
    (folder / MARKER).unlink(missing_ok=True)  # unmark first: never marked-but-incomplete
    shutil.rmtree(folder, ignore_errors=True)


class DiskWeightSender(WeightSender):
    """Writes each version under `root/v{N}/`; keeps the newest `keep_versions`."""

    def __init__(self, cfg: DiskWeightSyncConfig, path: str | os.PathLike[str] | None = None) -> None:
        self.root = _root(cfg, path)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep_versions = cfg.keep_versions
        self._last: TransferStats | None = None
        # There is one sender per run: an unmarked folder now is a crashed writer's leftover.
        for _, folder in _versions(self.root):
            if not (folder / MARKER).exists():
                log.warning("removing incomplete weight version %s (its writer did not finish)", folder)
                _remove_version(folder)

    @property
    def last_transfer(self) -> TransferStats | None:
        return self._last

    def send(self, version: int, named_tensors: NamedTensors) -> WeightUpdateMeta:
        t0 = time.perf_counter()
        tensors: dict[str, torch.Tensor] = {}
        storages: set[int] = set()
        for name, t in named_tensors:
            if name in tensors:
                raise WeightSyncError(f"tensor {name!r} given twice")
            t = t.detach().to("cpu").contiguous()
            ptr = t.untyped_storage().data_ptr()
            if ptr in storages and t.numel() > 0:
                t = t.clone()  # safetensors refuses shared storage (tied embeddings)
            storages.add(t.untyped_storage().data_ptr())
            tensors[name] = t
        metas = spec_of(tensors.items())
        folder = (self.root / f"v{version}").resolve()
        meta = WeightUpdateMeta(
            version=version,
            transport="disk",
            tensors=metas,
            checksum=checksum(metas, [tensor_digest(t) for t in tensors.values()]),
            path=str(folder),
        )
        if folder.exists():  # the same version again (a resumed trainer): replace it whole
            _remove_version(folder)
        folder.mkdir(parents=True)
        weights = folder / WEIGHTS_FILE
        save_file(tensors, str(weights), metadata={"version": str(version)})
        _fsync(weights)
        self._write_marker(folder, meta)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        self._last = TransferStats(version=version, bytes=nbytes, seconds=time.perf_counter() - t0, ok=True)
        log.info(
            "wrote weights v%d (%.1f MB) to %s in %.2fs", version, nbytes / 1e6, folder, self._last.seconds
        )
        self._cleanup(keep=folder)
        return meta

    def _write_marker(self, folder: Path, meta: WeightUpdateMeta) -> None:
        """Commit the version: the marker appears atomically, after the weights are on disk."""
        tmp = folder / f".{MARKER}.tmp"
        tmp.write_bytes(wire.encode(meta))
        _fsync(tmp)
        os.replace(tmp, folder / MARKER)
        _fsync(folder)

    def _cleanup(self, keep: Path) -> None:
        complete = [f for _, f in _versions(self.root) if (f / MARKER).exists() or f == keep]
        for folder in complete[: -self.keep_versions]:
            if folder != keep:
                _remove_version(folder)


class DiskWeightReceiver(WeightReceiver):
    """Loads a complete version from disk, verified against its meta before anything is yielded."""

    def __init__(
        self,
        cfg: DiskWeightSyncConfig,
        path: str | os.PathLike[str] | None = None,
        *,
        expected: list[TensorMeta] | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        self.root = _root(cfg, path) if (path is not None or cfg.disk_path is not None) else None
        self.timeout_s = cfg.timeout_s
        self.expected = expected
        self.device = torch.device(device)
        self._last: TransferStats | None = None

    @property
    def last_transfer(self) -> TransferStats | None:
        return self._last

    def latest(self) -> WeightUpdateMeta | None:
        """The newest complete version under the root, for a receiver that missed the message."""
        if self.root is None:
            raise WeightSyncError("latest() needs weight_sync.disk_path")
        for _attempt in range(5):
            listed = list(reversed(_versions(self.root)))
            for _, folder in listed:
                try:
                    return wire.decode((folder / MARKER).read_bytes(), expect=WeightUpdateMeta)
                except FileNotFoundError:
                    continue  # incomplete, or removed while we looked
                except wire.WireError as e:
                    log.warning("ignoring %s: unreadable marker (%s)", folder, e)
            if not listed:
                return None
            # Every version listed was incomplete or removed meanwhile: on a loaded machine
            # the writer can publish (and clean up) several while this reader is descheduled.
        return None

    def receive(self, meta: WeightUpdateMeta) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
        t0 = time.perf_counter()
        self._last = TransferStats(version=meta.version)
        try:
            tensors = self._load_verified(meta)
        except WeightSyncError as e:
            self._last.error = str(e)
            log.error("keeping the old weights: %s", e)
            raise
        self._last.bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        self._last.seconds = time.perf_counter() - t0
        self._last.ok = True
        return meta.version, ((m.name, tensors[m.name]) for m in meta.tensors)

    def _load_verified(self, meta: WeightUpdateMeta) -> dict[str, torch.Tensor]:
        if meta.transport != "disk" or not meta.path:
            raise WeightSyncError(f"disk receiver got a {meta.transport!r} meta without a folder")
        check_spec(meta.tensors, self.expected)
        folder = Path(meta.path)
        marker = self._wait_for_marker(folder, meta.version)
        try:
            on_disk = wire.decode(marker.read_bytes(), expect=WeightUpdateMeta)
            tensors = load_file(str(folder / WEIGHTS_FILE), device=str(self.device))
        except FileNotFoundError:
            raise WeightSyncError(
                f"weights v{meta.version} were removed from {folder} while loading "
                f"(keep_versions too small for this reader?)"
            ) from None
        except (OSError, SafetensorError, wire.WireError) as e:
            raise WeightSyncError(f"weights v{meta.version} in {folder} are unreadable: {e}") from e
        if on_disk.version != meta.version or on_disk.checksum != meta.checksum:
            raise WeightSyncError(
                f"{folder} holds v{on_disk.version} checksum {on_disk.checksum[:12]}, "
                f"but v{meta.version} checksum {meta.checksum[:12]} was announced"
            )
        names = [m.name for m in meta.tensors]
        if sorted(tensors) != sorted(names):
            raise WeightSyncError(f"{folder} does not hold the tensors its meta names")
        digests = []
        for m in meta.tensors:
            t = tensors[m.name]
            if str(t.dtype).removeprefix("torch.") != m.dtype or list(t.shape) != m.shape:
                raise WeightSyncError(
                    f"{m.name!r} on disk is {t.dtype}{list(t.shape)}, meta says {m.dtype}{m.shape}"
                )
            digests.append(tensor_digest(t))
        got = checksum(meta.tensors, digests)
        if got != meta.checksum:
            raise WeightSyncError(
                f"checksum mismatch for v{meta.version} in {folder}: got {got[:12]}, expected {meta.checksum[:12]}"
            )
        return tensors

    def _wait_for_marker(self, folder: Path, version: int) -> Path:
        """Shared filesystems may show the marker late; wait for it, up to timeout_s."""
        marker = folder / MARKER
        deadline = time.monotonic() + self.timeout_s
        delay = 0.005
        while not marker.exists():
            if time.monotonic() > deadline:
                raise WeightSyncError(
                    f"weights v{version} not complete in {folder} after {self.timeout_s:.1f}s (no {MARKER} marker)"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.2)
        return marker
