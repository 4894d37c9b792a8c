"""Benchmarks that cannot rot (#29, docs/benchmarks.md): every script in `bench/` (not the
`_` helpers) runs with `--smoke` (tiny sizes, the same code path) and ends with its JSON
record; the summary table of docs/benchmarks.md is what `scripts/bench_table.py` makes of
`bench/results/*.jsonl`.

The list of benchmarks is the directory listing, so a new script in `bench/` without a
smoke mode fails here. Smoke runs write under pytest's tmp_path (`AREAL_BENCH_SMOKE_DIR`),
never into the repository. The slowest ones start a whole quickstart run (or two); the
timeouts leave room for a loaded 2-core machine.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHES = sorted(p.name for p in (ROOT / "bench").glob("*.py") if not p.name.startswith("_"))
RECORD_KEYS = {"smoke", "command", "commit", "date", "other_cores"}
SMOKE_TIMEOUT_S = 420
BENCH_KEYS = {
    # #29's bar: our step cost against TRL's, both in the JSON (TRL's list is empty where its venv is absent)
    "vs_trl.py": {"ours_median_step_s", "trl_median_step_s", "step_cost_ratio_ours_over_trl",
                  "speedup_time_to_target_vs_trl"},
    # #29 item 4: the overlap bar and the monotone-in-η bar are read off these
    "async_vs_sync.py": {"fraction_of_overlap_ideal", "samples_per_s_non_decreasing",
                         "samples_per_s_non_decreasing_beyond_noise", "speedup_by_eta",
                         "overlap_ideal", "two_pool_ideal"},
    # the long-tailed step the length-cut forward is measured on (docs/benchmarks.md, per-step profile)
    "train_step.py": {"step_time_s", "tail_cap", "max_len", "shared_prompts", "mini_batch_split"},
    # #29: both lanes measured (same-host shared memory, and the broadcast other hosts get)
    "weight_sync.py": {"ratio_to_raw_broadcast", "broadcast_lane_ratio_to_raw_broadcast",
                       "verified_raw_ratio_to_raw_broadcast"},
    # #34: the paired test per η
    # the smoke evaluates along the run, and its objective is a --variant
    "staleness_ablation.py": {"paired", "paired_diff", "table", "plot_curves", "variants"},
}


def _results_state() -> dict[str, int]:
    d = ROOT / "bench" / "results"
    return {p.name: p.stat().st_size for p in d.glob("*")} if d.is_dir() else {}


def _run(cmd: list[str], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """`cmd` in its own session; on timeout the whole session is killed (runs, servers, Ray)."""
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"{' '.join(cmd)} ran past {timeout_s:.0f} s\n--- stderr (tail) ---\n{err[-4000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def test_there_are_benchmarks() -> None:
    assert len(BENCHES) >= 10, BENCHES


@pytest.mark.timeout(SMOKE_TIMEOUT_S + 60)
@pytest.mark.parametrize("script", BENCHES)
def test_bench_smoke(script: str, tmp_path: Path) -> None:
    before = _results_state()
    env = {**os.environ, "AREAL_BENCH_SMOKE_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    p = _run([sys.executable, f"bench/{script}", "--smoke"], env, SMOKE_TIMEOUT_S)
    where = f"bench/{script} --smoke (exit {p.returncode})\n--- stderr (tail) ---\n{p.stderr[-4000:]}"
    assert p.returncode == 0, where
    lines = p.stdout.strip().splitlines()
    assert lines, f"no stdout: {where}"
    try:
        rec = json.loads(lines[-1])
    except json.JSONDecodeError:
        pytest.fail(f"the last stdout line is not JSON: {lines[-1][:500]!r}\n{where}")
    assert isinstance(rec, dict)
    missing = RECORD_KEYS - set(rec)
    assert not missing, f"the JSON line lacks {sorted(missing)} (bench/_record.py adds them): {where}"
    assert rec["smoke"] is True
    assert f"bench/{script}" in rec["command"] and "--smoke" in rec["command"], rec["command"]
    assert rec["commit"] and rec["commit"] != "unknown", rec["commit"]
    assert datetime.datetime.fromisoformat(rec["date"]).utcoffset() == datetime.timedelta(0), rec["date"]
    assert isinstance(rec["other_cores"], (int, float)) and rec["other_cores"] >= 0, rec["other_cores"]
    assert _results_state() == before, "a smoke run must not write bench/results/"
    lacks = BENCH_KEYS.get(script, set()) - set(rec)
    assert not lacks, f"bench/{script}'s record lacks {sorted(lacks)}"
    if script == "vs_trl.py":
        assert all(isinstance(x, (int, float)) and x > 0 for x in rec["ours_median_step_s"]), rec["ours_median_step_s"]
    if script == "lora.py":  # #45: per rank, a version's bytes and load, and what the adapter costs a decode step
        assert all({"version_bytes", "load_s", "decode_step_s"} <= set(r) for r in rec["rows"].values()), rec
        assert all("decode_step_no_adapter_s" in r for n, r in rec["rows"].items() if n != "full"), rec


@pytest.mark.timeout(SMOKE_TIMEOUT_S + 60)
def test_vs_trl_runs_the_real_recipes_workload(tmp_path: Path) -> None:
    """#44 item 4: `--workload smollm2` runs the real recipe's settings (on the quickstart
    model in a smoke: nothing to fetch), both contenders saving every 2nd step."""
    env = {**os.environ, "AREAL_BENCH_SMOKE_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    p = _run([sys.executable, "bench/vs_trl.py", "--workload", "smollm2", "--smoke"], env, SMOKE_TIMEOUT_S)
    assert p.returncode == 0, p.stderr[-4000:]
    rec = json.loads(p.stdout.strip().splitlines()[-1])
    assert rec["workload"] == "smollm2" and rec["form"] == "chat", rec
    s = rec["settings"]
    assert (s["prompts_per_step"], s["samples_per_prompt"], s["response_length"], s["save_every"]) == (4, 4, 16, 2)
    assert "configs/smollm2.yaml" in s["ours"] and "cosine" in s["ours"], s["ours"]
    assert all(isinstance(x, (int, float)) and x > 0 for x in rec["ours_median_step_s"]), rec["ours_median_step_s"]
    assert [c["step"] for c in rec["runs"][0]["ours"]["eval_curve"]] == [2]  # saved every 2nd step


@pytest.mark.timeout(180)
def test_weight_sync_fails_fast_with_the_receivers_error(tmp_path: Path) -> None:
    """A receiver that dies before the rendezvous used to leave the parent waiting 120 s."""
    env = {**os.environ, "AREAL_BENCH_SMOKE_DIR": str(tmp_path), "AREAL_BENCH_WEIGHT_SYNC_FAIL": "1"}
    t0 = time.monotonic()
    p = _run([sys.executable, "bench/weight_sync.py", "--smoke"], env, 150)
    took = time.monotonic() - t0
    assert p.returncode != 0
    assert "receiver r0 failed" in p.stderr and "injected receiver failure" in p.stderr, p.stderr[-3000:]
    assert took < 60, f"took {took:.0f} s: the parent waited for a timeout instead of the receiver's error"
    assert not p.stdout.strip(), p.stdout


def _bench_table(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "scripts/bench_table.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.timeout(120)
def test_summary_table_is_generated_from_the_records() -> None:
    p = _bench_table("--check")
    assert p.returncode == 0, p.stderr[-6000:]


@pytest.mark.timeout(120)
def test_bench_table_shows_the_last_real_record(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    base = {"command": "python bench/weight_sync.py", "commit": "abc1234", "date": "2026-01-02T03:04:05+00:00",
            "other_cores": 0.02, "cpu_count": 2, "qwen2_100m": {"gb_per_s": 2.5}, "quickstart": {"transfer_s": 0.005}}
    lines = [{**base, "smoke": False, "ratio_to_raw_broadcast": 0.5},
             {**base, "smoke": False, "ratio_to_raw_broadcast": 0.913},
             {**base, "smoke": True, "ratio_to_raw_broadcast": 0.1},  # smoke lines are never shown
             {**base, "smoke": False, "background_cores": 0.5,  # nor a run beside a load it made itself
              "ratio_to_raw_broadcast": 0.2}]
    (results / "weight_sync.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    doc = tmp_path / "benchmarks.md"
    shutil.copy(ROOT / "docs" / "benchmarks.md", doc)
    assert _bench_table("--doc", str(doc), "--results", str(results), "--check").returncode == 1
    p = _bench_table("--doc", str(doc), "--results", str(results))
    assert p.returncode == 0, p.stderr
    row = next(line for line in doc.read_text().splitlines() if line.startswith("| weight sync |"))
    assert "`ratio_to_raw_broadcast` **0.913**" in row and "abc1234" in row and "2026-01-02T03:04:05" in row, row
    assert "0.02 of 2" in row and "`python bench/weight_sync.py`" in row, row
    assert "not re-measured" in next(line for line in doc.read_text().splitlines()
                                     if line.startswith("| async vs sync |"))
    assert _bench_table("--doc", str(doc), "--results", str(results), "--check").returncode == 0
    # a benchmark run on another config (the real model) adds a row; the default's stays
    start = {**base, "smoke": False, "first_step_s": 3.1, "command": "python bench/startup.py --repeats 3"}
    real = {**start, "first_step_s": 32.7, "command": "python bench/startup.py --config configs/smollm2.yaml"}
    (results / "startup.jsonl").write_text("".join(json.dumps(x) + "\n" for x in (start, real)))
    assert _bench_table("--doc", str(doc), "--results", str(results)).returncode == 0
    rows = [line for line in doc.read_text().splitlines() if line.startswith("| start-up") and "`first_step_s`" in line]
    assert len(rows) == 2 and "**3.1**" in rows[0] and rows[1].startswith("| start-up: configs/smollm2.yaml |")
    assert "**32.7**" in rows[1], rows
    # and one on another workload (vs_trl --workload smollm2)
    toy = {**base, "smoke": False, "speedup_time_to_target_vs_trl": 2.2, "command": "python bench/vs_trl.py --repeats 3"}
    smol = {**toy, "speedup_time_to_target_vs_trl": 1.6,
            "command": "python bench/vs_trl.py --workload smollm2 --repeats 3"}
    (results / "vs_trl.jsonl").write_text("".join(json.dumps(x) + "\n" for x in (toy, smol)))
    assert _bench_table("--doc", str(doc), "--results", str(results)).returncode == 0
    rows = [line for line in doc.read_text().splitlines() if line.startswith("| vs TRL") and "abc1234" in line]
    assert len(rows) == 2 and "**2.2**" in rows[0] and rows[1].startswith("| vs TRL: smollm2 |") and "**1.6**" in rows[1]
    # and one beside a bursty neighbour (#44 item 5): a row of its own, with the 3 % bar's flag
    quiet = {**base, "smoke": False, "speedup_eta2_vs_eta0": 1.8, "command": "python bench/async_vs_sync.py --etas 0,1,2,4"}
    bursty = {**quiet, "speedup_eta2_vs_eta0": 1.9, "samples_per_s_non_decreasing_3pct": False,
              "command": "python bench/async_vs_sync.py --etas 0,1,2,4 --background bursty"}
    (results / "async_vs_sync.jsonl").write_text("".join(json.dumps(x) + "\n" for x in (quiet, bursty)))
    assert _bench_table("--doc", str(doc), "--results", str(results)).returncode == 0
    rows = [line for line in doc.read_text().splitlines() if line.startswith("| async vs sync") and "abc1234" in line]
    assert len(rows) == 2 and "**1.8**" in rows[0] and rows[1].startswith("| async vs sync: bursty |"), rows
    assert "`samples_per_s_non_decreasing_3pct` **false**" in rows[1], rows


def test_the_bursty_neighbour_takes_a_core_half_of_each_second() -> None:
    """`bench/async_vs_sync.py --background bursty`'s load: one process, busy 0.5 s of CPU,
    then idle 0.5 s (its CPU time over 2.5 s is about half of it, never a whole core)."""
    import psutil

    sys.path.insert(0, str(ROOT / "bench"))
    from _runs import background_load

    with background_load(0, bursty=True):
        time.sleep(0.2)
        (child,) = psutil.Process().children()
        t0 = child.cpu_times()
        time.sleep(2.5)
        t1 = child.cpu_times()
    used = (t1.user + t1.system) - (t0.user + t0.system)
    assert 0.6 <= used <= 1.9, used  # ~1.25 s of a 2.5 s window: neither idle nor a steady core
