"""Search the splits and η values with the simulator and recommend one.

Why a search and not a formula: the interesting effects (long tails holding a synchronous
step, the gate shutting generation when the trainer lags, over-stale drops when tails
reorder groups, interrupt recompute growing with η) come from the interaction of the
gate, the buffer and continuous batching, which the simulation runs for real.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_like.core.config import ExperimentConfig
from areal_like.plan.costs import CostModel
from areal_like.plan.sim import SimResult, Split, simulate, snapshot_s

__all__ = ["PlanReport", "plan", "candidate_splits", "calibrate", "default_costs_path", "NEAR_BEST"]

NEAR_BEST = 0.03
"""Configurations within this fraction of the best throughput count as equally fast; the
smallest η among them wins (staleness costs reward: docs/staleness.md)."""


def default_costs_path() -> Path:
    """The measured costs of the CPU development box (the quickstart's hardware)."""
    return Path(__file__).resolve().parents[2] / "configs" / "costs" / "cpu_quickstart.json"


def candidate_splits(devices: int, costs: CostModel, max_candidates: int = 16) -> list[Split]:
    """Rollout shares in steps of whole servers, leaving the trainer at least `min_devices`;
    at most ~`max_candidates` evenly spaced ones (large clusters need no finer grid)."""
    tp = costs.decode.gpus_per_server
    options = [r for r in range(tp, devices, tp) if devices - r >= costs.train.min_devices]
    if len(options) > max_candidates:
        stride = -(-len(options) // max_candidates)
        options = options[::stride]
    return [Split(r, devices - r) for r in options]


@dataclass
class PlanReport:
    """Every simulated (split, η) and the recommendation."""

    devices: int
    nodes: int
    costs_source: str
    hardware: str
    results: list[SimResult]
    best: SimResult | None
    max_staleness: int | None
    price_per_device_hour: float | None
    assumptions: list[str] = field(default_factory=list)

    def cost_per_step(self, r: SimResult) -> float | None:
        if self.price_per_device_hour is None:
            return None
        return self.price_per_device_hour * self.devices * r.step_s / 3600.0

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for r in self.results:
            row = r.as_row()
            row["over_stale_share"] = round(r.outcomes["over_stale"] / max(1, r.outcomes["started"]), 4)
            cps = self.cost_per_step(r)
            if cps is not None:
                row["cost_per_step"] = round(cps, 4)
            out.append(row)
        return out

    def best_line(self) -> str:
        b = self.best
        if b is None:
            return "best: none (no configuration fits the limits)"
        cps = self.cost_per_step(b)
        cost = f", ${cps:.3f}/step" if cps is not None else ""
        return (f"best: {b.split.rollout_devices} rollout + {b.split.train_devices} train devices "
                f"({b.servers} servers), η={b.eta}: {b.samples_per_s:.2f} samples/s, {b.step_s:.2f} s/step{cost}, "
                f"trainer idle {b.trainer_idle_ratio:.0%}, rollout idle {b.rollout_idle_ratio:.0%}, "
                f"mean lag {b.lag.mean:.2f}")


def pick_best(results: list[SimResult], max_staleness: int | None) -> SimResult | None:
    ok = [r for r in results if max_staleness is None or r.eta <= max_staleness]
    if not ok:
        return None
    top = max(r.samples_per_s for r in ok)
    near = [r for r in ok if r.samples_per_s >= (1 - NEAR_BEST) * top]
    return min(near, key=lambda r: (r.eta, -r.samples_per_s))


def plan(cfg: ExperimentConfig, *, gpus: int, costs: CostModel, etas: tuple[int, ...] = (0, 1, 2, 4),
         nodes: int = 1, steps: int = 12, max_staleness: int | None = None,
         price_per_device_hour: float | None = None, budget_per_hour: float | None = None,
         seed: int = 0) -> PlanReport:
    """Simulate every candidate split × η and recommend the fastest within the limits.

    `budget_per_hour` (with a price) caps the devices used: a plan may use fewer than `gpus`.
    """
    devices = gpus
    if budget_per_hour is not None:
        if not price_per_device_hour:
            raise ValueError("a budget needs a price per device-hour (--price)")
        devices = min(gpus, int(budget_per_hour // price_per_device_hour))
    if devices < costs.decode.gpus_per_server + costs.train.min_devices:
        raise ValueError(
            f"{devices} devices cannot hold one rollout server ({costs.decode.gpus_per_server}) and the trainer "
            f"({costs.train.min_devices})")
    results = [simulate(cfg, costs, s, eta, steps=steps, seed=seed, nodes=nodes)
               for s in candidate_splits(devices, costs) for eta in etas]
    return PlanReport(
        devices=devices, nodes=nodes, costs_source=costs.source, hardware=costs.hardware, results=results,
        best=pick_best(results, max_staleness), max_staleness=max_staleness,
        price_per_device_hour=price_per_device_hour, assumptions=assumptions(cfg, costs, nodes),
    )


def assumptions(cfg: ExperimentConfig, costs: CostModel, nodes: int) -> list[str]:
    d, t, L = costs.decode, costs.train, costs.lengths
    return [
        f"costs: {costs.source} ({costs.hardware})",
        f"workload: {cfg.samples_per_step} samples/step ({cfg.train.batch_size} prompts × {cfg.rollout.group_size}), "
        f"lengths {L.kind} capped at {L.cap or cfg.rollout.response_length}, {costs.episode.turns} turn(s), "
        f"interrupt_mode={cfg.rollout.interrupt_mode}",
        f"server: {d.gpus_per_server} device(s), ≤{d.max_batch} sequences, KV {d.kv_capacity_tokens} tokens",
        f"trainer: {t.backend}, speedup n^{t.scaling_exponent}, ≥{t.min_devices} device(s); {nodes} node(s)",
    ]


def calibrate(cfg: ExperimentConfig, costs: CostModel, *, rollout_phase_s: float, train_phase_s: float,
              split: Split = Split(1, 1), rounds: int = 3) -> CostModel:
    """Scale the rollout-side and train-side costs so that the simulated synchronous (η = 0)
    phases match measured ones (R and T of bench/async_vs_sync.py). The shape of the costs
    (batch and context dependence, length distribution) is kept; only their level moves."""
    c = costs
    for _ in range(rounds):
        r = simulate(cfg, c, split, 0, steps=12)
        sync = snapshot_s(c)  # what of the publish holds the trainer (the broadcast runs behind the next step)
        fr = rollout_phase_s / max(r.rollout_phase_s, 1e-12)
        ft = max(train_phase_s - sync, 1e-9) / max(r.train_phase_s - sync, 1e-12)
        d, e, t = c.decode, c.episode, c.train
        c = c.model_copy(update={
            "decode": d.model_copy(update={
                "base_s": d.base_s * fr, "per_seq_s": d.per_seq_s * fr,
                "per_context_token_s": d.per_context_token_s * fr,
                "prefill_tokens_per_s": d.prefill_tokens_per_s / fr, "weight_load_s": d.weight_load_s * fr}),
            "episode": e.model_copy(update={"tool_latency_s": e.tool_latency_s * fr}),
            "train": t.model_copy(update={"fixed_s": t.fixed_s * ft, "seconds_per_token": t.seconds_per_token * ft}),
        })
    return c
