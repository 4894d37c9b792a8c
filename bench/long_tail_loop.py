"""The quickstart tool loop with a long-tailed response-length distribution (benchmarks).

The quickstart model answers in ~15 tokens, so every episode costs about the same.
Reasoning workloads do not: a few episodes run many times longer than the median,
and a synchronous step waits for the slowest one. This loop runs the normal
calculator episode and then keeps decoding the same sequence for `k` more tokens
(`ignore_eos`), `k ~ min(cap, scale · Pareto(α))`, drawn per episode from its id.
Those "thinking" tokens are real decode work on the rollout side and real sequence
length on the train side (forward/backward over them), but they carry mask 0, so
the learning signal is the quickstart's: reward and advantages are unchanged.

Distribution knobs (environment, read at import): `LONG_TAIL_ALPHA` (1.2),
`LONG_TAIL_SCALE` (12 tokens), `LONG_TAIL_CAP` (192 tokens). Used as
`agent.default_loop=bench/long_tail_loop.py:LongTailToolLoop` (bench/async_vs_sync.py).

Run as a script, it measures what the tail costs: `--episodes` quickstart prompts through
this loop on one embedded rollout server (the quickstart model and config, `--concurrency`
episodes at a time, the calculator tool, the quickstart reward), and reports the drawn tail
lengths, the episode times (the straggler ratio: slowest over median), and tokens/s. The
last stdout line is one JSON object (bench/_record.py).

    python bench/long_tail_loop.py [--episodes 64] [--concurrency 16] [--cap 192]
    python bench/long_tail_loop.py --smoke   # 4 episodes, tails of 16 tokens at most
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from areal_like.core.types import AgentLoopOutput, SamplingParams
from rollout_cluster.agent_loop.tool_agent import ToolAgentLoop

ALPHA = float(os.environ.get("LONG_TAIL_ALPHA", "1.2"))
SCALE = float(os.environ.get("LONG_TAIL_SCALE", "12"))
CAP = int(os.environ.get("LONG_TAIL_CAP", "192"))


def tail_length(episode_id: str, alpha: float = ALPHA, scale: float = SCALE, cap: int = CAP) -> int:
    """Extra tokens for this episode: a Pareto draw seeded by the episode id."""
    seed = int.from_bytes(hashlib.sha256(episode_id.encode()).digest()[:8], "little")
    draw = random.Random(seed).paretovariate(alpha)  # >= 1, heavy tail
    return max(1, min(cap, int(scale * draw)))


class LongTailToolLoop(ToolAgentLoop):
    cap = CAP  # the longest tail; the script's --cap sets it

    async def run(self, sampling_params: SamplingParams, **sample: Any) -> AgentLoopOutput | None:
        out = await super().run(sampling_params, **sample)
        if out is None:
            return None
        episode_id = str(out.episode_id or self.episode_id(sample))
        k = tail_length(episode_id, cap=self.cap)
        seq = out.prompt_ids + out.response_ids
        res = await self.server_manager.generate(
            request_id=f"{episode_id}-tail",
            prompt_ids=seq,
            sampling_params=sampling_params.model_copy(update={"max_tokens": k, "ignore_eos": True, "n": 1}),
            session_id=episode_id,
        )
        self.server_manager.release_session(episode_id)
        n = len(res.token_ids)
        return out.model_copy(
            update={
                "response_ids": out.response_ids + list(res.token_ids),
                "response_mask": out.response_mask + [0] * n,
                "response_logprobs": out.response_logprobs + [0.0] * n,
                "response_versions": out.response_versions + [-1] * n,
                "metrics": {**out.metrics, "tail_tokens": float(n)},
            }
        )


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _episodes(args: argparse.Namespace) -> dict[str, Any]:
    from areal_like.core.config import load_config
    from areal_like.models.tiny_model import load_tokenizer
    from areal_like.orchestration.dataset import load_rows
    from areal_like.orchestration.preflight import resolve_model_path
    from rollout_cluster.agent_loop.runner import AgentRunner
    from rollout_cluster.server import RolloutServer
    from rollout_cluster.server_manager import ServerManager

    root = Path(__file__).resolve().parent.parent
    cfg = load_config(str(root / args.config), ["rollout.engine.max_seq_len=512", f"rollout.server_threads={args.threads}"])
    model = resolve_model_path(cfg)
    server = RolloutServer.from_config(model, cfg.rollout.engine, seed=cfg.run.seed)
    try:
        manager = ServerManager({"s0": server})
        runner = AgentRunner.from_config(cfg, server_manager=manager, tokenizer=load_tokenizer(model),
                                         loops={"long_tail": LongTailToolLoop})
        rows = load_rows(cfg.dataset, "train", cfg.run.seed)[: args.episodes]
        sampling = SamplingParams(temperature=cfg.rollout.temperature, max_tokens=cfg.rollout.response_length)
        sem = asyncio.Semaphore(args.concurrency)
        done: list[dict[str, float]] = []

        async def one(i: int, row: dict[str, Any]) -> None:
            async with sem:
                t0 = time.perf_counter()
                out = await runner.run_episode({**row, "agent_name": "long_tail"},
                                               sampling.model_copy(update={"seed": i}), f"tail-{i}")
                if out is None:
                    return
                reward = await runner.score(row, out)
                done.append({"s": time.perf_counter() - t0, "tail": out.metrics.get("tail_tokens", 0.0),
                             "answer": float(sum(out.response_mask)), "tokens": float(len(out.response_ids)),
                             "reward": reward})

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, r) for i, r in enumerate(rows)))
        wall = time.perf_counter() - t0
    finally:
        await server.close()
    tails, secs = [d["tail"] for d in done], [d["s"] for d in done]
    return {
        "episodes": len(done), "concurrency": args.concurrency, "cap": LongTailToolLoop.cap, "alpha": ALPHA,
        "scale": SCALE, "threads": args.threads,
        "tail_tokens": {"mean": round(statistics.mean(tails), 1), "p50": _quantile(tails, 0.5),
                        "p90": _quantile(tails, 0.9), "max": max(tails)},
        "at_cap": round(sum(t >= LongTailToolLoop.cap for t in tails) / len(tails), 3),
        "answer_tokens_mean": round(statistics.mean(d["answer"] for d in done), 1),
        "episode_s": {"p50": round(statistics.median(secs), 3), "p90": round(_quantile(secs, 0.9), 3),
                      "max": round(max(secs), 3)},
        "episode_s_max_over_median": round(max(secs) / max(statistics.median(secs), 1e-9), 2),
        "generated_tokens_per_s": round(sum(d["tokens"] for d in done) / wall, 1),
        "reward_mean": round(statistics.mean(d["reward"] for d in done), 3),
        "wall_s": round(wall, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description="Episodes of the long-tail loop on one embedded server: what the "
                                             "tail costs.")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--cap", type=int, default=CAP, help="longest tail in tokens (LONG_TAIL_CAP)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    ap.add_argument("--config", default="configs/quickstart.yaml")
    args, recorder = _record.parse(ap, __file__, smoke={"episodes": 4, "concurrency": 4, "cap": 16})
    LongTailToolLoop.cap = args.cap
    recorder.finish({"bench": "long_tail_loop", **asyncio.run(_episodes(args))})


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _record

    main()
