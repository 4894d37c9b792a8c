"""The TRL-shaped Python entry point runs the real loop with user callables and rows."""

from __future__ import annotations

import pytest

from areal_like.core.metrics import read_jsonl

pytestmark = pytest.mark.timeout(300)


def always_one(sample, output) -> float:
    return 1.0


async def even_length(sample, output) -> dict:
    return {"reward": float(len(output.response_ids) % 2 == 0), "length": float(len(output.response_ids))}


def test_grpo_trainer_with_callables_and_rows(tiny_model_dir, tmp_path) -> None:
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
    trajs = read_jsonl(tmp_path / "run" / "trajectories.jsonl")
    prompts = {tuple(t["prompt_ids"]) for t in trajs}
    assert len(prompts) <= 4  # two steps of two prompts each, from the given rows
    for t in trajs:
        assert t["reward"] == 1.0 + float(len(t["response_ids"]) % 2 == 0)
