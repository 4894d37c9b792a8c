"""The dist transport's shared-memory lane: receivers on the sender's host read the staged
version straight from a file in `/dev/shm` instead of taking it off a gloo broadcast.

Over TCP loopback a gloo broadcast costs two kernel copies and a core on each side for
every byte; on one host the bytes are already in memory both processes can map. The
sender's staging buffer (the snapshot `send` takes) is that file. A receiver that proves
it can read the sender's files (`ShmProbe`: a random token in a file beside them, named
on the group's store) says so when it announces readiness; when every member of a
transfer can, the plan names the staging file and no bucket is broadcast. The header,
the checksum and the commit vote are unchanged: a receiver reads the file into its own
buffer (`read` calls, not a mapping: mapped pages would count as a second copy of the
version in the server's resident memory), verifies every byte against the meta's
checksum, and votes (docs/design.md §10.31). A receiver whose engine loads in place
verifies the file through one 16 MB piece instead and hands the engine `FileSlice`s to
read into its weights before it votes, so no buffer holds the version (§10.44). The sender never rewrites the file before the transfer's commit vote has
completed, so a receiver reads one version only; a receiver that somehow read a torn one
fails the checksum and keeps its weights.

Files are `areal_ws-<pid>-<nonce>-<k>` (mode 0600: another user's receivers cannot open
them and take the broadcast); a sender unlinks its own at `close`, and removes those of
dead senders (a trainer killed with -9) when it starts. Space is reserved up front
(`posix_fallocate`), so a full `/dev/shm` (a container's 64 MB default) means the
broadcast, not a SIGBUS.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from weight_sync.meta import FlatLayout, Slot, streamed_digest

__all__ = ["FileSlice", "FileSlices", "SenderLane", "ShmProbe", "ShmReader", "ShmStaging", "remove_stale"]

log = logging.getLogger(__name__)

PREFIX = "areal_ws-"
PROBE_KEY = "shm_probe"
"""Store key (under the group's control prefix): `<probe path> <token>`."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(folder: str) -> int:
    """Unlink the lane's files whose sender process is gone; returns how many."""
    removed = 0
    try:
        entries = list(Path(folder).glob(PREFIX + "*"))
    except OSError:
        return 0
    for p in entries:
        pid = p.name.removeprefix(PREFIX).split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            try:
                p.unlink()
                removed += 1
            except OSError:
                pass
    if removed:
        log.info("removed %d weight-sync files of dead senders from %s", removed, folder)
    return removed


def _create(path: str, size: int) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, max(1, size))
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)


class ShmProbe:
    """The sender's proof-of-host: a small file with a random token, named on the store."""

    def __init__(self, folder: str, nonce: str) -> None:
        self.path = os.path.join(folder, f"{PREFIX}{os.getpid()}-{nonce}.probe")
        self.token = secrets.token_hex(16)
        _create(self.path, 0)
        with open(self.path, "w") as f:
            f.write(self.token)

    @property
    def key_value(self) -> str:
        return f"{self.path} {self.token}"

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass


def sees(key_value: str) -> bool:
    """Receiver side: whether this process reads the probe the store names (same host,
    same /dev/shm, same user)."""
    path, _, token = key_value.partition(" ")
    try:
        with open(path) as f:
            return bool(token) and f.read(len(token) + 1) == token
    except OSError:
        return False


class ShmStaging:
    """The sender's staging buffer as a shared-memory file; `tensor` is its bytes."""

    def __init__(self, folder: str, nonce: str, k: int, size: int) -> None:
        self.path = os.path.join(folder, f"{PREFIX}{os.getpid()}-{nonce}-{k}")
        self.size = size
        _create(self.path, size)
        self.tensor = torch.from_file(self.path, shared=True, size=max(1, size), dtype=torch.uint8)[:size]

    def close(self) -> None:
        self.tensor = None  # type: ignore[assignment]
        try:
            os.unlink(self.path)
        except OSError:
            pass


def try_staging(folder: str, nonce: str, k: int, size: int) -> ShmStaging | None:
    """A staging file, or None (with the reason logged) where the folder cannot hold it."""
    try:
        st = os.statvfs(folder)
        free = st.f_bavail * st.f_frsize
        if free < size * 1.05 + (64 << 20):
            log.warning("weight_sync: %s has %.0f MB free, %.0f MB needed for the shared-memory lane; "
                        "same-host receivers take the broadcast", folder, free / 1e6, size / 1e6)
            return None
        return ShmStaging(folder, nonce, k, size)
    except OSError as e:
        log.warning("weight_sync: no shared-memory staging in %s (%s); same-host receivers take the broadcast",
                    folder, e)
        return None


class SenderLane:
    """The sender's side of the lane: its probe (announced with `announce`) and its
    current staging file. `folder` None: off, staging is plain memory."""

    def __init__(self, folder: str | None, nonce: str, announce: Callable[[str], None]) -> None:
        self.folder = folder
        self.nonce = nonce
        self.probe: ShmProbe | None = None
        self.staging_file: ShmStaging | None = None
        self.files = 0
        if folder is None:
            return
        remove_stale(folder)
        try:
            self.probe = ShmProbe(folder, nonce)
            announce(self.probe.key_value)
        except OSError as e:
            log.warning("weight_sync: no shared-memory lane (%s: %s); receivers take the broadcast", folder, e)
            self.folder = None

    @property
    def path(self) -> str | None:
        """The current staging file, when the staging buffer is one."""
        return self.staging_file.path if self.staging_file is not None else None

    def staging(self, size: int) -> torch.Tensor:
        """A new staging buffer of `size` bytes (the previous file, if any, is removed)."""
        if self.staging_file is not None:
            self.staging_file.close()
            self.staging_file = None
        if self.folder is not None:
            self.files += 1
            self.staging_file = try_staging(self.folder, self.nonce, self.files, size)
            if self.staging_file is not None:
                return self.staging_file.tensor
        return torch.empty(size, dtype=torch.uint8)

    def close(self) -> None:
        for f in (self.staging_file, self.probe):
            if f is not None:
                f.close()
        self.staging_file = self.probe = None


class ShmReader:
    """Receiver side: reads the sender's staging file with `read` calls, never a mapping:
    a mapping's pages count in this process's resident memory (a second copy of every
    version), the page cache's do not. Either into this side's buffer (`read_into`), or,
    for an engine that loads in place, only through a chunk to verify (`digests`) and
    then tensor by tensor straight into the engine's weights (`slices`)."""

    _PIECE = 16 << 20
    """What `digests` reads at a time: a whole number of the digest's 64 KiB chunks."""

    def __init__(self) -> None:
        self._piece: torch.Tensor | None = None

    def read_into(self, path: str, size: int, dst: torch.Tensor) -> None:
        """The first `size` bytes of `path` into the uint8 CPU tensor `dst`."""
        with open(path, "rb", buffering=0) as f:
            have = os.fstat(f.fileno()).st_size
            if have < size:
                raise OSError(f"{path} holds {have} bytes, the transfer needs {size}")
            _read_exact(f, 0, memoryview(dst.numpy()).cast("B")[:size], path)

    def digests(self, path: str, layout: FlatLayout) -> list[bytes]:
        """Each tensor's `tensor_digest`, streamed from `path` through one 16 MB piece, made
        for this call only (nothing is held between versions)."""
        try:
            return self._digests(path, layout)
        finally:
            self._piece = None

    def _digests(self, path: str, layout: FlatLayout) -> list[bytes]:
        self._piece = torch.empty(self._PIECE, dtype=torch.uint8)
        view = memoryview(self._piece.numpy()).cast("B")
        out = []
        with open(path, "rb", buffering=0) as f:
            have = os.fstat(f.fileno()).st_size
            if have < layout.total_bytes:
                raise OSError(f"{path} holds {have} bytes, the transfer needs {layout.total_bytes}")

            def pieces(slot: Slot) -> Iterator[torch.Tensor]:
                for start in range(slot.offset, slot.end, self._PIECE):
                    n = min(self._PIECE, slot.end - start)
                    _read_exact(f, start, view[:n], path)
                    yield self._piece[:n]  # type: ignore[index]

            for slot in layout.slots:
                out.append(streamed_digest(pieces(slot), slot.nbytes))
        return out

    @staticmethod
    def slices(f: Any, layout: FlatLayout) -> FileSlices:
        """The version's tensors in the open staging file `f` (open once: the file stays
        readable through it even if it is unlinked meanwhile)."""
        return FileSlices(f, layout)

    def close(self) -> None:
        """Drop the verify piece (made again when needed)."""
        self._piece = None


def _read_exact(f: Any, offset: int, view: memoryview, path: str) -> None:
    f.seek(offset)
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise OSError(f"{path} ended at byte {offset + done}")
        done += n


class FileSlices(list):  # type: ignore[type-arg]
    """A version as (name, `FileSlice`) pairs; `read` is set once every slice was read
    (then the file may change: the receiver votes)."""

    def __init__(self, f: Any, layout: FlatLayout) -> None:
        self.read = threading.Event()
        self._left = len(layout.slots)
        self._lock = threading.Lock()
        super().__init__((slot.name, FileSlice(f, slot, self._one_read)) for slot in layout.slots)
        if not self._left:
            self.read.set()

    def _one_read(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left == 0:
                self.read.set()


class FileSlice:
    """One tensor of a version in the sender's staging file, read only when an engine
    writes it (`into`): loading in place, no buffer ever holds the whole version. Valid
    until the transfer's commit vote (the sender does not rewrite the file before it)."""

    def __init__(self, f: Any, slot: Slot, on_read: Callable[[], None] | None = None) -> None:
        self.file, self.slot, self._on_read = f, slot, on_read

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.slot.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.slot.dtype

    def tensor(self) -> torch.Tensor:
        out = torch.empty(self.slot.shape, dtype=self.slot.dtype)
        self._read(out)
        return out

    def into(self, dst: torch.Tensor) -> None:
        """Write this tensor into `dst` (same shape): straight from the file when `dst` is a
        contiguous CPU tensor of its dtype, else through a tensor of its own size."""
        if dst.dtype == self.slot.dtype and dst.device.type == "cpu" and dst.is_contiguous():
            self._read(dst)
        else:
            dst.copy_(self.tensor())

    def _read(self, dst: torch.Tensor) -> None:
        if self.slot.nbytes:
            view = memoryview(dst.reshape(-1).view(torch.uint8).numpy())
            _read_exact(self.file, self.slot.offset, view, str(getattr(self.file, "name", "the staging file")))
        if self._on_read is not None:  # the first read of this slice counts
            on_read, self._on_read = self._on_read, None
            on_read()
