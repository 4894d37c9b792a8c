"""Actors as plain processes, for the single-machine default (`cluster.launcher: local`).

Ray costs the embedded quickstart about ten seconds before its first step: its own
daemons start, then every actor is a fresh interpreter that imports torch and
transformers again, one after the other (docs/benchmarks.md, start-up). On one machine
none of that is needed. This module gives the same actor bodies (`_TrainWorker`,
`RolloutSide`, `ServerActor`) processes of their own without Ray:

- a **zygote** process starts first and imports the heavy modules once; every actor is
  `fork()`ed from it on request, so a new actor costs milliseconds, not an import;
  the zygote is single-threaded when it forks, so the child is clean;
- an actor talks to whoever asked for it over a Unix socket pair (the requester's end
  never leaves this machine): calls and results are pickled frames between two of our
  own processes, never a network peer (network wires stay msgpack, docs/design.md §9.7);
  the zygote forks only for processes of its own user (SO_PEERCRED), and a requester
  talks only to a zygote of its own user;
- the handle has the face every launcher's has (`areal_like/launcher/base.py`):
  `handle.method.remote()` returns a ref that is awaitable (asyncio) or resolved with
  `get`/`wait`; a method that raised re-raises its own exception in the caller; an
  actor whose process is gone fails every pending and later call with `ActorDied`;
- any process may ask the zygote for an actor (the rollout controller starts its
  servers this way, a restart too), by the zygote's socket address;
- fate: an actor exits when its requester's end closes (the requester died or killed
  it), the zygote when the process that started it goes.

This module is the caller's side; what runs in the zygote and in each actor is in
`areal_like.launcher.local_process`.

`Zygote` is the local launcher (`LocalLauncher`): the same `spawn`, `place`, `kill`,
`shutdown` as `RayLauncher`, so the worker group and the server pool are written once
for both.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import logging
import os
import pickle
import signal
import socket
import struct
import subprocess
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from areal_like.launcher.base import (
    ActorDied,
    ActorDiedError,
    Placement,
    Ref,
    get,
    is_actor_death,
    kill,
    wait,
)
from areal_like.launcher.early import PRELOAD, adopt, popen
from areal_like.launcher.local_process import peer_uid, recv_exact

__all__ = ["ActorDied", "ActorDiedError", "LocalActor", "LocalLauncher", "LocalRef", "Zygote", "get", "wait", "kill",
           "is_actor_death"]

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------
# the caller's side
# ---------------------------------------------------------------------------------------
class LocalRef(Ref):
    """The pending result of one call to a local actor."""

    def __init__(self, future: concurrent.futures.Future[Any]) -> None:
        self.future = future

    def __await__(self) -> Any:
        return asyncio.wrap_future(self.future).__await__()

    @classmethod
    def _get_many(cls, refs: list[Any], timeout: float | None) -> list[Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        out = []
        for r in refs:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                out.append(r.future.result(timeout=left))
            except concurrent.futures.TimeoutError:
                raise TimeoutError(f"no result within {timeout}s") from None
        return out

    @classmethod
    def _wait_many(cls, refs: list[Any], num_returns: int, timeout: float | None) -> tuple[list[Any], list[Any]]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            done = [r for r in refs if r.future.done()]
            if len(done) >= num_returns or (deadline is not None and time.monotonic() >= deadline):
                done = done[:num_returns]
                return done, [r for r in refs if r not in done]
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            concurrent.futures.wait([r.future for r in refs if not r.future.done()], timeout=left,
                                    return_when=concurrent.futures.FIRST_COMPLETED)


class _Method:
    def __init__(self, actor: LocalActor, name: str) -> None:
        self.actor, self.actor_name = actor, name

    def remote(self, *args: Any, **kwargs: Any) -> LocalRef:
        return self.actor._call(self.actor_name, args, kwargs)


class LocalActor:
    """A handle of an actor process (module docstring)."""

    def __init__(self, sock: socket.socket, pid: int, name: str) -> None:
        self._sock = sock
        self._conn = Connection(sock.detach())
        self.actor_pid = pid
        self.actor_name = name
        self._ids = itertools.count(1)
        self._pending: dict[int, concurrent.futures.Future[Any]] = {}
        self._lock = threading.Lock()
        self._dead: str | None = None
        self._init_error: BaseException | None = None
        self._reader = threading.Thread(target=self._read, name=f"actor-{name}", daemon=True)
        self._reader.start()

    def __getattr__(self, name: str) -> _Method:  # the actor's methods (this handle's own names start with _ or actor_)
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self, name)

    def __repr__(self) -> str:
        return f"LocalActor({self.actor_name}, pid {self.actor_pid})"

    def _call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> LocalRef:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._dead is not None:
                fut.set_exception(self._death())
                return LocalRef(fut)
            call_id = next(self._ids)
            self._pending[call_id] = fut
            try:
                self._conn.send_bytes(_call_frame("call", call_id, method, (args, kwargs)))
            except (OSError, EOFError) as e:
                self._pending.pop(call_id, None)
                fut.set_exception(ActorDied(f"actor {self.actor_name} (pid {self.actor_pid}) is gone: {e}"))
        return LocalRef(fut)

    def _read(self) -> None:
        why = "its process exited"  # killed, crashed, or out of memory
        try:
            while True:
                kind, call_id, value = pickle.loads(self._conn.recv_bytes())
                if call_id == 0:  # the constructor failed: every call, pending or later, fails with its error
                    self._init_error = value
                    with self._lock:
                        self._dead = "its constructor failed"
                        pending, self._pending = self._pending, {}
                    for fut in pending.values():
                        _settle(fut, False, value)
                    continue
                with self._lock:
                    fut = self._pending.pop(call_id, None)
                if fut is None:
                    continue
                _settle(fut, kind == "ok", value)
        except (EOFError, OSError) as e:
            if not isinstance(e, EOFError):
                why = f"{type(e).__name__}: {e}"
        except Exception as e:  # a frame we cannot read: the actor is unusable
            why = f"unreadable reply ({type(e).__name__}: {e})"
        with self._lock:
            self._dead = why
            pending, self._pending = self._pending, {}
            self._conn.close()  # only here, under the lock `_call` sends under
        for fut in pending.values():
            _settle(fut, False, self._death())

    def _death(self) -> BaseException:
        if self._init_error is not None:
            return self._init_error
        return ActorDied(f"actor {self.actor_name} (pid {self.actor_pid}) is gone: {self._dead}")

    def actor_kill(self) -> None:
        try:
            os.kill(self.actor_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        # Shut the socket down, do not close it: the reader thread may be about to read its
        # descriptor, and a closed number is soon another actor's socket (a reader here then
        # took that actor's replies). The reader sees the end and closes it itself.
        try:
            with socket.fromfd(self._conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _settle(fut: concurrent.futures.Future[Any], ok: bool, value: Any) -> None:
    """Complete a call's future, unless its caller cancelled it meanwhile (an asyncio
    task awaiting it was cancelled): setting a cancelled future raises, and in the reader
    thread that would leave every later reply unread."""
    try:
        fut.set_result(value) if ok else fut.set_exception(value)
    except concurrent.futures.InvalidStateError:
        pass


# ---------------------------------------------------------------------------------------
# the zygote
# ---------------------------------------------------------------------------------------
class Zygote:
    """The local launcher: a client of the zygote at `address` (a Linux abstract Unix
    socket name), which is also what `areal_like.launcher.connect` takes."""

    runtime: str | None = None  # plain processes: no runtime to bring up, nothing to place

    def __init__(self, address: str, proc: subprocess.Popen[bytes] | None = None) -> None:
        self.address = address
        self.proc = proc
        self._ready = proc is None

    @classmethod
    def start(cls, preload: tuple[str, ...] = PRELOAD) -> Zygote:
        """Start a zygote; it imports `preload` in the background while the caller goes on.
        The CLI's, started before it read its config (`early.prestart`), when there is one."""
        address, proc = adopt(preload) or popen(preload)
        return cls(address, proc)

    def _connect(self, timeout_s: float = 120.0) -> socket.socket:
        deadline = time.monotonic() + timeout_s
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect("\0" + self.address)
                if peer_uid(s) != os.getuid():  # a name anyone could take: trust only our own user's
                    s.close()
                    raise RuntimeError(f"the process at {self.address} is not this user's zygote")
                return s
            except (FileNotFoundError, ConnectionRefusedError):
                s.close()
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"the local actor zygote exited ({self.proc.returncode}) before it was "
                                       "ready; see the log above") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the local actor zygote was not ready within {timeout_s:.0f}s") from None
                time.sleep(0.02)

    def spawn(self, cls: type, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None, *, name: str,
              cpus: float = 0.0, gpus: float = 0.0, threads: int | None = None, env: dict[str, str] | None = None,
              stdio: str | None = None, placement: Placement | None = None, concurrency: int | None = None,
              record_calls: bool = True, zero_copy_tensors: bool = False) -> LocalActor:
        """A new actor process running `cls(*args, **kwargs)`, with `threads` torch threads;
        its stdout and stderr go to the file `stdio` when given. The resources, placement
        and call options of `Launcher.spawn` are Ray's business: one machine, no
        reservations, every async call runs at once, no call records."""
        kwargs = kwargs or {}
        target = f"{cls.__module__}:{cls.__qualname__}"
        init = _call_frame("init", 0, target, (args, kwargs))  # refuses what cannot travel, here
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        req = self._connect()
        try:
            head = json.dumps({"name": name, "threads": threads, "env": env or {}, "stdio": stdio}).encode()
            socket.send_fds(req, [struct.pack("!I", len(head)) + head], [theirs.fileno()])
            theirs.close()
            pid = struct.unpack("!I", recv_exact(req, 4))[0]
        finally:
            req.close()
        actor = LocalActor(mine, pid, name)
        actor._conn.send_bytes(init)
        return actor

    async def aspawn(self, cls: type, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                     **options: Any) -> LocalActor:
        """`spawn` on a thread: it waits for the zygote (at first, for its imports)."""
        return await asyncio.to_thread(lambda: self.spawn(cls, args, kwargs, **options))

    def up(self) -> None:
        """Nothing to bring up: the zygote started with this launcher."""

    def place(self, name: str, bundles: list[dict[str, float]], strategy: str = "PACK") -> None:
        """Nothing to place: every actor is a process of this machine."""
        return None

    def remove(self, group: Any) -> None:
        pass

    def request_capacity(self, bundles: list[dict[str, float]]) -> None:
        """No autoscaler: this machine is what there is."""

    def kill(self, handle: Any) -> None:
        kill(handle)

    def shutdown(self) -> None:
        self.close()

    def close(self) -> None:
        """Stop the zygote this process started (its actors go when their callers do)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except Exception:
            self.proc.kill()


def _call_frame(kind: str, call_id: int, target: str, payload: tuple[Any, ...]) -> bytes:
    """One call (or the constructor, `init`) to an actor: a plain header around the
    arguments, which travel by cloudpickle, as Ray sends them: a function defined in
    `__main__`, a notebook cell, a lambda or a closure reaches the actor by value
    (docs/design.md §10.15). The header always decodes, so a payload the actor cannot
    rebuild fails that one call with its own error."""
    return pickle.dumps((kind, call_id, target, by_value(payload)), protocol=5)


def by_value(obj: Any) -> bytes:
    """`cloudpickle.dumps(obj)`, keeping each function's source file name: cloudpickle
    writes `<dynamic-code>` instead, and a user's error must name the user's file
    (`my_task/reward.py:12: KeyError: 'q'`, docs/design.md §10.12)."""
    import io

    buf = io.BytesIO()
    _pickler()(buf, protocol=5).dump(obj)
    return buf.getvalue()


_PICKLER: Any = None


def _pickler() -> Any:
    global _PICKLER
    if _PICKLER is None:
        import types
        from collections import ChainMap

        import cloudpickle

        code_reduce = getattr(cloudpickle.cloudpickle, "_code_reduce", None)
        if code_reduce is None:  # another cloudpickle: names are lost, nothing else
            _PICKLER = cloudpickle.Pickler
            return _PICKLER

        def keep_filename(code: types.CodeType) -> Any:
            fn, args = code_reduce(code)
            return fn, tuple(code.co_filename if isinstance(a, str) and a == "<dynamic-code>" else a for a in args)

        class _Pickler(cloudpickle.Pickler):  # type: ignore[misc, name-defined]
            dispatch_table = ChainMap({types.CodeType: keep_filename}, cloudpickle.Pickler.dispatch_table)

        _PICKLER = _Pickler
    return _PICKLER


LocalLauncher = Zygote
"""The local launcher (the zygote's client is all it needs)."""


