"""Full fine-tuning against LoRA at the real recipe's sizes: a train step by phase, the bytes
and seconds of a version, and the trainer's and a server's peak memory.

For each rank (0 = full fine-tuning) two fresh processes, one after the other, so each peak
is its own:
- trainer: a `TorchTrainEngine` (with `model.lora` at that rank) builds, takes a warm-up
  step and then `--steps` decoupled-PPO steps on the recipe's shape (16 answers of ~40–62
  tokens, one optimizer step); the step's time, its forward+backward and optimizer parts,
  the bytes of one version (`named_weights()`: the adapter with LoRA), its peak RSS;
- server: an `EmbeddedEngine` loads the model, then two versions of that shape (a
  version's load as the servers do it: stage and apply), timed; its peak RSS against the
  fp32 weights' bytes; then the recipe's generation shape on the last version (a prefill
  of 16 × 40 tokens, a decode step of 16 rows: with LoRA the adapter runs beside the base).

    python bench/lora.py                  # SmolLM2-135M-Instruct (fetch it first), ranks 0,8,16,32
    python bench/lora.py --smoke          # the toy model, ranks 0,4, one step
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _record import parse  # noqa: E402

sys.path.pop(0)

SMOKE = {"model": "areal_like/assets/quickstart_model", "ranks": "0,4", "steps": 1, "vocab_cap": 60}


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _trainer(model: str, rank: int, steps: int, threads: int, vocab_cap: int | None) -> dict[str, Any]:
    import random

    import torch

    from areal_like.core.config import LoraConfig, TorchBackendConfig, TrainConfig
    from areal_like.core.types import Trajectory
    from train_cluster.batch import build_batch
    from train_cluster.torch_engine import TorchTrainEngine

    cfg = TrainConfig(lr=2e-5, token_budget=2048, backend=TorchBackendConfig(threads=threads))
    t0 = time.perf_counter()
    engine = TorchTrainEngine(model, cfg, lora=LoraConfig(rank=rank) if rank else None)
    build_s = time.perf_counter() - t0
    vocab = vocab_cap or engine._module.config.vocab_size

    def batch(seed: int) -> Any:
        rng = random.Random(seed)
        trajs = []
        for g in range(4):  # 4 prompts x 4 answers, the recipe's step
            prompt = [rng.randrange(4, vocab) for _ in range(40)]
            for k in range(4):
                n = rng.randint(4, 22)
                trajs.append(Trajectory(episode_id=f"{seed}-{g}-{k}", group_id=f"{seed}-{g}", prompt_ids=prompt,
                                        response_ids=[rng.randrange(4, vocab) for _ in range(n)],
                                        response_mask=[1] * n, response_logprobs=[-2.0] * n,
                                        response_versions=[0] * n, reward=float(k % 2), temperature=1.0))
        return build_batch(trajs, cfg.loss)

    engine.train_step(batch(0))  # warm-up
    stats = []
    for s in range(steps):
        b = batch(s + 1)
        t = time.perf_counter()
        st = engine.train_step(b)
        st["wall"] = time.perf_counter() - t
        stats.append(st)
    t = time.perf_counter()
    wire = [(n, x.detach().clone()) for n, x in engine.named_weights()]
    snapshot_s = time.perf_counter() - t
    trainable = sum(p.numel() for p in engine._module.parameters() if p.requires_grad)
    return {"build_s": round(build_s, 2), "step_s": round(statistics.median(s["wall"] for s in stats), 3),
            "fwd_bwd_s": round(statistics.median(s["fwd_bwd_time_s"] for s in stats), 3),
            "optimizer_s": round(statistics.median(s["optimizer_time_s"] for s in stats), 3),
            "trainable_params": trainable, "version_bytes": sum(x.numel() * x.element_size() for _, x in wire),
            "snapshot_s": round(snapshot_s, 3), "trainer_peak_rss_mb": round(_peak_mb()),
            "threads": torch.get_num_threads()}


def _decode(runner: Any, rows: int = 16, prompt: int = 40, tokens: int = 16) -> dict[str, float]:
    """The recipe's generation shape on the loaded version: one prefill of 16 prompts of 40
    tokens, then the median of 32 decode steps of 16 rows. With LoRA the adapter runs
    beside the base weights; its cost is measured in this process, the steps alternating
    with the adapter switched off (what full weights, or a merged version, cost), since
    separate processes differ by more than the adapter costs."""
    import random

    import torch

    rng = random.Random(0)
    vocab = min(1000, runner.vocab_size)
    ids = [[rng.randrange(4, vocab) for _ in range(prompt)] for _ in range(rows)]
    kv = runner.new_kv(rows, prompt + tokens + 1)
    adapters = (runner._sites, runner._head)
    steps: dict[bool, list[float]] = {True: [], False: []}
    with torch.inference_mode():
        t = time.perf_counter()
        runner.forward(kv, 0, ids, [0] * rows)
        prefill = time.perf_counter() - t
        for k in range(2 * tokens):
            on = k % 2 == 0 or not adapters[0]
            runner._sites, runner._head = adapters if on else ({}, None)
            runner._pack()
            t = time.perf_counter()
            runner.forward(kv, 0, [[rng.randrange(4, vocab)] for _ in range(rows)], [prompt + k // 2] * rows)
            steps[on].append(time.perf_counter() - t)
    out = {"prefill_s": round(prefill, 3), "decode_step_s": round(statistics.median(steps[True]), 4)}
    if steps[False]:
        out["decode_step_no_adapter_s"] = round(statistics.median(steps[False]), 4)
    return out


def _versions(model: str, rank: int, state: dict[str, Any]) -> Any:
    """A maker of versions of this model's shape: full weights (rank 0), or an adapter (A,
    scale·B per linear layer but the head)."""
    import torch
    from safetensors.torch import load_file

    if rank:  # an adapter version of this model's shape: A, scale*B per linear layer but the head
        names = [n.removesuffix(".weight") for n, t in state.items()
                 if n.endswith("proj.weight") and t.dim() == 2]
        g = torch.Generator().manual_seed(0)

        def version() -> list[tuple[str, Any]]:
            out = []
            for x in names:
                o, i = state[f"{x}.weight"].shape
                out += [(f"{x}.lora_A.weight", torch.randn(rank, i, generator=g) * 0.01),
                        (f"{x}.lora_B.weight", torch.randn(o, rank, generator=g) * 0.01)]
            return out
        return version
    full = {k: v for f in sorted(Path(model).glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    return lambda: list(full.items())


def _vllm_server(model: str, rank: int) -> dict[str, Any]:
    """vLLM's load of a version (an adapter is merged into the folder's weights in each
    worker, then reloaded): seconds for the first and the second, as `_server`."""
    import asyncio

    from safetensors.torch import load_file

    from areal_like.core.config import VLLMEngineConfig
    from rollout_cluster.engine.vllm_engine import VLLMEngine

    state = {k: v for f in sorted(Path(model).glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    version = _versions(model, rank, state)

    async def main() -> list[float]:
        engine = VLLMEngine(model, VLLMEngineConfig(kv_cache_gb=0.5, max_model_len=512), seed=0)
        loads = []
        try:
            for v in (1, 2):
                named = version()
                t = time.perf_counter()
                await engine.update_weights(iter(named), v)
                loads.append(time.perf_counter() - t)
        finally:
            await engine.close()
        return loads

    loads = asyncio.run(main())
    return {"load_first_s": round(loads[0], 3), "load_s": round(loads[1], 3)}


def _server(model: str, rank: int) -> dict[str, Any]:
    import torch

    from rollout_cluster.engine import EmbeddedEngine

    torch.set_num_threads(1)
    files = sorted(Path(model).glob("*.safetensors"))
    weights_mb = sum(f.stat().st_size for f in files) / 1e6
    engine = EmbeddedEngine(model)
    built_mb = _peak_mb()
    version = _versions(model, rank, engine.runner._state)
    loads = []
    for v in (1, 2):
        named = version()
        t = time.perf_counter()
        engine.load_weights(iter(named), v)
        loads.append(time.perf_counter() - t)
        del named
    peak = _peak_mb()
    return {"load_first_s": round(loads[0], 3), "load_s": round(loads[1], 3), "server_built_rss_mb": round(built_mb),
            **_decode(engine.runner),
            "server_peak_rss_mb": round(peak), "weights_mb": round(weights_mb),
            "server_peak_over_weights": round(peak / weights_mb, 2) if weights_mb else None}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="an HF folder, or a name `areal-like model fetch` knows (fetched)")
    ap.add_argument("--ranks", default="0,8,16,32", help="LoRA ranks to measure; 0 is full fine-tuning")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="the trainer's torch threads (the recipe's: 1)")
    ap.add_argument("--engine", choices=("embedded", "vllm"), default="embedded",
                    help="the server's engine (vllm: run under .venv-vllm; it merges each adapter into the folder's "
                         "weights and reloads, so only load times are measured)")
    ap.add_argument("--vocab-cap", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # ROLE:RANK, in a child process
    args, rec = parse(ap, __file__, SMOKE, argv)
    model = args.model
    if not Path(model).is_dir():
        from areal_like.models.fetch import cached_folder

        found = cached_folder(model)
        if found is None:
            raise RuntimeError(f"{model} is neither a folder nor a fetched model: areal-like model fetch {model}")
        model = str(found)
    if args.one:
        role, rank = args.one.split(":")
        out = (_trainer(model, int(rank), args.steps, args.threads, args.vocab_cap) if role == "trainer"
               else _vllm_server(model, int(rank)) if args.engine == "vllm" else _server(model, int(rank)))
        print(json.dumps(out))
        return out
    rows: dict[str, dict[str, Any]] = {}
    for rank in (int(r) for r in args.ranks.split(",")):
        row: dict[str, Any] = {}
        for role in ("trainer", "server"):
            cmd = [sys.executable, __file__, "--one", f"{role}:{rank}", "--model", model, "--steps", str(args.steps),
                   "--threads", str(args.threads), "--engine", args.engine, "--no-record"]
            if args.vocab_cap:
                cmd += ["--vocab-cap", str(args.vocab_cap)]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            if p.returncode != 0:
                raise RuntimeError(f"{role} at rank {rank} failed:\n{p.stderr[-3000:]}")
            row.update(json.loads(p.stdout.strip().splitlines()[-1]))
        name = f"lora_r{rank}" if rank else "full"
        rows[name] = row
        print(f"[lora] {name}: {json.dumps(row)}", file=sys.stderr, flush=True)
    full = rows.get("full")
    summary = {}
    for name, row in rows.items():
        line = (f"step {row['step_s']:.2f} s (fwd+bwd {row['fwd_bwd_s']:.2f}, optimizer {row['optimizer_s']:.3f}); "
                f"version {row['version_bytes'] / 1e6:.1f} MB, loaded in {row['load_s']:.3f} s")
        if "decode_step_s" in row:
            line += f"; decode step {row['decode_step_s'] * 1e3:.1f} ms"
            if "decode_step_no_adapter_s" in row:
                line += f" ({row['decode_step_no_adapter_s'] * 1e3:.1f} without the adapter)"
            line += f"; trainer {row['trainer_peak_rss_mb']} MB, server {row['server_peak_rss_mb']} MB"
        if full is not None and name != "full":
            line += f"; bytes {row['version_bytes'] / full['version_bytes']:.1%} of full"
        summary[name] = line
    return rec.finish({"model": model, "engine": args.engine, "steps": args.steps, "rows": rows, "summary": summary})


if __name__ == "__main__":
    try:
        main()
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
