"""Routing generate calls over the rollout servers: least in-flight + sticky sessions.

An episode's first turn goes to the server with the fewest requests in flight
(ties broken by fewest requests served, so idle servers take turns); its later
turns go to the same server, whose prefix cache still holds the conversation. The
session → server map is an LRU bounded by `rollout.max_sticky_sessions`, so a run
of millions of episodes does not grow it without bound; agent loops also release
their session when the episode ends.

A server that fails (its `generate` raises one of `failure_exceptions`:
connection, OS, timeout or runtime errors, the launcher's `ActorDied` among them) is taken out of rotation, its
sticky sessions are forgotten so they move to other servers, and the call is
retried elsewhere: a server death costs the episode one regenerated turn, never the
episode. Other exceptions (a `ValueError` for an over-long prompt, say) are the
request's fault and are raised to the caller without touching the server. An engine
that died (`EngineDeadError`, a `RuntimeError`: vLLM's engine core crashed or was
killed) is such a server failure: every call on it fails at once and moves on.

A failed server is restarted when the manager is given a `restart` callable: up to
`max_restarts` times per server name, the n-th attempt after
`restart_backoff_s * 2**(n-1)` seconds; a restarted server goes back into rotation
under its name. While a restart is pending and no server is left, calls wait for it.
When no server is left and none is being restarted, `NoServerAvailableError` is
raised, naming the last server's root cause (`root_cause`) so the run can stop with
it instead of failing episode after episode.

Servers are any objects with `async generate(*, request_id, prompt_ids,
sampling_params) -> GenerateResult`: an in-process `RolloutServer`, an adapter over
an actor's handle (`ActorServer`), or an HTTP client.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from cachetools import Cache, LRUCache

from areal_like.core.types import GenerateResult, SamplingParams

logger = logging.getLogger(__name__)

__all__ = [
    "GenerateServer",
    "ActorServer",
    "NoServerAvailableError",
    "RayServer",
    "ServerManager",
    "default_failure_exceptions",
    "error_headline",
]


class GenerateServer(Protocol):
    async def generate(
        self, *, request_id: str, prompt_ids: list[int], sampling_params: SamplingParams
    ) -> GenerateResult: ...


class NoServerAvailableError(RuntimeError):
    """Every server has failed or been removed (and none is being restarted); the
    episode cannot continue, and neither can the run. `root_cause` is the last
    failed server's error, first line first ("" when servers were only removed)."""

    def __init__(self, message: str, root_cause: str = "") -> None:
        super().__init__(message)
        self.root_cause = root_cause

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.root_cause))


def error_headline(error: BaseException) -> str:
    """`Type: message` of an error, or its `root_cause` when it carries one (an engine's
    own error behind `EngineDeadError`, a server's behind `NoServerAvailableError`)."""
    root = getattr(error, "root_cause", "")
    if isinstance(root, str) and root:
        return root
    msg = str(error).strip()
    first = msg.splitlines()[0] if msg else ""
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def default_failure_exceptions() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "this server is broken": the launcher's `ActorDied` (a dead
    actor) and `ActorCallError` (what the server raised could not travel) are
    RuntimeErrors, whichever launcher runs it."""
    return (ConnectionError, OSError, TimeoutError, RuntimeError, EOFError)


class ActorServer:
    """An actor's handle (`areal_like.launcher`, either launcher) of a `RolloutServer`
    seen as a plain async server.

    `handle.generate.remote(...)` returns an awaitable ref; a dead actor raises
    `ActorDied`, which the manager treats as a server failure; an error the server raised
    comes back as itself (a `ValueError` for a bad request stays the request's fault).
    """

    def __init__(self, handle: Any, name: str | None = None) -> None:
        self.handle = handle
        self.name = name

    async def generate(
        self, *, request_id: str, prompt_ids: list[int], sampling_params: SamplingParams
    ) -> GenerateResult:
        """A cancelled call aborts its request in the server: the local launcher does not
        carry a caller's cancellation to the actor's process (nor is Ray relied on to),
        and a request nobody awaits would hold a batch slot until its last token (a run's
        last evaluation queued behind the training answers its end had cancelled)."""
        try:
            return await self.handle.generate.remote(
                request_id=request_id, prompt_ids=prompt_ids, sampling_params=sampling_params
            )
        except asyncio.CancelledError:
            try:
                self.handle.abort.remote([request_id])  # fire and forget: the caller is gone
            except Exception:  # a gone actor has nothing to abort; the cancellation goes on
                pass
            raise


RayServer = ActorServer
"""The adapter's name from when only Ray ran servers."""


class _SessionLRU(LRUCache):  # type: ignore[misc]
    """session → server name, least recently used out first."""

    def sessions_of(self, name: str) -> list[str]:
        """The sessions on server `name`, leaving the recency order as it is."""
        return [s for s in list(self) if Cache.__getitem__(self, s) == name]


@dataclass
class _Slot:
    server: Any
    in_flight: int = 0
    served: int = 0


class ServerManager:
    """Picks a server per call; see the module docstring for the policy."""

    def __init__(
        self,
        servers: Iterable[Any] | Mapping[str, Any] = (),
        *,
        max_sticky_sessions: int = 10_000,
        failure_exceptions: tuple[type[BaseException], ...] | None = None,
        on_server_failure: Callable[[str, BaseException], None] | None = None,
        restart: Callable[[str, BaseException], Awaitable[Any]] | None = None,
        max_restarts: int = 0,
        restart_backoff_s: float = 5.0,
        explain: Callable[[BaseException], str] | None = None,
    ) -> None:
        if max_sticky_sessions < 1:
            raise ValueError("max_sticky_sessions must be >= 1")
        if max_restarts < 0 or restart_backoff_s < 0:
            raise ValueError("max_restarts and restart_backoff_s must be >= 0")
        self.max_sticky_sessions = max_sticky_sessions
        self.failure_exceptions = failure_exceptions or default_failure_exceptions()
        self.on_server_failure = on_server_failure
        self.restart = restart
        """`await restart(name, error)` -> a new server for `name` (or raises)."""
        self.max_restarts = max_restarts
        self.restart_backoff_s = restart_backoff_s
        self.explain = explain
        self.on_none_left: Callable[[NoServerAvailableError], None] | None = None
        """Called once a failure leaves no server in rotation and none being restarted (a
        death found by a weight update or a health poll, not only by a generate call): the
        run stops now, not at the next episode, which may never come."""
        """`explain(error)`: what to change when that error killed a server (the memory
        settings for an out-of-memory kill), or "": added to the root cause."""
        self._slots: dict[str, _Slot] = {}
        self._sticky: _SessionLRU = _SessionLRU(maxsize=max_sticky_sessions)
        self._next_name = 0
        self._restarting: dict[str, asyncio.Task[None]] = {}
        self._closing = False
        """The run is ending (`begin_close`): a server that fails now is not restarted."""
        self._restart_attempts: dict[str, int] = {}
        self.last_error: BaseException | None = None
        """The last server failure: the root cause when no server is left."""
        self.num_failures = 0
        self.num_retries = 0
        self.num_restarts = 0
        items = servers.items() if isinstance(servers, Mapping) else ((None, s) for s in servers)
        for name, server in items:
            self.add_server(server, name=name)

    # --- membership -------------------------------------------------------------------

    def add_server(self, server: Any, name: str | None = None) -> str:
        """Put a server into rotation; returns its name (generated if not given)."""
        if name is None:
            name = getattr(server, "name", None) or f"server-{self._next_name}"
            self._next_name += 1
        if name in self._slots:
            raise ValueError(f"server {name!r} is already registered")
        self._slots[name] = _Slot(server)
        return name

    def remove_server(self, name: str) -> None:
        """Take a server out of rotation. Calls already on it finish there; its sessions move."""
        if self._slots.pop(name, None) is None:
            raise KeyError(f"no server named {name!r}; servers: {sorted(self._slots)}")
        for session in self._sticky.sessions_of(name):
            del self._sticky[session]

    async def drain(self, name: str, timeout_s: float) -> int:
        """Take a server out of rotation for good (an elastic pool shrinking, never a
        failure): no new episode or later turn goes to it (its sessions move), and the calls
        already on it may finish there for up to `timeout_s`. Returns how many were still
        running then: the caller stops the server, and each of those calls fails over to
        another server as after a death (the turn is generated again there), uncounted,
        because the server is no longer this manager's."""
        slot = self._slots.get(name)
        if slot is None:
            raise KeyError(f"no server named {name!r} in rotation; servers: {sorted(self._slots)}")
        self.remove_server(name)
        self._restart_attempts.pop(name, None)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while slot.in_flight > 0 and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return slot.in_flight

    @property
    def server_names(self) -> list[str]:
        return list(self._slots)

    @property
    def restarting(self) -> list[str]:
        """Servers being restarted (out of rotation until they are back)."""
        return list(self._restarting)

    def in_flight(self) -> dict[str, int]:
        return {name: slot.in_flight for name, slot in self._slots.items()}

    def release_session(self, session_id: str) -> None:
        """Forget a finished episode's server (the LRU bound is only the safety net)."""
        self._sticky.pop(session_id, None)

    def metrics(self) -> dict[str, float]:
        return {
            "servers": float(len(self._slots)),
            "sticky_sessions": float(len(self._sticky)),
            "in_flight": float(sum(s.in_flight for s in self._slots.values())),
            "server_failures": float(self.num_failures),
            "generate_retries": float(self.num_retries),
            "server_restarts": float(self.num_restarts),
            "servers_restarting": float(len(self._restarting)),
        }

    # --- routing ----------------------------------------------------------------------

    def _pick(self, session_id: str) -> str:
        name = self._sticky.get(session_id)  # a hit is the most recently used now
        if name is not None and name in self._slots:
            return name
        if not self._slots:
            raise self._none_left() from self.last_error
        name = min(self._slots, key=lambda n: (self._slots[n].in_flight, self._slots[n].served))
        self._sticky[session_id] = name  # the least recently used goes when it is full
        return name

    def none_left(self) -> NoServerAvailableError | None:
        """The error every call would now raise when no server is in rotation and none is
        being restarted (the run cannot go on); None while one serves or restarts."""
        return self._none_left() if not self._slots and not self._restarting else None

    def _none_left(self) -> NoServerAvailableError:
        if self.last_error is None:
            return NoServerAvailableError("no rollout server is available (all were removed)")
        root = error_headline(self.last_error)
        fix = self.explain(self.last_error) if self.explain is not None else ""
        if fix:
            root = f"{root}: {fix}"
        return NoServerAvailableError(f"{root} (no rollout server is left: all failed)", root_cause=root)

    async def _pick_or_wait(self, session_id: str) -> str:
        """`_pick`, waiting for a pending restart when no server is in rotation."""
        while not self._slots and self._restarting:
            await asyncio.wait(list(self._restarting.values()), return_when=asyncio.FIRST_COMPLETED)
        return self._pick(session_id)

    def mark_failed(self, name: str, error: BaseException) -> None:
        """Take a server that failed outside `generate` (a weight update, a health
        check) out of rotation, exactly as a failed call would."""
        slot = self._slots.get(name)
        if slot is not None:
            self._fail(name, slot, error)

    def _fail(self, name: str, slot: _Slot, error: BaseException) -> None:
        if self._slots.get(name) is not slot:
            return  # another call already took it out
        self.num_failures += 1
        self.last_error = error
        (logger.info if self._closing else logger.warning)(
            "rollout server %s failed (%s); taking it out of rotation", name, error_headline(error)
        )
        self.remove_server(name)
        if self.on_server_failure is not None:
            self.on_server_failure(name, error)
        if self._closing:
            logger.info("rollout server %s: not restarted, the run is ending", name)
        elif self.restart is not None and self._restart_attempts.get(name, 0) < self.max_restarts:
            self._restarting[name] = asyncio.get_running_loop().create_task(
                self._restart(name, error), name=f"restart-{name}"
            )
        elif self.restart is not None and self.max_restarts:
            logger.error(
                "rollout server %s: its %d restart(s) are spent; it stays down", name, self.max_restarts
            )
        self._say_if_none_left()

    def _say_if_none_left(self) -> None:
        left = None if self._closing else self.none_left()
        if left is not None and self.on_none_left is not None:
            self.on_none_left(left)

    async def _restart(self, name: str, error: BaseException) -> None:
        """Restart attempts for `name` with exponential backoff, within the budget."""
        assert self.restart is not None
        try:
            while self._restart_attempts.get(name, 0) < self.max_restarts:
                attempt = self._restart_attempts[name] = self._restart_attempts.get(name, 0) + 1
                delay = self.restart_backoff_s * 2 ** (attempt - 1)
                logger.warning(
                    "restarting rollout server %s in %.1fs (attempt %d of %d)",
                    name,
                    delay,
                    attempt,
                    self.max_restarts,
                )
                await asyncio.sleep(delay)
                try:
                    server = await self.restart(name, error)
                except Exception as e:  # a failed restart is one spent attempt, not the run's end
                    error = self.last_error = e
                    logger.error("restarting rollout server %s failed: %s", name, error_headline(e))
                    continue
                self.add_server(server, name=name)
                self.num_restarts += 1
                logger.warning("rollout server %s is back in rotation (restart %d)", name, attempt)
                return
            logger.error(
                "rollout server %s: its %d restart(s) are spent; it stays down", name, self.max_restarts
            )
        finally:
            self._restarting.pop(name, None)
        self._say_if_none_left()

    def begin_close(self) -> None:
        """The run is ending: no server is restarted from now on (one that fails is only
        taken out of rotation), and pending restarts are cancelled."""
        self._closing = True
        for t in self._restarting.values():
            t.cancel()

    async def close(self) -> None:
        """Cancel pending restarts (the run is ending)."""
        self.begin_close()
        tasks = list(self._restarting.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def generate(
        self,
        *,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: SamplingParams,
        session_id: str | None = None,
    ) -> GenerateResult:
        """Generate on the session's server (`session_id`, default `request_id`), failing over.

        The turn is retried on another server after a server failure, until it
        succeeds or no server is left.
        """
        session = session_id or request_id
        while True:
            name = await self._pick_or_wait(session)
            slot = self._slots[name]
            slot.in_flight += 1
            slot.served += 1
            try:
                return await slot.server.generate(
                    request_id=request_id, prompt_ids=prompt_ids, sampling_params=sampling_params
                )
            except self.failure_exceptions as e:
                if isinstance(e, NoServerAvailableError):
                    raise
                self._fail(name, slot, e)
                self.num_retries += 1
            finally:
                slot.in_flight -= 1
