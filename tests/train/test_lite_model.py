"""Our own Qwen2/Llama module computes what transformers' classes compute, by HF's names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from areal_like.models.lite import LiteCausalLM, lite_supported, load_causal_lm

QUICKSTART = Path(__file__).resolve().parents[2] / "areal_like" / "assets" / "quickstart_model"


def _llama_dir(tmp_path: Path, **over: object) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=90, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, **over)
    out = tmp_path / "llama"
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def _inputs() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(4, 80, (1, 30))
    pos = torch.cat([torch.arange(12), torch.arange(10), torch.arange(8)])[None]  # three packed sequences
    return {"input_ids": ids, "position_ids": pos}


@pytest.mark.parametrize("which", ["quickstart", "llama", "llama_bias"])
def test_lite_logits_and_gradients_equal_transformers(which: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = QUICKSTART if which == "quickstart" else _llama_dir(
        tmp_path, **({"attention_bias": True, "mlp_bias": True} if which == "llama_bias" else {}))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    lite = load_causal_lm(path)
    assert isinstance(lite, LiteCausalLM)
    assert set(lite.state_dict()) == set(hf.state_dict())

    x = _inputs()
    ids = x["input_ids"]
    a = torch.arange(ids.shape[1])
    shared = (a[None, :] <= a[:, None]) & ((a[None, :] < 5) | ((a[:, None] >= 5) == (a[None, :] >= 5)))
    pad = torch.ones(2, 15, dtype=torch.long)
    pad[1, 12:] = 0  # right padding
    cases = [
        {"input_ids": ids},  # causal
        x,  # packed: position ids restart
        {"input_ids": ids, "position_ids": torch.arange(30)[None], "attention_mask": shared[None, None]},
        {"input_ids": ids.view(2, 15), "attention_mask": pad},
    ]
    for kw in cases:
        out_l = lite(**kw, use_cache=False).logits
        out_h = hf(**kw, use_cache=False).logits
        torch.testing.assert_close(out_l, out_h, atol=2e-5, rtol=1e-5)

    lite(**x).logits.square().mean().backward()
    hf(**x, use_cache=False).logits.square().mean().backward()
    grads_h = {n: p.grad for n, p in hf.named_parameters()}
    for n, p in lite.named_parameters():
        torch.testing.assert_close(p.grad, grads_h[n], atol=1e-5, rtol=1e-4)


def test_unsupported_checkpoints_load_transformers_class(tmp_path: Path) -> None:
    """A checkpoint the module does not reproduce (another RoPE, another activation,
    another architecture) loads HF's class; `impl="hf"` always does."""
    cfg = json.loads((QUICKSTART / "config.json").read_text())
    assert lite_supported(cfg) is None
    assert "rope" in lite_supported({**cfg, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
    assert "activation" in lite_supported({**cfg, "hidden_act": "gelu"})
    assert "sliding" in lite_supported({**cfg, "layer_types": ["sliding_attention"] * 4})
    assert "model type" in lite_supported({**cfg, "model_type": "gpt2"})
    assert not isinstance(load_causal_lm(QUICKSTART, impl="hf"), LiteCausalLM)
    with pytest.raises(ValueError, match="impl"):
        load_causal_lm(QUICKSTART, impl="fast")


def test_the_quickstart_path_imports_no_transformers() -> None:
    """The start-up saving is the point: loading the quickstart model (trainer and engine
    alike) and its tokenizer, and rendering its chat template, never imports transformers
    (docs/design.md §10.30, §10.33), nor do the modules the local launcher's zygote preloads."""
    code = (
        "import sys, torch\n"
        "from areal_like.models.lite import load_causal_lm\n"
        "from areal_like.models.tiny_model import load_tokenizer\n"
        "from rollout_cluster.engine.embedded.runner import ModelRunner\n"
        f"p = {str(QUICKSTART)!r}\n"
        "m = load_causal_lm(p)\n"
        "ModelRunner(p, max_seq_len=64, device=torch.device('cpu'), dtype=torch.float32)\n"
        "tok = load_tokenizer(p)\n"
        "tok.apply_chat_template([{'role': 'user', 'content': '1+1'}], add_generation_prompt=True)\n"
        "import importlib\n"
        "from areal_like.launcher.early import PRELOAD\n"
        "for mod in PRELOAD: importlib.import_module(mod)\n"
        "print(type(m).__name__, type(tok).__name__, 'transformers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["LiteCausalLM", "LiteTokenizer", "False"]
