"""Throughput of the bubblewrap sandbox against a bare `python -I -c` subprocess.

Prints one JSON line (bench/_record.py): calls/s and mean latency, sequential and at
concurrency 4, for both, and the latency the sandbox adds per call. Not a test. Needs
bubblewrap (`bwrap`), as the sandbox does (`--smoke` without it: the bare side only, and
`"sandbox": "skipped: ..."`).

    PYTHONPATH=. .venv/bin/python bench/sandbox.py [--calls 50] [--concurrency 4]
    python bench/sandbox.py --smoke   # 3 calls each, concurrency 2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from rollout_cluster.sandbox import Sandbox, SandboxLimits

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _record  # noqa: E402

CODE = "print(sum(range(1000)))"
# The interpreter the sandbox runs (the base one, not the venv's), for a like-for-like baseline.
PYTHON = os.path.realpath(
    os.path.join(sys.base_prefix, "bin", f"python{sys.version_info[0]}.{sys.version_info[1]}")
)


async def bare() -> None:
    proc = await asyncio.create_subprocess_exec(
        PYTHON, "-I", "-c", CODE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={}
    )
    out, _ = await proc.communicate()
    assert out == b"499500\n", out


def sandboxed(sb: Sandbox) -> Callable[[], Awaitable[None]]:
    limits = SandboxLimits(wall_s=30)

    async def call() -> None:
        r = await sb.run(CODE, limits)
        assert r.stdout == "499500\n", r

    return call


async def measure(fn: Callable[[], Awaitable[None]], calls: int, concurrency: int) -> dict[str, float]:
    sem = asyncio.Semaphore(concurrency)
    lat: list[float] = []

    async def one() -> None:
        async with sem:
            t = time.perf_counter()
            await fn()
            lat.append(time.perf_counter() - t)

    start = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(calls)))
    total = time.perf_counter() - start
    return {"calls_per_s": round(calls / total, 1), "mean_ms": round(1000 * sum(lat) / len(lat), 1)}


async def main(calls: int, concurrency: int, with_sandbox: bool = True) -> dict[str, object]:
    sb = None
    if with_sandbox:
        sb = Sandbox()
        sb.prepare()
        await sandboxed(sb)()  # warm-up: runtime discovery
    await bare()
    res: dict[str, object] = {"calls": calls, "concurrency": concurrency}
    for label, conc in (("sequential", 1), (f"concurrency_{concurrency}", concurrency)):
        b = await measure(bare, calls, conc)
        if sb is None:
            res[label] = {"bare": b}
            continue
        s = await measure(sandboxed(sb), calls, conc)
        res[label] = {"bare": b, "sandbox": s, "added_ms_per_call": round(s["mean_ms"] - b["mean_ms"], 1)}
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--concurrency", type=int, default=4)
    a, rec = _record.parse(ap, __file__, smoke={"calls": 3, "concurrency": 2})
    # A smoke run on a machine without bubblewrap measures the bare side only and says so;
    # a real run needs it (the sandbox fails to start without it).
    have_bwrap = shutil.which("bwrap") is not None
    result: dict[str, object] = {"bench": "sandbox"}
    if a.smoke and not have_bwrap:
        result["sandbox"] = "skipped: bubblewrap (bwrap) not installed"
    result.update(asyncio.run(main(a.calls, a.concurrency, with_sandbox=have_bwrap or not a.smoke)))
    rec.finish(result)
