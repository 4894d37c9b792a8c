"""`train_cluster.optim.AdamW`: torch's AdamW, bit for bit, without importing `torch._dynamo`
(1.8 s of a core that the first train step waited for; docs/design.md §10.32)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from train_cluster.optim import AdamW

ROOT = Path(__file__).resolve().parents[2]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, xs: list[torch.Tensor]) -> None:
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (k + 1))
    for x in xs:
        model(x).pow(2).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()


def test_adamw_is_torchs_bit_for_bit_and_their_states_load_into_each_other() -> None:
    torch.manual_seed(1)
    xs = [torch.randn(4, 8) for _ in range(6)]
    ours_m, theirs_m = _model(), _model()
    kw = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}
    ours, theirs = AdamW(ours_m.parameters(), **kw), torch.optim.AdamW(theirs_m.parameters(), **kw)
    _steps(ours_m, ours, xs[:3])
    _steps(theirs_m, theirs, xs[:3])
    assert all(torch.equal(a, b) for a, b in zip(ours_m.parameters(), theirs_m.parameters(), strict=True))
    a, b = ours.state_dict(), theirs.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert all(torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i])
    # a checkpoint of either resumes in the other
    ours.load_state_dict(b)
    theirs.load_state_dict(a)
    _steps(ours_m, ours, xs[3:])
    _steps(theirs_m, theirs, xs[3:])
    assert all(torch.equal(a, b) for a, b in zip(ours_m.parameters(), theirs_m.parameters(), strict=True))


@pytest.mark.parametrize("fused", [False, True])
def test_state_made_before_the_first_step_changes_nothing(fused: bool) -> None:
    """`init_state` makes what the first `step` would (and nothing for a frozen parameter),
    for torch's per-tensor update and for its fused one (what the train engine runs)."""
    torch.manual_seed(1)
    xs = [torch.randn(4, 8) for _ in range(4)]
    early_m, lazy_m = _model(), _model()
    early_m[2].bias.requires_grad_(False)
    lazy_m[2].bias.requires_grad_(False)
    kw = {"lr": 1e-2, "weight_decay": 0.1, "fused": fused}
    early, lazy = AdamW(early_m.parameters(), **kw), torch.optim.AdamW(lazy_m.parameters(), **kw)
    assert early.init_state() == 2 * 4 * (8 * 16 + 16 + 16 * 3)
    assert early_m[2].bias not in early.state
    _steps(early_m, early, xs)
    _steps(lazy_m, lazy, xs)
    assert all(torch.equal(a, b) for a, b in zip(early_m.parameters(), lazy_m.parameters(), strict=True))
    a, b = early.state_dict(), lazy.state_dict()
    assert a["state"].keys() == b["state"].keys()
    assert all(torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i])


def test_a_train_engine_steps_without_importing_dynamo() -> None:
    """Through the real engine: build, step twice, read the lr; `torch._dynamo` never loads.
    (If a torch release moves its dynamo hooks, this says the start-up saving is gone.)"""
    code = (
        "import sys, torch\n"
        "from areal_like.core.config import LossConfig, TrainConfig\n"
        "from train_cluster.batch import build_batch\n"
        "from train_cluster.torch_engine import TorchTrainEngine\n"
        "from tests.train.conftest import make_trajectories\n"
        "e = TorchTrainEngine('areal_like/assets/quickstart_model', TrainConfig(mini_batches=2, warmup_steps=1))\n"
        "for s in range(2):\n"
        "    e.train_step(build_batch(make_trajectories(seed=s), LossConfig()))\n"
        "print(e.version, 'torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["2", "False"], out.stdout
