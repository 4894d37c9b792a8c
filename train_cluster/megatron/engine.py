"""Megatron-core backend: the same decoupled-PPO step on a tensor/data-parallel GPTModel.

Built for large models on GPUs: the HF Qwen2 folder is converted into a
Megatron-core `GPTModel` (local layer spec), split over `tensor_parallel_size`
ranks, replicated over `data_parallel_size` ranks (torch DDP on the data-parallel
group), and trained by `TrainEngine`'s shared step with torch AdamW — Megatron's
own optimizer and pipeline schedules hard-code CUDA, and our loop already does
accumulation, clipping and skipping. Weights leave as HF names (`named_weights`
gathers the TP shards), so weight sync and export do not know the backend.

Sequences are right-padded within a micro-batch (causal attention makes the padding
invisible to real tokens); Megatron's packed-sequence (THD) path needs Transformer
Engine and is not used. `kl_coef > 0` is refused at start-up (no reference model
here yet).

On CPU (`device: cpu`, for tests only) `shims.py` patches the three places where
megatron-core calls CUDA unconditionally.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from areal_like.core.config import MegatronBackendConfig, TrainConfig
from train_cluster.batch import TrainBatch
from train_cluster.engine import TrainEngine, lr_factor
from train_cluster.megatron.convert import hf_to_megatron, megatron_to_hf, padded_vocab_size
from train_cluster.torch_engine import _rng_state, _set_rng_state, check_device, free_port

__all__ = ["MegatronTrainEngine", "build_gpt_model"]

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
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
    return GPTModel(
        cfg, get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=padded_vocab_size(hf_cfg.vocab_size, tp), max_sequence_length=hf_cfg.max_position_embeddings,
        position_embedding_type="rope", rotary_base=int(theta),
        share_embeddings_and_output_weights=hf_cfg.tie_word_embeddings, parallel_output=True,
    )


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
        if dtype not in _DTYPES:
            raise ValueError(f"train dtype {dtype!r} is not supported: use float32 or bfloat16")
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
            logger.warning("megatron backend on CPU: for tests of forward/backward only (CUDA shims active)")
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
        self.rank = dist.get_rank()
        self.world_size = dp  # data-parallel ranks: what losses are averaged over
        self.group = ps.get_data_parallel_group()

        from transformers import AutoConfig, AutoModelForCausalLM

        self.hf_config = AutoConfig.from_pretrained(str(model_path))
        module = build_gpt_model(self.hf_config, _DTYPES[dtype], tp, on_cpu)
        if on_cpu:
            from train_cluster.megatron.shims import cpu_rotary

            cpu_rotary(module)
        hf_sd = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=_DTYPES[dtype]).state_dict()
        self._load_hf(module, hf_sd)
        self._module = module.to(self.device)
        self._model: Any = module
        if dp > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self._model = DDP(module, process_group=self.group, broadcast_buffers=False,
                              device_ids=None if on_cpu else [self.device.index])
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=train_cfg.lr, betas=train_cfg.betas,
                                           weight_decay=train_cfg.weight_decay)
        sched, warm, total = train_cfg.lr_schedule, train_cfg.warmup_steps, train_cfg.total_steps

        def factor(step: int) -> float:
            return lr_factor(step, schedule=sched, warmup=warm, total=total)

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)
        logger.info("MegatronTrainEngine rank %d: tp %d/%d, dp size %d on %s", self.rank, self.tp_rank, tp, dp,
                    self.device)

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
        """Full HF-named weights (TP shards all-gathered: every TP rank must iterate)."""
        local = self._local_state()
        if self.tp == 1:
            shards = [local]
        else:
            shards = [{} for _ in range(self.tp)]
            for name, t in local.items():
                parts = [torch.empty_like(t) for _ in range(self.tp)]
                dist.all_gather(parts, t.contiguous(), group=self.tp_group)
                for s, p in zip(shards, parts, strict=True):
                    s[name] = p
        yield from megatron_to_hf(shards, self.hf_config).items()

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
        self.optimizer.load_state_dict(torch.load(src / f"optimizer_rank{self.rank}.pt", weights_only=True))
        _set_rng_state(torch.load(src / f"rng_rank{self.rank}.pt", weights_only=True))
        state = json.loads((src / "trainer_state.json").read_text())
        self.scheduler.load_state_dict(state["scheduler"])
        self.version, self.skipped = int(state["version"]), int(state["skipped"])
        return dict(state["extra"])

    # ---- hooks ----------------------------------------------------------------------------------------

    def _forward_logits(self, mb: TrainBatch) -> torch.Tensor:
        """Right-padded [S, L] batch with a causal mask; padding is sliced away again."""
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
        return logits[valid.to(self.device)][:, : self.hf_config.vocab_size]

    def _train_mode(self, on: bool) -> None:
        self._module.train(on)

    def _clip_grad(self, max_norm: float) -> torch.Tensor:
        """Global norm over the TP grid: sharded params counted on every TP rank, replicated ones once."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        # Megatron's own `tensor_model_parallel` flag is not set on weights built with
        # perform_initialization=False, so the layout decides: only the norms are replicated.
        named = [(n, p) for n, p in self._module.named_parameters() if p.grad is not None]
        params = [p for _, p in named]
        for n, p in named:
            if "layernorm" not in n or self.tp_rank == 0:
                total += p.grad.detach().double().pow(2).sum()
        if self.tp > 1:
            dist.all_reduce(total, group=self.tp_group)
        norm = total.sqrt().float()
        coef = max_norm / (norm + 1e-6)
        if coef < 1:
            for p in params:
                p.grad.mul_(coef.to(p.grad.dtype))
        return norm.cpu()

    def _optimizer_step(self) -> None:
        self.optimizer.step()

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _scheduler_step(self) -> None:
        self.scheduler.step()

    def _current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])
