"""A causal LM of our own for plain Qwen2 and Llama checkpoints: torch only, HF's names.

Why: importing `transformers.modeling_utils` (every HF model class stands on it) pulls
`torch._dynamo`, `torch.distributed.tensor`, sympy and the quantizer integrations: 2–3 s
of the local launcher's zygote imports, which the first train step waits for
(docs/benchmarks.md, start-up). The quickstart's model is a 4-layer Qwen2. This module is
that architecture's forward in ~150 lines, with the HF parameter names (weights load,
sync and save as before) and HF's op order (logits equal to ~1e-6, tested against
`Qwen2ForCausalLM` and `LlamaForCausalLM`).

`load_causal_lm` picks it only for checkpoints it reproduces exactly: model type `qwen2`
or `llama`, SiLU, default RoPE, full attention in every layer. Anything else (and
`model.impl: hf`) loads the HF class as before.

The forward takes what the trainer passes:
- `input_ids` [B, T];
- `position_ids`: restarting at 0 marks packed sequences; a block-diagonal causal mask is
  built from them, as transformers does;
- `attention_mask`: a [B, 1, T, T] boolean mask (True: may attend) or a [B, T] padding
  mask, or none (causal).
It returns an object with `.logits` [B, T, V].
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LiteCausalLM", "LiteConfig", "lite_supported", "load_causal_lm"]

_TYPES = ("qwen2", "llama")


class LiteConfig(SimpleNamespace):
    """config.json as attributes (the fields HF's config would give), written back as read."""

    def __init__(self, data: dict[str, Any]) -> None:
        super().__init__(**data)
        self._data = dict(data)

    @classmethod
    def from_dir(cls, path: str | Path) -> LiteConfig:
        return cls(json.loads((Path(path) / "config.json").read_text()))

    def to_dict(self) -> dict[str, Any]:
        out = dict(self._data)
        out.update({k: v for k, v in vars(self).items() if not k.startswith("_")})
        return out

    def save_pretrained(self, out: str | Path) -> None:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "config.json").write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @property
    def head_dim_(self) -> int:
        return int(getattr(self, "head_dim", None) or self.hidden_size // self.num_attention_heads)

    @property
    def rope_theta_(self) -> float:
        rp = getattr(self, "rope_parameters", None) or {}
        return float(rp.get("rope_theta", getattr(self, "rope_theta", 10000.0)))


def lite_supported(cfg: dict[str, Any]) -> str | None:
    """None when `LiteCausalLM` reproduces the checkpoint `cfg` (config.json), else why not."""
    if cfg.get("model_type") not in _TYPES:
        return f"model type {cfg.get('model_type')!r}"
    if cfg.get("hidden_act", "silu") != "silu":
        return f"activation {cfg.get('hidden_act')!r}"
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if (rope.get("rope_type") or rope.get("type") or "default") != "default":
        return f"rope type {rope.get('rope_type') or rope.get('type')!r}"
    if any(t != "full_attention" for t in cfg.get("layer_types") or []) or cfg.get("use_sliding_window"):
        return "sliding-window layers"
    if cfg.get("pretraining_tp", 1) not in (1, None):
        return "pretraining_tp"
    return None


class _RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # HF's op order
        dtype = x.dtype
        x = x.to(torch.float32)
        var = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(var + self.variance_epsilon)
        return self.weight * x.to(dtype)


class _Rotary(nn.Module):
    def __init__(self, cfg: LiteConfig) -> None:
        super().__init__()
        dim = cfg.head_dim_
        inv = 1.0 / (cfg.rope_theta_ ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.inv_freq = nn.Buffer(inv, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype=x.dtype), emb.sin().to(dtype=x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class _Attention(nn.Module):
    def __init__(self, cfg: LiteConfig) -> None:
        super().__init__()
        qwen2 = cfg.model_type == "qwen2"
        bias = bool(getattr(cfg, "attention_bias", False))
        self.head_dim = cfg.head_dim_
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.num_key_value_groups = cfg.num_attention_heads // self.n_kv
        self.scaling = self.head_dim ** -0.5
        h, q, kv = cfg.hidden_size, cfg.num_attention_heads * self.head_dim, self.n_kv * self.head_dim
        self.q_proj = nn.Linear(h, q, bias=qwen2 or bias)
        self.k_proj = nn.Linear(h, kv, bias=qwen2 or bias)
        self.v_proj = nn.Linear(h, kv, bias=qwen2 or bias)
        self.o_proj = nn.Linear(q, h, bias=bias and not qwen2)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        shape = (*x.shape[:-1], -1, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q * cos) + (_rotate_half(q) * sin)
        k = (k * cos) + (_rotate_half(k) * sin)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, scale=self.scaling,
                                                 enable_gqa=self.num_key_value_groups > 1)
        else:
            if self.num_key_value_groups > 1:
                k = k.repeat_interleave(self.num_key_value_groups, dim=1)
                v = v.repeat_interleave(self.num_key_value_groups, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:-1], -1).contiguous())


class _MLP(nn.Module):
    def __init__(self, cfg: LiteConfig) -> None:
        super().__init__()
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg: LiteConfig) -> None:
        super().__init__()
        self.self_attn = _Attention(cfg)
        self.mlp = _MLP(cfg)
        self.input_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Decoder(nn.Module):
    def __init__(self, cfg: LiteConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, getattr(cfg, "pad_token_id", None))
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = _Rotary(cfg)


def _mask(input_ids: torch.Tensor, position_ids: torch.Tensor | None,
          attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(position ids, boolean mask [B, 1, T, T] or None for plain causal attention)."""
    b, t = input_ids.shape
    dev = input_ids.device
    causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
    if position_ids is None:  # as transformers: 0..T-1 in every row, padding or not
        position_ids = torch.arange(t, device=dev).expand(b, t)
    if attention_mask is not None:
        if attention_mask.dim() == 4:
            return position_ids, attention_mask.to(torch.bool)
        if attention_mask.dim() != 2:
            raise ValueError(f"attention_mask must be [B, T] or [B, 1, T, T], got {tuple(attention_mask.shape)}")
        return position_ids, (causal[None] & attention_mask.to(torch.bool)[:, None, :])[:, None]
    new = torch.ones_like(position_ids, dtype=torch.bool)
    new[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    if not bool(new[:, 1:].any()):  # one sequence per row
        return position_ids, None
    seg = new.long().cumsum(-1)
    return position_ids, (causal[None] & (seg[:, :, None] == seg[:, None, :]))[:, None]


class LiteCausalLM(nn.Module):
    """A Qwen2 / Llama causal LM with HF's parameter names (module docstring)."""

    def __init__(self, cfg: LiteConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = _Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if getattr(cfg, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.generation_config = SimpleNamespace(eos_token_id=getattr(cfg, "eos_token_id", None))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, use_cache: bool = False,
                logits_to_keep: torch.Tensor | None = None, **_: Any) -> SimpleNamespace:
        """`logits_to_keep` as transformers' 1-D form: only these positions (of every row)
        are projected onto the vocabulary."""
        pos, mask = _mask(input_ids, position_ids, attention_mask)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(x, pos)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask)
        if logits_to_keep is not None:
            x = x[:, logits_to_keep]
        return SimpleNamespace(logits=self.lm_head(self.model.norm(x)))

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> LiteCausalLM:
        from areal_like.models.hf_folder import read_hf_weights

        path = Path(path)
        cfg = LiteConfig.from_dir(path)
        why = lite_supported(cfg.to_dict())
        if why is not None:
            raise ValueError(f"LiteCausalLM does not implement {path}: {why}")
        gen = path / "generation_config.json"
        with _no_init():
            model = cls(cfg)
        state = read_hf_weights(path)  # read, not mapped: each weight held once (its docstring)
        if not state:
            raise FileNotFoundError(f"no *.safetensors weights in {path}")
        if getattr(cfg, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        # assign: the loaded tensors become the parameters (the built ones, never written, are
        # dropped), so loading holds the weights once, not twice (a server's peak at start).
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        missing = [m for m in missing if not (m == "lm_head.weight" and getattr(cfg, "tie_word_embeddings", False))]
        if missing or unexpected:
            raise ValueError(f"checkpoint {path} does not match a {cfg.model_type} model: missing "
                             f"{missing[:5]}, unexpected {unexpected[:5]}")
        if getattr(cfg, "tie_word_embeddings", False):
            model.lm_head.weight = model.model.embed_tokens.weight
        if gen.exists():
            model.generation_config = SimpleNamespace(**json.loads(gen.read_text()))
        return model.to(dtype)


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """Layers built without their random init (the checkpoint overwrites every weight). Not
    the meta device: building there runs torch's decompositions, which import sympy (3 s)."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved  # type: ignore[method-assign]


def load_causal_lm(path: str | Path, dtype: torch.dtype = torch.float32, impl: str = "auto") -> nn.Module:
    """The model at `path`: `LiteCausalLM` when `impl` is `auto` and it reproduces the
    checkpoint, else transformers' `AutoModelForCausalLM` (`impl` `hf`: always)."""
    if impl not in ("auto", "hf"):
        raise ValueError(f"model impl must be 'auto' or 'hf', got {impl!r}")
    cfg_file = Path(path) / "config.json"
    if impl == "auto" and cfg_file.exists() and lite_supported(json.loads(cfg_file.read_text())) is None:
        return LiteCausalLM.from_pretrained(path, dtype)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
