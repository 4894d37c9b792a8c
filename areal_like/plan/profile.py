"""Measure a cost file on the machine at hand (short runs of the real components).

- decode: the embedded engine (`EmbeddedEngine`, the class the rollout servers run) at a
  few batch sizes and two context lengths; a least-squares fit of the iteration time to
  `base + per_seq·n + per_context_token·Σcontext`;
- prefill: the engine's first step over fresh prompts (tokens / s);
- train: `TorchTrainEngine.train_step` (the trainer's class) at two batch sizes, fitted to
  `fixed + seconds_per_token · tokens`;
- weight sync: a version written and read back through the disk transport (`weight_sync.disk`),
  bytes / s (the dist transport needs a second process; bench/weight_sync.py measures it);
  and the snapshot the trainer is held for before a broadcast goes to the background
  (`DistWeightSender.send`: the copy into a flat staging buffer and its digests), bytes / s.

Each part takes a few seconds; the numbers are as noisy as the machine is busy, so the
file records the load average next to them.
"""

from __future__ import annotations

import logging
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from areal_like.core.config import DiskWeightSyncConfig, ExperimentConfig
from areal_like.core.types import SamplingParams, Trajectory
from areal_like.plan.costs import CostModel, DecodeCost, EpisodeCost, LengthDist, TrainCost, WeightSyncCost

__all__ = ["profile", "fit_linear", "default_lengths", "default_episode"]

log = logging.getLogger(__name__)


def fit_linear(xs: list[list[float]], ys: list[float]) -> list[float]:
    """Non-negative least squares by clipping: y ≈ Σ c_i x_i (small systems, numpy)."""
    import numpy as np

    a, b = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    coef, *_ = np.linalg.lstsq(a, b, rcond=None)
    return [max(0.0, float(c)) for c in coef]


def _decode_points(engine: Any, vocab: int, batches: tuple[int, ...], prompt_lens: tuple[int, ...],
                   new_tokens: int) -> tuple[list[list[float]], list[float], float]:
    """(features, iteration seconds) per run, and the prefill rate seen on the first steps."""
    rng = random.Random(0)
    xs, ys, pre_tok, pre_s = [], [], 0, 0.0
    for p in prompt_lens:
        for n in batches:
            for i in range(n):
                ids = [rng.randrange(4, vocab) for _ in range(p)]
                engine.add_request(f"p{p}-n{n}-{i}", ids, SamplingParams(max_tokens=new_tokens, seed=i))
            t0 = time.perf_counter()
            engine.step()  # admits and prefills everyone
            pre_s += time.perf_counter() - t0
            pre_tok += n * p
            t0 = time.perf_counter()
            iters = 0
            while engine.has_unfinished():
                engine.step()
                iters += 1
            dt = (time.perf_counter() - t0) / max(1, iters)
            ctx = n * (p + new_tokens / 2)
            xs.append([1.0, float(n), ctx])
            ys.append(dt)
            log.info("decode: batch %d, prompt %d: %.2f ms/iteration", n, p, dt * 1e3)
    return xs, ys, pre_tok / max(pre_s, 1e-9)


def _trajectories(n: int, vocab: int, seed: int) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        r = rng.randint(40, 104)
        out.append(Trajectory(
            episode_id=f"e{i}", group_id=f"g{i // 8}", prompt_ids=[rng.randrange(4, vocab) for _ in range(24)],
            response_ids=[rng.randrange(4, vocab) for _ in range(r)], response_mask=[1] * r,
            response_logprobs=[-2.0] * r, response_versions=[0] * r, reward=float(i % 2)))
    return out


def _train_points(model: str, cfg: ExperimentConfig) -> tuple[list[list[float]], list[float], int]:
    from train_cluster.batch import build_batch
    from train_cluster.torch_engine import TorchTrainEngine

    # The config's own train section (mini-batches, loss, token budget): a step of the
    # quickstart applies `train.mini_batches` = 4 optimizer steps, and profiling a 1-mini-batch
    # step instead measured ~0.6 of its cost per token (docs/planning.md, out of sample).
    tcfg = cfg.train.model_copy(deep=True)
    eng = TorchTrainEngine(model, tcfg)
    vocab = eng._module.config.vocab_size
    eng.train_step(build_batch(_trajectories(16, vocab, 99), tcfg.loss))  # warm-up
    xs, ys = [], []
    for k, n in enumerate((16, 64, 16, 64)):
        b = build_batch(_trajectories(n, vocab, k), tcfg.loss)
        t0 = time.perf_counter()
        eng.train_step(b)
        dt = time.perf_counter() - t0
        xs.append([1.0, float(b.num_tokens)])
        ys.append(dt)
        log.info("train: %d sequences, %d tokens: %.2f s", n, b.num_tokens, dt)
    nbytes = sum(t.numel() * t.element_size() for _, t in eng.named_weights())
    return xs, ys, nbytes


def _weight_sync_rate(model_path: str) -> tuple[float, float, int]:
    """(latency s, bytes/s, bytes) of disk-transport versions of the model's weights."""
    from safetensors.torch import load_file

    from weight_sync.disk import DiskWeightReceiver, DiskWeightSender

    files = sorted(Path(model_path).glob("*.safetensors"))
    tensors: dict[str, Any] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    with tempfile.TemporaryDirectory(prefix="profile_ws_") as d:
        wcfg = DiskWeightSyncConfig(type="disk", disk_path=d)
        send, recv = DiskWeightSender(wcfg, d), DiskWeightReceiver(wcfg, d)
        times = []
        for v in range(1, 4):
            t0 = time.perf_counter()
            meta = send.send(v, iter(tensors.items()))
            _, it = recv.receive(meta)
            for _ in it:
                pass
            times.append(time.perf_counter() - t0)
    best = min(times)
    log.info("weight sync (disk): %d bytes in %.4f s", nbytes, best)
    return 0.0, nbytes / max(best, 1e-9), nbytes


def _snapshot_rate(model_path: str) -> float:
    """Bytes / s of what `DistWeightSender.send` does before its background thread starts:
    pack every tensor into one flat staging buffer and digest each slot (best of 3)."""
    import torch
    from safetensors.torch import load_file

    from weight_sync.meta import FlatLayout, spec_of

    tensors: dict[str, Any] = {}
    for f in sorted(Path(model_path).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    items = list(tensors.items())
    layout = FlatLayout.from_metas(spec_of(items))
    staging = torch.empty(layout.total_bytes, dtype=torch.uint8)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for slot, (_, t) in zip(layout.slots, items, strict=True):
            layout.view(staging, slot).copy_(t)
            layout.slot_digest(staging, slot)
        times.append(time.perf_counter() - t0)
    log.info("snapshot: %d bytes in %.4f s", layout.total_bytes, min(times))
    return layout.total_bytes / max(min(times), 1e-9)


def default_lengths(cfg: ExperimentConfig) -> LengthDist:
    """What `profile` writes for the generated lengths: a guess from the config alone
    (lognormal, median half of `rollout.response_length`), not a measurement."""
    return LengthDist(kind="lognormal", median=cfg.rollout.response_length / 2, sigma=0.6)


def default_episode(cfg: ExperimentConfig) -> EpisodeCost:
    """What `profile` writes for the agent loop around the generate calls (the quickstart's
    tool loop: up to two turns, a fast tool, a short tool answer): from the config alone."""
    return EpisodeCost(prompt_tokens=24, turns=min(2, cfg.agent.max_assistant_turns), tool_latency_s=0.001,
                       tool_response_tokens=4)


def profile(cfg: ExperimentConfig, model_path: str, *, threads: int = 1, quick: bool = False) -> CostModel:
    """Measure decode, prefill, train and weight-sync costs here; returns a validated CostModel."""
    import torch

    from rollout_cluster.engine.embedded import EmbeddedEngine

    torch.set_num_threads(threads)
    from areal_like.core.config import EmbeddedEngineConfig

    ecfg = cfg.rollout.engine  # the profile times the embedded engine; a vLLM config lends no shape
    max_batch, max_seq = (ecfg.max_batch_size, ecfg.max_seq_len) if isinstance(ecfg, EmbeddedEngineConfig) else (64, 512)

    engine = EmbeddedEngine(model_path, EmbeddedEngineConfig(max_batch_size=max_batch, max_seq_len=max_seq),
                            eos_token_ids=[])
    batches = (1, 8, 32) if quick else (1, 8, 32, min(64, max_batch))
    long_prompt = max(32, min(max_seq // 2, max_seq - 64))
    xs, ys, prefill_rate = _decode_points(engine, engine.vocab_size, batches, (24, long_prompt), 24 if quick else 48)
    base, per_seq, per_ctx = fit_linear(xs, ys)
    txs, tys, nbytes = _train_points(model_path, cfg)
    fixed, per_tok = fit_linear(txs, tys)
    lat, bw, wbytes = _weight_sync_rate(model_path)
    snap_rate = _snapshot_rate(model_path)
    host = os.uname().nodename
    load = os.getloadavg()[0]
    return CostModel(
        source=f"areal-like profile on {host} ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}), "
               f"load average {load:.1f}",
        notes=(f"one device = one CPU core with {threads} torch thread(s); embedded engine, fp32; "
               "weight sync measured with the disk transport in one process"),
        hardware=f"CPU core ({host})", devices_per_node=os.cpu_count() or 1,
        shared_cores=float(os.cpu_count() or 1),  # both pools share this machine's cores
        decode=DecodeCost(base_s=base, per_seq_s=per_seq, per_context_token_s=per_ctx,
                          prefill_tokens_per_s=prefill_rate, max_batch=max_batch,
                          kv_capacity_tokens=max_batch * max_seq),
        train=TrainCost(backend=f"torch ({cfg.train.backend.type}) cpu", fixed_s=fixed,
                        seconds_per_token=max(per_tok, 1e-9), scaling_exponent=0.9),
        weight_sync=WeightSyncCost(model_bytes=wbytes or nbytes, latency_s=lat, intra_node_bytes_per_s=bw,
                                   inter_node_bytes_per_s=bw, snapshot_bytes_per_s=snap_rate),
        episode=default_episode(cfg),
        lengths=default_lengths(cfg),
    )
