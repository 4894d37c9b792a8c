"""Megatron-core backend: the same decoupled-PPO step on a tensor/data-parallel GPTModel.

Built for large models on GPUs: the HF Qwen2 folder is converted into a
Megatron-core `GPTModel` (local layer spec), split over `tensor_parallel_size`
ranks and replicated over `data_parallel_size` ranks, and trained by `TrainEngine`'s
shared step (accumulation, clipping and the non-finite skip are ours on both paths):

- `device: cuda`: Megatron's own `DistributedDataParallel` (fp32 gradient buffers)
  and distributed optimizer (`get_megatron_optimizer`, Adam with fp32 main params
  sharded over data-parallel ranks); the model weights stay in the model dtype.
- `device: cpu` (CI, small runs): torch DDP on the data-parallel group and torch
  AdamW, which steps fp32 master copies when the model is bf16 — the same contract:
  bf16 forward/backward, fp32 updates, tiny updates are not rounded away.

Weights leave as HF names in the model dtype (`named_weights` gathers the TP shards),
so weight sync and export do not know the backend.

Sequences are right-padded within a micro-batch (causal attention makes the padding
invisible to real tokens); Megatron's packed-sequence (THD) path needs Transformer
Engine and is not used. `kl_coef > 0` is refused at start-up (no reference model
here yet).

On CPU `shims.py` patches the three places where megatron-core's model code calls
CUDA unconditionally.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from areal_like.core.config import MegatronBackendConfig, TrainConfig
from areal_like.core.precision import resolve_dtype, torch_dtype
from train_cluster.batch import TrainBatch
from train_cluster.engine import TrainEngine, lr_factor
from train_cluster.megatron.convert import hf_to_megatron, iter_megatron_to_hf, padded_vocab_size
from train_cluster.torch_engine import _rng_state, _set_rng_state, check_device, free_port

__all__ = ["MegatronTrainEngine", "build_gpt_model"]

logger = logging.getLogger(__name__)

_COMPLETE = "COMPLETE"


def build_gpt_model(hf_cfg: Any, dtype: torch.dtype, tp: int, on_cpu: bool) -> Any:
    """A Megatron GPTModel with the architecture of an HF Qwen2 config (this rank's TP shard)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    if hf_cfg.model_type != "qwen2":
        raise ValueError(f"the megatron backend converts Qwen2 models; got model_type={hf_cfg.model_type!r}")
    rope = getattr(hf_cfg, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(hf_cfg, "rope_theta", 10000.0))
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope scaling {rope.get('rope_type')!r} is not converted to Megatron")
    cfg = TransformerConfig(
        num_layers=hf_cfg.num_hidden_layers, hidden_size=hf_cfg.hidden_size,
        num_attention_heads=hf_cfg.num_attention_heads, num_query_groups=hf_cfg.num_key_value_heads,
        ffn_hidden_size=hf_cfg.intermediate_size, kv_channels=hf_cfg.hidden_size // hf_cfg.num_attention_heads,
        normalization="RMSNorm", layernorm_epsilon=hf_cfg.rms_norm_eps,
        add_bias_linear=False, add_qkv_bias=True, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=on_cpu, perform_initialization=False,
    )
    model = GPTModel(
        cfg, get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=padded_vocab_size(hf_cfg.vocab_size, tp), max_sequence_length=hf_cfg.max_position_embeddings,
        position_embedding_type="rope", rotary_base=int(theta),
        share_embeddings_and_output_weights=hf_cfg.tie_word_embeddings, parallel_output=True,
    )
    _mark_tensor_parallel(model)
    return model


def _mark_tensor_parallel(model: torch.nn.Module) -> None:
    """Set Megatron's `tensor_model_parallel` attributes on the TP-split weights.

    Megatron sets them only inside its weight initialisers, which `perform_initialization=False`
    skips; its optimizer's grad norm needs them (replicated norms are counted once, split
    weights on every TP rank).
    """
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    for mod in model.modules():
        if isinstance(mod, (ColumnParallelLinear, VocabParallelEmbedding)):
            split = {"weight": 0, "bias": 0}
        elif isinstance(mod, RowParallelLinear):
            split = {"weight": 1}  # a row-parallel bias is replicated
        else:
            continue
        for name, dim in split.items():
            p = getattr(mod, name, None)
            if isinstance(p, torch.Tensor):
                p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1


class _LRSchedule:
    """Warmup and decay (`lr_factor`) set on the optimizer's param groups once per train step.

    Works for torch and Megatron optimizers alike (a Megatron optimizer is no
    `torch.optim.Optimizer`, so torch's LR schedulers cannot drive it).
    """

    def __init__(self, optimizer: Any, cfg: TrainConfig) -> None:
        self.optimizer, self.cfg, self.steps = optimizer, cfg, 0
        self._apply()

    def _apply(self) -> None:
        c = self.cfg
        lr = c.lr * lr_factor(self.steps, schedule=c.lr_schedule, warmup=c.warmup_steps, total=c.total_steps)
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def step(self) -> None:
        self.steps += 1
        self._apply()

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        self._apply()


class _GatherVocab(torch.autograd.Function):
    """All-gather vocab-parallel logits along the last dim; backward keeps this rank's slice.

    Every TP rank computes the same loss from the same gathered logits, so the
    gradient of a rank's own slice is already complete (no sum over ranks). This is
    Megatron's `gather_from_tensor_model_parallel_region`, whose buffer is hard-coded
    to CUDA; using our own also keeps the GPU path identical.
    """

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group, ctx.size = group, local.shape[-1]
        ctx.rank = dist.get_rank(group)
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad[..., ctx.rank * ctx.size:(ctx.rank + 1) * ctx.size].contiguous(), None


class MegatronTrainEngine(TrainEngine):
    """Decoupled-PPO trainer on Megatron-core. Every rank of the TP×DP grid builds one.

    Needs a torch.distributed group of exactly `tp × dp` ranks (`init_train_group`);
    a single-rank run creates its own one-process gloo group.
    """

    def __init__(self, model_path: str | Path, train_cfg: TrainConfig, *, dtype: str = "float32",
                 seed: int = 0) -> None:
        backend = train_cfg.backend
        if not isinstance(backend, MegatronBackendConfig):
            raise ValueError(f"MegatronTrainEngine needs train.backend.type=megatron, got {backend.type!r}")
        dtype = resolve_dtype(dtype, backend.device)
        if train_cfg.loss.kl_coef > 0:
            raise ValueError("train.loss.kl_coef > 0 is not supported by the megatron backend "
                             "(no reference model); use the torch backend or kl_coef=0")
        try:
            import megatron.core  # noqa: F401
        except ImportError as e:
            raise RuntimeError("train.backend.type=megatron needs megatron-core: pip install "
                               "megatron-core==0.16.1") from e
        super().__init__(train_cfg)
        self.device = check_device(backend.device)
        on_cpu = backend.device == "cpu"
        if on_cpu:
            logger.info("megatron backend on CPU: TP over gloo, torch AdamW (CUDA shims active)")
        tp, dp = backend.tensor_parallel_size, backend.data_parallel_size
        if not dist.is_initialized():
            if tp * dp > 1:
                raise RuntimeError(f"megatron tensor_parallel_size={tp} × data_parallel_size={dp} needs a "
                                   "torch.distributed group of that size: call init_train_group() in each process")
            store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=timedelta(seconds=60))
            dist.init_process_group("nccl" if not on_cpu else "gloo", store=store, rank=0, world_size=1)
        if dist.get_world_size() != tp * dp:
            raise RuntimeError(f"torch.distributed world size {dist.get_world_size()} != tensor_parallel_size {tp} "
                               f"× data_parallel_size {dp}")
        if not on_cpu:
            self.device = torch.device("cuda", torch.cuda.current_device())
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(tensor_model_parallel_size=tp)
        if ps.get_tensor_model_parallel_world_size() != tp:
            raise RuntimeError("Megatron model parallel state already initialised with another TP size")
        torch.manual_seed(seed)
        if on_cpu:
            from train_cluster.megatron.shims import install_cpu_shims

            install_cpu_shims(seed)
        else:
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(seed)
        self.tp, self.tp_rank, self.tp_group = tp, ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
        self.dp_rank = ps.get_data_parallel_rank()
        self.rank = dist.get_rank()
        self.on_cpu = on_cpu
        self.world_size = dp  # data-parallel ranks: what losses are averaged over
        self.group = ps.get_data_parallel_group()

        from transformers import AutoConfig, AutoModelForCausalLM

        self.hf_config = AutoConfig.from_pretrained(str(model_path))
        module = build_gpt_model(self.hf_config, torch_dtype(dtype), tp, on_cpu)
        if on_cpu:
            from train_cluster.megatron.shims import cpu_rotary

            cpu_rotary(module)
        hf_sd = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch_dtype(dtype)).state_dict()
        self._load_hf(module, hf_sd)
        # Every weight in the model dtype, as Megatron's Float16Module would (its torch-norm
        # fallback builds the RMSNorm weights in fp32); the fp32 copies live in the optimizer.
        self._module = module.to(self.device, torch_dtype(dtype))
        self._model: Any = module
        self._master: list[torch.Tensor] | None = None  # CPU bf16: fp32 copies the optimizer steps
        if on_cpu:
            if dp > 1:
                from torch.nn.parallel import DistributedDataParallel as DDP

                self._model = DDP(module, process_group=self.group, broadcast_buffers=False)
            params = list(module.parameters())
            if torch_dtype(dtype) != torch.float32:
                self._master = [p.detach().float().clone() for p in params]
                params = self._master
            self.optimizer: Any = torch.optim.AdamW(params, lr=train_cfg.lr, betas=train_cfg.betas,
                                                    weight_decay=train_cfg.weight_decay)
        else:
            self._model, self.optimizer = _megatron_ddp_and_optimizer(module, train_cfg, torch_dtype(dtype))
        self.scheduler = _LRSchedule(self.optimizer, train_cfg)
        logger.info("MegatronTrainEngine rank %d: tp %d/%d, dp %d/%d on %s (%s, %s optimizer)", self.rank,
                    self.tp_rank, tp, self.dp_rank, dp, self.device, dtype,
                    "torch AdamW" if on_cpu else "Megatron distributed")

    def _load_hf(self, module: torch.nn.Module, hf_sd: dict[str, torch.Tensor]) -> None:
        shard = hf_to_megatron(hf_sd, self.hf_config, self.tp, self.tp_rank)
        result = module.load_state_dict(shard, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing or result.unexpected_keys:
            raise ValueError(f"HF→Megatron conversion mismatch: missing {missing[:5]}, "
                             f"unexpected {result.unexpected_keys[:5]}")

    # ---- weights and checkpoints ----------------------------------------------------------------

    def _local_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self._module.state_dict().items() if not k.endswith("_extra_state")}

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named weights, one tensor at a time: each TP-split tensor is all-gathered
        when its turn comes (every TP rank must iterate, in step), never the whole model."""
        local = self._local_state()

        def get(name: str) -> list[torch.Tensor]:
            t = local[name]
            if self.tp == 1:
                return [t]
            parts = [torch.empty_like(t) for _ in range(self.tp)]
            dist.all_gather(parts, t.contiguous(), group=self.tp_group)
            return parts

        yield from iter_megatron_to_hf(get, local.__contains__, self.hf_config)

    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        """HF weights (rank 0) + per-rank optimizer and RNG + state JSON; COMPLETE marker last."""
        from safetensors.torch import save_file

        out = Path(path)
        extra_json = json.dumps(extra or {})
        weights = {n: t.to("cpu").contiguous() for n, t in self.named_weights()}
        if self.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / _COMPLETE).unlink(missing_ok=True)
            save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
            self.hf_config.save_pretrained(out)
            state = {"version": self.version, "skipped": self.skipped, "scheduler": self.scheduler.state_dict(),
                     "extra": json.loads(extra_json)}
            (out / "trainer_state.json").write_text(json.dumps(state, indent=1))
        dist.barrier()
        torch.save(self.optimizer.state_dict(), out / f"optimizer_rank{self.rank}.pt")
        if self._master is not None:
            torch.save(self._master, out / f"master_rank{self.rank}.pt")
        if not self.on_cpu:  # fp32 main params and Adam moments, gathered on DP rank 0 of each TP rank
            self.optimizer.save_parameter_state(str(out / f"optimizer_params_tp{self.tp_rank}.pt"))
        torch.save(_rng_state(), out / f"rng_rank{self.rank}.pt")
        dist.barrier()
        if self.rank == 0:
            (out / _COMPLETE).write_text("ok\n")

    def load(self, path: str | Path) -> dict[str, Any]:
        from safetensors.torch import load_file

        src = Path(path)
        if not (src / _COMPLETE).is_file():
            raise FileNotFoundError(f"{src} is not a complete checkpoint (no {_COMPLETE} marker)")
        self._load_hf(self._module, load_file(str(src / "model.safetensors")))
        if self.on_cpu:
            self.optimizer.load_state_dict(torch.load(src / f"optimizer_rank{self.rank}.pt", weights_only=True))
            if self._master is not None:
                saved = torch.load(src / f"master_rank{self.rank}.pt", weights_only=True)
                with torch.no_grad():
                    for m, w in zip(self._master, saved, strict=True):
                        m.copy_(w)
        else:  # tensors, numbers and containers only: nothing on disk is unpickled as code
            self.optimizer.load_state_dict(torch.load(src / f"optimizer_rank{self.rank}.pt", weights_only=True))
            with _adam_steps_aside(self.optimizer):
                self.optimizer.load_parameter_state(str(src / f"optimizer_params_tp{self.tp_rank}.pt"))
        _set_rng_state(torch.load(src / f"rng_rank{self.rank}.pt", weights_only=True))
        state = json.loads((src / "trainer_state.json").read_text())
        self.scheduler.load_state_dict(state["scheduler"])
        self.version, self.skipped = int(state["version"]), int(state["skipped"])
        return dict(state["extra"])

    # ---- hooks ----------------------------------------------------------------------------------------

    def _forward_logits(self, mb: TrainBatch, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Right-padded [S, L] batch with a causal mask; padding is sliced away again (and
        with `rows`, every position but theirs)."""
        lens = mb.seq_lens.tolist()
        length = max(lens)
        valid = torch.arange(length)[None, :] < mb.seq_lens[:, None]
        ids = torch.zeros(len(lens), length, dtype=torch.int64)
        ids[valid] = mb.input_ids
        pos = torch.arange(length).expand(len(lens), length)
        causal = torch.triu(torch.ones(length, length, dtype=torch.bool), 1)[None, None]  # True = masked
        logits = self._model(ids.to(self.device), pos.to(self.device), attention_mask=causal.to(self.device))
        if self.tp > 1:
            logits = _GatherVocab.apply(logits, self.tp_group)
        logits = logits[valid.to(self.device)][:, : self.hf_config.vocab_size]
        return logits if rows is None else logits[rows.to(self.device)]

    def _train_mode(self, on: bool) -> None:
        self._module.train(on)

    def _clip_grad(self, max_norm: float) -> torch.Tensor:
        """Global norm over the TP grid: sharded params counted on every TP rank, replicated ones once."""
        if not self.on_cpu:
            return self._megatron_clip_grad(max_norm)
        params = list(self._module.parameters())
        if self._master is not None:  # the fp32 masters take the gradients (Megatron's main grads)
            for p, m in zip(params, self._master, strict=True):
                m.grad = None if p.grad is None else p.grad.detach().float()
                p.grad = None
            params = self._master
        grads = [p.grad for p in params if p.grad is not None]
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for p, g in zip(self._module.parameters(), params, strict=True):
            if g.grad is not None and (getattr(p, "tensor_model_parallel", False) or self.tp_rank == 0):
                total += g.grad.detach().double().pow(2).sum()
        if self.tp > 1:
            dist.all_reduce(total, group=self.tp_group)
        norm = total.sqrt().float()
        coef = max_norm / (norm + 1e-6)
        if coef < 1:
            for g in grads:
                g.mul_(coef.to(g.dtype))
        return norm.cpu()

    def _megatron_clip_grad(self, max_norm: float) -> torch.Tensor:
        """Reduce the fp32 grad buffers over DP, copy them to the main params, norm, clip."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        self._model.finish_grad_sync()
        self.optimizer.prepare_grads()
        norm = float(self.optimizer.get_grad_norm())
        if math.isfinite(norm):
            for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                params = opt.get_parameters()
                if params:
                    clip_grad_by_total_norm_fp32(params, max_norm=max_norm, total_norm=norm)
        return torch.tensor(norm, dtype=torch.float32)

    def _optimizer_step(self) -> None:
        if not self.on_cpu:
            self.optimizer.step_with_ready_grads()  # main params -> model weights (+ DP all-gather)
            return
        self.optimizer.step()
        if self._master is not None:
            with torch.no_grad():
                for p, m in zip(self._module.parameters(), self._master, strict=True):
                    p.copy_(m)  # rounded to the model dtype; the master keeps the rest

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.on_cpu:
            self._module.zero_grad(set_to_none=True)
        else:
            self._model.zero_grad_buffer()

    def _scheduler_step(self) -> None:
        self.scheduler.step()

    def _current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _grad_sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        if not last and self.on_cpu and hasattr(self._model, "no_sync"):
            return self._model.no_sync()  # torch DDP: all-reduce on the last micro-batch only
        return contextlib.nullcontext()


@contextlib.contextmanager
def _adam_steps_aside(optimizer: Any) -> Iterator[None]:
    """Megatron's parameter-state load with torch's Adam (no Apex or Transformer Engine):
    `load_state_dict` gives every main param a `step` entry, which `load_parameter_state`
    then expects in the file too (it saves param, exp_avg and exp_avg_sq only) and fails
    with KeyError 'step' (megatron-core 0.16.1, seen on an H200). The steps are set aside
    while the moments load and put back after; they came from `load_state_dict`."""
    kept: list[tuple[dict[str, Any], Any]] = []
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in chained.optimizer.state.values():  # torch's Adam under Megatron's wrapper
            if "step" in state:
                kept.append((state, state.pop("step")))
    try:
        yield
    finally:
        for state, step in kept:
            state["step"] = step


def _megatron_ddp_and_optimizer(module: torch.nn.Module, train_cfg: TrainConfig, dtype: torch.dtype) -> tuple[Any, Any]:
    """GPU: Megatron's DDP (fp32 grad buffers, reduced over the DP group in `finish_grad_sync`)
    and its distributed optimizer: Adam on fp32 main params sharded over DP ranks, copied
    back to the model-dtype weights (and all-gathered) after each step."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            overlap_param_gather=False, use_distributed_optimizer=True)
    model = DistributedDataParallel(module.config, ddp_cfg, module)
    opt_cfg = OptimizerConfig(
        optimizer="adam", lr=train_cfg.lr, min_lr=0.0, weight_decay=train_cfg.weight_decay,
        adam_beta1=train_cfg.betas[0], adam_beta2=train_cfg.betas[1], adam_eps=1e-8,
        bf16=dtype == torch.bfloat16, params_dtype=dtype, use_distributed_optimizer=True,
        clip_grad=train_cfg.grad_clip,
    )
    # config_overrides={}: weight decay on every parameter, as torch AdamW on the CPU path does
    optimizer = get_megatron_optimizer(opt_cfg, [model], config_overrides={})
    model.zero_grad_buffer()
    return model, optimizer
