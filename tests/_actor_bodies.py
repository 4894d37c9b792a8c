"""Actor bodies for tests/test_local_actors.py: the zygote imports them by module path."""

from __future__ import annotations

import asyncio
import os
import time


class Picky(ValueError):
    """An error type of our own: the caller must get it back as itself."""


class Echo:
    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.calls = 0

    def hello(self, x: int) -> str:
        self.calls += 1
        return f"{self.tag}:{x}:{self.calls}"

    def getpid(self) -> int:
        return os.getpid()

    def fail(self) -> None:
        raise Picky("bad input, said the actor")

    def sleep(self, s: float) -> float:
        time.sleep(s)
        return s

    def threads(self) -> int:
        import torch

        return torch.get_num_threads()


class AsyncEcho:
    def __init__(self) -> None:
        self.running = 0
        self.peak = 0

    async def nap(self, s: float) -> int:
        self.running += 1
        self.peak = max(self.peak, self.running)
        await asyncio.sleep(s)
        self.running -= 1
        return self.peak

    def getpid(self) -> int:
        return os.getpid()


class Apply:
    """Calls what it is handed: user callables must arrive by value (docs/design.md §10.15)."""

    def call(self, fn, *args):  # noqa: ANN001, ANN002, ANN201 - any callable, any arguments
        return fn(*args)

    def ping(self) -> str:
        return "pong"
