"""AdamW without `torch._dynamo`: torch's own update, called so that nothing imports dynamo.

A torch optimizer imports `torch._dynamo` (1.8 s of one core here) on its first `step`
(`_use_grad_for_differentiable` imports it for its graph breaks) and on its first
`add_param_group`, `zero_grad`, `state_dict` and `load_state_dict` (each wrapped in
`torch._disable_dynamo`, which imports it lazily). Nothing here is compiled, so the
import only costs time, and in a train worker that time falls on the first step, beside
the rollout side generating the first batch (docs/design.md §10.32).

`AdamW` is `torch.optim.AdamW` with `step` running torch's undecorated update under
`no_grad`. The update itself is torch's, so parameters and state are bitwise those of
`torch.optim.AdamW` (tested), and checkpoints load into either. The `_disable_dynamo`
wrappers of the optimizer's other methods are told their function is already "disabled"
(their own per-function cache, `__dynamo_disable`), so they call it directly. If a torch
release changes either mechanism, the import comes back (a test says so) and nothing is
computed differently.
"""

from __future__ import annotations

import types
from typing import Any

import torch

__all__ = ["AdamW", "dynamo_free"]


def dynamo_free(cls: type) -> None:
    """Let `cls`'s `torch._disable_dynamo`-wrapped methods call their function without
    importing dynamo (they are never compiled here)."""
    wrapper_code = torch._disable_dynamo(lambda: None).__code__
    for klass in cls.__mro__:
        for f in vars(klass).values():
            if isinstance(f, types.FunctionType) and f.__code__ is wrapper_code and hasattr(f, "__wrapped__"):
                f.__wrapped__.__dynamo_disable = f.__wrapped__


_TORCH_STEP = getattr(torch.optim.AdamW.step, "__wrapped__", None)
"""torch's AdamW update without its dynamo graph-break wrapper (None: a torch without one)."""


class AdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` whose first step does not import `torch._dynamo`, and whose state
    can be made before the first step (`init_state`)."""

    def init_state(self) -> int:
        """The state torch makes lazily in the first `step` (step 0, zero moments), made now
        for every parameter that trains: at 135M parameters that is 1 GB written, 3 s that
        the first train step paid while the trainer had been idle for the first batch
        (docs/benchmarks.md, the real-model recipe). `_init_group` skips a parameter whose
        state exists, so the steps that follow are torch's, bit for bit. Returns the bytes."""
        made = 0
        for group in self.param_groups:
            if group["capturable"] or group["differentiable"]:
                continue  # left to torch
            for p in group["params"]:
                if not p.requires_grad or self.state.get(p):  # (`self.state[p]` would add an entry)
                    continue
                state = self.state[p]
                if group["fused"]:  # as torch makes it: fp32, beside the parameter
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                else:
                    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
                    state["step"] = torch.tensor(0.0, dtype=scalar, device="cpu")
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                made += p.numel() * p.element_size() * (3 if group["amsgrad"] else 2)
        return made

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if _TORCH_STEP is None or self.defaults.get("differentiable"):
            return super().step(closure)
        with torch.no_grad():
            return _TORCH_STEP(self, closure)


dynamo_free(AdamW)
