"""The cost file: what one rollout server, one train step and one weight broadcast cost.

A planner is only as good as its costs, so they come from measurement (`areal-like
profile`) or from published figures whose source is named (`configs/costs/*.json`);
`source` is required for that reason. Units are one *device*: a GPU, or on the CPU
development box one core (the quickstart pools each take one).

Everything is validated here, once, so a bad file fails with the field's dotted name
instead of an odd simulation result.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = [
    "CostFileError",
    "CostModel",
    "DecodeCost",
    "EpisodeCost",
    "LengthDist",
    "TrainCost",
    "WeightSyncCost",
    "load_costs",
    "parse_lengths",
    "scale_to_model",
]


class CostFileError(ValueError):
    """A cost file that cannot be read or does not validate (the message names the field)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DecodeCost(_Strict):
    """One rollout server (continuous batching). A decode iteration advances every running
    request by one token and takes `base_s + per_seq_s·n + per_context_token_s·Σcontext`:
    weights are read once per iteration (base), each sequence costs compute (per_seq), and
    attention reads every cached token (per_context_token)."""

    gpus_per_server: int = Field(1, ge=1, le=64)
    """Devices one server spans (tensor parallel degree): rollout devices / this = servers."""
    base_s: float = Field(ge=0.0, le=10.0)
    """Seconds per decode iteration independent of the batch (weight reads, launch overhead)."""
    per_seq_s: float = Field(ge=0.0, le=10.0)
    """Extra seconds per iteration for each running sequence."""
    per_context_token_s: float = Field(0.0, ge=0.0, le=1.0)
    """Extra seconds per iteration for each token held in the KV cache (attention reads)."""
    prefill_tokens_per_s: float = Field(gt=0.0, le=1e9)
    """Prompt (and recompute) tokens per second; prefill stalls the server's decode batch."""
    max_batch: int = Field(ge=1, le=100_000)
    """Most sequences decoding at once on one server."""
    kv_capacity_tokens: int = Field(ge=1, le=10**10)
    """KV cache size in tokens; a request is admitted only if its prompt + full response fit."""
    weight_load_s: float = Field(0.0, ge=0.0, le=600.0)
    """Seconds a server pauses to apply a received version (on top of the transfer)."""


class TrainCost(_Strict):
    """A train step: `fixed_s + seconds_per_token · tokens / speedup(devices)` where
    `speedup(n) = n ** scaling_exponent` (1 = linear data-parallel scaling)."""

    backend: str = Field("torch", min_length=1)
    """Which backend the figures are for (torch fsdp, megatron, ...): a label, for the report."""
    fixed_s: float = Field(0.0, ge=0.0, le=3600.0)
    """Per-step overhead independent of tokens (optimizer step, π_prox setup, logging)."""
    seconds_per_token: float = Field(gt=0.0, le=10.0)
    """Forward + backward (+ π_prox recompute) seconds per token on ONE device."""
    scaling_exponent: float = Field(0.9, gt=0.0, le=1.0)
    """Data-parallel efficiency: n devices are n**exponent times as fast as one."""
    min_devices: int = Field(1, ge=1, le=100_000)
    """Fewest devices that hold the model, gradients and optimizer state."""


class WeightSyncCost(_Strict):
    """Broadcasting a version to every rollout server: `latency_s + model_bytes / bandwidth`.
    As `WeightFeed.publish` does it, the trainer is held only for the snapshot
    (`model_bytes / snapshot_bytes_per_s`); the broadcast runs in the background of the next
    train step, and the next publish waits for it to end. Servers keep decoding until they
    apply the version."""

    model_bytes: int = Field(ge=0, le=10**14)
    """Bytes of one version (parameters × bytes per parameter in the serving dtype)."""
    latency_s: float = Field(0.0, ge=0.0, le=600.0)
    """Fixed cost per version (rendezvous, checksum, commit)."""
    intra_node_bytes_per_s: float = Field(gt=0.0, le=1e13)
    """Achieved broadcast bandwidth when trainer and servers share a node (NVLink, shared memory)."""
    inter_node_bytes_per_s: float = Field(gt=0.0, le=1e13)
    """Achieved broadcast bandwidth across nodes (InfiniBand/Ethernet)."""
    snapshot_bytes_per_s: float | None = Field(None, gt=0.0, le=1e13)
    """Rate of the snapshot the trainer waits for before the broadcast goes to the background
    (a copy into the sender's staging buffer and its digest); None: free."""


class LengthDist(_Strict):
    """Generated tokens per episode: `offset + draw`, capped at `cap` (default: the
    config's `rollout.response_length`). Long tails are what asynchrony hides."""

    kind: Literal["fixed", "lognormal", "pareto", "empirical"] = "lognormal"
    """fixed: `mean`; lognormal: median `median`, shape `sigma`; pareto: `scale`·Pareto(`alpha`);
    empirical: a uniform draw from `values`."""
    offset: int = Field(0, ge=0)
    """Tokens every episode generates before the drawn part (e.g. the answer before a tail)."""
    mean: float = Field(64.0, ge=1.0)
    """Length for `fixed`."""
    median: float = Field(64.0, ge=1.0)
    """Median of the `lognormal` draw."""
    sigma: float = Field(1.0, ge=0.0, le=5.0)
    """Log-space standard deviation of the `lognormal` draw."""
    alpha: float = Field(1.5, gt=0.0, le=100.0)
    """Tail index of the `pareto` draw (smaller = heavier tail)."""
    scale: float = Field(16.0, gt=0.0)
    """Multiplier of the `pareto` draw (its minimum)."""
    values: list[int] = Field(default_factory=list)
    """Observed lengths for `empirical`."""
    cap: int | None = Field(None, ge=1)
    """Largest length; None = the config's `rollout.response_length`."""
    tail_cap: int | None = Field(None, ge=1)
    """Cap on the drawn part alone (before `offset` is added), as `bench/long_tail_loop.py` does."""

    @model_validator(mode="after")
    def _empirical_has_values(self) -> LengthDist:
        if self.kind == "empirical" and not self.values:
            raise ValueError("kind 'empirical' needs a non-empty `values` list")
        if any(v < 1 for v in self.values):
            raise ValueError("`values` must all be >= 1")
        return self


class EpisodeCost(_Strict):
    """The agent loop around the generate calls: turns, tools, prompts."""

    prompt_tokens: int = Field(64, ge=1)
    """Prompt tokens of the first turn (prefilled once per episode)."""
    turns: int = Field(1, ge=1, le=100)
    """Generate calls per episode (capped by `agent.max_assistant_turns`); the length is split across them."""
    tool_latency_s: float = Field(0.0, ge=0.0, le=3600.0)
    """Median seconds a tool call takes between two turns."""
    tool_latency_sigma: float = Field(0.0, ge=0.0, le=5.0)
    """Log-space spread of the tool latency (0 = always the median)."""
    tool_response_tokens: int = Field(0, ge=0)
    """Tokens a tool answer adds to the context (prefilled at the next turn)."""
    uniform_group_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    """Share of groups whose rewards are all equal (dropped as `filtered` when filtering is on)."""


class CostModel(_Strict):
    """Everything the simulator needs about the hardware and the workload."""

    source: str = Field(min_length=3)
    """Where the figures come from: `areal-like profile` on a named machine, or a citation."""
    notes: str = ""
    """Assumptions (precision, parallelism, what was not measured)."""
    hardware: str = Field("unknown", min_length=1)
    """Device name, for the report."""
    devices_per_node: int = Field(8, ge=1, le=1024)
    """Devices per node (decides when a broadcast crosses nodes)."""
    shared_cores: float | None = Field(None, gt=0.0, le=4096.0)
    """CPU cores that both pools share (one CPU machine): while more compute threads are
    busy than there are cores (each rollout server's `rollout.server_threads`, the trainer's
    `train.backend.threads` × ranks), every busy one slows in proportion. None: every
    device is its own (GPU clusters)."""
    price_per_device_hour: float | None = Field(None, ge=0.0, le=1000.0)
    """Rental price, for $/step in the plan (the CLI's --price overrides it)."""
    decode: DecodeCost
    train: TrainCost
    weight_sync: WeightSyncCost
    episode: EpisodeCost = Field(default_factory=EpisodeCost)
    lengths: LengthDist = Field(default_factory=LengthDist)


def load_costs(path: str | Path) -> CostModel:
    """Read and validate a cost file; errors name the file and each bad field."""
    p = Path(path)
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError:
        raise CostFileError(f"cost file {p} does not exist") from None
    except json.JSONDecodeError as e:
        raise CostFileError(f"cost file {p} is not valid JSON: {e}") from None
    try:
        return CostModel.model_validate(raw)
    except ValidationError as e:
        lines = [f"invalid cost file {p}:"]
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
            msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
            lines.append(f"  {loc}: {msg} (got {err.get('input')!r:.80})")
        raise CostFileError("\n".join(lines)) from None


def parse_lengths(spec: str) -> LengthDist:
    """A length distribution from the command line: `lognormal:median=2000,sigma=0.8`,
    `pareto:alpha=1.2,scale=100,offset=15`, `fixed:mean=512`, `empirical:120,300,2048`;
    any kind also takes `cap=N`. Errors name the bad part."""
    kind, _, rest = spec.partition(":")
    kind = kind.strip()
    data: dict[str, object] = {"kind": kind}
    if kind == "empirical":
        try:
            data["values"] = [int(x) for x in rest.split(",") if x.strip() and "=" not in x]
        except ValueError:
            raise CostFileError(f"--lengths {spec!r}: empirical values must be integers") from None
        parts = [x for x in rest.split(",") if "=" in x]
    else:
        parts = [x for x in rest.split(",") if x.strip()]
    for part in parts:
        key, eq, val = part.partition("=")
        if not eq:
            raise CostFileError(f"--lengths {spec!r}: expected key=value, got {part!r}")
        data[key.strip()] = val.strip()
    try:
        return LengthDist.model_validate(data)
    except ValidationError as e:
        bad = "; ".join(f"{'.'.join(str(x) for x in err['loc']) or kind}: {err['msg']}" for err in e.errors())
        raise CostFileError(f"--lengths {spec!r}: {bad}") from None


def scale_to_model(costs: CostModel, model_bytes: int) -> CostModel:
    """The costs of another model of `model_bytes` bytes (same dtype) from those profiled,
    under a plain ASSUMPTION, not a measurement: every compute cost grows in proportion to
    the parameters — the decode iteration's three terms, the prefill time per token, the
    train step's fixed and per-token seconds — and the snapshot and broadcast through
    `model_bytes`; the server's slots and KV capacity in tokens, the episode and the
    lengths stay. Where the profiled model is tiny (the CPU box) part of each cost is
    Python and launch overhead that need not grow with the model, and a bigger model may
    use the core better or worse; docs/planning.md ("Checked out of sample") compares
    the scaled train cost per token with a measured run of one bigger model."""
    ratio = model_bytes / max(1, costs.weight_sync.model_bytes)
    d, t = costs.decode, costs.train
    return costs.model_copy(update={
        "decode": d.model_copy(update={
            "base_s": d.base_s * ratio, "per_seq_s": d.per_seq_s * ratio,
            "per_context_token_s": d.per_context_token_s * ratio,
            "prefill_tokens_per_s": d.prefill_tokens_per_s / ratio}),
        "train": t.model_copy(update={"fixed_s": t.fixed_s * ratio, "seconds_per_token": t.seconds_per_token * ratio}),
        "weight_sync": costs.weight_sync.model_copy(update={"model_bytes": int(model_bytes)}),
        "notes": (costs.notes + "; " if costs.notes else "") + f"scaled to a model of {model_bytes} bytes "
                 f"(×{ratio:.2f}: compute assumed proportional to parameters)",
    })
