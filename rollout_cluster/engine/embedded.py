"""The embedded engine: continuous batching over an HF causal LM with our own KV cache.

Why not `model.generate()`: it pads a batch to its longest response, cannot admit
new requests mid-flight, and cannot be interrupted for a weight update. Why not the
HF forward with a `DynamicCache`: per-step Python overhead (mask construction, cache
objects) dominates a small model on CPU. So this engine runs the decoder itself
(Qwen2 / Qwen3 / Llama / Mistral layer math, numerically the HF computation) over
the HF module's own parameters, which keeps weight loading a plain copy by HF name.

KV cache: one preallocated tensor `[layers, slots, kv_heads, max_seq_len, head_dim]`
(keys and values each). A running sequence owns one slot; running sequences always
occupy slots `0..B-1`, so a decode step reads a plain slice; when one finishes the
last one moves into its hole (one copy). Prefill keeps tokens packed (no padding)
except inside attention. A step: decode every running sequence (one token each),
retire finished ones, admit waiting ones within a padded-token budget, prefill them
in one batch (sampling their first token), retire.

Prefix cache: `(version, token ids) -> KV (+ last-position logits)`, LRU bounded in
tokens. Entries are written for every prefilled prompt and every finished sequence
(so a multi-turn episode's next turn reuses its previous turn), duplicates in one
admission batch (the n samples of a GRPO group) are prefilled once, and the whole
cache is dropped on every weight update: KV computed with old weights is never reused
(invariant 3c).

Interrupts (docs/design.md §9.1) are `update_weights`: see `interrupt_mode` there.
"""

from __future__ import annotations

import logging
import random
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from areal_like.core.config import EmbeddedEngineConfig
from areal_like.core.types import GenerateResult, SamplingParams, StopReason
from rollout_cluster.engine.base import (
    INTERRUPT_MODES,
    DuplicateRequestError,
    Engine,
    EngineCounters,
    InterruptMode,
    InvalidSamplingParamsError,
    NamedTensors,
    RequestOutput,
    finished_result,
    validate_request,
)
from rollout_cluster.engine.sampling import SamplingBatch, mix_seed, sample_tokens

__all__ = ["EmbeddedEngine", "SUPPORTED_MODEL_TYPES"]

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")


@dataclass(eq=False)
class _Seq:
    request_id: str
    ids: list[int]
    """Prompt followed by every generated token (the sequence as the model sees it)."""
    prompt_len: int
    params: SamplingParams
    stream: int
    """32-bit RNG stream key; noise = hash(stream, position, vocab index)."""
    max_len: int
    """Stop with `length` when `len(ids)` reaches this (prompt + max_tokens, capped)."""
    stop_ids: frozenset[int]
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    num_computed: int = 0
    """Tokens of `ids` whose KV is in the slot; while running it is `len(ids) - 1`."""
    num_interrupts: int = 0
    stop_reason: StopReason | None = None

    @property
    def out_ids(self) -> list[int]:
        return self.ids[self.prompt_len :]


@dataclass(eq=False)
class _CacheEntry:
    k: torch.Tensor  # [layers, kv_heads, n, head_dim]
    v: torch.Tensor
    logits: torch.Tensor | None  # logits at the last position, when known


class _PrefixCache:
    """LRU map `(version, token ids) -> KV`; lookups find the longest cached prefix."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self._entries: OrderedDict[tuple[int, tuple[int, ...]], _CacheEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = 0

    def insert(self, version: int, ids: tuple[int, ...], entry: _CacheEntry) -> None:
        key = (version, ids)
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        if len(ids) > self.max_tokens:
            return
        self._entries[key] = entry
        self.tokens += len(ids)
        while self.tokens > self.max_tokens:
            (_, old_ids), _ = self._entries.popitem(last=False)
            self.tokens -= len(old_ids)

    def lookup(self, version: int, ids: tuple[int, ...]) -> tuple[_CacheEntry | None, int]:
        """Exact entry with logits, else the longest strict prefix; returns (entry, length)."""
        exact = self._entries.get((version, ids))
        if exact is not None and exact.logits is not None:
            self._entries.move_to_end((version, ids))
            return exact, len(ids)
        best: tuple[tuple[int, tuple[int, ...]], _CacheEntry] | None = None
        n = len(ids)
        for key, entry in self._entries.items():
            v, k_ids = key
            m = len(k_ids)
            if v != version or m > n or (best is not None and m <= len(best[0][1])):
                continue
            if ids[:m] == k_ids:
                best = (key, entry)
        if best is None:
            return None, 0
        self._entries.move_to_end(best[0])
        # A full-length hit without logits still needs the last position computed.
        return best[1], min(len(best[0][1]), n - 1)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # Same op order as HF's Qwen2RMSNorm / LlamaRMSNorm, so fp32 results match bit for bit.
    var = x.pow(2).mean(-1, keepdim=True)
    return w * (x * torch.rsqrt(var + eps))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


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


class EmbeddedEngine(Engine):
    """Continuous-batching engine over a local HF causal LM (fp32 on CPU by default).

    Construct from a model folder and an `EmbeddedEngineConfig`:
    `EmbeddedEngine(path, config, interrupt_mode="recompute", seed=0)`.
    `eos_token_ids=[]` disables the model's eos (benchmarks force response lengths).
    """

    def __init__(
        self,
        model: str | Path | torch.nn.Module,
        config: EmbeddedEngineConfig | None = None,
        *,
        interrupt_mode: InterruptMode = "recompute",
        seed: int = 0,
        eos_token_ids: Iterable[int] | None = None,
        prefix_cache_max_tokens: int | None = None,
        max_prefill_tokens: int = 4096,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if interrupt_mode not in INTERRUPT_MODES:
            raise ValueError(f"interrupt_mode must be one of {INTERRUPT_MODES}, got {interrupt_mode!r}")
        self.config = config or EmbeddedEngineConfig()
        self.interrupt_mode: InterruptMode = interrupt_mode
        self.device = torch.device(self.config.device)
        self.max_seq_len = self.config.max_seq_len
        self.max_slots = self.config.max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self._model = self._load_model(model, dtype).to(self.device)
        hf = self._model.config
        model_type = getattr(hf, "model_type", "?")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"EmbeddedEngine supports model types {SUPPORTED_MODEL_TYPES}, got {model_type!r}; "
                "use the vLLM engine for other architectures"
            )
        if "sliding_attention" in (getattr(hf, "layer_types", None) or []):
            raise ValueError("EmbeddedEngine does not implement sliding-window attention layers")
        if hf.max_position_embeddings < self.max_seq_len:
            raise ValueError(
                f"max_seq_len {self.max_seq_len} exceeds the model's max_position_embeddings "
                f"{hf.max_position_embeddings}"
            )
        self.vocab_size = int(hf.vocab_size)
        self._n_heads = hf.num_attention_heads
        self._n_kv = getattr(hf, "num_key_value_heads", None) or self._n_heads
        self._head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // self._n_heads
        self._eps = float(hf.rms_norm_eps)
        self._act = self._activation(hf.hidden_act)
        self._scale = float(self._model.model.layers[0].self_attn.scaling)
        if eos_token_ids is None:
            eos = getattr(self._model.generation_config, "eos_token_id", None)
            if eos is None:
                eos = hf.eos_token_id
            eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self._state = self._model.state_dict()
        self._layers: list[_Layer] = []
        self._pack()
        with torch.inference_mode():
            positions = torch.arange(self.max_seq_len, device=self.device)[None]
            probe = torch.zeros(1, device=self.device, dtype=dtype)
            cos, sin = self._model.model.rotary_emb(probe, positions)
        self._cos, self._sin = cos[0], sin[0]  # [max_seq_len, head_dim]
        shape = (len(self._layers), self.max_slots, self._n_kv, self.max_seq_len, self._head_dim)
        self._k = torch.zeros(shape, dtype=dtype, device=self.device)
        self._v = torch.zeros(shape, dtype=dtype, device=self.device)
        self._version = 0
        self._paused = False
        self._admission_closed = False
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._by_id: dict[str, _Seq] = {}
        self._rng = random.Random(seed)
        self._prefix = _PrefixCache(
            # Default: half the slot cache again, enough for every running episode's last turn.
            prefix_cache_max_tokens
            if prefix_cache_max_tokens is not None
            else self.max_slots * self.max_seq_len // 2
        )
        self.counters = EngineCounters()

    # ---- construction helpers -------------------------------------------------------

    @staticmethod
    def _load_model(model: str | Path | torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
        if isinstance(model, torch.nn.Module):
            m = model
        else:
            from transformers import AutoModelForCausalLM

            m = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype)
        m = m.to(dtype).eval()
        for p in m.parameters():
            p.requires_grad_(False)
        return m

    @staticmethod
    def _activation(name: str) -> Any:
        if name == "silu":
            return F.silu
        from transformers.activations import ACT2FN

        return ACT2FN[name]

    def _pack(self) -> None:
        """Fuse q/k/v and gate/up projections into single matmuls.

        Packed tensors are copies, so they must be rebuilt after every weight load
        (the same trap vLLM's packed linears set for a plain `load_state_dict`).
        """
        layers = []
        for layer in self._model.model.layers:
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
                    w_qkv=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                    b_qkv=b_qkv,
                    w_o=a.o_proj.weight,
                    b_o=a.o_proj.bias,
                    w_gu=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                    b_gu=b_gu,
                    w_down=mlp.down_proj.weight,
                    b_down=mlp.down_proj.bias,
                    q_norm=a.q_norm.weight if hasattr(a, "q_norm") else None,
                    k_norm=a.k_norm.weight if hasattr(a, "k_norm") else None,
                )
            )
        self._layers = layers
        self._embed = self._model.model.embed_tokens.weight
        self._norm = self._model.model.norm.weight
        self._lm_head = self._model.lm_head.weight

    # ---- Engine interface -------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def model(self) -> torch.nn.Module:
        """The HF module whose parameters the engine runs (read-only use, e.g. tests)."""
        return self._model

    def add_request(self, request_id: str, prompt_ids: list[int], sampling_params: SamplingParams) -> None:
        ids = validate_request(
            request_id, prompt_ids, sampling_params, max_seq_len=self.max_seq_len, vocab_size=self.vocab_size
        )
        if sampling_params.n != 1:
            raise InvalidSamplingParamsError(
                f"request {request_id}: the engine runs one sample per request (n={sampling_params.n}); "
                "submit n requests (AsyncEngine.generate_n does)"
            )
        if request_id in self._by_id:
            raise DuplicateRequestError(f"request id {request_id!r} is already in flight")
        seed = sampling_params.seed if sampling_params.seed is not None else self._rng.getrandbits(63)
        seq = _Seq(
            request_id=request_id,
            ids=ids,
            prompt_len=len(ids),
            params=sampling_params,
            stream=mix_seed(seed, 0),
            max_len=min(len(ids) + sampling_params.max_tokens, self.max_seq_len),
            stop_ids=(frozenset() if sampling_params.ignore_eos else self.eos_token_ids)
            | frozenset(sampling_params.stop_token_ids),
        )
        self._by_id[request_id] = seq
        self._waiting.append(seq)
        self.counters.prompt_tokens += len(ids)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def step(self) -> list[RequestOutput]:
        if self._paused:
            return []
        outs: list[RequestOutput] = []
        with torch.inference_mode():
            if self._running:
                outs += self._decode()
                self._retire()
            if self._waiting and not self._admission_closed:
                admitted = self._admit()
                if admitted:
                    outs += self._prefill(admitted)
                    self._retire()
        return outs

    def abort(self, request_ids: Iterable[str]) -> list[GenerateResult]:
        results = []
        for rid in request_ids:
            seq = self._by_id.get(rid)
            if seq is None:
                continue
            seq.stop_reason = "abort"
            if seq in self._waiting:
                self._waiting.remove(seq)
                del self._by_id[rid]
            results.append(self._result(seq))
            self.counters.requests_aborted += 1
        self._retire()
        return results

    def pause(self) -> None:
        self._paused = True

    def resume(self) -> None:
        self._paused = False

    def load_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Copy `(HF name, tensor)` pairs into the model, then re-pack and set the version.

        Everything is checked and staged before anything is copied, so a wrong name
        or shape leaves the engine on its old weights and version (weight-sync
        receivers may also reuse their buffers between buckets, so we copy at once).
        Tied embeddings stay tied: `lm_head.weight` and `model.embed_tokens.weight`
        are the same storage, whichever name arrives.
        """
        self._apply(self._stage(named_tensors), version)

    def _stage(self, named_tensors: NamedTensors) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Check names and shapes and copy the incoming tensors; raises before any change."""
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, tensor in named_tensors:
            dst = self._state.get(name)
            if dst is None:
                raise KeyError(f"load_weights: unknown weight {name!r} for {type(self._model).__name__}")
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"load_weights: {name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
                )
            staged.append((dst, tensor.detach().to(device=dst.device, dtype=dst.dtype, copy=True)))
        return staged

    def _apply(self, staged: list[tuple[torch.Tensor, torch.Tensor]], version: int) -> None:
        with torch.no_grad():
            for dst, src in staged:
                dst.copy_(src)
        self._pack()
        self._version = int(version)
        self.counters.weight_updates += 1

    def update_weights(self, named_tensors: NamedTensors, version: int) -> list[RequestOutput]:
        """Load new weights mid-generation, per `interrupt_mode`:

        - `recompute`: stop at this step boundary; keep every sampled token, logprob
          and version; drop all KV (slots and prefix cache); load; set the version;
          re-prefill prompt + partial with the new weights for every in-flight
          request (inside this call, so pause→resume latency includes it); continue.
        - `keep` (ablation; breaks invariant 3): load, keep the stale KV, continue.
        - `wait`: stop admitting; decode in-flight requests to completion with the
          old weights (no call mixes versions); load; admit the waiting ones.
        """
        t0 = time.perf_counter()
        self._paused = True
        outs: list[RequestOutput] = []
        try:
            # Receive and check everything first: a failed transfer leaves in-flight
            # requests untouched, on the old weights and version.
            staged = self._stage(named_tensors)
            if self.interrupt_mode == "wait":
                outs += self._drain()
            inflight = list(self._running)
            if inflight:
                self.counters.interrupts += 1
                self.counters.interrupted_requests += len(inflight)
                self.counters.interrupted_tokens += sum(len(s.ids) - s.prompt_len for s in inflight)
                for s in inflight:
                    s.num_interrupts += 1
            self._prefix.clear()
            if self.interrupt_mode == "recompute":
                for s in inflight:
                    s.num_computed = 0  # the KV of its slot is now garbage
                self._running = []
                # Shortest first: re-prefill batches of similar lengths pad attention least.
                self._waiting.extendleft(sorted(inflight, key=lambda s: len(s.ids), reverse=True))
            self._apply(staged, version)
            if self.interrupt_mode == "recompute" and inflight:
                outs += self._reprefill(inflight)
        finally:
            self._paused = False
        self.counters.record_pause(time.perf_counter() - t0)
        return outs

    def metrics(self) -> dict[str, float]:
        m = self.counters.as_dict()
        used = sum(s.num_computed for s in self._running)
        m.update(
            version=float(self._version),
            queue_depth=float(len(self._waiting)),
            running=float(len(self._running)),
            kv_used_tokens=float(used),
            kv_capacity_tokens=float(self.max_slots * self.max_seq_len),
            kv_usage=used / float(self.max_slots * self.max_seq_len),
            prefix_cache_tokens=float(self._prefix.tokens),
            prefix_cache_entries=float(len(self._prefix)),
        )
        return m

    # ---- scheduling -------------------------------------------------------------------

    def _drain(self) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        self._admission_closed = True
        self._paused = False
        try:
            while self._running:
                outs += self.step()
        finally:
            self._admission_closed = False
            self._paused = True
        return outs

    def _reprefill(self, inflight: list[_Seq]) -> list[RequestOutput]:
        """Admit and prefill the interrupted requests (now at the head of the queue)."""
        outs: list[RequestOutput] = []
        pending = set(map(id, inflight))
        with torch.inference_mode():
            while pending and self._waiting and id(self._waiting[0]) in pending:
                admitted = self._admit(only=pending)
                for s in admitted:
                    pending.discard(id(s))
                    self.counters.recompute_tokens += len(s.ids)
                outs += self._prefill(admitted)
                self._retire()
        return outs

    def _admit(self, only: set[int] | None = None) -> list[_Seq]:
        """Pop waiting requests into free slots while the padded prefill stays in budget."""
        admitted: list[_Seq] = []
        longest = 0
        while self._waiting and len(self._running) + len(admitted) < self.max_slots:
            seq = self._waiting[0]
            if only is not None and id(seq) not in only:
                break
            longest_if = max(longest, len(seq.ids))
            if admitted and (len(admitted) + 1) * longest_if > self.max_prefill_tokens:
                break
            self._waiting.popleft()
            admitted.append(seq)
            longest = longest_if
        return admitted

    def _retire(self) -> None:
        """Drop finished requests from the running batch, keeping slots 0..B-1 dense."""
        running = self._running
        if not any(s.stop_reason is not None for s in running):
            return
        holes = [i for i, s in enumerate(running) if s.stop_reason is not None]
        for s in (running[i] for i in holes):
            self._by_id.pop(s.request_id, None)
            if s.stop_reason != "abort":
                self._remember(s)
        keep = len(running) - len(holes)
        tail = [i for i in range(keep, len(running)) if running[i].stop_reason is None]
        for hole in (h for h in holes if h < keep):
            src = tail.pop()
            n = running[src].num_computed
            self._k[:, hole, :, :n] = self._k[:, src, :, :n]
            self._v[:, hole, :, :n] = self._v[:, src, :, :n]
            running[hole] = running[src]
        del running[keep:]

    def _remember(self, seq: _Seq) -> None:
        """Cache a finished sequence's KV so the next turn of its episode reuses it."""
        n = seq.num_computed
        if not self.config.prefix_cache or n < 2:
            return
        slot = self._running.index(seq)
        entry = _CacheEntry(self._k[:, slot, :, :n].clone(), self._v[:, slot, :, :n].clone(), None)
        self._prefix.insert(self._version, tuple(seq.ids[:n]), entry)

    # ---- model execution ------------------------------------------------------------

    def _forward(self, slot0: int, chunks: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Run token chunks for slots `slot0..slot0+N-1`, chunk i starting at position `starts[i]`.

        Writes their K/V into the cache and returns each chunk's last-position logits
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
        hq, hkv, d = self._n_heads, self._n_kv, self._head_dim
        rep = hq // hkv
        m = tokens.numel()
        h = F.embedding(tokens, self._embed)  # [M, hidden]
        for li, L in enumerate(self._layers):
            x = _rms(h, L.ln1, self._eps)
            qkv = F.linear(x, L.w_qkv, L.b_qkv)
            qs, ks, vs = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            qs = qs.view(m, hq, d)
            ks = ks.view(m, hkv, d)
            if L.q_norm is not None and L.k_norm is not None:
                qs = _rms(qs, L.q_norm, self._eps)
                ks = _rms(ks, L.k_norm, self._eps)
            qs = _rotate(qs, cos, sin)
            ks = _rotate(ks, cos, sin)
            kc, vc = self._k[li], self._v[li]
            kc[rows, :, pos] = ks
            vc[rows, :, pos] = vs.view(m, hkv, d)
            keys = kc[slot0 : slot0 + n, :, :total]  # [N, Hkv, T, D]
            vals = vc[slot0 : slot0 + n, :, :total]
            if grid is not None:
                padded = qs.new_zeros(n * q, hq, d)
                padded[grid] = qs
                qs = padded
            qg = qs.view(n, q, hq, d).transpose(1, 2).reshape(n, hkv, rep * q, d)
            scores = torch.matmul(qg, keys.transpose(-1, -2)).mul_(self._scale)
            scores = scores.view(n, hkv, rep, q, total).add_(bias)
            probs = torch.softmax(scores, dim=-1).view(n, hkv, rep * q, total)
            attn = torch.matmul(probs, vals).view(n, hq, q, d).transpose(1, 2).reshape(n * q, hq * d)
            if grid is not None:
                attn = attn[grid]
            h = h + F.linear(attn, L.w_o, L.b_o)
            x = _rms(h, L.ln2, self._eps)
            gate, up = F.linear(x, L.w_gu, L.b_gu).chunk(2, dim=-1)
            h = h + F.linear(self._act(gate) * up, L.w_down, L.b_down)
        if not decode:
            h = h[torch.cumsum(torch.tensor(qlens, device=dev), 0) - 1]
        return F.linear(_rms(h, self._norm, self._eps), self._lm_head)

    def _decode(self) -> list[RequestOutput]:
        running = self._running
        logits = self._forward(0, [[s.ids[-1]] for s in running], [s.num_computed for s in running])
        for s in running:
            s.num_computed += 1
        return self._sample(running, logits)

    def _prefill(self, admitted: list[_Seq]) -> list[RequestOutput]:
        """Prefill newly admitted (or resumed) sequences in one padded batch.

        Identical sequences are computed once and copied; prefix-cache hits start
        from the cached KV (exact hits with logits skip the model entirely).
        """
        version = self._version
        use_cache = self.config.prefix_cache
        leaders: dict[tuple[int, ...], _Seq] = {}
        followers: list[tuple[_Seq, _Seq]] = []
        hits: dict[int, tuple[_CacheEntry, int]] = {}
        for s in admitted:
            key = tuple(s.ids)
            lead = leaders.get(key)
            if lead is not None:
                followers.append((s, lead))
                continue
            leaders[key] = s
            if use_cache:
                entry, n = self._prefix.lookup(version, key)
                if entry is not None:
                    hits[id(s)] = (entry, n)
        compute = [s for s in leaders.values() if not (id(s) in hits and hits[id(s)][1] == len(s.ids))]
        exact = [s for s in leaders.values() if id(s) in hits and hits[id(s)][1] == len(s.ids)]
        order = compute + exact + [f for f, _ in followers]
        base = len(self._running)
        self._running.extend(order)
        slot = {id(s): base + i for i, s in enumerate(order)}
        logits_of: dict[int, torch.Tensor] = {}
        if compute:
            starts = []
            for s in compute:
                entry, n = hits.get(id(s), (None, 0))
                if entry is not None:
                    self._k[:, slot[id(s)], :, :n] = entry.k[:, :, :n]
                    self._v[:, slot[id(s)], :, :n] = entry.v[:, :, :n]
                    self.counters.prefix_cache_hit_tokens += n
                starts.append(n)
            chunks = [s.ids[st:] for s, st in zip(compute, starts, strict=True)]
            logits = self._forward(base, chunks, starts)
            self.counters.prefill_tokens += sum(map(len, chunks))
            for i, s in enumerate(compute):
                logits_of[id(s)] = logits[i]
                if use_cache:
                    n = len(s.ids)
                    sl = slot[id(s)]
                    entry = _CacheEntry(
                        self._k[:, sl, :, :n].clone(), self._v[:, sl, :, :n].clone(), logits[i]
                    )
                    self._prefix.insert(version, tuple(s.ids), entry)
        for s in exact:
            entry, n = hits[id(s)]
            self._k[:, slot[id(s)], :, :n] = entry.k
            self._v[:, slot[id(s)], :, :n] = entry.v
            assert entry.logits is not None
            logits_of[id(s)] = entry.logits
            self.counters.prefix_cache_hit_tokens += n
        for s, lead in followers:
            n = len(s.ids)
            self._k[:, slot[id(s)], :, :n] = self._k[:, slot[id(lead)], :, :n]
            self._v[:, slot[id(s)], :, :n] = self._v[:, slot[id(lead)], :, :n]
            logits_of[id(s)] = logits_of[id(lead)]
            self.counters.prefix_cache_hit_tokens += n
        for s in order:
            s.num_computed = len(s.ids)
        return self._sample(order, torch.stack([logits_of[id(s)] for s in order]))

    def _sample(self, seqs: list[_Seq], logits: torch.Tensor) -> list[RequestOutput]:
        batch = SamplingBatch(
            temperature=[s.params.temperature for s in seqs],
            top_k=[s.params.top_k for s in seqs],
            top_p=[s.params.top_p for s in seqs],
            seeds=[s.stream for s in seqs],
            positions=[len(s.ids) for s in seqs],
            device=self.device,
        )
        tokens, logps = sample_tokens(logits, batch)
        version = self._version
        outs = []
        for s, tok, lp in zip(seqs, tokens.tolist(), logps.tolist(), strict=True):
            s.ids.append(tok)
            s.logprobs.append(lp)
            s.versions.append(version)
            out = RequestOutput(s.request_id, [tok], [lp], [version])
            if tok in s.stop_ids:
                s.stop_reason = "stop"
            elif len(s.ids) >= s.max_len:
                s.stop_reason = "length"
            if s.stop_reason is not None:
                out.result = self._result(s)
                self.counters.requests_finished += 1
            outs.append(out)
        self.counters.generated_tokens += len(seqs)
        return outs

    @staticmethod
    def _result(s: _Seq) -> GenerateResult:
        assert s.stop_reason is not None
        return finished_result(
            s.request_id, s.out_ids, s.logprobs, s.versions, s.stop_reason, s.num_interrupts
        )
