"""LoRA adapters: PEFT's layers on the trainer's model, and the adapter as it travels.

Training (`add_adapters`, needs the `lora` extra): PEFT's LoRA layers are injected into
the HF model in place (`peft.inject_adapter_in_model`), so the module keeps its HF
structure (FSDP wraps `model.layers` as before) and only the adapters' A and B require
gradients. Parameter names gain `.base_layer.` and `.lora_A.default.` segments.

The wire (`wire_tensors`): per adapted linear layer `X`, `X.lora_A.weight` (r × in) and
`X.lora_B.weight` (out × r) with the scale alpha / r folded into B. A receiver
(`adapter_pairs`) keeps the base weights as loaded and runs each version's adapter beside
them (the embedded engine: y = x·Wᵀ + (x·Aᵀ)·Bᵀ), which computes what `base + B @ A`
computes up to float rounding; a version costs the adapter's bytes, not the model's.

Export (`merged_weights`): the model's HF names with each adapted weight merged — an HF
folder any engine, `audit` and `eval` load as they load a full fine-tune. `save_adapter`
writes PEFT's own format (`PeftModel.from_pretrained` loads it); `load_adapter` reads it
back (checkpoints, `model.lora.init_from`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = ["add_adapters", "wire_tensors", "adapter_wire", "merged_weights", "save_adapter", "load_adapter",
           "adapter_pairs", "is_adapter_name", "ADAPTER_FILE", "ADAPTER_CONFIG"]

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_A, _B = ".lora_A.weight", ".lora_B.weight"
_ADAPTER = "default"


def is_adapter_name(name: str) -> bool:
    """A wire name of an adapter tensor (`X.lora_A.weight` / `X.lora_B.weight`)."""
    return name.endswith(_A) or name.endswith(_B)


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise RuntimeError("model.lora needs peft: pip install 'areal_like[lora]' (or .[dev])") from None
    return peft


def _targets(cfg: Any, module: torch.nn.Module | None) -> str | list[str]:
    """`all-linear` as the leaf names of every linear layer but the output head (PEFT does
    this for transformers' classes only; our lite model is not one)."""
    if isinstance(cfg.target_modules, str):
        if cfg.target_modules != "all-linear" or module is None:
            return cfg.target_modules
        head = module.get_submodule("lm_head") if hasattr(module, "lm_head") else None
        return sorted({n.rsplit(".", 1)[-1] for n, m in module.named_modules()
                       if isinstance(m, torch.nn.Linear) and m is not head})
    return list(cfg.target_modules)


def _peft_config(cfg: Any, base_path: str | Path | None = None, module: torch.nn.Module | None = None,
                 targets: list[str] | None = None) -> Any:
    target = targets if targets is not None else _targets(cfg, module)
    return _peft().LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=target,
                              task_type="CAUSAL_LM",
                              base_model_name_or_path=str(base_path) if base_path is not None else None)


def add_adapters(module: torch.nn.Module, cfg: Any) -> dict[str, float]:
    """Inject adapters per `cfg` (`model.lora`) into `module` in place; freeze everything
    else. Returns {adapted layer name: scale}."""
    peft = _peft()
    for p in module.parameters():
        p.requires_grad_(False)
    try:
        peft.inject_adapter_in_model(_peft_config(cfg, module=module), module, adapter_name=_ADAPTER)
    except ValueError as e:
        if "not found in the base model" not in str(e):
            raise
        scales = {}
    else:
        scales = _scales(module)
    if not scales:
        raise ValueError(f"model.lora.target_modules={cfg.target_modules!r} matched no linear layer of the model")
    shared = _tied(module, scales)
    if shared:
        raise ValueError(f"model.lora.target_modules adapts {shared}, whose weight is tied to another (the "
                         "embeddings): a merged version would change both; leave it out")
    for n, p in module.named_parameters():
        p.requires_grad_(".lora_A." in n or ".lora_B." in n)
    return scales


def _tied(module: torch.nn.Module, scales: dict[str, float]) -> list[str]:
    owners: dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        owners[id(p)] = owners.get(id(p), 0) + 1
    return [x for x in scales if owners.get(id(module.get_submodule(x).base_layer.weight), 0) > 1]


def _scales(module: torch.nn.Module) -> dict[str, float]:
    from peft.tuners.lora import LoraLayer

    return {name: float(m.scaling[_ADAPTER]) for name, m in module.named_modules()
            if isinstance(m, LoraLayer) and _ADAPTER in m.scaling}


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def _adapter_params(module: torch.nn.Module, scales: dict[str, float]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{layer: (A, B)} in full (a gather under FSDP: every rank calls it in step)."""
    params = dict(module.named_parameters())
    return {x: (_full(params[f"{x}.lora_A.{_ADAPTER}.weight"]), _full(params[f"{x}.lora_B.{_ADAPTER}.weight"]))
            for x in scales}


def wire_tensors(module: torch.nn.Module, scales: dict[str, float],
                 dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """What a version puts on the wire: A and scale·B per adapted layer (module docstring)."""
    for x, (a, b) in _adapter_params(module, scales).items():
        yield f"{x}{_A}", a.to(dtype)
        yield f"{x}{_B}", (b * scales[x]).to(dtype)


def merged_weights(module: torch.nn.Module, scales: dict[str, float],
                   full_named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`full_named` (the module's full-precision (name, tensor) pairs, adapters included)
    as plain HF names, each adapted weight merged: W + scale · B @ A, as PEFT merges."""
    adapters = _adapter_params(module, scales)
    for name, t in full_named:
        if ".lora_A." in name or ".lora_B." in name:
            continue
        if ".base_layer." not in name:
            yield name, t
            continue
        x, leaf = name.split(".base_layer.", 1)
        if leaf == "weight" and x in adapters:
            a, b = adapters[x]
            t = t + (b.to(t.dtype) @ a.to(t.dtype)) * scales[x]
        yield f"{x}.{leaf}", t


def _peft_name(x: str, which: str) -> str:
    return f"base_model.model.{x}.{which}.weight"


def save_adapter(folder: str | Path, module: torch.nn.Module, scales: dict[str, float], cfg: Any,
                 base_path: str | Path, *, write: bool = True) -> None:
    """PEFT's format: `adapter_config.json` + `adapter_model.safetensors` (fp32)."""
    from safetensors.torch import save_file

    tensors = {}
    for x, (a, b) in _adapter_params(module, scales).items():
        tensors[_peft_name(x, "lora_A")] = a.float().cpu().contiguous()
        tensors[_peft_name(x, "lora_B")] = b.float().cpu().contiguous()
    if not write:
        return
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_FILE), metadata={"format": "pt"})
    conf = _peft_config(cfg, base_path, targets=sorted({x.rsplit(".", 1)[-1] for x in scales})).to_dict()
    conf = {k: (sorted(v) if isinstance(v, set) else v) for k, v in conf.items()}
    (out / ADAPTER_CONFIG).write_text(json.dumps(conf, indent=1, default=str))


def load_adapter(folder: str | Path, scales: dict[str, float]) -> dict[str, torch.Tensor]:
    """A PEFT-format adapter as this module's parameter names (`X.lora_A.default.weight`);
    refuses one whose layers differ from the model's adapted layers."""
    from safetensors.torch import load_file

    src = Path(folder)
    file = src / ADAPTER_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{src} holds no {ADAPTER_FILE}: not a saved adapter (PEFT format)")
    got = load_file(str(file), device="cpu")
    out: dict[str, torch.Tensor] = {}
    for x in scales:
        for which in ("lora_A", "lora_B"):
            key = _peft_name(x, which)
            if key not in got:
                raise ValueError(f"adapter {src} has no {key}: it was saved for other layers or another model "
                                 "(model.lora.target_modules must match)")
            out[f"{x}.{which}.{_ADAPTER}.weight"] = got.pop(key)
    if got:
        raise ValueError(f"adapter {src} has tensors for layers this model does not adapt: {sorted(got)[:3]}")
    return out


def adapter_wire(folder: str | Path) -> list[tuple[str, torch.Tensor]]:
    """A saved PEFT adapter as a version's wire tensors (A and scale·B per layer), for a
    server that starts from it (`serve` with `model.lora.init_from`)."""
    from safetensors.torch import load_file

    src = Path(folder)
    if not (src / ADAPTER_CONFIG).is_file() or not (src / ADAPTER_FILE).is_file():
        raise FileNotFoundError(f"{src} is not a saved adapter: it needs {ADAPTER_CONFIG} and {ADAPTER_FILE} "
                                "(a run's final/adapter, or PEFT's save_pretrained)")
    conf = json.loads((src / ADAPTER_CONFIG).read_text())
    r, alpha = int(conf["r"]), float(conf["lora_alpha"])
    scale = alpha / (r ** 0.5 if conf.get("use_rslora") else r)
    out = []
    for key, t in load_file(str(src / ADAPTER_FILE), device="cpu").items():
        x = key.removeprefix("base_model.model.")
        if x.endswith(_A):
            out.append((x, t))
        elif x.endswith(_B):
            out.append((x, t * scale))
        else:
            raise ValueError(f"adapter {src}: {key} is not a LoRA A or B weight (only LoRA adapters are read)")
    return out


def adapter_pairs(named: Iterable[tuple[str, torch.Tensor]],
                  pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A receiver's side of the wire: pass full tensors through; put each adapted layer's
    (A, scale·B) into `pairs` under the layer's name (referenced, not copied: like full
    tensors, they stay unchanged until the version is applied). Raises on a half without
    its pair once `named` is spent."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in named:
        if not is_adapter_name(name):
            yield name, t
            continue
        x, which = (name[: -len(_A)], "a") if name.endswith(_A) else (name[: -len(_B)], "b")
        part = pending.setdefault(x, {})
        part[which] = t.detach() if isinstance(t, torch.Tensor) else t.tensor()  # a file slice is read now
        if len(part) == 2:
            del pending[x]
            pairs[x] = (part["a"], part["b"])
    if pending:
        raise ValueError(f"load_weights: adapter halves without their pair: {sorted(pending)[:3]}")
