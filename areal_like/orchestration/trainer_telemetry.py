"""What the trainer side records: one call per event, out of the schedule's way.

The trainer controller calls `train_step`, `rollout_report` and `evaluation`; this
module turns them into `metrics.jsonl` records (docs/design.md §7) and the Prometheus
registry behind the dashboard (§5). Rollout numbers arrive cumulative per rollout
process; counters here add only what is new.
"""

from __future__ import annotations

import time
from typing import Any

from areal_like.core.buffer import TrajectoryBuffer
from areal_like.core.metrics import MetricsLog, MetricsRegistry
from areal_like.core.types import RolloutCounters, RolloutStats, TrajectoryGroup
from areal_like.orchestration.step_budget import ROLLOUT_PHASES, StepBudget

__all__ = ["TrainerTelemetry"]


class TrainerTelemetry:
    def __init__(self, mlog: MetricsLog, registry: MetricsRegistry) -> None:
        self.mlog = mlog
        self.m = registry
        self.evals: list[dict[str, Any]] = []
        self.idle_s = 0.0
        self.busy_s = 0.0
        """The trainer's time waiting for data, and stepping (`idle_ratio`)."""
        self._last: dict[str, float] = {}
        self._pauses_seen = 0.0
        self._rewards_seen: tuple[str, int, float] = ("", 0, 0.0)
        self._rewards_now: tuple[str, int, float] = ("", 0, 0.0)
        self._cpu_seen: tuple[float, float] | None = None
        """(time, the train workers' CPU seconds) at the previous step."""
        self._rollout_budget_now: tuple[str, dict[str, float]] | None = None
        self._rollout_budget_seen: tuple[str, dict[str, float]] | None = None
        """(sender, cumulative seconds per rollout phase): of the newest report, and as of
        the previous step's record."""

    def train_step(self, groups: list[TrajectoryGroup], v: int, new_v: int, skipped: bool,
                   stats: dict[str, float], buffer: TrajectoryBuffer) -> dict[str, Any]:
        """The step's record (written by the caller once weight-sync numbers are in)."""
        trajs = [t for g in groups for t in g.trajectories]
        head_lags = [v - g.head_version for g in groups]
        token_lags = [v - x for t in trajs for x, m in zip(t.response_versions, t.response_mask, strict=True) if m]
        rewards = [t.reward for t in trajs]
        rec: dict[str, Any] = {
            "step": new_v if not skipped else v,
            "skipped": skipped,
            "reward_mean": sum(rewards) / len(rewards),
            "samples": len(trajs),
            "max_version_lag": max(head_lags),
            "mean_version_lag": sum(head_lags) / len(head_lags),
            "head_lag_hist": _hist(head_lags),
            "token_lag_hist": _hist(token_lags),
            "response_len_mean": sum(len(t.response_ids) for t in trajs) / len(trajs),
            "truncated_frac": sum(t.truncated for t in trajs) / len(trajs),
            "buffer_depth": buffer.depth,
            "over_stale": buffer.counts["over_stale"],
            "filtered": buffer.counts["filtered"],
            **{k: x for k, x in stats.items() if k != "version"},
        }
        for lag in head_lags:
            self.m.versions.head_lag.observe(lag)
        for lag in token_lags:
            self.m.versions.token_lag.observe(lag)
        for r in rewards:
            self.m.samples.reward.observe(r)
        self.m.samples.reward_mean.set(rec["reward_mean"])
        self.m.versions.trainer_version.set(new_v)
        self.m.training.train_tokens.inc(sum(len(t.prompt_ids) + len(t.response_ids) for t in trajs))
        if "behav_prox_gap" in stats:
            self.m.training.logprob_gap.set(stats["behav_prox_gap"])
        for stat in ("behav_weight_mean", "behav_weight_max", "behav_capped", "behav_masked"):
            if stat in stats:
                self.m.training.iw.labels(stat=stat.removeprefix("behav_")).set(stats[stat])
        if "tokens_per_s" in stats:
            self.m.pools.tokens_per_s.labels(pool="train").set(stats["tokens_per_s"])
        for k, n in buffer.summary(0, 0).items():
            if k not in ("started", "cancelled"):
                self.m.samples.outcomes.labels(outcome=k).set(n)
        return rec

    def weight_sync(self, rec: dict[str, Any], seconds: float, done: Any) -> None:
        rec["weight_sync_s"] = seconds
        if done is not None and done.bytes:
            rec["weight_sync_bytes"] = done.bytes
            self.m.training.sync_bytes.inc(done.bytes)
            self.m.training.sync_seconds.observe(done.seconds)

    def idle_ratio(self) -> float:
        return self.idle_s / max(self.idle_s + self.busy_s, 1e-9)

    def write_step(self, rec: dict[str, Any], trainer_idle_ratio: float, rollout_version: int | None,
                   budget: StepBudget | None = None) -> None:
        """Write the step's record; with `budget`, its time budget since the previous record
        (the record's `time` is the end of that interval) and the rollout side's."""
        if rollout_version is not None:
            rec["rollout_version"] = rollout_version
        rec["trainer_idle_ratio"] = trainer_idle_ratio
        self.m.pools.idle_ratio.labels(pool="train").set(trainer_idle_ratio)
        rec.pop("cpu_s", None)  # rank 0's own total: train_cpu_s sums every rank
        if "train_cpu_s" in rec:  # cores the train workers used since the previous step
            now, used = time.time(), float(rec["train_cpu_s"])
            if self._cpu_seen is not None and now > self._cpu_seen[0]:
                rec["train_cores_used"] = max(0.0, (used - self._cpu_seen[1]) / (now - self._cpu_seen[0]))
                self.m.pools.cores_used.labels(pool="train").set(rec["train_cores_used"])
            self._cpu_seen = (now, used)
        rec.update(self._rollout_budget())
        if budget is not None:
            rec.update(budget.take())
            rec["time"] = budget.taken_at
        self.mlog.write("train_step", rec["step"], **rec)

    def sampled_reward(self, rec: dict[str, Any]) -> None:
        """Mean reward of every trajectory the rollout side finished since the last step,
        filtered (uniform) groups included, as `reward_mean_all_groups` beside the trained
        `reward_mean`: once the task saturates, most all-correct groups are filtered and
        the trained mean alone understates the policy."""
        sender, n, total = self._rewards_now
        s0, n0, t0 = self._rewards_seen
        if sender != s0:
            n0, t0 = 0, 0.0
        if n > n0:
            rec["reward_mean_all_groups"] = (total - t0) / (n - n0)
            self._rewards_seen = self._rewards_now

    def rollout_report(self, msg: RolloutStats, trainer_version: int) -> None:
        if msg.origin is not None:
            self._rewards_now = (msg.origin.sender, msg.outcomes.sent, msg.outcomes.reward_sum)
        flat = msg.flat()
        self._rollout_budget_now = (msg.origin.sender if msg.origin is not None else "",
                                    {name: float(flat.get(field, 0.0)) for name, field, _ in ROLLOUT_PHASES})
        self.m.versions.server_version.labels(server="rollout").set(msg.loaded_version)
        self._counters(msg.counters)
        for k in ("running", "sent", "dropped", "consumed", "capacity"):
            self.m.samples.gate.labels(state=k).set(getattr(msg.gate, k))
        self.mlog.write("rollout", trainer_version, **flat, loaded_version=msg.loaded_version,
                        started=msg.started, episodes_running=msg.running)

    def _rollout_budget(self) -> dict[str, float]:
        """`rollout_budget_<phase>_s`: the rollout side's seconds per phase since the previous
        step, from the cumulative counters of its newest report (reports come every ~2 s and
        whenever it admits groups, so a step may see none and the next two steps' worth). A
        new rollout controller counts from 0; a counter that went back (a restarted server)
        adds nothing that step."""
        if self._rollout_budget_now is None:
            return {}
        sender, now = self._rollout_budget_now
        seen = self._rollout_budget_seen
        base = seen[1] if seen is not None and seen[0] == sender else {}
        self._rollout_budget_seen = self._rollout_budget_now
        return {f"rollout_budget_{k}_s": max(0.0, v - base.get(k, 0.0)) for k, v in now.items()}

    def evaluation(self, msg: RolloutStats, trainer_version: int) -> dict[str, Any]:
        assert msg.eval is not None
        rec = self.mlog.write("eval", trainer_version, version=msg.loaded_version, **msg.eval.model_dump())
        self.evals.append(rec)
        return rec

    def _counters(self, c: RolloutCounters) -> None:
        g = self.m.generation
        counters = {"generated_tokens": g.gen_tokens, "interrupts": g.interrupts,
                    "interrupted_tokens": g.interrupted_tokens, "recompute_tokens": g.recompute_tokens}
        for key, counter in counters.items():
            value = getattr(c, key)
            delta = value - self._last.get(key, 0.0)
            if delta > 0:
                counter.inc(delta)
            self._last[key] = value
        if c.interrupts > self._pauses_seen:
            self._pauses_seen = c.interrupts
            self.m.generation.pause_resume.observe(c.pause_resume_latency_s_max)
        self.m.pools.tokens_per_s.labels(pool="rollout").set(c.gen_tokens_per_s)
        self.m.pools.idle_ratio.labels(pool="rollout").set(c.rollout_idle_ratio)
        self.m.pools.cores_used.labels(pool="rollout").set(c.rollout_cores_used)


def _hist(values: list[int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in values:
        out[str(x)] = out.get(str(x), 0) + 1
    return out
