"""A stop asked for by the user (Ctrl-C, SIGTERM), delivered where it is safe.

The CLI's signal handler raises `KeyboardInterrupt` in the main thread so that blocking
calls unwind. Inside a train step or a weight publish that would leave the trainer
between two states (the workers stepped, the buffer not yet told), so the controller
wraps those in `critical()`: a signal arriving there is remembered and raised as
`KeyboardInterrupt` when the section ends. A second signal always acts at once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["critical", "defer_now", "request"]

_lock = threading.Lock()
_depth = 0
_pending = False


def defer_now() -> bool:
    """Called by the signal handler: True if a critical section is running (the stop is
    then pending and raised at its end instead of now)."""
    global _pending
    with _lock:
        if _depth > 0:
            _pending = True
            return True
        return False


def request() -> None:
    """Ask for a stop from code (tests, the API): raised at the next safe point."""
    global _pending
    with _lock:
        _pending = True


@contextmanager
def critical() -> Iterator[None]:
    global _depth, _pending
    with _lock:
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            raise_now = _pending and _depth == 0
            if raise_now:
                _pending = False
        if raise_now:
            raise KeyboardInterrupt("stop requested during a train step")
