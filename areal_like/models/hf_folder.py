"""HF weight files written from a stream of `(name, tensor)` pairs, in bounded shards.

`write_hf_weights(folder, named_tensors)` never holds more than one shard of CPU tensors
(`max_shard_bytes`, plus the tensor that overflows it; on the CPU the trainer's own,
elsewhere copies): a train rank exports a 7B model
without a whole-model copy in its own memory, and nothing of it passes through the driver
(which hands the rank only the folder's path). The layout is what
`transformers.AutoModelForCausalLM.from_pretrained` reads:

- everything in one shard: `model.safetensors` (the single-file layout, as before);
- more: `model-00001-of-0000N.safetensors` … plus `model.safetensors.index.json`
  (`metadata.total_size`, `weight_map`), HF's sharded layout.

Config, generation config and tokenizer files are the caller's (copied from the model folder).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "INDEX_FILE", "SINGLE_FILE", "has_hf_weights", "read_hf_weights",
           "write_hf_weights"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 2 * 2**30
"""2 GiB: a 7B model in bf16 is 7 shards, and a writer's peak stays near one."""


def has_hf_weights(folder: str | os.PathLike[str]) -> bool:
    """The folder holds HF weights, single-file or sharded."""
    f = Path(folder)
    return (f / SINGLE_FILE).is_file() or (f / INDEX_FILE).is_file()


def _dtype_codes() -> dict[Any, str]:
    import torch

    codes = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}
    for attr, code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
        if hasattr(torch, attr):
            codes[getattr(torch, attr)] = code
    return codes


def read_hf_weights(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """Every tensor of the folder's safetensors files, each read into memory of its own.

    Read with `readinto`, not mapped (safetensors' `load_file` maps the file): a mapping
    lives as long as any tensor of it, so the pages of tensors a model copies elsewhere
    (an engine's fused projections) or rewrites (each weight version, copy-on-write) stay
    resident beside the copies. Here the process holds each weight once."""
    import torch

    dtypes = {code: dt for dt, code in _dtype_codes().items()}
    out: dict[str, Any] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with open(path, "rb", buffering=0) as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
            base = 8 + n
            for name, spec in header.items():
                if name == "__metadata__":
                    continue
                if spec["dtype"] not in dtypes:
                    raise ValueError(f"{path}: {name} has dtype {spec['dtype']}, which torch here cannot hold")
                begin, end = spec["data_offsets"]
                t = torch.empty(spec["shape"], dtype=dtypes[spec["dtype"]])
                if end - begin != t.numel() * t.element_size():
                    raise ValueError(f"{path}: {name}'s bytes {begin}..{end} do not hold shape {spec['shape']}")
                view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
                f.seek(base + begin)
                done = 0
                while done < len(view):
                    got = f.readinto(view[done:])
                    if not got:
                        raise ValueError(f"{path} ends inside {name}")
                    done += got
                out[name] = t
    return out


def _save_shard(tensors: dict[str, Any], path: Path) -> None:
    """One safetensors file written straight from the tensors' memory (safetensors'
    `save_file` first makes a bytes copy of each: twice the shard at the peak). The format:
    the header's length (u64, little-endian), the header (JSON: dtype, shape and byte range
    of each tensor, padded with spaces to 8 bytes), then the tensors' bytes in order."""
    import torch

    codes = _dtype_codes()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": codes[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in tensors.values():
            if t.numel():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


def write_hf_weights(folder: str | os.PathLike[str], named_tensors: Iterable[tuple[str, Any]], *,
                     max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, write: bool = True) -> dict[str, Any]:
    """Stream `named_tensors` into safetensors shards under `folder` (module docstring).
    Returns `{"files", "tensors", "total_bytes"}`. `write=False` iterates without writing
    (a rank that takes part in the gathers but is not the writer)."""
    out = Path(folder)
    if not write:
        for _ in named_tensors:
            pass
        return {"files": [], "tensors": 0, "total_bytes": 0}
    out.mkdir(parents=True, exist_ok=True)
    parts: list[tuple[Path, list[str]]] = []
    shard: dict[str, Any] = {}
    size = total = count = 0

    def flush() -> None:
        nonlocal shard, size
        if shard:
            path = out / f".part-{len(parts):05d}.safetensors"
            _save_shard(shard, path)
            parts.append((path, list(shard)))
        shard, size = {}, 0

    for name, t in named_tensors:
        # on the CPU (a GPU tensor is copied; a CPU one is written from its own memory, as
        # nothing trains while this runs), contiguous
        c = t.detach().to("cpu").contiguous()
        n = c.numel() * c.element_size()
        if shard and size + n > max_shard_bytes:
            flush()
        shard[name] = c
        size += n
        total += n
        count += 1
    flush()
    if len(parts) <= 1:  # one shard (or an empty model): the single-file layout
        files = [SINGLE_FILE]
        if parts:
            parts[0][0].rename(out / SINGLE_FILE)
        else:
            _save_shard({}, out / SINGLE_FILE)
        return {"files": files, "tensors": count, "total_bytes": total}
    files, weight_map = [], {}
    for i, (path, names) in enumerate(parts):
        fname = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        path.rename(out / fname)
        files.append(fname)
        weight_map.update(dict.fromkeys(names, fname))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return {"files": [*files, INDEX_FILE], "tensors": count, "total_bytes": total}
