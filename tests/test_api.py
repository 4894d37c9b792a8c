"""The TRL-shaped Python entry point runs the real loop with user callables and rows."""

from __future__ import annotations

import pytest

from areal_like.core.metrics import read_jsonl

pytestmark = pytest.mark.timeout(300)


def always_one(sample, output) -> float:
    return 1.0


async def even_length(sample, output) -> dict:
    return {"reward": float(len(output.response_ids) % 2 == 0), "length": float(len(output.response_ids))}


def test_grpo_trainer_with_callables_and_rows(tiny_model_dir, tmp_path, capfd) -> None:
    from areal_like.api import GRPOTrainer

    rows = [{"prompt": f"{i}+{i}", "answer": str(2 * i), "agent_name": "single_turn"} for i in range(20)]
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=[always_one, even_length],
        args={
            "run": {"dir": str(tmp_path / "run"), "record_trajectories": True},
            "train": {"total_steps": 2, "batch_size": 2, "token_budget": 1024},
            "rollout": {"group_size": 4, "response_length": 16},
            "staleness": {"filter_uniform_groups": False},
            "eval": {"num_samples": 4},
        },
        train_dataset=rows,
    )
    summary = trainer.train()
    assert summary["trained"] == 2 * 8
    err = capfd.readouterr().err  # the API shows the CLI's progress display
    assert "dashboard: http://127.0.0.1:" in err and "step 2/2  reward" in err, err[-2000:]
    # the end on the console and in the summary: the last evaluation (of the final version)
    assert f"held-out accuracy {summary['eval_accuracy']:.3f} at v{summary['eval_version']}" in err, err[-2000:]
    assert "pid=" not in err, err[-2000:]  # quiet: Ray's worker output is in the run's log file
    assert "train[0]" in (tmp_path / "run" / "run.log").read_text()
    trajs = read_jsonl(tmp_path / "run" / "trajectories.jsonl")
    prompts = {tuple(t["prompt_ids"]) for t in trajs}
    assert len(prompts) <= 4  # two steps of two prompts each, from the given rows
    for t in trajs:
        assert t["reward"] == 1.0 + float(len(t["response_ids"]) % 2 == 0)


def test_grpo_trainer_takes_trl_rewards_and_holds_out_eval_rows(tiny_model_dir, tmp_path) -> None:
    """No training: what the trainer hands the rollout side (docs/design.md §10.13)."""
    import asyncio

    from areal_like.api import GRPOTrainer
    from areal_like.core.types import AgentLoopOutput
    from rollout_cluster.rewards import compute_reward

    def accuracy(completions, solution, **kwargs) -> list[float]:  # TRL-shaped, a renamed answer column
        return [float(c.strip() == s) for c, s in zip(completions, solution, strict=True)]

    def has_digits(sample, output) -> dict:
        return {"reward": 0.5, "format_ok": 1.0}

    rows = [{"question": f"{i}+{i}", "solution": str(2 * i)} for i in range(40)]
    args = {"run": {"dir": str(tmp_path / "run")}, "eval": {"num_samples": 3},
            "dataset": {"prompt_key": "question", "answer_key": "solution"}}
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=[accuracy, has_digits], args=args, train_dataset=rows)
    assert len(trainer.eval_rows) == 2 and len(trainer.rows) == 38  # 5% of 40, not the arithmetic set
    assert not {r["answer"] for r in trainer.eval_rows} & {r["answer"] for r in trainer.rows}
    out = AgentLoopOutput(prompt_ids=[1], response_ids=[2], response_mask=[1], response_logprobs=[-0.1],
                          response_versions=[0], final_text="4")
    row = next(r for r in trainer.rows + trainer.eval_rows if r["answer"] == "4")
    reward, metrics = asyncio.run(compute_reward(trainer.reward_fn, row, out, timeout_s=5))
    assert reward == 1.5 and metrics == {"reward_accuracy": 1.0, "reward_has_digits": 0.5, "format_ok": 1.0}
    alone = GRPOTrainer(model=tiny_model_dir, reward_funcs=accuracy, args=args, train_dataset=rows[:10])
    assert alone.eval_rows == []  # too few rows to hold any out: no evaluation, never the built-in set


def test_overrides_take_the_dotted_keys_of_set_on_any_args(tiny_model_dir, tmp_path) -> None:
    """TRL users change a setting without reading our code: `overrides` (dotted keys, as
    `--set`) on top of a YAML path, a dict or a config object; a wrong key is named."""
    from areal_like.api import GRPOTrainer
    from areal_like.core.config import ConfigError, load_config

    rows = [{"prompt": f"{i}+{i}", "answer": str(2 * i)} for i in range(40)]
    over = {"train.total_steps": 3, "run.dir": str(tmp_path / "r"), "staleness.max_staleness": 0}
    for args in ("configs/quickstart.yaml", {"train": {"lr": 1e-4}}, load_config("configs/quickstart.yaml")):
        t = GRPOTrainer(model=tiny_model_dir, reward_funcs="arithmetic", args=args, train_dataset=rows,
                        overrides=over)
        assert (t.cfg.train.total_steps, t.cfg.run.dir, t.cfg.staleness.max_staleness) == (3, str(tmp_path / "r"), 0)
    t = GRPOTrainer(model=tiny_model_dir, reward_funcs="arithmetic", args="configs/quickstart.yaml",
                    overrides=["train.total_steps=4"])
    assert t.cfg.train.total_steps == 4 and t.cfg.train.mini_batches == 4  # the rest of the YAML stays
    with pytest.raises(ConfigError, match="total_stepz"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs="arithmetic", args={}, overrides={"train.total_stepz": 3})
