"""Plan a cluster before renting it: a calibrated simulation of the asynchronous loop.

`plan(cfg, gpus=..., costs=...)` simulates every rollout/train split and η and picks
the best under a staleness or budget limit; `profile` measures the costs on this machine.
"""

from areal_like.plan.costs import CostFileError, CostModel, load_costs
from areal_like.plan.sim import SimResult, Split, simulate

__all__ = ["CostFileError", "CostModel", "SimResult", "Split", "load_costs", "simulate"]
