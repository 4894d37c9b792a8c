"""Supervised warm start of the small model on the arithmetic task's format.

RL needs a policy that already sometimes calls the tool and copies its result;
a random model never gets reward. The recipe (docs/design.md §8): 25% tool traces
(call the calculator, read the result, answer with it) and 75% direct answers,
loss on assistant tokens only. After ~1500 steps of batch 64 the model samples
(T=1) correct answers ~20% of the time: tool rate ~0.25, ~0.75 correct when the
tool is called. The skill of copying digits appears suddenly between steps 900
and 1200, so stopping earlier leaves RL nothing to work with.

Results are cached under a folder keyed by the config's hash, so the quickstart
never retrains what exists.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import time
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from areal_like.core.config import ConfigError

__all__ = ["SFTConfig", "load_sft_config", "run_sft", "build_example", "sampled_accuracy"]

log = logging.getLogger(__name__)

CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate integer arithmetic (+, -, *).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


class SFTConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    out: str | None = None
    """Output folder; default `.cache/sft/<config hash>` (a cache: reused when present)."""
    base_model: str | None = None
    """HF folder to start from; None = a fresh model from `areal-like model init`."""
    init_seed: int = 0
    """Seed of the fresh model's initialisation."""
    seed: int = 0
    """Data and shuffling seed."""
    steps: int = Field(1500, ge=1)
    """Optimizer steps."""
    batch_size: int = Field(64, ge=1)
    """Sequences per step."""
    lr: float = Field(1e-3, gt=0)
    """Peak AdamW learning rate (linear warmup, cosine decay to 10%)."""
    warmup_steps: int = Field(100, ge=0)
    """Linear warmup steps."""
    tool_fraction: float = Field(0.25, ge=0.0, le=1.0)
    """Fraction of examples that are tool traces (the rest answer directly)."""
    threads: int = Field(2, ge=1)
    """torch threads."""
    eval_samples: int = Field(256, ge=0)
    """Problems for the final sampled-accuracy check (0 = skip)."""


def load_sft_config(path: str | Path, overrides: list[str] | None = None) -> SFTConfig:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"SFT config {p} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"SFT config {p} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"SFT config {p}: top level must be a mapping")
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected KEY=VALUE")
        key, raw = item.split("=", 1)
        if key not in SFTConfig.model_fields:
            raise ConfigError(f"override {item!r}: unknown key; valid: {sorted(SFTConfig.model_fields)}")
        data = {**data, key: yaml.safe_load(raw)}
    try:
        return SFTConfig.model_validate(data)
    except ValidationError as e:
        lines = [f"invalid SFT config {p}:"]
        lines += [f"  {'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]
        raise ConfigError("\n".join(lines)) from None


def build_example(tokenizer: Any, problem: dict[str, Any], use_tool: bool) -> tuple[list[int], list[int]]:
    """Token ids and loss mask (1 on assistant tokens) of one SFT conversation."""
    messages: list[dict[str, Any]] = list(problem["prompt"])
    if use_tool:
        expr = problem["extra"]["expression"]
        messages += [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": expr}}}],
            },
            {"role": "tool", "content": problem["answer"]},
        ]
    messages.append({"role": "assistant", "content": problem["answer"]})
    tools = [CALCULATOR_SCHEMA]
    ids: list[int] = []
    mask: list[int] = []
    for k, msg in enumerate(messages):
        if msg["role"] == "assistant":
            prefix = _template(tokenizer, messages[:k], tools, gen=True)
            mask += [0] * (len(prefix) - len(ids))
            ids = prefix
        full = _template(tokenizer, messages[: k + 1], tools, gen=False)
        mask += [1 if msg["role"] == "assistant" else 0] * (len(full) - len(ids))
        ids = full
    return ids, mask


def _template(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]], gen: bool) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=True)
    return list(out["input_ids"] if not isinstance(out, list) else out)


def _config_hash(cfg: SFTConfig) -> str:
    payload = cfg.model_dump(exclude={"out", "threads", "eval_samples"})
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


def run_sft(cfg: SFTConfig, force: bool = False) -> Path:
    """Train (or reuse the cached result) and return the HF folder."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from areal_like.models.tiny_model import init_model, load_tokenizer
    from areal_like.tasks.arithmetic import generate_problems

    out = Path(cfg.out) if cfg.out else Path(".cache/sft") / _config_hash(cfg)
    done = out / "sft_done.json"
    if done.is_file() and not force:
        log.info("SFT result cached at %s (config hash matches); use --force to retrain", out)
        return out
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    base = Path(cfg.base_model) if cfg.base_model else init_model(out / "_init", seed=cfg.init_seed)
    tokenizer = load_tokenizer(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.train()
    rng = random.Random(cfg.seed)
    problems = generate_problems(cfg.steps * cfg.batch_size, seed=cfg.seed + 1_000_003)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    pad = tokenizer.pad_token_id
    t0 = time.time()
    bar = tqdm(range(cfg.steps), desc="sft", mininterval=5)
    for step in bar:
        batch = problems[step * cfg.batch_size : (step + 1) * cfg.batch_size]
        examples = [build_example(tokenizer, p, rng.random() < cfg.tool_fraction) for p in batch]
        width = max(len(ids) for ids, _ in examples)
        input_ids = torch.full((len(examples), width), pad, dtype=torch.long)
        labels = torch.full((len(examples), width), -100, dtype=torch.long)
        attn = torch.zeros((len(examples), width), dtype=torch.long)
        for i, (ids, mask) in enumerate(examples):
            n = len(ids)
            input_ids[i, :n] = torch.tensor(ids)
            attn[i, :n] = 1
            lab = torch.tensor([t if m else -100 for t, m in zip(ids, mask, strict=True)])
            labels[i, :n] = lab
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        logits = model(input_ids=input_ids, attention_mask=attn).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    summary: dict[str, Any] = {"steps": cfg.steps, "seconds": round(time.time() - t0, 1), "final_loss": loss.item()}
    if cfg.eval_samples:
        summary.update(sampled_accuracy(model, tokenizer, cfg.eval_samples, seed=cfg.seed + 7))
    summary["config"] = cfg.model_dump()
    done.write_text(json.dumps(summary, indent=2))
    log.info("SFT done: %s", {k: v for k, v in summary.items() if k != "config"})
    return out


def sampled_accuracy(model: Any, tokenizer: Any, n: int, seed: int, temperature: float = 1.0) -> dict[str, float]:
    """Sampled (T=1) accuracy of the tool-form task with plain HF generate.

    A self-contained check for the SFT result (the RL run evaluates through its own
    agent loop and engine). One tool call at most, as in the SFT traces.
    """
    import torch

    from areal_like.models.tiny_model import CALL_PREFIX, CALL_SUFFIX
    from areal_like.tasks.arithmetic import calculate, extract_answer, generate_problems

    problems = generate_problems(n, seed=seed + 99_991)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(seed)
    correct = tool = tool_correct = 0

    def gen(prompts: list[list[int]]) -> list[str]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p)
            attn[i, width - len(p) :] = 1
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=attn,
                do_sample=True,
                temperature=temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=24,
                eos_token_id=eos,
                pad_token_id=tokenizer.pad_token_id,
            )
        return [tokenizer.decode(o[width:], skip_special_tokens=True) for o in out]

    prompts = [_template(tokenizer, p["prompt"], [CALCULATOR_SCHEMA], gen=True) for p in problems]
    first = gen(prompts)
    second_idx, second_prompts = [], []
    finals = list(first)
    for i, text in enumerate(first):
        if text.startswith(CALL_PREFIX) and CALL_SUFFIX in text:
            tool += 1
            expr = text[len(CALL_PREFIX) : text.index(CALL_SUFFIX)]
            try:
                result = str(calculate(expr))
            except ValueError as e:
                result = f"error: {e}"
            call_ids = tokenizer.encode(text[: text.index(CALL_SUFFIX) + len(CALL_SUFFIX)]) + [eos]
            tool_ids = tokenizer.encode(f"<|im_start|>tool<tool_response>{result}</tool_response><|im_end|><|im_start|>assistant")
            second_idx.append(i)
            second_prompts.append(prompts[i] + call_ids + tool_ids)
    if second_prompts:
        for i, text in zip(second_idx, gen(second_prompts), strict=True):
            finals[i] = text
    for i, (p, text) in enumerate(zip(problems, finals, strict=True)):
        ok = extract_answer(text) == p["answer"]
        correct += ok
        if i in second_idx:
            tool_correct += ok
    return {
        "sampled_accuracy": correct / n,
        "tool_rate": tool / n,
        "accuracy_when_tool": tool_correct / max(tool, 1),
    }
