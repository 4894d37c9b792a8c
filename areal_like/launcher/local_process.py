"""The local launcher's own processes (areal_like/launcher/local.py is the caller's side):
the zygote, which imports the heavy modules once and forks an actor per request, and each
actor's main loop, which runs calls from its one requester and sends back results or the
actor's own exception. Started as `python -m areal_like.launcher.local_process ADDRESS
PRELOAD`; frames are pickled between two processes of one user over a Unix socket pair,
never a network wire (docs/design.md §10.15).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import inspect
import json
import os
import pickle
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from areal_like.launcher.base import ActorCallError


def peer_uid(s: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket (SO_PEERCRED)."""
    creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the zygote closed the connection")
        buf += chunk
    return buf


def _zygote_main(address: str, preload: list[str]) -> None:
    """Import `preload`, then fork one actor per request until stdin closes."""
    _set_process_name("zygote")
    _die_with_parent()  # stdin's end is read only after the imports: a driver killed during them
    # must not leave this process behind (the actors go when their callers do)
    for mod in preload:
        try:
            importlib.import_module(mod)
        except Exception as e:  # an optional module (no vLLM here): the actor imports what it needs
            print(f"zygote: could not preload {mod}: {e}", file=sys.stderr)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind("\0" + address)
    srv.listen(64)

    def reap(*_: Any) -> None:
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            pass

    signal.signal(signal.SIGCHLD, reap)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle (a graceful stop)
    # The process that started us is gone (stdin closed): stop forking.
    threading_free_watch = os.dup(0)
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(srv, selectors.EVENT_READ)
    sel.register(threading_free_watch, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            if key.fileobj is not srv:
                if not os.read(threading_free_watch, 4096):
                    os._exit(0)
                continue
            try:
                conn, _ = srv.accept()
            except InterruptedError:
                continue
            if peer_uid(conn) != os.getuid():  # only our own user's processes get an actor
                print("zygote: refused a request from another user", file=sys.stderr)
                conn.close()
                continue
            try:
                msg, fds, _, _ = socket.recv_fds(conn, 65536, 1)
                (n,) = struct.unpack("!I", msg[:4])
                head = json.loads(msg[4:4 + n])
            except Exception as e:
                print(f"zygote: bad request: {e}", file=sys.stderr)
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                sel.close()
                srv.close()
                conn.close()
                os.close(threading_free_watch)
                os.close(0)
                os.open(os.devnull, os.O_RDONLY)
                _actor_main(fds[0], head)
                os._exit(0)
            for fd in fds:
                os.close(fd)
            try:
                conn.sendall(struct.pack("!I", pid))
            except OSError:
                pass
            conn.close()


def _die_with_parent() -> None:
    """SIGKILL this process when the one that started it dies (Linux PR_SET_PDEATHSIG)."""
    parent = os.getppid()
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: stdin's end still stops it, after the imports
        return
    if os.getppid() != parent:  # it died before the call took effect
        os._exit(0)


def _set_process_name(name: str) -> None:
    """`areal-<name>` in ps/top (Linux keeps 15 bytes), as Ray names its actors `ray::<Class>`."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, f"areal-{name}"[:15].encode(), 0, 0, 0)  # PR_SET_NAME
    except Exception:  # not Linux, or no libc: the name is cosmetic
        pass


def _actor_main(fd: int, head: dict[str, Any]) -> None:
    """In the forked child: build the object, then serve calls until the caller goes."""
    _set_process_name(str(head.get("name", "actor")))
    os.environ.update(head.get("env") or {})
    if head.get("stdio"):  # Ray keeps an actor's prints in its logs; we keep them in the run's
        try:
            out = os.open(head["stdio"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError:  # no such folder here (`areal-like rollout` on a machine without the run
            pass  # folder): the actor keeps its requester's stdout and stderr, as its log lines do
        else:
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.close(out)
    try:
        os.setpgid(0, 0)  # a signal to the zygote's group is not one to us
    except OSError:
        pass
    conn = Connection(fd)
    threads = head.get("threads")
    if threads:
        import torch

        torch.set_num_threads(int(threads))
    try:
        _, _, target, payload = pickle.loads(conn.recv_bytes())
        args, kwargs = pickle.loads(payload)
        mod, qual = target.split(":")
        cls: Any = importlib.import_module(mod)
        for part in qual.split("."):
            cls = getattr(cls, part)
        obj = cls(*args, **kwargs)
    except EOFError:
        return
    except BaseException as e:
        _send(conn, ("err", 0, _portable(e)))
        # Read what the caller sent before it heard (a socket closed with unread data resets
        # the connection, and the caller could lose the error to the reset), then go.
        deadline = time.monotonic() + 2.0
        try:
            while conn.poll(max(0.0, deadline - time.monotonic())):
                conn.recv_bytes()
        except (EOFError, OSError):
            pass
        return
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    tasks: set[asyncio.Task[Any]] = set()
    # As Ray runs them: an actor with coroutine methods runs its plain methods on its event
    # loop too; one without runs every call, in order, on one thread of its own (so a
    # method may start its own event loop).
    is_async = any(inspect.iscoroutinefunction(v) for _, v in inspect.getmembers(type(obj)))
    worker = None if is_async else concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="actor")

    def reply(call_id: int, ok: bool, value: Any) -> None:
        _send(conn, ("ok" if ok else "err", call_id, value if ok else _portable(value)))

    def dispatch(msg: Any) -> None:
        if msg is None:  # the caller is gone
            loop.stop()
            return
        _, call_id, method, payload = msg
        try:
            # Decoded here, not by the reader thread: arguments that cannot be rebuilt in
            # this process fail this call with their error instead of silencing the actor.
            args, kwargs = pickle.loads(payload)
            fn = getattr(obj, method)
            if inspect.iscoroutinefunction(fn):
                async def run() -> None:
                    try:
                        reply(call_id, True, await fn(*args, **kwargs))
                    except BaseException as e:  # noqa: BLE001 - returned to the caller
                        reply(call_id, False, e)

                t = loop.create_task(run())
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            elif worker is not None:
                def run_sync() -> None:
                    try:
                        value = fn(*args, **kwargs)
                    except BaseException as e:  # noqa: BLE001 - returned to the caller
                        loop.call_soon_threadsafe(reply, call_id, False, e)
                        return
                    loop.call_soon_threadsafe(reply, call_id, True, value)

                worker.submit(run_sync)
            else:
                reply(call_id, True, fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - returned to the caller
            reply(call_id, False, e)

    def read() -> None:
        while True:
            try:
                msg = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                msg = None
            except Exception as e:  # a frame that is not ours: the caller is broken, so are we
                print(f"actor {head.get('name')}: unreadable call frame ({type(e).__name__}: {e})", file=sys.stderr)
                msg = None
            try:
                loop.call_soon_threadsafe(dispatch, msg)
            except RuntimeError:  # the loop is closed
                return
            if msg is None:
                return

    threading.Thread(target=read, name="actor-reader", daemon=True).start()
    loop.run_forever()
    os._exit(0)  # the caller is gone: so are we, whatever threads remain


_send_lock = threading.Lock()


def _send(conn: Connection, msg: Any) -> None:
    try:
        data = pickle.dumps(msg, protocol=5)
    except Exception as e:  # an unpicklable result: say so instead of hanging the caller
        data = pickle.dumps((msg[0] if msg[0] == "err" else "err", msg[1],
                             ActorCallError(f"result could not be returned: {type(e).__name__}: {e}")), protocol=5)
    with _send_lock:
        try:
            conn.send_bytes(data)
        except OSError:
            pass


def _portable(e: BaseException) -> BaseException:
    """The exception itself when it pickles (so the caller can catch its type), else an
    `ActorCallError` (a RuntimeError) with its text; either way with the actor's traceback
    as a note."""
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    try:
        pickle.loads(pickle.dumps(e))
        out = e
    except Exception:
        out = ActorCallError(f"{type(e).__name__}: {e}")
    try:
        out.add_note(f"in actor process {os.getpid()}:\n{tb}")
    except Exception:
        pass
    out.__traceback__ = None
    out.__cause__ = out.__context__ = None
    return out


if __name__ == "__main__":
    _zygote_main(sys.argv[1], [m for m in sys.argv[2].split(",") if m])
