"""What code that calls actors needs, whoever started them: Ray, or the local launcher
(`areal_like/orchestration/local_actors.py`, docs/design.md §10.15).

A local actor's `handle.method.remote()` returns a `LocalRef` (awaitable, or resolved
with `get`/`wait`); a call to an actor whose process is gone fails with
`ActorDiedError`. `get`, `wait`, `kill` and `is_actor_death` take Ray's refs, handles
and errors too, so the worker group and the server pool are written once for both
launchers. Ray is imported only when a Ray object is passed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import time
from typing import Any

__all__ = ["ActorDiedError", "LocalRef", "get", "wait", "kill", "is_actor_death"]


class ActorDiedError(RuntimeError):
    """The actor's process is gone (killed, crashed or exited)."""


class LocalRef:
    """The pending result of one call to a local actor."""

    def __init__(self, future: concurrent.futures.Future[Any]) -> None:
        self.future = future

    def __await__(self) -> Any:
        return asyncio.wrap_future(self.future).__await__()


def _is_local(x: Any) -> bool:
    return isinstance(x, LocalRef)


def get(refs: Any, timeout: float | None = None) -> Any:
    """`ray.get` for local refs and Ray refs alike (a list gives a list)."""
    items = refs if isinstance(refs, list) else [refs]
    if items and not any(_is_local(r) for r in items):
        import ray

        return ray.get(refs, timeout=timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    out = []
    for r in items:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            out.append(r.future.result(timeout=left))
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"no result within {timeout}s") from None
    return out if isinstance(refs, list) else out[0]


def wait(refs: list[Any], num_returns: int = 1, timeout: float | None = None) -> tuple[list[Any], list[Any]]:
    """`ray.wait` for local refs and Ray refs alike."""
    if refs and not any(_is_local(r) for r in refs):
        import ray

        return ray.wait(refs, num_returns=num_returns, timeout=timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        done = [r for r in refs if r.future.done()]
        if len(done) >= num_returns or (deadline is not None and time.monotonic() >= deadline):
            done = done[:num_returns]
            return done, [r for r in refs if r not in done]
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        concurrent.futures.wait([r.future for r in refs if not r.future.done()], timeout=left,
                                return_when=concurrent.futures.FIRST_COMPLETED)


def kill(handle: Any) -> None:
    """Kill an actor, local or Ray's; one that is gone already is no error."""
    local_kill = getattr(type(handle), "actor_kill", None)
    if local_kill is not None:
        local_kill(handle)
        return
    import ray

    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # already gone
        pass


def is_actor_death(error: BaseException) -> bool:
    if isinstance(error, ActorDiedError):
        return True
    ray_exceptions = sys.modules.get("ray.exceptions")
    return ray_exceptions is not None and isinstance(error, ray_exceptions.RayActorError)
