"""`areal-like audit RUN_DIR`: check a finished run's invariants by recomputation.

For every recorded trajectory and every generated token, the behaviour logprob is
recomputed with a fresh forward pass of the weights of the token's recorded version
(`weights/v{N}/`) at the trajectory's temperature, and compared with the recorded
one (invariant 3: interrupted requests were re-prefilled with the new weights, so a
token's logprob is exactly what its own version gives). It also checks provenance
(invariant 2), the staleness bound at consume time (invariant 1), that no episode
was trained twice and that the outcome counts add up (invariant 5).

Detection is by recomputation, never by checksum (docs/design.md §9.14). A run made
with `rollout.interrupt_mode=keep` is reported as violating invariant 3 by design.

The recompute is fp32. A run whose engine computed in bf16 (`model.dtype` bfloat16, or
auto on a machine with native bf16) is held to bf16's rounding instead of 1e-3: at most
`BF16_TOL` on any token and `BF16_MEAN_TOL` on average (a correct SmolLM2 run: ~0.04 mean,
~0.2 worst). That still catches a token scored at the wrong position, prompt or temperature,
not a version off by one at a small learning rate (docs/design.md §10.48).
"""

from __future__ import annotations

import json
import logging
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from areal_like.core.metrics import read_jsonl

__all__ = ["AuditReport", "BF16_MEAN_TOL", "BF16_TOL", "audit_run"]

log = logging.getLogger(__name__)

BF16_TOL = 0.5
"""Largest |recorded - recomputed| logprob allowed on one token of a bf16 run."""
BF16_MEAN_TOL = 0.1
"""Largest mean |recorded - recomputed| logprob allowed over a bf16 run's tokens."""


@dataclass
class AuditReport:
    trajectories: int = 0
    tokens_checked: int = 0
    max_logprob_error: float = 0.0
    mean_logprob_error: float = 0.0
    dtype: str = "float32"
    """The run's engine dtype (`model.dtype`, auto resolved on this machine)."""
    worst: dict[str, Any] = field(default_factory=dict)
    lag_histogram: dict[int, int] = field(default_factory=dict)
    token_lag_histogram: dict[int, int] = field(default_factory=dict)
    multi_version_turns: int = 0
    multi_version_trajectories: int = 0
    problems: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and not self.missing

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "trajectories": self.trajectories,
            "tokens_checked": self.tokens_checked,
            "max_logprob_error": self.max_logprob_error,
            "mean_logprob_error": self.mean_logprob_error,
            "dtype": self.dtype,
            "worst": self.worst,
            "lag_histogram": {str(k): v for k, v in sorted(self.lag_histogram.items())},
            "token_lag_histogram": {str(k): v for k, v in sorted(self.token_lag_histogram.items())},
            "responses_spanning_versions": self.multi_version_turns,
            "trajectories_spanning_versions": self.multi_version_trajectories,
            "problems": self.problems[:50],
            "missing": self.missing,
        }


def audit_run(run_dir: str | Path, tol: float | None = None, batch_size: int = 32) -> AuditReport:
    """`tol`: the largest allowed |recorded - recomputed| logprob; None: 1e-3, or bf16's
    rounding (`BF16_TOL`, and `BF16_MEAN_TOL` on average) for a run computed in bf16."""
    import torch

    from areal_like.core.precision import resolve_dtype

    rd = Path(run_dir)
    rep = AuditReport()
    cfg_file = rd / "config.yaml"
    if not cfg_file.is_file():
        rep.missing.append(f"{cfg_file} (is {rd} a run folder?)")
        return rep
    cfg = yaml.safe_load(cfg_file.read_text())
    eta = int(cfg.get("staleness", {}).get("max_staleness", 0))
    engine = cfg.get("rollout", {}).get("engine", {})
    rep.dtype = resolve_dtype(str(cfg.get("model", {}).get("dtype", "float32")), str(engine.get("device", "cpu")))
    bf16 = rep.dtype == "bfloat16" and engine.get("type", "embedded") == "embedded"
    if tol is None:
        tol = BF16_TOL if bf16 else 1e-3
    err_sum = 0.0
    mode = cfg.get("rollout", {}).get("interrupt_mode", "recompute")
    traj_file = rd / "trajectories.jsonl"
    if not traj_file.is_file():
        rep.missing.append("trajectories.jsonl: the run was made without run.record_trajectories=true")
    weights_dir = rd / "weights"
    if not weights_dir.is_dir():
        rep.missing.append("weights/: the run was made without run.record_weights=true")
    _check_summary(rd, rep)
    if rep.missing:
        return rep
    if mode == "keep":
        rep.problems.append(
            "invariant 3: rollout.interrupt_mode=keep decodes on stale KV after updates; "
            "behaviour logprobs are not those of any single version (by design of the ablation)"
        )
    trajs = read_jsonl(traj_file)
    rep.trajectories = len(trajs)
    seen: Counter[str] = Counter(t["episode_id"] for t in trajs)
    for eid, n in seen.items():
        if n > 1:
            rep.problems.append(f"invariant 5: episode {eid} was trained {n} times")
    # provenance + lag; collect the positions to recompute per version
    todo: dict[int, list[tuple[int, list[int]]]] = defaultdict(list)
    for i, t in enumerate(trajs):
        ids, mask, lps, vers = t["response_ids"], t["response_mask"], t["response_logprobs"], t["response_versions"]
        if not (len(ids) == len(mask) == len(lps) == len(vers)):
            rep.problems.append(f"invariant 2: {t['episode_id']}: lengths of ids/mask/logprobs/versions disagree")
            continue
        gen = [v for v, m in zip(vers, mask, strict=True) if m == 1]
        for k, (m, lp, v) in enumerate(zip(mask, lps, vers, strict=True)):
            if m == 0 and (lp != 0.0 or v != -1):
                rep.problems.append(f"invariant 2: {t['episode_id']} token {k}: tool token with logprob {lp} version {v}")
                break
            if m == 1 and v < 0:
                rep.problems.append(f"invariant 2: {t['episode_id']} token {k}: generated token with version {v}")
                break
        if not gen:
            continue
        lag = t["consumed_at_version"] - min(gen)
        rep.lag_histogram[lag] = rep.lag_histogram.get(lag, 0) + 1
        for v in gen:
            tl = t["consumed_at_version"] - v
            rep.token_lag_histogram[tl] = rep.token_lag_histogram.get(tl, 0) + 1
        if lag > eta:
            rep.problems.append(f"invariant 1: {t['episode_id']} trained with lag {lag} > η={eta}")
        if _spans_versions_within_turn(mask, vers):
            rep.multi_version_turns += 1  # one generate call decoded across a weight update
        if len(set(gen)) > 1:
            rep.multi_version_trajectories += 1  # within a turn, or turns of different versions
        for v in sorted(set(gen)):
            todo[v].append((i, [k for k, (m, x) in enumerate(zip(mask, vers, strict=True)) if m == 1 and x == v]))
    torch.set_num_threads(max(1, torch.get_num_threads()))
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from areal_like.models.hf_folder import has_hf_weights

    hf_logging.disable_progress_bar()  # one "Loading weights" bar per version drowned the report
    for v in sorted(todo):
        wdir = weights_dir / f"v{v}"
        if not has_hf_weights(wdir):
            rep.missing.append(f"weights/v{v}/ (tokens of version {v} cannot be checked)")
            continue
        model = AutoModelForCausalLM.from_pretrained(str(wdir), dtype=torch.float32).eval()
        items = todo[v]
        for s in range(0, len(items), batch_size):
            chunk = items[s : s + batch_size]
            seqs = [trajs[i]["prompt_ids"] + trajs[i]["response_ids"] for i, _ in chunk]
            width = max(len(x) for x in seqs)
            input_ids = torch.zeros((len(seqs), width), dtype=torch.long)
            attn = torch.zeros_like(input_ids)
            for r, x in enumerate(seqs):
                input_ids[r, : len(x)] = torch.tensor(x)
                attn[r, : len(x)] = 1
            with torch.no_grad():
                logits = model(input_ids=input_ids, attention_mask=attn).logits.float()
            for r, (i, positions) in enumerate(chunk):
                t = trajs[i]
                p = len(t["prompt_ids"])
                temp = float(t.get("temperature", 1.0))
                pos = torch.tensor(positions)
                step_logits = logits[r, p + pos - 1] / temp
                lp = torch.log_softmax(step_logits, dim=-1)
                tok = torch.tensor([t["response_ids"][k] for k in positions])
                fresh = lp.gather(-1, tok[:, None])[:, 0]
                rec = torch.tensor([t["response_logprobs"][k] for k in positions], dtype=torch.float32)
                err = (fresh - rec).abs()
                err_sum += float(err.sum())
                rep.tokens_checked += len(positions)
                j = int(err.argmax())
                if float(err[j]) > rep.max_logprob_error:
                    rep.max_logprob_error = float(err[j])
                    rep.worst = {"episode_id": t["episode_id"], "token": positions[j], "version": v,
                                 "recorded": float(rec[j]), "recomputed": float(fresh[j])}
        del model
    rep.mean_logprob_error = err_sum / max(1, rep.tokens_checked)
    if rep.max_logprob_error > tol:
        rep.problems.append(
            f"invariant 3: behaviour logprob differs from a fresh forward pass of its version by "
            f"{rep.max_logprob_error:.3g} > tol {tol:g} (worst: {json.dumps(rep.worst)})"
        )
    if bf16 and rep.mean_logprob_error > BF16_MEAN_TOL:
        rep.problems.append(
            f"invariant 3: behaviour logprobs differ from fresh forward passes of their versions by "
            f"{rep.mean_logprob_error:.3g} on average > {BF16_MEAN_TOL:g}, more than bf16's rounding"
        )
    return rep


def _spans_versions_within_turn(mask: list[int], versions: list[int]) -> bool:
    """True if one contiguous generated span (one LLM turn) holds tokens of 2+ versions."""
    prev = None
    for m, v in zip(mask, versions, strict=True):
        if m == 0:
            prev = None
            continue
        if prev is not None and v != prev:
            return True
        prev = v
    return False


def _check_summary(rd: Path, rep: AuditReport) -> None:
    mfile = rd / "metrics.jsonl"
    if not mfile.is_file():
        rep.missing.append("metrics.jsonl")
        return
    summaries = [r for r in read_jsonl(mfile) if r.get("kind") == "summary"]
    if not summaries:
        rep.problems.append("invariant 5: metrics.jsonl has no summary line (the run did not finish)")
        return
    s = summaries[-1]
    keys = ("trained", "rejected", "filtered", "over_stale", "failed", "skipped", "buffered", "cancelled")
    total = sum(int(s.get(k, 0)) for k in keys)
    if total != int(s.get("started", -1)):
        rep.problems.append(f"invariant 5: outcome counts sum to {total}, started is {s.get('started')}")
