"""The trainer's driver never imports torch on the quickstart (docs/design.md §10.34): its
2 s of a core were on the start-up's critical path, and the workers hold every tensor.
A real `areal-like run` of 3 steps (evaluation, checkpoint and export included), with an
import hook in the driver that records the first import of torch and where it came from."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HOOK = """
import atexit, runpy, sys, traceback
first = []
class Hook:
    def find_spec(self, name, path, target=None):
        if name == "torch" and not first:
            first.append("".join(traceback.format_stack(limit=40)))
        return None
sys.meta_path.insert(0, Hook())
atexit.register(lambda: print("DRIVER TORCH:", first[0] if first else "never", flush=True))
sys.argv = ["areal-like"] + sys.argv[1:]
runpy.run_module("areal_like.orchestration.cli", run_name="__main__")
"""


def test_the_quickstart_driver_never_imports_torch(tmp_path: Path) -> None:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
           "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", HOOK, "run", "configs/quickstart.yaml", "--set", "train.total_steps=3",
                          "--set", "eval.every_n_steps=2", "--set", "run.checkpoint_every_n_steps=2",
                          "--set", f"run.dir={tmp_path / 'run'}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = out.stdout[out.stdout.index("DRIVER TORCH:"):]
    assert line.startswith("DRIVER TORCH: never"), line
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()


def test_what_the_rollout_sides_event_loop_imports_is_torch_free() -> None:
    """`areal-like rollout` runs its controller in the CLI's own process, which never needs
    torch. An import of torch inside its event loop (the first weight update once reached
    `weight_sync.meta`) stalls the loop for 2 s or more, and a trainer with a short
    `transport.peer_dead_s` declared the side lost. This pins the modules it imports (and
    the weight-sync names it reads) torch-free; the slow suite's resume tests
    (tests/test_lifecycle_processes.py, weight sync under 2 s) catch an import inside a call."""
    code = ("import sys\n"
            "import weight_sync\n"
            "from weight_sync.base import NotAMemberError, TransferStats, WeightSyncError\n"
            "import areal_like.orchestration.server_pool, areal_like.orchestration.rollout_controller\n"
            "import train_cluster.worker_group\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False"]
