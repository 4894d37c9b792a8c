"""Interrupt modes compared: recompute (default) vs keep (stale KV, ablation) vs wait.

Workload: 32 concurrent sampled requests with long-tailed forced lengths (eos
ignored), 64 more queued behind them, and a weight update (perturbed weights, a new
version) every --every steps until everything finishes. Per mode it reports
pause→resume latency (mean / max), tokens recomputed, throughput with frequent
updates (and without, as the baseline), how many responses span versions, and the
behaviour-logprob error: each token's recorded logprob vs a fresh HF forward pass
of the weights of its recorded version (recompute should be ~1e-6; keep is not).
Progress goes to stderr; the last stdout line is one JSON object (bench/_record.py).

    python bench/interrupt.py [--model DIR] [--every 16] [--max-len 200]
    python bench/interrupt.py --smoke   # 8 requests of at most 24 tokens, an update every 4 steps
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

from areal_like.core.config import EmbeddedEngineConfig
from areal_like.core.types import GenerateResult, SamplingParams
from rollout_cluster.engine.embedded import EmbeddedEngine

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _record  # noqa: E402

logger = logging.getLogger("bench.interrupt")


def workload(n: int, max_len: int, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(4, vocab) for _ in range(rng.randint(16, 48))] for _ in range(n)]
    lengths = [max(4, min(max_len, int(rng.paretovariate(1.2) * max_len / 8))) for _ in range(n)]
    return prompts, lengths


def perturbed(base: dict[str, torch.Tensor], seed: int, scale: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: t + scale * torch.randn(t.shape, generator=g) for n, t in base.items()}


def run_mode(
    model_dir: str,
    mode: str,
    prompts: list[list[int]],
    lengths: list[int],
    versions: list[dict[str, torch.Tensor]],
    every: int,
) -> tuple[dict, dict[str, GenerateResult]]:
    engine = EmbeddedEngine(
        model_dir,
        EmbeddedEngineConfig(max_batch_size=32, max_seq_len=320),
        interrupt_mode=mode,
        eos_token_ids=[],
    )
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=1.0, max_tokens=n, seed=i))
    done: dict[str, GenerateResult] = {}
    latencies = []
    steps = 0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step()
        steps += 1
        if versions and steps % every == 0 and engine.version + 1 < len(versions):
            v = engine.version + 1
            outs += engine.update_weights(versions[v].items(), v)
            latencies.append(engine.counters.pause_resume_latency_s_last)
        for o in outs:
            if o.result is not None:
                done[o.request_id] = o.result
    wall = time.perf_counter() - t0
    m = engine.metrics()
    stats = {
        "tok_s": round(sum(lengths) / wall, 1),
        "updates": len(latencies),
        "pause_resume_latency_s_mean": round(statistics.mean(latencies), 5) if latencies else 0.0,
        "pause_resume_latency_s_max": round(max(latencies), 5) if latencies else 0.0,
        "recompute_tokens": int(m["recompute_tokens"]),
        "interrupted_tokens": int(m["interrupted_tokens"]),
        "interrupts": int(m["interrupts"]),
        "responses_spanning_versions": sum(len(set(r.versions)) > 1 for r in done.values()),
    }
    return stats, done


@torch.inference_mode()
def logprob_error(
    model: torch.nn.Module,
    versions: list[dict[str, torch.Tensor]],
    prompts: list[list[int]],
    done: dict[str, GenerateResult],
) -> dict[str, float]:
    """max / mean |recorded - fresh forward of the recorded version| over all tokens."""
    errors: list[float] = []
    for v, weights in enumerate(versions):
        for name, t in weights.items():
            model.get_parameter(name).copy_(t)
        for i, p in enumerate(prompts):
            r = done[f"r{i}"]
            if v not in r.versions:
                continue
            logits = model(torch.tensor([p + r.token_ids])).logits[0, len(p) - 1 : -1]
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.token_ids)[:, None]).squeeze(-1)
            errors += [
                abs(lp - ref[j].item())
                for j, (lp, tv) in enumerate(zip(r.logprobs, r.versions, strict=True))
                if tv == v
            ]
    return {
        "logprob_err_max": float(f"{max(errors):.3g}"),
        "logprob_err_mean": float(f"{statistics.mean(errors):.3g}"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF model folder (default: the quickstart architecture, random init)")
    ap.add_argument("--every", type=int, default=16, help="steps between weight updates")
    ap.add_argument("--max-len", type=int, default=200)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--scale", type=float, default=0.02, help="std of the weight perturbation per version")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--versions", type=int, default=1000,
                    help="weight versions prepared up front (each a full copy of the model)")
    args, rec = _record.parse(ap, __file__, smoke={"requests": 8, "max_len": 24, "every": 4, "versions": 8})
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    tmp = None
    if args.model is None:
        from areal_like.models.tiny_model import init_model

        tmp = tempfile.TemporaryDirectory()
        args.model = str(init_model(Path(tmp.name) / "model", seed=args.seed))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    versions = [base] + [perturbed(base, args.seed + v, args.scale) for v in range(1, args.versions)]
    prompts, lengths = workload(args.requests, args.max_len, model.config.vocab_size, args.seed)
    baseline, _ = run_mode(args.model, "recompute", prompts, lengths, [], args.every)
    logger.info("no updates: %s", baseline)
    result: dict = {"bench": "interrupt", "every_steps": args.every, "baseline_tok_s": baseline["tok_s"]}
    for mode in ("recompute", "keep", "wait"):
        stats, done = run_mode(args.model, mode, prompts, lengths, versions, args.every)
        stats.update(logprob_error(model, versions, prompts, done))
        logger.info("%s: %s", mode, stats)
        result[mode] = stats
    rec.finish(result)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
