"""What every launcher gives the code that starts and calls actors (docs/design.md §10.15).

A launcher (`LocalLauncher`: plain processes forked from a zygote; `RayLauncher`: Ray
actors) spawns an actor from a class (`spawn`, with its resources and placement), and
returns a handle whose methods are called as `handle.method.remote(*args)`. A call gives
a `Ref`: awaitable from asyncio, or resolved with `get`/`wait` (module functions here,
which take either launcher's refs). Whatever launcher ran it, a call fails with

- `ActorDied` when the actor's process is gone (killed, crashed, out of memory, its
  constructor failed to run at all): the caller's cue that the actor must be replaced;
- the actor's own exception, as itself (a `ValueError` stays one, so a caller can catch
  its type), with the actor's traceback as a note, when the method raised;
- `ActorCallError` when what the method raised cannot be rebuilt in the caller (it
  carries the original's `Type: message` text, and the original in `cause` when it
  came back at all);
- `TimeoutError` from `get` when a result did not come within its `timeout`.

Nothing outside this package knows which launcher runs or what its own error types are.
This module imports nothing heavy (no Ray, no torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["ActorCallError", "ActorDied", "ActorDiedError", "Launcher", "Placement", "Ref", "get", "is_actor_death",
           "kill", "wait"]


class ActorDied(RuntimeError):
    """The actor's process is gone (killed, crashed or exited): its calls cannot finish."""


ActorDiedError = ActorDied
"""The name this error had before the launcher package (kept for callers and pickles)."""


class ActorCallError(RuntimeError):
    """The actor's method raised an exception that cannot be rebuilt here: its text is
    this error's message; `cause` is the original when it travelled."""

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.cause = cause  # pickles with the instance's __dict__ (notes too)


@dataclass(frozen=True)
class Placement:
    """Where an actor goes: bundle `bundle` of a placement `group` (a launcher's `place`
    made it; -1: any bundle of it). A group of None places nothing (the local launcher's)."""

    group: Any = None
    bundle: int = -1

    @classmethod
    def of_rank(cls, group: Any, rank: int, world_size: int) -> Placement:
        """Rank `rank`'s own bundle when the group has one per rank, else any of its bundles."""
        per_rank = group is not None and len(getattr(group, "bundle_specs", ()) or ()) == world_size
        return cls(group, rank if per_rank else -1)


class Ref:
    """The pending result of one actor call (awaitable); each launcher's refs subclass it
    and resolve a list of their own kind in `_get_many` / `_wait_many`."""

    def __await__(self) -> Any:
        raise NotImplementedError

    @classmethod
    def _get_many(cls, refs: list[Any], timeout: float | None) -> list[Any]:
        raise NotImplementedError

    @classmethod
    def _wait_many(cls, refs: list[Any], num_returns: int, timeout: float | None) -> tuple[list[Any], list[Any]]:
        raise NotImplementedError


class Launcher(Protocol):
    """Starts, calls and stops actors (module docstring); `LocalLauncher` and `RayLauncher`."""

    runtime: str | None
    """The cluster runtime this launcher brings up, as a start-up phase name (`ray`), or
    None for plain processes (docs: `areal_like/orchestration/startup.py`)."""

    @property
    def address(self) -> str:
        """What another process passes to `areal_like.launcher.connect` to spawn actors
        through this launcher (the rollout controller's actor starts its servers so)."""
        ...

    def up(self) -> None:
        """Bring the runtime up now, if it is not (Ray: start or join it); idempotent."""
        ...

    def spawn(self, cls: type, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None, *, name: str,
              cpus: float = 0.0, gpus: float = 0.0, threads: int | None = None, env: dict[str, str] | None = None,
              stdio: str | None = None, placement: Placement | None = None, concurrency: int | None = None,
              record_calls: bool = True, zero_copy_tensors: bool = False) -> Any:
        """An actor running `cls(*args, **kwargs)`: `cpus`/`gpus` reserved for it, `threads`
        its torch/OMP threads, `env` added to its environment, its stdout and stderr to the
        file `stdio` (plain processes; Ray keeps its own logs), `placement` its bundle,
        `concurrency` how many calls may run at once (async actors), `record_calls=False`:
        keep no per-call record (Ray's task events), `zero_copy_tensors`: tensors in its
        arguments may be read in place (Ray's object store)."""
        ...

    async def aspawn(self, cls: type, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                     **options: Any) -> Any:
        """`spawn` from asyncio, without blocking the event loop where spawning blocks."""
        ...

    def place(self, name: str, bundles: list[dict[str, float]], strategy: str = "PACK") -> Any:
        """A placement group of `bundles`, ready (a `ConfigError` when it cannot be placed);
        None where the launcher places nothing (plain processes on this machine)."""
        ...

    def remove(self, group: Any) -> None:
        """Give back a group `place` made (None: nothing)."""
        ...

    def request_capacity(self, bundles: list[dict[str, float]]) -> None:
        """Ask the cluster's autoscaler for room for `bundles` (a pool's whole shape; each
        call replaces the one before, `[]` withdraws it). Plain processes: nothing to ask."""
        ...

    def kill(self, handle: Any) -> None:
        """Kill an actor; one that is gone already is no error."""
        ...

    def shutdown(self) -> None:
        """Stop what this launcher started (the zygote, the embedded Ray); not what it joined."""
        ...


def get(refs: Any, timeout: float | None = None) -> Any:
    """The result of one ref, or of each in a list (a list gives a list): see the module
    docstring for what a failed call raises."""
    items = refs if isinstance(refs, list) else [refs]
    if not items:
        return []
    out = type(items[0])._get_many(items, timeout)
    return out if isinstance(refs, list) else out[0]


def wait(refs: list[Any], num_returns: int = 1, timeout: float | None = None) -> tuple[list[Any], list[Any]]:
    """(done, pending): returns once `num_returns` of `refs` are done, or at `timeout`."""
    if not refs:
        return [], []
    return type(refs[0])._wait_many(list(refs), num_returns, timeout)


def kill(handle: Any) -> None:
    """Kill an actor of either launcher; one that is gone already is no error."""
    handle.actor_kill()


def is_actor_death(error: BaseException) -> bool:
    """Whether a call failed because its actor is gone (`ActorDied`)."""
    return isinstance(error, ActorDied)
