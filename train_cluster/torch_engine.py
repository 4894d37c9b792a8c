"""Torch backend: an HF causal LM trained with AdamW, single process, DDP or FSDP2.

One `TorchTrainEngine` lives in each train worker process. With
`train.backend.world_size == 1` it is a plain model in the caller's process. With
more workers every process builds its engine after joining a torch.distributed group
(`init_train_group`, done for you by `TrainWorkerGroup`): gloo on CPU, NCCL on GPU,
on a TCPStore of its own, so it never collides with the weight-sync group.

Precision: the module's weights are always fp32 and AdamW steps them; with
`model.dtype: bfloat16` (or `auto` on hardware with native bf16) forward and backward run
under bf16 autocast, so bf16 training keeps fp32 master weights (small updates accumulate
instead of being rounded away).
Checkpoints hold the fp32 weights; `named_weights()` hands out the model dtype.

`named_weights()` yields the HF `state_dict()` names and tensors minus duplicates:
with tied embeddings HF's state_dict holds the same tensor as both
`model.embed_tokens.weight` and `lm_head.weight`; we yield only the first. Load
them with `model.load_state_dict(dict(engine.named_weights()), strict=False)` —
the only missing keys are the tied ones, which follow their source.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import socket
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from areal_like.core.config import LoraConfig, TorchBackendConfig, TrainConfig
from areal_like.core.precision import bound_onednn_cache, resolve_dtype, torch_dtype
from areal_like.models.lite import load_causal_lm
from train_cluster.batch import TrainBatch
from train_cluster.engine import TrainEngine, lr_factor
from train_cluster.shared_prefix import plan_calls, plan_cost, prefix_clusters, shared_logits

__all__ = ["TorchTrainEngine", "init_train_group", "free_port", "check_device"]

logger = logging.getLogger(__name__)

_COMPLETE = "COMPLETE"


def free_port(host: str = "127.0.0.1") -> int:
    """A currently free TCP port (for a fresh TCPStore)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def check_device(device: str) -> torch.device:
    """Fail at start-up, with the fix in the message, when the device cannot run here."""
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "train.backend.device=cuda but no CUDA GPU is visible to this process "
            "(torch.cuda.is_available() is False); set train.backend.device=cpu or give the "
            "train pool GPUs (cluster.train_pool.num_gpus)"
        )
    return torch.device(device)


def init_train_group(rank: int, world_size: int, store_addr: str, device: str = "cpu",
                     timeout_s: float = 300.0) -> None:
    """Join the trainers' torch.distributed default group on the TCPStore at `store_addr`.

    Rank 0 hosts the store. gloo on CPU, NCCL on GPU: the same code either way.
    """
    host, port = store_addr.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), world_size, is_master=rank == 0,
                          timeout=timedelta(seconds=timeout_s))
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


class TorchTrainEngine(TrainEngine):
    """Decoupled-PPO trainer for an HF causal LM folder (see `TrainEngine` for the algorithm)."""

    def __init__(self, model_path: str | Path, train_cfg: TrainConfig, *, dtype: str = "float32",
                 seed: int = 0, lora: LoraConfig | None = None) -> None:
        backend = train_cfg.backend
        if not isinstance(backend, TorchBackendConfig):
            raise ValueError(f"TorchTrainEngine needs train.backend.type=torch, got {backend.type!r}")
        dtype = resolve_dtype(dtype, backend.device)  # refuses float16: it would need loss scaling
        bound_onednn_cache()
        super().__init__(train_cfg)
        self.backend = backend
        self.device = check_device(backend.device)
        if backend.device == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.world_size = backend.world_size
        self.group = None
        if self.world_size > 1:
            if not dist.is_initialized() or dist.get_world_size() != self.world_size:
                raise RuntimeError(
                    f"train.backend.world_size={self.world_size} needs a torch.distributed group of that size "
                    "in every worker: use TrainWorkerGroup, or call init_train_group() in each process first"
                )
            self.rank = dist.get_rank()
        else:
            self.rank = 0
        torch.set_num_threads(backend.threads)
        torch.manual_seed(seed)
        self.seed = seed

        self.dtype = torch_dtype(dtype)
        # fp32 master weights; bf16 compute comes from autocast (`_autocast`)
        module = load_causal_lm(model_path, torch.float32, backend.model_impl).to(self.device)
        module.config.use_cache = False
        self.model_path = model_path
        self.lora = lora if lora is not None and lora.enabled else None
        self._lora_scales: dict[str, float] = {}
        """LoRA: {adapted layer: alpha / r}; empty for full fine-tuning."""
        if self.lora is not None:
            from areal_like.models.lora import add_adapters, load_adapter

            self._lora_scales = add_adapters(module, self.lora)
            if self.lora.init_from:
                module.load_state_dict(load_adapter(self.lora.init_from, self._lora_scales), strict=False)
        self._module = module
        self._model: Any = module
        self._fsdp = self.world_size > 1 and backend.strategy == "fsdp"
        if self.world_size > 1 and backend.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            # broadcast_buffers=False: the only buffers (rotary inv_freq) are constants, and a
            # broadcast on every forward would add a collective to no-grad forwards.
            self._model = DDP(module, broadcast_buffers=False,
                              device_ids=[self.device.index] if self.device.type == "cuda" else None)
        elif self._fsdp:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(self.device.type, (self.world_size,))
            for layer in module.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(module, mesh=mesh)
        sched, warm, total = train_cfg.lr_schedule, train_cfg.warmup_steps, train_cfg.total_steps
        params = [p for p in module.parameters() if p.requires_grad]  # LoRA: the adapters only

        def factor(step: int) -> float:
            return lr_factor(step, schedule=sched, warmup=warm, total=total)

        from train_cluster.optim import AdamW

        # fused: one kernel per parameter instead of a dozen passes over each; on this CPU 0.10 s
        # against 0.81 s for 135M parameters (design §10.45). Not for FSDP's sharded tensors.
        self._optimizer = AdamW(params, lr=train_cfg.lr, betas=train_cfg.betas, weight_decay=train_cfg.weight_decay,
                                fused=not self._fsdp)
        if self.device.type == "cpu":  # the first step's allocation, paid now while the first batch is sampled
            self._optimizer.init_state()
        self._scheduler = torch.optim.lr_scheduler.LambdaLR(self._optimizer, factor)
        self._ref: Any = None
        if train_cfg.loss.kl_coef > 0:
            self._ref = load_causal_lm(model_path, torch_dtype(dtype), backend.model_impl).to(self.device)
            self._ref.eval().requires_grad_(False)
        logger.info("TorchTrainEngine rank %d/%d on %s (%s, %s, %d threads)", self.rank, self.world_size,
                    self.device, backend.strategy if self.world_size > 1 else "single", dtype, backend.threads)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    @property
    def scheduler(self) -> Any:
        return self._scheduler

    # ---- colocated: the devices between steps belong to the rollout servers ---------------

    def offload(self) -> None:
        """`cluster.colocate` on CUDA: move the weights, the optimizer state (and the KL
        reference) to host memory and free the cache, so a rollout server on the same GPU
        can wake; `onload` brings them back before the next step. No-op on CPU. Tensors
        handed out earlier (a weight broadcast still reading them) stay valid: parameters
        get new storage, the old one is not written."""
        self._move(torch.device("cpu"))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def onload(self) -> None:
        self._move(self.device)

    def _move(self, device: torch.device) -> None:
        if self.device.type != "cuda":
            return
        self._module.to(device)
        if self._ref is not None:
            self._ref.to(device)
        for state in self.optimizer.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.device != device and k != "step":
                    state[k] = v.to(device, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # ---- weights and checkpoints --------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF names and tensors, tied duplicates dropped (module docstring).

        Tensors are in the model dtype. In fp32 they alias the live weights (no copy);
        under bf16 they are rounded copies of the fp32 masters. Under FSDP each is
        gathered in full — a collective, so every rank must iterate in step.
        """
        if self.lora is not None:  # a version is its adapter (areal_like.models.lora)
            from areal_like.models.lora import wire_tensors

            yield from wire_tensors(self._module, self._lora_scales, self.dtype)
            return
        for name, t in self._master_weights():
            yield name, t.to(self.dtype)

    def export_weights(self, path: str | Path, max_shard_bytes: int | None = None) -> dict[str, Any]:
        """As `TrainEngine.export_weights`; with LoRA the weights are merged (an HF model any
        engine loads) and the adapter is written beside them in PEFT's format (`adapter/`)."""
        if self.lora is None:
            return super().export_weights(path, max_shard_bytes)
        from areal_like.models.hf_folder import DEFAULT_MAX_SHARD_BYTES, write_hf_weights
        from areal_like.models.lora import merged_weights, save_adapter

        merged = ((n, t.to(self.dtype)) for n, t in merged_weights(self._module, self._lora_scales,
                                                                    self._master_weights()))
        out = write_hf_weights(path, merged, write=self.rank == 0,
                               max_shard_bytes=max_shard_bytes or DEFAULT_MAX_SHARD_BYTES)
        save_adapter(Path(path) / "adapter", self._module, self._lora_scales, self.lora, self.model_path,
                     write=self.rank == 0)
        return out

    def _master_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """`named_weights` in full precision (fp32), for checkpoints."""
        params = dict(self._module.named_parameters(remove_duplicate=False))
        seen: set[int] = set()
        for name, t in self._module.state_dict().items():
            p = params.get(name)
            if p is not None:
                if id(p) in seen:
                    continue
                seen.add(id(p))
                t = p
            if hasattr(t, "full_tensor"):
                t = t.full_tensor()
            yield name, t.detach()

    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        """Model (safetensors + config.json: the folder is also an HF model; with LoRA the adapter
        alone, in PEFT's format), optimizer, schedule,
        version and counters, per-rank RNG states and `extra`; a COMPLETE marker is written last."""
        from safetensors.torch import save_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        out = Path(path)
        try:
            extra_json = json.dumps(extra or {})
        except TypeError as e:
            raise TypeError(f"checkpoint extra must be JSON-serialisable: {e}") from None
        if self.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / _COMPLETE).unlink(missing_ok=True)
        weights = None
        if self.lora is not None:  # the adapter only: the base is model.path's
            from areal_like.models.lora import save_adapter

            save_adapter(out, self._module, self._lora_scales, self.lora, self.model_path, write=self.rank == 0)
        else:
            weights = {n: t.to("cpu", copy=True).contiguous() for n, t in self._master_weights()}
        optim = get_optimizer_state_dict(self._module, self.optimizer,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            if weights is not None:
                save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
                self._module.config.save_pretrained(out)
            torch.save(optim, out / "optimizer.pt")
            state = {"version": self.version, "skipped": self.skipped, "world_size": self.world_size,
                     "scheduler": self.scheduler.state_dict(), "extra": json.loads(extra_json)}
            (out / "trainer_state.json").write_text(json.dumps(state, indent=1))
        self._barrier()
        torch.save(_rng_state(), out / f"rng_rank{self.rank}.pt")
        self._barrier()
        if self.rank == 0:
            (out / _COMPLETE).write_text("ok\n")
        logger.info("saved checkpoint v%d to %s", self.version, out)

    def load(self, path: str | Path) -> dict[str, Any]:
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        src = Path(path)
        if not (src / _COMPLETE).is_file():
            raise FileNotFoundError(f"{src} is not a complete checkpoint (no {_COMPLETE} marker)")
        state = json.loads((src / "trainer_state.json").read_text())
        if self.lora is not None:
            from areal_like.models.lora import load_adapter

            weights = load_adapter(src, self._lora_scales)
        else:
            if not (src / "model.safetensors").is_file():
                raise FileNotFoundError(f"{src} holds no model.safetensors (a LoRA checkpoint? set model.lora as "
                                        "the run that wrote it had it)")
            weights = load_file(str(src / "model.safetensors"), device="cpu")
            _check_weight_names(self._module, weights)
        full = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(self._module, weights, options=full)
        optim = torch.load(src / "optimizer.pt", weights_only=True, map_location="cpu")
        set_optimizer_state_dict(self._module, self.optimizer, optim, options=full)
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = int(state["version"])
        self.skipped = int(state["skipped"])
        rng_file = src / f"rng_rank{self.rank}.pt"
        if rng_file.is_file():
            _set_rng_state(torch.load(rng_file, weights_only=True))
        else:
            logger.warning("checkpoint %s has no RNG state for rank %d (saved with world_size=%s)",
                           src, self.rank, state.get("world_size"))
        logger.info("loaded checkpoint v%d from %s", self.version, src)
        return dict(state.get("extra", {}))

    # ---- hooks ------------------------------------------------------------------------------------

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def _forward_logits(self, mb: TrainBatch, rows: torch.Tensor | None = None) -> torch.Tensor:
        with self._autocast():
            return _hf_logits(self._model, mb, self.device, split=self.world_size == 1, rows=rows)

    def _ref_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        def forward(mb: TrainBatch, rows: torch.Tensor | None = None) -> torch.Tensor:
            with self._autocast():
                return _hf_logits(self._ref, mb, self.device, split=self.world_size == 1, rows=rows)

        with torch.no_grad():
            return self._logprobs_with(forward, batch)

    def _train_mode(self, on: bool) -> None:
        self._module.train(on)

    def _clip_grad(self, max_norm: float) -> torch.Tensor:
        norm = torch.nn.utils.clip_grad_norm_(self._module.parameters(), max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return norm.detach().float().cpu()

    def _optimizer_step(self) -> None:
        self.optimizer.step()

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _scheduler_step(self) -> None:
        self.scheduler.step()

    def _current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _grad_sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        if not last and hasattr(self._model, "no_sync"):
            return self._model.no_sync()
        return contextlib.nullcontext()

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)


def _hf_logits(model: Any, mb: TrainBatch, device: torch.device, *, split: bool = True,
               rows: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [N, V] of a micro-batch's packed tokens, computed the cheapest way; with `rows`
    (packed positions) only theirs, [len(rows), V]: one-row layouts (packed, shared prefix)
    project only those positions onto the vocabulary (`logits_to_keep`), padded ones select
    them after.

    Two ways to run sequences of different lengths: one packed row attends through a dense
    block-diagonal mask, so attention costs (Σ len)² but no token is wasted; right-padded rows
    are plain causal attention, n · max² of it, and every row computes its padding through
    the linear layers too. Which is cheaper depends on the lengths: for the quickstart's ~16
    sequences of ~50 tokens padding is 10x less attention; with a long tail (one answer of
    250 tokens among answers of 60) padding the short ones to 250 computes four times the
    tokens. So the sequences, sorted by length, are cut into runs (`_split_by_cost`), each run
    computed packed or padded, whichever the cost model says is cheaper, and the logits
    gathered back in packed order: same numbers, per sequence, as one packed row (tested).
    Samples of one group share their prompt: when the cost model says so, the micro-batch is
    laid out with each common prefix computed once (train_cluster/shared_prefix.py).
    `split=False` (data parallel: DDP wants one forward per backward, FSDP the same number
    of all-gathers on every rank) keeps one call, packed or padded by the same cost model.
    docs/benchmarks.md, per-step profile."""
    lens = mb.seq_lens.tolist()
    if len(lens) == 1:
        return _hf_packed_logits(model, mb, device, rows)
    cost = _cost_model(model)
    runs = _split_by_cost(lens, cost, max_runs=None if split else 1)
    clusters = prefix_clusters(mb)
    if len(clusters) < len(lens):  # some sequences share a prompt: compute it once if cheaper
        call = _CALL_TOKENS * cost[0]
        calls = plan_calls(clusters, lens, cost, call, max_calls=None if split else 1)
        if plan_cost(calls, lens, cost, call) < _runs_cost(runs, lens, cost, call):
            return shared_logits(model, mb, calls, device, rows)
    if len(runs) == 1:
        idx, padded = runs[0]
        if len(idx) == len(lens):
            if not padded:
                return _hf_packed_logits(model, mb, device, rows)
            logits = _hf_padded_logits(model, mb, lens, device)
            return logits if rows is None else logits[rows.to(device)]
    offs = mb.offsets().tolist()
    parts: list[torch.Tensor] = []
    order: list[torch.Tensor] = []
    for idx, padded in runs:
        sub = mb.select(idx)
        parts.append(_hf_padded_logits(model, sub, [lens[i] for i in idx], device) if padded
                     else _hf_packed_logits(model, sub, device))
        order.append(torch.cat([torch.arange(offs[i], offs[i + 1]) for i in idx]))
    logits = torch.cat(parts)
    where = torch.empty(mb.num_tokens, dtype=torch.int64)
    where[torch.cat(order)] = torch.arange(mb.num_tokens)
    return logits[(where if rows is None else where[rows]).to(logits.device)]


def _runs_cost(runs: list[tuple[list[int], bool]], lens: list[int], cost: tuple[float, float],
               call: float) -> float:
    """The modelled cost of `_split_by_cost`'s runs (the same terms it minimises)."""
    lin, pair = cost
    total = 0.0
    for idx, padded in runs:
        if padded:
            w = max(lens[i] for i in idx)
            total += call + (lin * w + pair * w * w) * len(idx)
        else:
            t = sum(lens[i] for i in idx)
            total += call + lin * t + pair * t * t
    return total


def _cost_model(model: Any) -> tuple[float, float]:
    """(cost of one token through the linear layers, cost of one attention score pair), in
    multiply-adds, from the model itself; cached on it."""
    model = getattr(model, "module", model)  # under DDP, the model it wraps
    cached = getattr(model, "_areal_cost_model", None)
    if cached is not None:
        return cached
    linear = float(sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)))
    cfg = getattr(model, "config", None)
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None) or 0
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None) or 0
    # Q·K and the weighted sum of V, every head; unknown shapes: the ratio measured here (~1000)
    pair = float(2 * hidden * layers) or max(linear / 1000.0, 1.0)
    cost = (linear or pair, pair)
    try:
        model._areal_cost_model = cost
    except AttributeError:  # a module that refuses attributes: recompute next time (cheap)
        pass
    return cost


_MAX_SPLIT_SEQS = 256
"""Above this many sequences in one micro-batch the cut is not searched (O(n²) steps of Python)."""
_CALL_TOKENS = 128
"""What one more forward call costs, in tokens through the linear layers: the model's per-call
overhead (Python, per-layer dispatch, the backward's bookkeeping) was ~18 ms forward and
backward for the quickstart model on one core, ~116 tokens' worth. For a large model this
overstates the overhead, which only makes the split more reluctant to cut."""


def _split_by_cost(lens: list[int], cost: tuple[float, float], *,
                   max_runs: int | None = None) -> list[tuple[list[int], bool]]:
    """Cut the sequences, sorted by length, into consecutive runs minimising the modelled
    cost (a call's overhead, tokens through the linear layers, attention score pairs), each
    run padded (True) or packed (False): an exact dynamic programme over the sorted order
    (n ≤ a few dozen per micro-batch, O(n²)). Measured on the quickstart model, one core:
    0.155 ms per token and 0.12–0.3 µs per score pair forward and backward, a ratio of ~900
    where the model's weights give 974."""
    lin, pair = cost
    call = _CALL_TOKENS * lin
    order = sorted(range(len(lens)), key=lambda i: (lens[i], i))
    s = [lens[i] for i in order]
    n = len(s)
    if max_runs == 1 or n > _MAX_SPLIT_SEQS:  # one call (or too many sequences for O(n²) in Python)
        tokens, width = sum(s), s[-1]
        return [(list(range(n)), (lin * width + pair * width * width) * n < lin * tokens + pair * tokens * tokens)]
    prefix = [0]
    for x in s:
        prefix.append(prefix[-1] + x)
    best = [0.0] + [float("inf")] * n
    cut: list[tuple[int, bool]] = [(0, False)] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # run = s[i:j]; its longest is s[j-1] (sorted)
            tokens = prefix[j] - prefix[i]
            packed = lin * tokens + pair * tokens * tokens
            width = s[j - 1]
            padded = (lin * width + pair * width * width) * (j - i)
            c = best[i] + call + min(packed, padded)
            if c < best[j]:
                best[j], cut[j] = c, (i, padded < packed)
    runs: list[tuple[list[int], bool]] = []
    j = n
    while j > 0:
        i, padded = cut[j]
        runs.append((sorted(order[i:j]), padded))
        j = i
    return runs[::-1]


def _hf_padded_logits(model: Any, mb: TrainBatch, lens: list[int], device: torch.device) -> torch.Tensor:
    """Right-padded rows, causal attention only (a real token never sees the padding after
    it), logits gathered back in packed order."""
    width = max(lens)
    keep = torch.arange(width).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)  # [n, width]
    ids = torch.zeros(len(lens), width, dtype=mb.input_ids.dtype)
    ids[keep] = mb.input_ids
    logits = model(input_ids=ids.to(device), use_cache=False).logits
    return logits[keep.to(device)]


def _hf_packed_logits(model: Any, mb: TrainBatch, device: torch.device,
                      rows: torch.Tensor | None = None) -> torch.Tensor:
    """One row of packed sequences. Position ids that restart at 0 make transformers build a
    block-diagonal causal mask (no attention mask given, no cache). `rows`: only theirs."""
    ids = mb.input_ids.to(device).unsqueeze(0)
    pos = mb.position_ids().to(device).unsqueeze(0)
    if rows is None:
        return model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    return model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=rows.to(device)).logits[0]


def _check_weight_names(module: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    expected = set(module.state_dict())
    unknown = set(weights) - expected
    tied = {n for n, _ in module.named_parameters(remove_duplicate=False)} - {
        n for n, _ in module.named_parameters()}
    missing = expected - set(weights) - tied
    if unknown or missing:
        raise ValueError(f"checkpoint weights do not match the model: unknown {sorted(unknown)[:5]}, "
                         f"missing {sorted(missing)[:5]}")


def _rng_state() -> dict[str, Any]:
    """RNG states as tensors and plain containers (loadable with weights_only=True)."""
    py = random.getstate()
    npst = np.random.get_state()
    out: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [npst[0], torch.from_numpy(np.asarray(npst[1], dtype=np.int64)), int(npst[2]), int(npst[3]),
                  float(npst[4])],
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _set_rng_state(st: dict[str, Any]) -> None:
    torch.set_rng_state(st["torch"])
    py = st["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = st["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), n[2], n[3], n[4]))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])

