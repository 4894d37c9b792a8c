"""The held-out evaluator bench/vs_trl.py scores both contenders' checkpoints with (not
timed), and the time to a target read off those scores.

One evaluator for both: batched HF `generate` at T = 1 with one seed for every checkpoint,
the workload's episode rules and its reward (the config's `agent.reward`):

- tool form (the quickstart): turn 1 is sampled; a hermes calculator call gets the
  calculator's answer as a tool message (template ids, like our loop), then turn 2 is
  sampled with what is left of the response budget (observation included); the reward is
  read on the last turn's text;
- any other form (single turn, chat: the real recipe): one turn.

A turn ends at the tokenizer's eos or at the chat template's end-of-turn token, as both
contenders' generation does.
"""

from __future__ import annotations

import logging
import statistics
from pathlib import Path
from typing import Any

log = logging.getLogger("bench.vs_trl")


class Evaluator:
    """Held-out sampled accuracy of a checkpoint (a safetensors file of the model's weights)."""

    def __init__(self, config: Path, sets: list[str], n: int, seed: int, threads: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from areal_like.core.config import load_config
        from areal_like.models.fetch import end_of_turn_ids
        from areal_like.models.tiny_model import load_tokenizer
        from areal_like.orchestration.dataset import load_rows
        from areal_like.orchestration.preflight import resolve_model_path
        from rollout_cluster.agent_loop.chat import ChatTemplate
        from rollout_cluster.rewards import BUILTIN_REWARDS
        from rollout_cluster.tool_parser import HermesToolParser
        from rollout_cluster.tools.calculator import CalculatorTool

        torch.set_num_threads(threads)
        self.torch = torch
        cfg = self.cfg = load_config(str(config), sets)
        self.form = cfg.dataset.form
        self.settings = {"prompts_per_step": cfg.train.batch_size, "samples_per_prompt": cfg.rollout.group_size,
                         "grad_clip": cfg.train.grad_clip, "response_length": cfg.rollout.response_length}
        self.seed = seed
        path = resolve_model_path(cfg)
        self.tok = load_tokenizer(path)
        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        self.base_state = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.chat = ChatTemplate(self.tok)
        self.parser = HermesToolParser()
        self.tool_form = cfg.dataset.form == "tool"
        self.reward = BUILTIN_REWARDS[cfg.agent.reward]
        self.tools = [CalculatorTool("calculator").schema] if self.tool_form else None
        self.rows = load_rows(cfg.dataset, "eval", cfg.run.seed)[:n]
        self.prompts = [self.chat.prompt_ids(r["prompt"], tools=self.tools) for r in self.rows]
        self.budget = cfg.rollout.response_length
        eos = self.tok.eos_token_id
        self.stops = sorted({eos, *end_of_turn_ids(self.tok)} - {None})
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else eos

    def load(self, path: str | None) -> None:
        from safetensors.torch import load_file

        self.model.load_state_dict(self.base_state)
        if path is not None:
            sd = load_file(path)
            missing, unexpected = self.model.load_state_dict(sd, strict=False)
            if unexpected or any(k != "lm_head.weight" for k in missing):
                raise RuntimeError(f"{path}: missing {missing}, unexpected {unexpected}")
            if self.model.config.tie_word_embeddings:
                self.model.tie_weights()

    def _sample(self, seqs: list[list[int]], max_new: list[int]) -> list[list[int]]:
        """One turn per sequence: sampled tokens up to and including a stop, at most max_new[i]."""
        torch = self.torch
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad, dtype=torch.long)
        att = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, width - len(s):] = torch.tensor(s)
            att[i, width - len(s):] = 1
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=att, do_sample=True, temperature=1.0, top_k=0,
                                      top_p=1.0, max_new_tokens=max(max_new), eos_token_id=self.stops,
                                      pad_token_id=self.pad)
        res = []
        for i, row in enumerate(out[:, width:].tolist()):
            row = row[: max_new[i]]
            end = next((j for j, t in enumerate(row) if t in self.stops), None)
            res.append(row if end is None else row[: end + 1])
        return res

    def _text(self, ids: list[int]) -> str:
        return self.parser.parse(self.tok.decode(ids, skip_special_tokens=True)).content

    def accuracy(self, path: str | None) -> float:
        from types import SimpleNamespace

        self.load(path)
        self.torch.manual_seed(self.seed)
        n = len(self.rows)
        turn1 = self._sample(self.prompts, [self.budget] * n)
        finals = [self._text(ids) for ids in turn1]
        if self.tool_form:
            self._second_turns(turn1, finals)
        hits = sum(self.reward(r, SimpleNamespace(final_text=f)) for r, f in zip(self.rows, finals, strict=True))
        return hits / n

    def _second_turns(self, turn1: list[list[int]], finals: list[str]) -> None:
        from areal_like.tasks.arithmetic import calculate

        second: list[tuple[int, list[int], int]] = []
        for i, ids in enumerate(turn1):
            parsed = self.parser.parse(self.tok.decode(ids, skip_special_tokens=True))
            stopped = bool(ids) and ids[-1] in self.stops
            if not parsed.calls or not stopped or len(ids) >= self.budget:
                continue
            call = parsed.calls[0]
            if call.error is not None:
                text = f"Error: {call.error}"
            elif call.name != "calculator":
                text = f"Error: unknown tool {call.name!r}"
            else:
                try:
                    text = str(calculate(str(call.arguments.get("expression", ""))))
                except Exception as e:
                    text = f"Error: {e}"
            obs = self.chat.observation_ids([{"role": "tool", "content": text, "name": call.name or "calculator"}])
            if len(ids) + len(obs) >= self.budget:
                continue  # no room for another turn: the episode ends on the call
            second.append((i, self.prompts[i] + ids + obs, self.budget - len(ids) - len(obs)))
        if second:
            turn2 = self._sample([s for _, s, _ in second], [m for _, _, m in second])
            for (i, _, _), ids in zip(second, turn2, strict=True):
                finals[i] = self._text(ids)


def other_cores(cpu: dict[str, Any], t_from: float, t_to: float) -> float | None:
    """Average cores other processes used between two times (from the monitor's samples)."""
    samples = cpu.get("samples") or []

    def at(t: float) -> tuple[float, float]:
        return min(samples, key=lambda s: abs(s[0] - t))

    if len(samples) < 2:
        return None
    (a_t, a_v), (b_t, b_v) = at(t_from), at(t_to)
    return round((b_v - a_v) / (b_t - a_t), 2) if b_t > a_t else None


def time_to_target(ev: Evaluator, run: dict[str, Any], target: float, stride: int, tag: str) -> dict[str, Any]:
    """Evaluate every `stride`-th checkpoint until one reaches `target`, then the ones
    before it back to the last miss; the first that reaches it is the answer. The step's
    cost is read off every step's time (`run["steps"]`), saved or not."""
    ckpts = run["ckpts"]
    evaluated: dict[int, float] = {}

    def acc(k: int) -> float:
        if k not in evaluated:
            evaluated[k] = ev.accuracy(ckpts[k]["path"])
            c = ckpts[k]
            log.info("[eval %s] step %d (t=%.1fs): accuracy %.3f", tag, c["step"], c["time"] - run["t0"], evaluated[k])
        return evaluated[k]

    hit = None
    last_miss = -1
    idx = list(range(stride - 1, len(ckpts), stride))
    if ckpts and (not idx or idx[-1] != len(ckpts) - 1):
        idx.append(len(ckpts) - 1)
    for k in idx:
        if acc(k) >= target:
            hit = k
            break
        last_miss = k
    if hit is not None:
        for k in range(last_miss + 1, hit):
            if acc(k) >= target:
                hit = k
                break
    curve = [{"step": ckpts[k]["step"], "t_s": round(ckpts[k]["time"] - run["t0"], 1), "accuracy": round(a, 4)}
             for k, a in sorted(evaluated.items())]
    steps = run["steps"]
    step_s = median_step_s(steps, ckpts[hit]["step"] if hit is not None else None)
    best = max(evaluated.values()) if evaluated else None
    return {
        "reached": hit is not None,
        "time_to_target_s": round(ckpts[hit]["time"] - run["t0"], 1) if hit is not None else "not reached",
        "time_to_target_from_launch_s": round(ckpts[hit]["time"] - run["t_launch"], 1) if hit is not None else None,
        "steps_to_target": ckpts[hit]["step"] if hit is not None else None,
        # setup cost: contender start to its first optimiser step (Ray, actors, model, first batch)
        "first_step_s": round(steps[0][1] - run["t0"], 1) if steps else None,
        # what other processes used while this contender was on its way to the target
        "other_processes_avg_cores_to_target": other_cores(run["cpu"], run["t0"], ckpts[hit]["time"])
        if hit is not None else None,
        "best_accuracy": round(best, 4) if best is not None else None,
        # the step's cost: the median interval between optimiser steps up to the target
        "median_step_s_to_target": round(step_s, 3) if step_s is not None else None,
        "eval_curve": curve,
    }


def median_step_s(steps: list[tuple[int, float]], upto: int | None, warmup: int = 3) -> float | None:
    """The median seconds between consecutive optimiser steps (`(step, time)` of each), from
    step `warmup` (the first steps carry start-up: our servers' first batch, TRL's first
    generate) to step `upto` (the target; None: every step). A short run (a smoke) skips no
    warm-up."""
    times = [t for s, t in steps if upto is None or s <= upto]
    first = warmup if len(times) - 1 - warmup >= 2 else 0
    times = times[first:]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return statistics.median(gaps) if gaps else None
