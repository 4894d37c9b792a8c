"""`areal-like eval RUN_DIR`: a run's saved versions evaluated after the run, as a user
runs it (two CLI processes). It scores the run's own held-out rows with the run's
per-episode sampling seeds, so every version the run evaluated while it trained gets
the same accuracy again; a run without saved weights, or a version it did not save,
gets one clear line and exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
       "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT)}

pytestmark = pytest.mark.timeout(300)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "areal_like.orchestration.cli", *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=240)


def _run(run_dir: Path, *extra: str) -> None:
    p = _cli("run", "configs/quickstart.yaml", "--set", f"run.dir={run_dir}", "--set", "train.total_steps=4",
             "--set", "train.batch_size=4", "--set", "eval.every_n_steps=2", "--set", "eval.num_samples=32",
             *[x for e in extra for x in ("--set", e)])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


def test_saved_versions_score_as_the_run_scored_them(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _run(run_dir, "run.record_weights=true")
    records = [r for r in map(json.loads, (run_dir / "metrics.jsonl").open()) if r["kind"] == "eval"]
    in_run = {r["version"]: r["accuracy"] for r in records}
    assert {0, 2, 4} <= set(in_run), in_run
    # An evaluation during training may be interrupted by the next update, and its answers
    # then end with the newer weights (its record says so in `max_token_version`): only
    # the evaluations that ran on their own version's weights throughout are comparable.
    # The last version's always is: no update comes after it.
    pure = {r["version"] for r in records if r["max_token_version"] == r["version"]}
    assert 4 in pure, records
    p = _cli("eval", str(run_dir), "--versions", "every:2")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "v2: held-out accuracy" in p.stdout and "v4: held-out accuracy" in p.stdout, p.stdout
    assert "v0:" not in p.stdout and "v1:" not in p.stdout  # every:2 takes 2, 4 (and the last)
    offline = [json.loads(x) for x in (run_dir / "offline_eval.jsonl").read_text().splitlines()]
    assert [r["version"] for r in offline] == [2, 4]
    for r in offline:
        # Same rows, same seeds, same weights: the same number (v2 was evaluated in the run
        # while training episodes shared the server, v4 at the end with it to itself).
        assert r["kind"] == "offline_eval" and r["num_samples"] == 32
        if r["version"] in pure:
            assert r["accuracy"] == in_run[r["version"]], (r, in_run)


def test_a_run_without_saved_weights_or_a_missing_version_is_one_clear_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _run(run_dir)
    p = _cli("eval", str(run_dir))
    assert p.returncode == 2 and "run.record_weights=true" in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    (run_dir / "weights" / "v3").mkdir(parents=True)
    (run_dir / "weights" / "v3" / "config.json").write_text("{}")
    p = _cli("eval", str(run_dir), "--versions", "3,7")
    assert p.returncode == 2 and "[7] not saved" in p.stderr and "v3..v3" in p.stderr, p.stderr[-2000:]
    p = _cli("eval", str(tmp_path / "nowhere"))
    assert p.returncode == 2 and "no config.yaml" in p.stderr, p.stderr[-2000:]
