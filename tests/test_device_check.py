"""The GPU check that runs only when a machine is lent (tests/gpu/device_check.sh) must not
rot between loans: its random-init model round-trips through the project's own loader, and
every run it starts names a config and `--set` keys that still load."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import torch

from areal_like.core.config import load_config
from areal_like.models.lite import LiteCausalLM

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "gpu" / "device_check.sh"
TOY = ROOT / "areal_like" / "assets" / "quickstart_model"


def test_the_random_init_travels_without_weights_and_loads_like_the_model(tmp_path: Path) -> None:
    described, built = tmp_path / "described", tmp_path / "built"
    for args in (["--model", str(TOY), "--out", str(described)], ["--from", str(described), "--out", str(built)]):
        p = subprocess.run([sys.executable, "tests/gpu/random_model.py", *args], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 0, p.stderr
    assert not list(described.glob("*.safetensors"))  # what travels holds no weights
    assert (described / "shapes.json").is_file() and (described / "tokenizer.json").is_file()
    real, rand = LiteCausalLM.from_pretrained(TOY), LiteCausalLM.from_pretrained(built)
    real_state, rand_state = real.state_dict(), rand.state_dict()
    assert real_state.keys() == rand_state.keys()
    for name, t in real_state.items():
        assert rand_state[name].shape == t.shape, name
        if t.dim() == 1:  # norms start at one
            assert torch.equal(rand_state[name], torch.ones_like(t)), name
        else:
            assert not torch.equal(rand_state[name], t), name
            assert 0.015 < float(rand_state[name].std()) < 0.025, name


def _runs(script: str) -> list[tuple[str, list[str]]]:
    """(config, --set pairs) of each `run CONFIG NAME LIMIT PAIRS...` line, with the
    script's own arrays and the pairs `run()` always adds."""
    text = script.replace("\\\n", " ")
    arrays = {m[1]: shlex.split(m[2]) for m in re.finditer(r"^\s*(\w+)=\((.*)\)\s*$", text, re.M)}
    always = re.findall(r"--set (\S+=\S+)", text[text.index("run() {"):text.index("\n}\n")])
    out = []
    for line in re.findall(r"^\s*run (configs/\S+ .*)$", text, re.M):
        config, _name, _limit, *rest = shlex.split(line)
        pairs = []
        for word in rest:
            name = re.fullmatch(r"\$\{(\w+)\[@\]\}", word)
            pairs += arrays[name[1]] if name else [word]
        out.append((config, [p.replace('"', "").replace("$name", "x") for p in always] + pairs))
    return out


def test_every_run_of_the_gpu_check_names_settings_that_load() -> None:
    runs = _runs(SCRIPT.read_text())
    assert len(runs) >= 6 and any(c == "configs/smollm2.yaml" for c, _ in runs), runs
    for config, pairs in runs:
        assert all("=" in p for p in pairs), pairs
        cfg = load_config(ROOT / config, pairs)
        assert cfg.train.backend.device == "cuda", (config, pairs)
    p = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
