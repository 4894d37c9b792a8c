"""A step's time budget (issue #29 item 2): where the time between two step records goes.

`StepBudget` alone on a fake clock (phases, nesting, whole phases, renaming, splitting:
the parts always add up to the wall), then a real short `areal-like run` whose
metrics.jsonl carries the budget in every `train_step` record, which `areal-like report`
draws and the dashboard's JSON carries. No timing figure is asserted: only the structure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_like.core.metrics import MetricsRegistry, read_jsonl
from areal_like.orchestration.step_budget import ROLLOUT_PHASES, TRAINER_PHASES, StepBudget, budget_of

ROOT = Path(__file__).resolve().parents[1]


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _phases(taken: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in taken.items() if k != "budget_wall_s"}


def test_phases_add_up_to_the_wall_nested_renamed_and_split() -> None:
    clock = _Clock()
    b = StepBudget(clock=clock, wall_clock=clock)
    clock.t += 0.5  # nothing open: other
    with b.phase("wait_data") as wait:
        clock.t += 1.0
        with b.phase("drain"):  # takes its own time out of the wait
            clock.t += 0.25
        clock.t += 0.5
        wait.name = "wait_straggler"  # what it turned out to wait for
    with b.phase("train", whole=True):
        clock.t += 2.0
        with b.phase("drain"):  # inside a whole phase: still the train step's
            clock.t += 0.5
    b.split("train", {"train_fwd_bwd": 1.5, "train_optimizer": 0.5}, rest="train_other")
    with b.phase("checkpoint"):
        clock.t += 0.125
    taken = b.take()
    assert taken == {"budget_wall_s": 4.875, "budget_drain_s": 0.25, "budget_wait_straggler_s": 1.5,
                     "budget_train_fwd_bwd_s": 1.5, "budget_train_optimizer_s": 0.5, "budget_train_other_s": 0.5,
                     "budget_checkpoint_s": 0.125, "budget_other_s": 0.5}
    assert sum(_phases(taken).values()) == taken["budget_wall_s"]
    assert b.taken_at == clock.t

    clock.t += 1.0  # the next interval starts at the take
    with b.phase("train", whole=True):
        clock.t += 1.0
    b.split("train", {"train_fwd_bwd": 3.0, "train_optimizer": 1.0}, rest="train_other")  # claims too much: scaled
    again = b.take()
    assert again == {"budget_wall_s": 2.0, "budget_train_fwd_bwd_s": 0.75, "budget_train_optimizer_s": 0.25,
                     "budget_train_other_s": 0.0, "budget_other_s": 1.0}


def test_a_phase_still_open_at_the_take_is_split_there() -> None:
    clock = _Clock()
    b = StepBudget(clock=clock, wall_clock=clock)
    with b.phase("publish"):
        with b.phase("wait_broadcast"):
            clock.t += 1.0
            first = b.take()
            clock.t += 2.0
        clock.t += 0.5
    second = b.take()
    assert first == {"budget_wall_s": 1.0, "budget_wait_broadcast_s": 1.0, "budget_other_s": 0.0}
    assert second == {"budget_wall_s": 2.5, "budget_wait_broadcast_s": 2.0, "budget_publish_s": 0.5,
                      "budget_other_s": 0.0}


def test_budget_of_reads_a_record() -> None:
    rec = {"budget_wall_s": 1.0, "budget_drain_s": 0.25, "budget_other_s": 0.75, "rollout_budget_generate_s": 0.5,
           "step_time_s": 0.9, "budget_flag_s": True}
    assert budget_of(rec) == {"drain": 0.25, "other": 0.75}
    assert budget_of(rec, "rollout_budget_") == {"generate": 0.5}


@pytest.mark.timeout(300)
def test_a_real_run_records_reports_and_serves_its_budget(tiny_model_dir, tmp_path) -> None:
    run_dir = tmp_path / "run"
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
    sets = [f"model.path={tiny_model_dir}", f"run.dir={run_dir}", "train.total_steps=5", "train.batch_size=2",
            "rollout.group_size=4", "rollout.response_length=24", "staleness.filter_uniform_groups=false",
            "eval.every_n_steps=0", "eval.num_samples=4", "run.checkpoint_every_n_steps=2"]
    p = subprocess.run([sys.executable, "-m", "areal_like.orchestration.cli", "run", "configs/quickstart.yaml",
                        *[x for s in sets for x in ("--set", s)]],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]

    recs = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in recs if r["kind"] == "train_step"]
    assert len(steps) == 5
    known = {name for name, _ in TRAINER_PHASES}
    for i, r in enumerate(steps):
        phases = budget_of(r)
        assert set(phases) <= known, set(phases) - known
        assert {"train_fwd_bwd", "train_optimizer", "train_logprobs_prox", "other"} <= set(phases)
        assert all(v >= 0 for v in phases.values()), phases
        assert sum(phases.values()) == pytest.approx(r["budget_wall_s"], abs=1e-6)
        if i:  # the wall interval is the time between consecutive step records
            assert r["time"] - steps[i - 1]["time"] == pytest.approx(r["budget_wall_s"], abs=1e-3)
        rollout = budget_of(r, "rollout_budget_")
        assert set(rollout) == {name for name, _, _ in ROLLOUT_PHASES}
        assert all(v >= 0 for v in rollout.values()), rollout
    assert any(budget_of(r).get("checkpoint", 0) > 0 for r in steps)  # after step 2, in step 3's record
    assert sum(r["rollout_budget_generate_s"] for r in steps) > 0
    assert sum(r["rollout_budget_reward_s"] for r in steps) > 0
    # The rollout reports carry the cumulative counters the deltas come from.
    assert max(r.get("generate_seconds_total", 0) for r in recs if r["kind"] == "rollout") > 0

    from areal_like.orchestration.report import make_report

    _png, text = make_report(run_dir, tmp_path / "report")
    plot = tmp_path / "report" / "budget.png"
    assert plot.is_file() and plot.read_bytes().startswith(b"\x89PNG")
    assert "time budget per step" in text and "train: forward + backward" in text and "rollout servers" in text

    from areal_like.orchestration.dashboard import build_data

    d = json.loads(json.dumps(build_data(recs, MetricsRegistry())))
    last = steps[-1]
    assert d["budget"]["step"] == last["step"]
    assert d["budget"]["wall_s"] == pytest.approx(last["budget_wall_s"])
    assert d["budget"]["trainer"] == pytest.approx(budget_of(last))
    assert d["budget"]["rollout"] == pytest.approx(budget_of(last, "rollout_budget_"))
    assert [name for name in d["budget"]["labels"]["trainer"]] == [n for n, _ in TRAINER_PHASES]
    grouped = [p for g in d["budget"]["groups"] for p in g["phases"]]
    assert sorted(grouped) == sorted(d["budget"]["labels"]["rollout"]) == sorted(n for n, _, _ in ROLLOUT_PHASES)
