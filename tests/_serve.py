"""`areal-like serve` started as a user starts it: the process, and the base URL it prints."""

from __future__ import annotations

import queue
import re
import subprocess
import threading
from pathlib import Path

import pytest


def start_serve(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 120) -> tuple[
        subprocess.Popen[str], str]:
    """Run `args` (a serve command line); return the process and its `base_url`, or fail the
    test with the output when none is printed within `timeout` (the process is killed)."""
    proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    found: queue.Queue[str] = queue.Queue()
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"base_url: (http://\S+/v1)", line)
            if m:
                found.put(m.group(1))

    threading.Thread(target=pump, daemon=True).start()
    try:
        return proc, found.get(timeout=timeout)
    except queue.Empty:
        proc.kill()
        pytest.fail("areal-like serve printed no URL:\n" + "".join(lines)[-3000:])
