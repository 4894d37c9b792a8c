"""The model runner: the decoder math over the HF module's own weights, and sampling.

Why not `model.generate()`: it pads a batch to its longest response, cannot admit
new requests mid-flight, and cannot be interrupted for a weight update. Why not the
HF forward with a `DynamicCache`: per-step Python overhead (mask construction, cache
objects) dominates a small model on CPU. So the runner computes the decoder itself
(Qwen2 / Qwen3 / Llama / Mistral layer math, numerically the HF computation) over the
HF module's parameters, which keeps weight loading a plain copy by HF name.

This is the only part that touches the model's tensors: packed weights, rotary
tables, the forward pass over `KVSlots`, executing a `PrefillPlan`, the sampling
call, and staging / applying new weights. It keeps no per-request state and knows
nothing of queues or versions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from areal_like.core.config import EMBEDDED_MODEL_TYPES
from areal_like.models.lora import adapter_pairs
from rollout_cluster.engine.base import NamedTensors
from rollout_cluster.engine.embedded.cache import KVSlots
from rollout_cluster.engine.embedded.scheduler import PrefillPlan, Seq
from rollout_cluster.engine.sampling import SamplingBatch, sample_tokens

__all__ = ["ModelRunner", "SUPPORTED_MODEL_TYPES", "Staged"]

SUPPORTED_MODEL_TYPES = EMBEDDED_MODEL_TYPES  # checked before anything starts too (orchestration/paths.py)

Lora = tuple[torch.Tensor, torch.Tensor]
"""A fused site's adapter: (A [R, in], Bᵀ [R, out]); y += (x·Aᵀ)·Bᵀ."""


@dataclass(eq=False)
class Staged:
    """A checked version, ready to apply: (destination parameter, incoming tensor) pairs,
    and each adapted layer's (A, scale·B) (LoRA)."""

    copies: list[tuple[torch.Tensor, Any]]
    """(destination, a tensor or what writes itself there: `weight_sync.shm.FileSlice`)."""
    adapters: dict[str, Lora]


_SITES = {"self_attn.q_proj": ("qkv", 0), "self_attn.k_proj": ("qkv", 1), "self_attn.v_proj": ("qkv", 2),
          "self_attn.o_proj": ("o", 0), "mlp.gate_proj": ("gu", 0), "mlp.up_proj": ("gu", 1),
          "mlp.down_proj": ("down", 0)}
"""Where an adapted HF linear layer (`model.layers.{i}.` + key) runs: its fused site and
its row block there (q, k, v share one matmul; gate, up another)."""
_MEMBERS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
            "gu": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}


def _fuse(mods: list[torch.nn.Module], fused: torch.Tensor | None) -> torch.Tensor:
    """`fused` when the modules' weights are still its row blocks (a load wrote into them);
    else a new fused tensor, with the modules' weights made views of it."""
    weights = [m.weight for m in mods]
    if fused is not None:
        off = 0
        for w in weights:
            if w.data_ptr() != fused[off].data_ptr() or w.shape[1:] != fused.shape[1:]:
                break
            off += w.shape[0]
        else:
            if off == fused.shape[0]:
                return fused
    fused = torch.cat([w.detach() for w in weights])
    off = 0
    for m in mods:
        n = m.weight.shape[0]
        m.weight.data = fused[off:off + n]
        off += n
    return fused


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, lora: Lora | None) -> torch.Tensor:
    x = x.to(w.dtype)  # bf16 weights: the matmul in bf16, as under the trainer's autocast
    y = F.linear(x, w, b)
    if lora is not None:
        y.addmm_(F.linear(x, lora[0]), lora[1])
    return y


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # Same op order as HF's Qwen2RMSNorm / LlamaRMSNorm, so fp32 results match bit for bit.
    var = x.pow(2).mean(-1, keepdim=True)
    return w * (x * torch.rsqrt(var + eps))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name == "silu":
        return F.silu
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def _load_model(model: str | Path | torch.nn.Module, dtype: torch.dtype, impl: str = "auto") -> torch.nn.Module:
    if isinstance(model, torch.nn.Module):
        m = model
    else:
        from areal_like.models.lite import load_causal_lm

        m = load_causal_lm(model, dtype, impl)
    m = m.to(dtype).eval()
    for p in m.parameters():
        p.requires_grad_(False)
    return m


@dataclass(eq=False)
class _Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    w_qkv: torch.Tensor
    b_qkv: torch.Tensor | None
    w_o: torch.Tensor
    b_o: torch.Tensor | None
    w_gu: torch.Tensor
    b_gu: torch.Tensor | None
    w_down: torch.Tensor
    b_down: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    lora: dict[str, Lora]
    """Site ("qkv", "o", "gu", "down") → its adapter, run beside the base weight."""


class ModelRunner:
    """An HF causal LM (one of `SUPPORTED_MODEL_TYPES`), run by our own decoder loop."""

    def __init__(
        self, model: str | Path | torch.nn.Module, *, max_seq_len: int, device: torch.device, dtype: torch.dtype,
        model_impl: str = "auto",
    ) -> None:
        self.device = device
        self.dtype = dtype
        self.model = _load_model(model, dtype, model_impl).to(device)
        hf = self.model.config
        model_type = getattr(hf, "model_type", "?")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"EmbeddedEngine supports model types {SUPPORTED_MODEL_TYPES}, got {model_type!r}; "
                "use the vLLM engine for other architectures"
            )
        if "sliding_attention" in (getattr(hf, "layer_types", None) or []):
            raise ValueError("EmbeddedEngine does not implement sliding-window attention layers")
        if hf.max_position_embeddings < max_seq_len:
            raise ValueError(
                f"max_seq_len {max_seq_len} exceeds the model's max_position_embeddings "
                f"{hf.max_position_embeddings}"
            )
        self.vocab_size = int(hf.vocab_size)
        self.n_layers = len(self.model.model.layers)
        self.n_heads = hf.num_attention_heads
        self.n_kv = getattr(hf, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // self.n_heads
        self._eps = float(hf.rms_norm_eps)
        self._act = _activation(hf.hidden_act)
        self._scale = float(self.model.model.layers[0].self_attn.scaling)
        self._state = self.model.state_dict()
        self._sites: dict[tuple[int, str], Lora] = {}
        """LoRA: (layer, site) → the adapter `forward` runs beside the base weight (`_put_adapter`)."""
        self._head: Lora | None = None
        self._layers: list[_Layer] = []
        self._pack()
        with torch.inference_mode():
            positions = torch.arange(max_seq_len, device=device)[None]
            probe = torch.zeros(1, device=device, dtype=torch.float32)  # rotary in fp32 whatever the weights
            cos, sin = self.model.model.rotary_emb(probe, positions)
        self._cos, self._sin = cos[0], sin[0]  # [max_seq_len, head_dim]

    def eos_token_ids(self) -> list[int]:
        """The model's own stop tokens (generation config first, then model config)."""
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = self.model.config.eos_token_id
        return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))

    def new_kv(self, slots: int, max_seq_len: int) -> KVSlots:
        return KVSlots(
            self.n_layers, slots, self.n_kv, max_seq_len, self.head_dim, dtype=self.dtype, device=self.device
        )

    # ---- weights ------------------------------------------------------------------------

    def _pack(self) -> None:
        """Fuse q/k/v and gate/up projections into single matmuls.

        The fused tensor holds the projections' weights as consecutive row blocks, and the
        modules' own weights become views of it (vLLM's packed linears, the other way
        round): a weight load writes straight into the fused tensor, so nothing is copied
        again after a load and the weights are held once, not twice. `_state` (the names
        a load writes to) is taken after the views are in place.
        """
        old = getattr(self, "_layers", None)
        layers = []
        for i, layer in enumerate(self.model.model.layers):
            a, mlp = layer.self_attn, layer.mlp
            biases = [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]
            b_qkv = torch.cat(biases) if all(b is not None for b in biases) else None
            b_gu = None
            if mlp.gate_proj.bias is not None and mlp.up_proj.bias is not None:
                b_gu = torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias])
            layers.append(
                _Layer(
                    ln1=layer.input_layernorm.weight,
                    ln2=layer.post_attention_layernorm.weight,
                    w_qkv=_fuse([a.q_proj, a.k_proj, a.v_proj], old[i].w_qkv if old else None),
                    b_qkv=b_qkv,
                    w_o=a.o_proj.weight,
                    b_o=a.o_proj.bias,
                    w_gu=_fuse([mlp.gate_proj, mlp.up_proj], old[i].w_gu if old else None),
                    b_gu=b_gu,
                    w_down=mlp.down_proj.weight,
                    b_down=mlp.down_proj.bias,
                    q_norm=a.q_norm.weight if hasattr(a, "q_norm") else None,
                    k_norm=a.k_norm.weight if hasattr(a, "k_norm") else None,
                    lora={site: ab for (li, site), ab in self._sites.items() if li == i},
                )
            )
        self._layers = layers
        self._state = self.model.state_dict()
        self._embed = self.model.model.embed_tokens.weight
        self._norm = self.model.model.norm.weight
        self._lm_head = self.model.lm_head.weight

    def stage(self, named_tensors: NamedTensors) -> Staged:
        """Check names and shapes; raises before any change.

        The incoming tensors are referenced, not copied (a copy would hold a third copy
        of the weights at every update): they must stay unchanged until `apply`, as every
        receiver's are (a whole version in one buffer, reused at the next version only),
        and `update_weights` stages and applies in one call. Tied embeddings stay tied: `lm_head.weight` and
        `model.embed_tokens.weight` are the same storage, whichever name arrives. A LoRA
        version's adapter halves arrive as `X.lora_A/B.weight`: the weights stay the base's
        and the adapter runs beside them (`_put_adapter`), so a version is the adapter's
        bytes to apply, not the model's.
        """
        copies: list[tuple[torch.Tensor, Any]] = []
        pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, tensor in adapter_pairs(named_tensors, pairs):
            dst = self._state.get(name)
            if dst is None:
                raise KeyError(f"load_weights: unknown weight {name!r} for {type(self.model).__name__}")
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"load_weights: {name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
                )
            if isinstance(tensor, torch.Tensor):
                copies.append((dst, tensor.detach().to(device=dst.device, dtype=dst.dtype)))
            else:  # written by itself at `apply` (`into`: a slice of the sender's file)
                copies.append((dst, tensor))
        for x, (a, b) in pairs.items():
            w = self._state.get(f"{x}.weight")
            if w is None or (x != "lm_head" and self._site(x) is None):
                raise KeyError(f"load_weights: adapter for {x!r}, which is not a linear layer the embedded engine "
                               "adapts (the decoder's projections and lm_head)")
            if b.shape[1] != a.shape[0] or (b.shape[0], a.shape[1]) != tuple(w.shape):
                raise ValueError(f"load_weights: adapter for {x} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
                                 f"which do not make its weight's shape {tuple(w.shape)}")
        return Staged(copies, pairs)

    @staticmethod
    def _site(x: str) -> tuple[int, str, int] | None:
        """`model.layers.{i}.{key}` → (i, its fused site, its place in the site)."""
        head, _, rest = x.partition("model.layers.")
        i, _, key = rest.partition(".")
        if head or not i.isdigit() or key not in _SITES:
            return None
        return (int(i), *_SITES[key])

    def apply(self, staged: Staged) -> None:
        """Copy staged tensors into the model (and adapters into their sites); cannot fail
        halfway on a bad name."""
        with torch.no_grad():
            for dst, src in staged.copies:
                if isinstance(src, torch.Tensor):
                    dst.copy_(src)
                else:
                    src.into(dst)
            new = [self._put_adapter(x, a, b) for x, (a, b) in staged.adapters.items()]
        if staged.copies or any(new):
            self._pack()

    def _put_adapter(self, x: str, a: torch.Tensor, b: torch.Tensor) -> bool:
        """Write layer `x`'s A and scale·B into its site's adapter, in place: a site's A's
        are stacked ([R, in], R = rank × the site's members) and its B's block-diagonal
        (Bᵀ [R, out], zeros where one member's rank meets another's rows), so q/k/v
        (gate/up) stay one matmul and one adapter pair, and a version allocates nothing.
        Returns whether the site's buffers were (re)made (the first version, or a new rank)."""
        r = a.shape[0]
        if x == "lm_head":
            made = self._head is None or self._head[0].shape[0] != r
            if made:
                self._head = (a.new_zeros(r, a.shape[1], dtype=self.dtype, device=self.device),
                              a.new_zeros(r, b.shape[0], dtype=self.dtype, device=self.device))
            head, j, c0 = self._head, 0, 0
        else:
            i, site, j = self._site(x)  # type: ignore[misc]
            outs = [self.model.model.layers[i].get_submodule(k).weight.shape[0] for k in _MEMBERS[site]]
            head = self._sites.get((i, site))
            made = head is None or head[0].shape[0] != r * len(outs)
            if made:
                head = self._sites[(i, site)] = (
                    a.new_zeros(r * len(outs), a.shape[1], dtype=self.dtype, device=self.device),
                    a.new_zeros(r * len(outs), sum(outs), dtype=self.dtype, device=self.device))
            c0 = sum(outs[:j])
        assert head is not None
        head[0][j * r:(j + 1) * r].copy_(a)
        head[1][j * r:(j + 1) * r, c0:c0 + b.shape[0]].copy_(b.t())
        return made

    # ---- compute ------------------------------------------------------------------------

    def forward(self, kv: KVSlots, slot0: int, chunks: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Run token chunks for slots `slot0..slot0+N-1`, chunk i starting at position `starts[i]`.

        Writes their K/V into `kv` and returns each chunk's last-position logits
        [N, V]. Tokens stay packed ([M, hidden], no padding) through embeddings, norms,
        projections and the MLP; only attention works on a padded [N, Q] grid. A decode
        step is the case of N chunks of one token, where packed and padded coincide.
        """
        n = len(chunks)
        dev = self.device
        qlens = [len(c) for c in chunks]
        q = max(qlens)
        total = max(st + ql for st, ql in zip(starts, qlens, strict=True))
        decode = q == 1
        tokens = torch.tensor([t for c in chunks for t in c], device=dev)  # [M]
        starts_t = torch.tensor(starts, device=dev)
        if decode:
            seq = torch.arange(n, device=dev)
            pos = starts_t
            grid_pos = pos[:, None]  # [N, 1]
            grid = None
        else:
            qlens_t = torch.tensor(qlens, device=dev)
            seq = torch.repeat_interleave(torch.arange(n, device=dev), qlens_t)  # [M]
            first = torch.cumsum(qlens_t, 0) - qlens_t
            offs = torch.arange(tokens.numel(), device=dev) - first[seq]
            pos = starts_t[seq] + offs  # [M]
            grid = seq * q + offs  # where each packed token sits in the padded [N, Q] grid
            grid_pos = starts_t[:, None] + torch.arange(q, device=dev)[None, :]  # padded rows see junk only
        cos = self._cos[pos].unsqueeze(1)  # [M, 1, D]
        sin = self._sin[pos].unsqueeze(1)
        keymask = torch.arange(total, device=dev)[None, None, :] <= grid_pos[:, :, None]  # [N, Q, T]
        bias = torch.zeros(keymask.shape, dtype=cos.dtype, device=dev).masked_fill_(~keymask, float("-inf"))
        bias = bias[:, None, None]  # [N, 1, 1, Q, T]
        rows = seq + slot0
        hq, hkv, d = self.n_heads, self.n_kv, self.head_dim
        rep = hq // hkv
        m = tokens.numel()
        # The residual stream, norms, rotary and softmax stay fp32 and only the matmuls take the
        # weights' dtype: with bf16 weights this is the trainer's autocast arithmetic, so the
        # behaviour logprobs are the ones the trainer recomputes (docs/design.md §10.48).
        h = F.embedding(tokens, self._embed).float()  # [M, hidden]
        for li, L in enumerate(self._layers):
            x = _rms(h, L.ln1, self._eps)
            qkv = _linear(x, L.w_qkv, L.b_qkv, L.lora.get("qkv"))
            vs = qkv[:, (hq + hkv) * d:]
            if L.q_norm is not None and L.k_norm is not None:
                qs, ks = qkv[:, :hq * d].view(m, hq, d), qkv[:, hq * d:(hq + hkv) * d].view(m, hkv, d)
                qs = _rotate(_rms(qs, L.q_norm, self._eps), cos, sin)
                ks = _rotate(_rms(ks, L.k_norm, self._eps), cos, sin)
            else:  # queries and keys rotated in one pass (the same arithmetic, half the calls)
                qk = _rotate(qkv[:, :(hq + hkv) * d].view(m, hq + hkv, d), cos, sin)
                qs, ks = qk[:, :hq], qk[:, hq:]
            kc, vc = kv.k[li], kv.v[li]
            kc[rows, :, pos] = ks.to(kc.dtype)
            vc[rows, :, pos] = vs.view(m, hkv, d)
            keys = kc[slot0 : slot0 + n, :, :total]  # [N, Hkv, T, D]
            vals = vc[slot0 : slot0 + n, :, :total]
            qs = qs.to(kc.dtype)
            if grid is not None:
                padded = qs.new_zeros(n * q, hq, d)
                padded[grid] = qs
                qs = padded
            qg = qs.view(n, q, hq, d).transpose(1, 2).reshape(n, hkv, rep * q, d)
            scores = torch.matmul(qg, keys.transpose(-1, -2)).float().mul_(self._scale)
            scores = scores.view(n, hkv, rep, q, total).add_(bias)
            probs = torch.softmax(scores, dim=-1).view(n, hkv, rep * q, total).to(vals.dtype)
            attn = torch.matmul(probs, vals).view(n, hq, q, d).transpose(1, 2).reshape(n * q, hq * d)
            if grid is not None:
                attn = attn[grid]
            h = h + _linear(attn, L.w_o, L.b_o, L.lora.get("o"))
            x = _rms(h, L.ln2, self._eps)
            gate, up = _linear(x, L.w_gu, L.b_gu, L.lora.get("gu")).chunk(2, dim=-1)
            h = h + _linear(self._act(gate) * up, L.w_down, L.b_down, L.lora.get("down"))
        if not decode:
            h = h[torch.cumsum(torch.tensor(qlens, device=dev), 0) - 1]
        return _linear(_rms(h, self._norm, self._eps), self._lm_head, None, self._head)

    def decode(self, kv: KVSlots, running: list[Seq]) -> torch.Tensor:
        """One token for every running sequence (slots 0..B-1): logits [B, V]."""
        return self.forward(kv, 0, [[s.ids[-1]] for s in running], [s.num_computed for s in running])

    def prefill(self, kv: KVSlots, plan: PrefillPlan) -> torch.Tensor:
        """Give every sequence of the plan its KV; return last-position logits in `plan.order`.

        Cached prefixes are copied in first, then the computed sequences run in one
        padded batch; exact hits only copy; duplicates copy their leader's slot.
        """
        logits_of: dict[int, torch.Tensor] = {}
        if plan.compute:
            for s, entry, n in plan.compute:
                if entry is not None:
                    kv.load(plan.slot[id(s)], entry, n)
            chunks = [s.ids[n:] for s, _, n in plan.compute]
            logits = self.forward(kv, plan.base, chunks, [n for _, _, n in plan.compute])
            for i, (s, _, _) in enumerate(plan.compute):
                logits_of[id(s)] = logits[i]
        for s, entry in plan.exact:
            assert entry.logits is not None
            kv.load(plan.slot[id(s)], entry, len(s.ids))
            logits_of[id(s)] = entry.logits
        for s, lead in plan.copies:
            kv.move(plan.slot[id(s)], plan.slot[id(lead)], len(s.ids))
            logits_of[id(s)] = logits_of[id(lead)]
        return torch.stack([logits_of[id(s)] for s in plan.order])

    def sample(self, seqs: list[Seq], logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """One token per row with its behaviour logprob; randomness from (seed, position)."""
        batch = SamplingBatch(
            temperature=[s.params.temperature for s in seqs],
            top_k=[s.params.top_k for s in seqs],
            top_p=[s.params.top_p for s in seqs],
            seeds=[s.stream for s in seqs],
            positions=[len(s.ids) for s in seqs],
            device=self.device,
        )
        tokens, logps = sample_tokens(logits, batch)
        return tokens.tolist(), logps.tolist()
