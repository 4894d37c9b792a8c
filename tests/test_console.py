"""What a person sees (issue #17 item 4): `areal-like run` is quiet by default — the
dashboard URL, the run folder and log file, one progress line per step (reward, eval,
lag, rate, ETA), our warnings and errors, the summary — and every process's own lines
are in `run.dir/run.log`; `--verbose` brings Ray's prefixed worker output back."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[1]


def _run(tiny_model_dir, run_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
    sets = [f"model.path={tiny_model_dir}", f"run.dir={run_dir}", "train.total_steps=3", "train.batch_size=2",
            "rollout.group_size=4", "rollout.response_length=24", "staleness.filter_uniform_groups=false",
            "eval.every_n_steps=2", "eval.num_samples=4"]
    args = [sys.executable, "-m", "areal_like.orchestration.cli", "run", "configs/quickstart.yaml",
            *[x for s in sets for x in ("--set", s)], *extra]
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)


@pytest.mark.parametrize("launcher", ["local", pytest.param("ray", marks=pytest.mark.slow)])  # Ray: the slow suite
def test_the_console_is_quiet_and_the_log_file_has_the_rest(tiny_model_dir, tmp_path, launcher) -> None:
    p = _run(tiny_model_dir, tmp_path / "run", "--set", f"cluster.launcher={launcher}")
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "pid=" not in out, out  # no Ray worker prefixes
    assert not re.search(r"(train\[0\]|server-0|rollout) (INFO|WARNING)", out), out  # nor local actors' lines
    assert not re.search(r"Warning|Loading weights|Started a local Ray", out), out
    assert re.search(r"^dashboard: http://127\.0\.0\.1:\d+/", out, re.M), out
    assert f"log: {tmp_path / 'run' / 'run.log'}" in out
    steps = [x for x in out.splitlines() if x.startswith("step ")]
    assert steps and steps[-1].startswith("step 3/3  reward ") and "ETA" in steps[-1] and "eval " in steps[-1], out
    assert len(out.splitlines()) < 20, out
    log = (tmp_path / "run" / "run.log").read_text()
    # what the console no longer shows: every process's own lines
    assert "train[0] INFO" in log and "server-0 INFO" in log and "rollout INFO" in log and "driver INFO" in log


@pytest.mark.parametrize("launcher", ["local", pytest.param("ray", marks=pytest.mark.slow)])  # Ray: the slow suite
def test_verbose_brings_the_workers_output_back(tiny_model_dir, tmp_path, launcher) -> None:
    p = _run(tiny_model_dir, tmp_path / "run", "--verbose", "--set", f"cluster.launcher={launcher}")
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "step 3/3" in out
    if launcher == "ray":
        assert "pid=" in out  # Ray's worker prefixes
    else:  # every actor process's own lines, tagged
        assert "train[0] INFO" in out and "server-0 INFO" in out and "rollout INFO" in out, out
