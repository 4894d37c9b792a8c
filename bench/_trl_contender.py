"""The TRL side of bench/vs_trl.py: TRL's `GRPOTrainer` on the workload's task.

Run by bench/vs_trl.py in `.venv-trl` (bench/setup_trl.sh). Same model, same data rows,
same reward (the config's `agent.reward` on the last assistant message), same budget
(prompts x samples per step, response tokens, assistant turns), same optimiser settings
and learning-rate schedule as the config (`--config`, with `--set` overrides).

The tool form (the quickstart) runs through TRL's own tool loop (`tools=[calculator]`): it
needs a `response_template` on the tokenizer to parse our hermes calls, set here (the
committed tokenizer is left alone). Every `--save-every`-th optimiser step saves the weights
to `OUT/ckpt/step{N}.safetensors`; every step writes a line with its time to
`OUT/steps.jsonl`, so the bench can evaluate the checkpoints afterwards with the same
held-out evaluator as ours.

    python bench/_trl_contender.py --out DIR --config CONFIG [--set KEY=VALUE] [--max-steps 200]
        [--max-seconds 900] [--threads 2] [--stop-reward 0.93] [--extra-steps 10] [--save-every 1]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

# Run as a script, this folder is sys.path[0], and bench/weight_sync.py would shadow the
# `weight_sync` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
# Set before torch is imported anywhere.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

# The response template TRL's tool loop uses to read our hermes-style calls out of a
# generated turn (transformers >= 5.13 `response_template` format).
RESPONSE_TEMPLATE: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>", "content": "text"},
    },
}


def calculator(expression: str) -> str:
    """Evaluate integer arithmetic with + - * and parentheses.

    Args:
        expression: e.g. 123*45
    """
    from areal_like.tasks.arithmetic import CalculatorError, calculate

    try:
        return str(calculate(expression))
    except CalculatorError as e:  # the same text our tool loop answers with
        return f"Error: {e}"


def final_text(completion: Any) -> str:
    """Text of the last assistant message (what our loops put in `final_text`)."""
    if isinstance(completion, str):
        return completion
    for msg in reversed(completion or []):
        if msg.get("role") == "assistant":
            return str(msg.get("content") or "").strip()
    return ""


def reward_func(name: str) -> Any:
    """Our reward `name` (the config's `agent.reward`), in TRL's reward-function shape."""
    from types import SimpleNamespace

    from rollout_cluster.rewards import BUILTIN_REWARDS

    fn = BUILTIN_REWARDS[name]

    def reward(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
        return [fn({"answer": a}, SimpleNamespace(final_text=final_text(c)))
                for c, a in zip(completions, answer, strict=True)]

    reward.__name__ = name
    return reward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default="configs/quickstart.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override")
    ap.add_argument("--save-every", type=int, default=1, help="save every N-th step's weights")
    ap.add_argument("--max-steps", type=int, default=200)
    ap.add_argument("--max-seconds", type=float, default=900.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=None, help="learning rate (default: the config's train.lr)")
    ap.add_argument("--stop-reward", type=float, default=None,
                    help="stop --extra-steps after the mean train reward of the last 5 steps reaches this")
    ap.add_argument("--extra-steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from areal_like.core.config import load_config
    from areal_like.core.precision import resolve_dtype
    from areal_like.models.tiny_model import load_tokenizer
    from areal_like.orchestration.dataset import load_rows
    from areal_like.orchestration.preflight import resolve_model_path

    out = Path(args.out)
    (out / "ckpt").mkdir(parents=True, exist_ok=True)
    log_path = out / "steps.jsonl"
    log_f = log_path.open("w")

    def emit(rec: dict[str, Any]) -> None:
        log_f.write(json.dumps(rec) + "\n")
        log_f.flush()

    t0 = time.time()  # after imports: what follows is setup + training
    emit({"kind": "start", "time": t0, "threads": args.threads, "torch": torch.__version__})
    cfg = load_config(args.config, args.set)
    tool_form = cfg.dataset.form == "tool"
    model_path = resolve_model_path(cfg)
    tokenizer = load_tokenizer(model_path, hf=True)  # GRPOTrainer requires transformers' class
    if tool_form:
        tokenizer.response_template = RESPONSE_TEMPLATE
    # fp32 weights; with model.dtype bf16 (or auto on a CPU with native bf16) training and
    # generation run under bf16 autocast, as ours: fp32 masters, bf16 matmuls
    dtype = resolve_dtype(cfg.model.dtype, "cpu")
    emit({"kind": "dtype", "time": time.time(), "dtype": dtype})
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    rows = load_rows(cfg.dataset, "train", cfg.run.seed)
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])

    g, b = cfg.rollout.group_size, cfg.train.batch_size
    targs = GRPOConfig(
        output_dir=str(out / "trl_output"),
        per_device_train_batch_size=g * b,  # completions per step: prompts x samples
        num_generations=g,
        gradient_accumulation_steps=1,
        num_iterations=1,
        max_completion_length=cfg.rollout.response_length,
        max_tool_calling_iterations=cfg.agent.max_assistant_turns - 1,
        temperature=cfg.rollout.temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=args.lr if args.lr is not None else cfg.train.lr,
        lr_scheduler_type=cfg.train.lr_schedule,  # over max_steps, as ours over train.total_steps
        warmup_steps=cfg.train.warmup_steps,
        weight_decay=cfg.train.weight_decay,
        adam_beta1=cfg.train.betas[0],
        adam_beta2=cfg.train.betas[1],
        max_grad_norm=cfg.train.grad_clip,
        beta=cfg.train.loss.kl_coef,
        epsilon=cfg.train.loss.eps_clip,
        loss_type="dapo",  # token-level mean over the batch, like ours (loss.agg=token_mean)
        scale_rewards="group",  # group std normalisation, like ours (loss.adv_std_norm)
        mask_truncated_completions=cfg.train.loss.mask_truncated,  # the same knob under TRL's name
        max_steps=args.max_steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=dtype == "bfloat16",
        fp16=False,
        seed=args.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
        # TRL turns it on by default; a 1M-parameter model does not need it and it costs time
        gradient_checkpointing=False,
    )

    class Recorder(TrainerCallback):
        def __init__(self) -> None:
            self.rewards: list[float] = []
            self.stop_at: int | None = None

        def on_step_end(self, a: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            now = time.time()
            path = None
            if state.global_step % args.save_every == 0:
                m = model if model is not None else trainer.model
                # clone: tied embeddings share storage, which safetensors refuses to save
                sd = {k: v.detach().clone().contiguous() for k, v in m.state_dict().items() if k != "lm_head.weight"}
                path = str(out / "ckpt" / f"step{state.global_step}.safetensors")
                save_file(sd, path)
            emit({"kind": "step", "step": state.global_step, "time": now, "path": path})
            if now - t0 > args.max_seconds:
                print(f"[trl] wall budget {args.max_seconds:.0f}s spent at step {state.global_step}", flush=True)
                control.should_training_stop = True
            if self.stop_at is not None and state.global_step >= self.stop_at:
                control.should_training_stop = True

        def on_log(self, a: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kw: Any) -> None:
            if not logs or "reward" not in logs:
                return
            self.rewards.append(float(logs["reward"]))
            tail = self.rewards[-5:]
            rolling = sum(tail) / len(tail)
            emit({"kind": "log", "step": state.global_step, "time": time.time(), "reward": logs["reward"],
                  "reward_roll5": rolling, "tool_calls": logs.get("tools/call_frequency"),
                  "completion_len": logs.get("completions/mean_length")})
            print(f"[trl] step {state.global_step}  t={time.time() - t0:6.1f}s  reward {logs['reward']:.3f}  "
                  f"(last 5: {rolling:.3f})", flush=True)
            if (args.stop_reward is not None and self.stop_at is None and len(tail) == 5
                    and rolling >= args.stop_reward):
                self.stop_at = state.global_step + args.extra_steps
                print(f"[trl] train reward reached {args.stop_reward}: stopping at step {self.stop_at}", flush=True)

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward_func(cfg.agent.reward)],
        args=targs,
        train_dataset=dataset,
        processing_class=tokenizer,
        tools=[calculator] if tool_form else None,
        callbacks=[Recorder()],
    )
    emit({"kind": "ready", "time": time.time()})
    trainer.train()
    emit({"kind": "end", "time": time.time()})
    log_f.close()


if __name__ == "__main__":
    main()
