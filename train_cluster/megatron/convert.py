"""HF Qwen2 ↔ Megatron-core GPTModel (local layer spec) weights, with tensor-parallel shards.

Pure functions over state dicts, so the round trip is tested bitwise without a
process group. Layout differences, per decoder layer:

- q/k/v: HF keeps three matrices; Megatron's `linear_qkv` interleaves them per
  query group: for each of the `g` KV heads, its `h/g` query heads, then its key,
  then its value. Tensor parallelism splits that fused matrix into `tp` equal row
  blocks, i.e. whole query groups per rank. Biases follow the same layout.
- gate/up: Megatron's `linear_fc1` is [gate; up] per rank, so each TP shard is
  [gate_r; up_r], not a slice of the full [gate; up].
- o_proj and down_proj are row-parallel (split along the input dimension).
- Norm weights are replicated on every TP rank.
- The vocabulary is padded up to a multiple of `tp` (Megatron splits it evenly);
  padded rows are zero and dropped again on the way back to HF.

Tied embeddings: HF yields `model.embed_tokens.weight` only (see torch_engine);
Megatron has no `output_layer.weight` when `share_embeddings_and_output_weights`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["hf_to_megatron", "iter_megatron_to_hf", "megatron_to_hf", "padded_vocab_size"]


def padded_vocab_size(vocab: int, tp: int) -> int:
    return -(-vocab // tp) * tp


def _dims(cfg: Any) -> tuple[int, int, int, int]:
    heads, groups = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return heads, groups, head_dim, cfg.hidden_size


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: Any) -> torch.Tensor:
    heads, groups, hd, _ = _dims(cfg)
    rest = q.shape[1:]
    q = q.reshape(groups, heads // groups * hd, *rest)
    k = k.reshape(groups, hd, *rest)
    v = v.reshape(groups, hd, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, cfg: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    heads, groups, hd, _ = _dims(cfg)
    rest = qkv.shape[1:]
    per = heads // groups * hd
    g = qkv.reshape(groups, per + 2 * hd, *rest)
    q, k, v = g[:, :per], g[:, per:per + hd], g[:, per + hd:]
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def hf_to_megatron(hf: dict[str, torch.Tensor], cfg: Any, tp: int = 1, rank: int = 0) -> dict[str, torch.Tensor]:
    """This TP rank's Megatron state dict from a full HF Qwen2 state dict."""
    def col(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp, dim=0)[rank].clone()

    def row(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp, dim=1)[rank].clone()

    emb = hf["model.embed_tokens.weight"]
    pad = padded_vocab_size(emb.shape[0], tp) - emb.shape[0]
    if pad:
        emb = torch.cat([emb, emb.new_zeros(pad, emb.shape[1])])
    out = {"embedding.word_embeddings.weight": col(emb), "decoder.final_layernorm.weight": hf["model.norm.weight"].clone()}
    if not cfg.tie_word_embeddings:
        head = hf["lm_head.weight"]
        if pad:
            head = torch.cat([head, head.new_zeros(pad, head.shape[1])])
        out["output_layer.weight"] = col(head)
    for i in range(cfg.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = h + "self_attn."
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"].clone()
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"].clone()
        out[m + "self_attention.linear_qkv.weight"] = col(
            _fuse_qkv(hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], cfg))
        if a + "q_proj.bias" in hf:
            out[m + "self_attention.linear_qkv.bias"] = col(
                _fuse_qkv(hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"], cfg))
        out[m + "self_attention.linear_proj.weight"] = row(hf[a + "o_proj.weight"])
        gate, up = hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([col(gate), col(up)])
        out[m + "mlp.linear_fc2.weight"] = row(hf[h + "mlp.down_proj.weight"])
    return out


def megatron_to_hf(shards: list[dict[str, torch.Tensor]], cfg: Any) -> dict[str, torch.Tensor]:
    """A full HF state dict (tied duplicates dropped) from every TP rank's Megatron state dict."""
    return dict(iter_megatron_to_hf(lambda name: [s[name] for s in shards], shards[0].__contains__, cfg))


def iter_megatron_to_hf(get: Callable[[str], list[torch.Tensor]], has: Callable[[str], bool],
                        cfg: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """HF names and full tensors, one Megatron tensor at a time: `get(name)` gives every TP
    rank's shard of that one tensor (the engine all-gathers it there and then), `has(name)`
    whether the model has it. The order is fixed by `cfg`, so every TP rank asks for the
    same tensors in the same order (the gathers are collectives); at most one layer's
    weight, gathered, is alive at a time."""
    def col(name: str) -> torch.Tensor:
        return torch.cat(get(name), dim=0)

    def row(name: str) -> torch.Tensor:
        return torch.cat(get(name), dim=1)

    def one(name: str) -> torch.Tensor:  # replicated on every TP rank: rank 0's (no gather)
        return get(name)[0].clone()

    vocab = cfg.vocab_size
    yield "model.embed_tokens.weight", col("embedding.word_embeddings.weight")[:vocab].contiguous().clone()
    for i in range(cfg.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = h + "self_attn."
        yield h + "input_layernorm.weight", one(m + "input_layernorm.weight")
        q, k, v = _split_qkv(col(m + "self_attention.linear_qkv.weight"), cfg)
        yield from ((a + "q_proj.weight", q.contiguous()), (a + "k_proj.weight", k.contiguous()),
                    (a + "v_proj.weight", v.contiguous()))
        if has(m + "self_attention.linear_qkv.bias"):
            qb, kb, vb = _split_qkv(col(m + "self_attention.linear_qkv.bias"), cfg)
            yield from ((a + "q_proj.bias", qb.contiguous()), (a + "k_proj.bias", kb.contiguous()),
                        (a + "v_proj.bias", vb.contiguous()))
        yield a + "o_proj.weight", row(m + "self_attention.linear_proj.weight").contiguous()
        fc1 = [t.chunk(2, dim=0) for t in get(m + "mlp.linear_fc1.weight")]
        yield h + "mlp.gate_proj.weight", torch.cat([g for g, _ in fc1]).contiguous()
        yield h + "mlp.up_proj.weight", torch.cat([u for _, u in fc1]).contiguous()
        del fc1
        yield h + "mlp.down_proj.weight", row(m + "mlp.linear_fc2.weight").contiguous()
        yield h + "post_attention_layernorm.weight", one(m + "pre_mlp_layernorm.weight")
    yield "model.norm.weight", one("decoder.final_layernorm.weight")
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", col("output_layer.weight")[:vocab].contiguous().clone()
