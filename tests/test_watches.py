"""What the console says as a run on a real model goes (docs/real_models.md, docs/design.md
§10.39–10.40): a rising share of answers cut by the length limit, once, with the settings to
look at; a task solved (an end) against a reward that never told answers apart (a failure);
and the end of a run: the last evaluation, the first and the best."""

from __future__ import annotations

import json

from areal_like.core.types import Trajectory, TrajectoryGroup
from areal_like.orchestration.console import eval_summary, final_evals
from areal_like.orchestration.watch import TruncationWatch


def _group(cut: list[bool]) -> TrajectoryGroup:
    trajs = [Trajectory(episode_id=f"e{i}", group_id="g", prompt_ids=[1], response_ids=[2], response_mask=[1],
                        response_logprobs=[-1.0], response_versions=[0], reward=float(i % 2), truncated=c)
             for i, c in enumerate(cut)]
    return TrajectoryGroup(group_id="g", trajectories=trajs)


def test_truncation_line_once_when_the_share_rises_then_again_after_it_fell() -> None:
    w = TruncationWatch(response_length=16, window=8, threshold=0.5, rise=0.25)
    assert w.group(_group([False] * 4)) is None
    assert w.group(_group([True, False, False, False])) is None  # the first window: 1 of 8
    line = w.group(_group([True] * 4))  # 5 of 8
    assert line is not None and "62% of the last 8 answers were cut by the length limit" in line
    assert "up from 12% at the start" in line
    assert "rollout.response_length=16" in line and "train.loss.mask_truncated=true" in line
    assert w.group(_group([True] * 4)) is None  # said once
    assert w.group(_group([False] * 4)) is None  # 4 of 8: not yet back down
    assert w.group(_group([False] * 4)) is None  # 0 of 8: re-armed
    again = w.group(_group([True] * 4))  # 4 of 8: at the threshold
    assert again is not None and again.startswith("50% of the last 8 answers")


def test_a_model_that_starts_out_cut_is_named_once_from_its_first_window() -> None:
    w = TruncationWatch(response_length=16, window=8, threshold=0.5, rise=0.25)
    assert w.group(_group([True, True, False, False])) is None
    line = w.group(_group([True, True, True, False]))  # 5 of 8 in the first window
    assert line is not None and line.startswith("62% of the run's first 8 answers were cut")
    assert w.group(_group([True, True, False, False])) is None  # 5 of 8: where it started
    assert w.group(_group([True] * 4)) is None  # 6 of 8: not 25 points over the start
    rose = w.group(_group([True] * 4))  # 8 of 8
    assert rose is not None and "up from 62% at the start" in rose


def test_truncation_line_names_the_options_already_on() -> None:
    w = TruncationWatch(response_length=8, window=4, threshold=0.5, mask_truncated=True)
    line = w.group(_group([True] * 4))
    assert line is not None and "(train.loss.mask_truncated on)" in line


def test_eval_summary_tells_the_end_and_a_fall_from_the_best(tmp_path) -> None:
    assert eval_summary([]) is None
    kept = [{"version": 0, "accuracy": 0.125}, {"version": 10, "accuracy": 0.8}, {"version": 20, "accuracy": 0.78}]
    line = eval_summary(kept)
    assert line == "held-out accuracy 0.780 at v20, the last evaluation (v0 0.125; best 0.800 at v10)"
    fell = eval_summary([*kept, {"version": 30, "accuracy": 0.5}])
    assert fell is not None and "0.300 under the run's best" in fell
    records = [{"kind": "eval", "trainer_version": 12, "version": 10, "accuracy": 0.8},
               {"kind": "eval", "trainer_version": 0, "version": 0, "accuracy": 0.125},  # order of arrival is not
               {"kind": "train_step", "step": 20},
               {"kind": "eval", "trainer_version": 21, "version": 20, "accuracy": 0.78},
               {"kind": "summary", "evals": kept[-1:]}]  # a resumed run's summary knows only its own
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert final_evals(tmp_path) == kept
    assert final_evals(tmp_path / "nowhere") == []


def _scored(rewards: list[float]) -> TrajectoryGroup:
    g = _group([False] * len(rewards))
    return g.model_copy(update={"trajectories": [t.model_copy(update={"reward": r})
                                                 for t, r in zip(g.trajectories, rewards, strict=True)]})


def test_a_solved_task_ends_the_run_and_a_flat_reward_fails_it() -> None:
    """Groups that all score the run's best reward after mixed ones: the task is solved (an
    end, said as such); a reward that never told answers apart is a failure (docs/design.md §10.15)."""
    from areal_like.orchestration.watch import SignalWatch

    now = [0.0]
    solved = SignalWatch("last_integer", max_no_signal_s=60, clock=lambda: now[0])
    for _ in range(10):
        solved.group(_scored([0.0] * 4), "filtered")  # at the start the answers were mostly wrong
    solved.group(_scored([1.0, 0.0, 0.0, 0.0]), None)  # then mixed groups were trained
    for _ in range(3):
        solved.group(_scored([1.0] * 4), "filtered")
    now[0] = 20.0
    line, verdict = solved.check()
    assert verdict is None and line is not None and "the policy solves these prompts" in line
    assert "dataset.uniform_after" in line and "The run ends in 40s" in line
    assert "had different rewards" not in line  # the no-signal wording is not used
    now[0] = 61.0
    line, verdict = solved.check()
    assert solved.solved and verdict is not None and verdict.startswith("the task is solved")

    flat = SignalWatch("flat", max_no_signal_s=60, clock=lambda: now[0])
    now[0] = 0.0
    for _ in range(3):
        flat.group(_scored([0.0] * 4), "filtered")
    now[0] = 61.0
    line, verdict = flat.check()
    assert not flat.solved and verdict is not None and verdict.startswith("no learning signal for 61s")

    # a reward that is nearly always 1 (one early outlier): not learning, so not "solved"
    now[0] = 0.0
    constant = SignalWatch("broken", max_no_signal_s=60, clock=lambda: now[0])
    constant.group(_scored([1.0, 1.0, 0.0, 1.0]), None)
    for _ in range(20):
        constant.group(_scored([1.0] * 4), "filtered")
    now[0] = 61.0
    line, verdict = constant.check()
    assert not constant.solved and verdict is not None and verdict.startswith("no learning signal")


def test_the_no_signal_line_says_what_share_of_groups_had_signal() -> None:
    from areal_like.orchestration.watch import SignalWatch

    now = [0.0]
    w = SignalWatch("r", max_no_signal_s=300, clock=lambda: now[0])
    w.group(_scored([0.5, 0.0, 0.0, 0.0]), None)
    for _ in range(4):
        w.group(_scored([0.0] * 4), "filtered")
    now[0] = 15.0
    line, _ = w.check()
    assert line is not None and "1 of the run's 5 groups so far (20%) had different rewards" in line


def test_a_run_that_ended_solved_is_finished_for_resume(tmp_path) -> None:
    """`--resume` on a run that ended by itself before total_steps says it finished: resuming
    would only wait again for a signal that is gone (docs/design.md §10.40)."""
    import pytest

    from areal_like.orchestration.run_dir import RunDir, RunFinished

    rd = RunDir(tmp_path / "run")
    ckpt = rd.checkpoints / "v000012"
    ckpt.mkdir(parents=True)
    RunDir.mark_complete(ckpt, {"version": 12})
    for ended, finished in (("interrupted", None), ("solved", 12), ("target_reached", 12)):
        rd.metrics.write_text(json.dumps({"kind": "summary", "ended": ended}) + "\n")
        assert rd.finished_at(40) == finished
    with pytest.raises(RunFinished, match="ended by itself"):
        rd.check(resume=True, overwrite=False, total_steps=40)
