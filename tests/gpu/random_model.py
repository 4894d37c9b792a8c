"""A model folder that travels to a lent GPU machine without its weights.

A real checkpoint does not fit the device tool's 64 MiB working tree (SmolLM2-135M is
538 MB in fp32), and that machine reaches no package index or hub. So the GPU check runs
the real recipe on a random init of the same shapes: the same work per step, no learning.

Here (a fetched model):  python tests/gpu/random_model.py --out .gpu_model
  copies its config, tokenizer and chat template and writes shapes.json (the weights'
  names and shapes), ~3.4 MB.
There (on the device):   python tests/gpu/random_model.py --from .gpu_model --out /tmp/smollm2-rand
  writes model.safetensors with N(0, 0.02) matrices and unit norms, seeded.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

KEEP = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def describe(model: Path, out: Path) -> None:
    from safetensors import safe_open

    out.mkdir(parents=True, exist_ok=True)
    for name in KEEP:
        if (model / name).is_file():
            shutil.copy2(model / name, out / name)
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    (out / "shapes.json").write_text(json.dumps(shapes))
    print(f"{out}: {len(shapes)} tensors, {sum(_numel(s) for s in shapes.values()) / 1e6:.1f}M parameters")


def random_init(described: Path, out: Path, seed: int = 0) -> None:
    import torch
    from safetensors.torch import save_file

    shapes = json.loads((described / "shapes.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    for name in KEEP:
        if (described / name).is_file():
            shutil.copy2(described / name, out / name)
    g = torch.Generator().manual_seed(seed)
    tensors = {k: (torch.ones(s) if len(s) == 1 else torch.randn(s, generator=g) * 0.02) for k, s in shapes.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    print(f"{out}: random init of {len(tensors)} tensors, {sum(t.numel() for t in tensors.values()) / 1e6:.1f}M parameters")


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="A fetched model's name or folder.")
    p.add_argument("--from", dest="described", help="A folder this script described: write a random init from it.")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    if a.described:
        random_init(Path(a.described), Path(a.out))
        return
    from areal_like.models.fetch import cached_folder

    model = Path(a.model) if Path(a.model).is_dir() else cached_folder(a.model)
    if model is None:
        raise SystemExit(f"{a.model!r} is not fetched: areal-like model fetch {a.model}")
    describe(model, Path(a.out))


if __name__ == "__main__":
    main()
