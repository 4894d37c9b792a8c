"""Receiver processes for the dist tests: a fake engine that records what it loaded.

Each worker gets wire-encoded metas on its inbox (the orchestrator's role) and answers
with the sha256 of every tensor it was handed, so the test checks bytes independently
of the transport's own checksum. `fault=("exit" | "hang", version, n)` kills the
process (os._exit) or stalls it for `hang_s` at its n-th collective call of that
version: a receiver dying or hanging mid-transfer. `expected` is the engine's spec.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from typing import Any

import torch


def tensor_digest(t: torch.Tensor) -> str:
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}:{hashlib.sha256(raw).hexdigest()}"


class _DyingGroup:
    """Wraps a process group; exits the process at a chosen collective call."""

    def __init__(self, group: Any, state: dict[str, Any]) -> None:
        self._group, self._state = group, state

    def _tick(self) -> None:
        kind, version, call = self._state["fault"]
        if self._state["version"] == version:
            self._state["calls"] += 1
            if self._state["calls"] == call and kind == "exit":
                os._exit(17)
            if self._state["calls"] == call and kind == "hang":
                time.sleep(self._state["hang_s"])

    def broadcast(self, *args: Any) -> Any:
        self._tick()
        return self._group.broadcast(*args)

    def allreduce(self, *args: Any) -> Any:
        self._tick()
        return self._group.allreduce(*args)

    def abort(self) -> None:
        self._group.abort()


def receiver_main(
    receiver_id: str,
    store_addr: str | None,
    inbox: Any,
    outbox: Any,
    timeout_s: float,
    fault: tuple[str, int, int] | None = None,
    expected: list[dict[str, Any]] | None = None,
) -> None:
    logging.basicConfig(level=logging.INFO, format=f"[{receiver_id}] %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    from areal_like.core import wire
    from areal_like.core.config import DistWeightSyncConfig
    from areal_like.core.types import TensorMeta, WeightUpdateMeta
    from weight_sync import DistWeightReceiver, WeightSyncError
    from weight_sync import dist as dist_mod

    state: dict[str, Any] = {"fault": fault, "version": None, "calls": 0, "hang_s": 2 * timeout_s}
    if fault is not None:
        make_group = dist_mod._make_group
        dist_mod._make_group = lambda *a, **k: _DyingGroup(make_group(*a, **k), state)  # type: ignore[assignment]

    cfg = DistWeightSyncConfig(type="dist", timeout_s=timeout_s, store_addr="127.0.0.1:0")
    spec = None if expected is None else [TensorMeta.model_validate(m) for m in expected]
    receiver = DistWeightReceiver(cfg, receiver_id, expected=spec)
    if store_addr is not None:
        receiver.connect(store_addr)
    outbox.put({"id": receiver_id, "event": "started"})
    loaded: int | None = None
    while True:
        frame = inbox.get()
        if frame == b"stop":
            break
        meta = wire.decode(frame, expect=WeightUpdateMeta)
        state["version"], state["calls"] = meta.version, 0
        try:
            version, named = receiver.receive(meta)
            digests = {name: tensor_digest(t) for name, t in named}
            loaded = version
            outbox.put(
                {
                    "id": receiver_id,
                    "ok": True,
                    "version": loaded,
                    "digests": digests,
                    "gen": receiver.generation,
                }
            )
        except WeightSyncError as e:
            outbox.put(
                {"id": receiver_id, "ok": False, "version": loaded, "error": str(e), "kind": type(e).__name__}
            )
    receiver.close()
