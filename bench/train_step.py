"""Train throughput of the quickstart model: tokens/s of full decoupled-PPO train steps.

A step = π_prox recompute + forward/backward over packed micro-batches + AdamW, on
64 sequences of 64–128 tokens (prompt ~24, the rest generated). Weights are the
quickstart architecture, randomly initialised unless `--model` is given. Progress
goes to the log; the last stdout line is one JSON object (bench/_record.py).

    python bench/train_step.py [--steps 5] [--threads 1] [--token-budget 1024] [--model DIR]
    python bench/train_step.py --tail-cap 192 ...   # plus async_vs_sync's long tail per answer
    python bench/train_step.py --mini-batches 4 --lengths 35,45 --prompt-len 28 --shared-prompts \
        --split groups   # the quickstart's shape: a group's prompt computed once (design §10.29)
    python bench/train_step.py --smoke   # 1 step of 16 short sequences (2 groups sharing their
                                         # prompts), 2 mini-batches of whole groups
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from areal_like.core.config import TorchBackendConfig, TrainConfig
from areal_like.core.types import Trajectory
from train_cluster.batch import build_batch
from train_cluster.torch_engine import TorchTrainEngine

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _record  # noqa: E402

logger = logging.getLogger("bench.train_step")


def _trajectories(n: int, vocab: int, seed: int, lo: int = 64, hi: int = 128, tail_cap: int = 0,
                  prompt_len: int = 24, shared: bool = False) -> list[Trajectory]:
    """`n` sequences of lo–hi tokens in groups of 8, the first `prompt_len` of them the prompt
    (`shared`: one prompt per group, as GRPO's samples have; else each its own); with
    `tail_cap`, each answer also gets the long-tailed extra tokens of `bench/long_tail_loop.py`
    (Pareto, at most `tail_cap`), as in async_vs_sync."""
    from long_tail_loop import tail_length

    rng = random.Random(seed)
    out = []
    prompts: dict[int, list[int]] = {}
    for i in range(n):
        total = rng.randint(lo, hi) + (tail_length(f"s{seed}-e{i}", cap=tail_cap) if tail_cap else 0)
        p = min(prompt_len, total - 8)
        r = total - p
        own = [rng.randrange(4, vocab) for _ in range(p)]
        prompt = prompts.setdefault(i // 8, own)[:p] if shared else own
        out.append(Trajectory(
            episode_id=f"e{i}", group_id=f"g{i // 8}",
            prompt_ids=prompt,
            response_ids=[rng.randrange(4, vocab) for _ in range(r)],
            response_mask=[1] * r, response_logprobs=[-2.0 - rng.random() for _ in range(r)],
            response_versions=[0] * r, reward=float(rng.random() < 0.4),
        ))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    # A packed row attends through a dense block-diagonal mask on CPU: cost grows with the
    # square of the row, so CPU runs want rows of ~1k tokens (8192 was 5x slower here).
    ap.add_argument("--token-budget", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--model", default=None)
    ap.add_argument("--mini-batches", type=int, default=1, help="optimizer steps per train step (quickstart: 4)")
    ap.add_argument("--lengths", default="64,128", help="sequence lengths drawn from LO,HI (quickstart: ~35,60)")
    ap.add_argument("--prompt-len", type=int, default=24, help="prompt tokens per sequence (quickstart: ~28)")
    ap.add_argument("--shared-prompts", action="store_true",
                    help="the 8 samples of a group share one prompt (GRPO's shape; the trainer computes it once)")
    ap.add_argument("--split", choices=("tokens", "groups"), default="tokens",
                    help="train.mini_batch_split (quickstart: groups)")
    ap.add_argument("--tail-cap", type=int, default=0,
                    help="add bench/long_tail_loop.py's long tail (at most this many tokens) to each answer")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="model.dtype: bfloat16 runs forward and backward under bf16 autocast over fp32 masters")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="print the N functions that took the most time over the timed steps (cProfile)")
    args, rec = _record.parse(ap, __file__, smoke={"steps": 1, "batch": 16, "lengths": "16,32", "mini_batches": 2,
                                                          "tail_cap": 32, "shared_prompts": True,
                                                          "split": "groups", "prompt_len": 10})
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    model = args.model
    tmp = None
    if model is None:
        from areal_like.models.tiny_model import init_model

        tmp = tempfile.TemporaryDirectory(prefix="bench_model_")
        model = str(init_model(Path(tmp.name), seed=0))
    cfg = TrainConfig(token_budget=args.token_budget, mini_batches=args.mini_batches,
                      mini_batch_split=args.split, backend=TorchBackendConfig(threads=args.threads))
    lo, hi = (int(x) for x in args.lengths.split(","))
    engine = TorchTrainEngine(model, cfg, dtype=args.dtype)
    vocab = engine._module.config.vocab_size
    batches = [build_batch(_trajectories(args.batch, vocab, s, lo, hi, args.tail_cap, args.prompt_len,
                                         args.shared_prompts), cfg.loss)
               for s in range(args.steps + 1)]
    engine.train_step(batches[0])  # warm-up (allocator, kernels)
    rates, times, prox = [], [], []
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    for i, b in enumerate(batches[1:]):
        t0 = time.perf_counter()
        stats = engine.train_step(b)
        dt = time.perf_counter() - t0
        rates.append(b.num_tokens / dt)
        times.append(dt)
        prox.append(stats["prox_time_s"])
        logger.info("step %d/%d: %d tokens in %.2fs = %.0f tok/s (prox %.2fs, loss %.4f)", i + 1, args.steps,
                    b.num_tokens, dt, rates[-1], stats["prox_time_s"], stats["loss"])
    if prof is not None:
        import io
        import pstats

        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.profile)
        print(out.getvalue(), file=sys.stderr)
    rec.finish({
        "bench": "train_step", "mini_batches": args.mini_batches, "lengths": [lo, hi], "tail_cap": args.tail_cap,
        "prompt_len": args.prompt_len, "shared_prompts": args.shared_prompts, "mini_batch_split": args.split,
        "max_len": max(max(b.seq_lens.tolist()) for b in batches[1:]),
        "prox_time_s": statistics.median(prox), "model_params": sum(p.numel() for p in engine._module.parameters()),
        "batch_seqs": args.batch, "mean_tokens_per_step": statistics.mean(b.num_tokens for b in batches[1:]),
        "threads": args.threads, "dtype": args.dtype, "token_budget": args.token_budget, "steps": args.steps,
        "tokens_per_s": statistics.median(rates), "step_time_s": statistics.median(times),
        "torch": torch.__version__,
    })
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
