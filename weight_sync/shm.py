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
checksum, and votes (docs/design.md §10.31). The sender never rewrites the file before the transfer's commit vote has
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
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["SenderLane", "ShmProbe", "ShmReader", "ShmStaging", "remove_stale"]

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
    """Receiver side: reads the sender's staging file into this side's buffer with
    `read` calls, never a mapping: a mapping's pages count in this process's resident
    memory (a second copy of every version), the page cache's do not."""

    _CHUNK = 64 << 20

    def read_into(self, path: str, size: int, dst: torch.Tensor) -> None:
        """The first `size` bytes of `path` into the uint8 CPU tensor `dst`."""
        view = memoryview(dst.numpy()).cast("B")[:size]
        with open(path, "rb", buffering=0) as f:
            have = os.fstat(f.fileno()).st_size
            if have < size:
                raise OSError(f"{path} holds {have} bytes, the transfer needs {size}")
            done = 0
            while done < size:
                n = f.readinto(view[done:done + self._CHUNK])
                if not n:
                    raise OSError(f"{path} ended at byte {done} of {size}")
                done += n

    def close(self) -> None:
        """Nothing is held between versions."""
