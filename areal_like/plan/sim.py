"""A discrete-event simulation of the asynchronous loop, for planning a cluster.

What is simulated, on one clock (a heap of timed events):

- **rollout servers** with continuous batching: a decode iteration advances every running
  request one token and costs `DecodeCost` (batch and context dependent); new requests are
  prefilled (stalling the batch) when a slot and KV room are free; between two events the
  batch is constant, so a server advances analytically to the next request to finish;
- **episodes**: `turns` generate calls with tool latency between them, sticky to one server;
- **admission and consumption** through the project's REAL `StalenessGate` and
  `TrajectoryBuffer` (areal_like.core): the simulator only feeds them events, so the
  staleness the plan reports is what the real rules would give;
- **the trainer**: pops a batch (η re-checked by the buffer), trains for `TrainCost`, then
  publishes the version as `WeightFeed.publish` does: it first waits for the previous
  version's broadcast to end, is held for the snapshot (`sim.snapshot_s`), and
  goes on to the next step while the broadcast (`WeightSyncCost`) runs in the background;
  when the broadcast ends, servers apply the version (pause, and under
  `interrupt_mode=recompute` re-prefill every in-flight context: the interrupt cost), then
  the gate sees the new loaded version.

Simplifications (stated in docs/planning.md): CPU contention (`shared_cores`) is taken
when a segment or step is planned, not re-planned as others start or stop; KV admission
reserves the full response (no preemption), prefill is not chunked, all servers get a
version at the same moment, the trainer's DP replicas are one step-time formula, the
background broadcast takes no compute from the trainer.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from areal_like.core.buffer import TrajectoryBuffer
from areal_like.core.config import ExperimentConfig
from areal_like.core.staleness import GateTally, StalenessGate
from areal_like.core.types import Trajectory, TrajectoryGroup
from areal_like.plan.costs import CostModel, LengthDist
from areal_like.plan.sim_trainer import SimTrainer as _Trainer

__all__ = ["SimInterrupts", "SimLag", "SimResult", "Split", "simulate", "sample_length", "train_step_s", "broadcast_s",
           "snapshot_s"]


@dataclass(frozen=True)
class Split:
    """How the devices are divided: rollout devices (servers × TP) and train devices."""

    rollout_devices: int
    train_devices: int


# ---- small pure cost functions ----------------------------------------------------------


def sample_length(d: LengthDist, cap: int, rng: random.Random) -> int:
    """One episode's generated tokens from the distribution, within [1, cap]."""
    if d.kind == "fixed":
        draw = d.mean
    elif d.kind == "lognormal":
        draw = d.median * math.exp(d.sigma * rng.gauss(0.0, 1.0))
    elif d.kind == "pareto":
        draw = d.scale * rng.paretovariate(d.alpha)
    else:
        draw = float(rng.choice(d.values))
    if d.tail_cap is not None:
        draw = min(draw, d.tail_cap)
    return max(1, min(d.cap or cap, d.offset + int(draw)))


def train_step_s(costs: CostModel, tokens: int, devices: int) -> float:
    """Seconds of one train step over `tokens` on `devices` (data-parallel speedup n**exp)."""
    t = costs.train
    return t.fixed_s + t.seconds_per_token * tokens / (devices**t.scaling_exponent)


def broadcast_s(costs: CostModel, cross_node: bool) -> float:
    """Seconds to deliver one version to every server (in the background of the next step)."""
    w = costs.weight_sync
    bw = w.inter_node_bytes_per_s if cross_node else w.intra_node_bytes_per_s
    return w.latency_s + w.model_bytes / bw


def snapshot_s(costs: CostModel) -> float:
    """Seconds the trainer is held to snapshot one version before its broadcast starts
    (the copy into the sender's staging buffer and its digest); 0 when not measured."""
    w = costs.weight_sync
    return w.model_bytes / w.snapshot_bytes_per_s if w.snapshot_bytes_per_s else 0.0


# ---- simulated entities -----------------------------------------------------------------


@dataclass
class _Episode:
    group: _Group
    index: int
    turn_lengths: list[int]
    server: int
    turn: int = 0
    context: int = 0
    head_version: int = -1
    tokens: int = 0


@dataclass
class _Group:
    gid: str
    episodes: list[_Episode] = field(default_factory=list)
    done: int = 0
    uniform: bool = False


@dataclass
class _Req:
    episode: _Episode
    new_tokens: int
    """Tokens to prefill before decoding (the prompt, or a tool answer with the prefix cached)."""
    remaining: float


@dataclass
class _Server:
    sid: int
    version: int = 0
    running: list[_Req] = field(default_factory=list)
    queue: deque[_Req] = field(default_factory=deque)
    decode_from: float = 0.0
    """When decoding (re)starts after a prefill or weight-load pause."""
    iter_s: float = 0.0
    gen: int = 0
    """Bumped at every replan: older wake-up events are stale."""
    busy_s: float = 0.0
    decode_s: float = 0.0


@dataclass
class SimLag:
    """The version lag of the samples a simulated run trained on."""

    hist: dict[int, int]
    """Samples trained at each version lag (head version)."""
    max: int
    mean: float


@dataclass
class SimInterrupts:
    """What weight updates cost in-flight generation in a simulated run."""

    per_sample: float
    """Interrupts per trained sample."""
    recompute_tokens_per_sample: float
    share: float
    """Recomputed tokens / generated tokens."""


@dataclass
class SimResult:
    """What one simulated run gives; rates are after `warmup_steps` steps."""

    eta: int
    split: Split
    servers: int
    steps: int
    samples_per_s: float
    step_s: float
    trainer_idle_ratio: float
    """Share of the steady window (after warm-up) the trainer neither computed nor took a
    snapshot: waiting for data, or for the previous broadcast before publishing."""
    rollout_idle_ratio: float
    lag: SimLag
    interrupts: SimInterrupts
    straggler_wait_s_per_step: float
    """Trainer-waiting time during which rollout servers sat idle (waiting on tails or the gate), per step."""
    overlap_s: float
    """Seconds the trainer computed while some server decoded (0 for η = 0: synchronous)."""
    train_phase_s: float
    rollout_phase_s: float
    """Median per step: train + publish (the wait for the previous broadcast and the
    snapshot), and the rest of the gap between steps."""
    weight_sync_s: float
    """One broadcast's seconds (in the background of the next step)."""
    outcomes: dict[str, int]
    counts_add_up: bool
    wall_s: float
    gate_refusals: int
    train_tokens_per_step: float = 0.0
    """Mean tokens a train step trained on, after warm-up."""

    def as_row(self) -> dict[str, Any]:
        return {
            "eta": self.eta, "rollout_devices": self.split.rollout_devices, "train_devices": self.split.train_devices,
            "servers": self.servers, "samples_per_s": round(self.samples_per_s, 3), "step_s": round(self.step_s, 3),
            "trainer_idle": round(self.trainer_idle_ratio, 3), "rollout_idle": round(self.rollout_idle_ratio, 3),
            "mean_lag": round(self.lag.mean, 2), "max_lag": self.lag.max,
            "interrupts_per_sample": round(self.interrupts.per_sample, 3),
            "recompute_share": round(self.interrupts.share, 4),
            "straggler_wait_s": round(self.straggler_wait_s_per_step, 3),
        }


# ---- the simulation's collaborators ----------------------------------------------------------


class _Clock:
    """The simulated clock: a heap of timed events, popped in time order (ties: push order)."""

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, str, Any]] = []
        self.seq = 0
        self.now = 0.0

    def push(self, t: float, kind: str, data: Any = None) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, data))

    def pop(self) -> tuple[float, str, Any]:
        """The next event; the clock moves to its time."""
        t, _, kind, data = heapq.heappop(self.heap)
        self.now = t
        return t, kind, data

    def __bool__(self) -> bool:
        return bool(self.heap)


class _RunCounters:
    """What the run counts for its result: interrupts, recomputed and generated tokens,
    and the time-weighted straggler wait and overlap between two events."""

    def __init__(self) -> None:
        self.interrupts = 0
        self.recomputed = 0
        self.generated = 0
        self.straggler_s = 0.0
        self.overlap_s = 0.0
        self.last_t = 0.0

    def integrate(self, t: float, servers: list[_Server], trainer: _Trainer) -> None:
        """Time-weighted counters between two events (straggler wait, overlap)."""
        dt = t - self.last_t
        self.last_t = t
        if dt <= 0:
            return
        decoding = sum(1 for s in servers if s.running and s.decode_from < t)
        if not trainer.training:
            self.straggler_s += dt * (1 - decoding / len(servers))
        elif trainer.in_compute and decoding:
            self.overlap_s += dt


# ---- the simulation -------------------------------------------------------------------------


class _Sim:
    """One run: the rollout side (servers, episodes, the real gate and buffer) driven by
    `run()`, the event loop, read top to bottom, with the clock, the trainer and the
    run's counters as collaborators."""

    def __init__(self, cfg: ExperimentConfig, costs: CostModel, split: Split, eta: int, steps: int,
                 seed: int, nodes: int) -> None:
        self.cfg, self.costs, self.split, self.eta, self.steps = cfg, costs, split, eta, steps
        self.rng = random.Random(seed)
        self.n = cfg.rollout.group_size
        self.B = cfg.samples_per_step
        self.gate = StalenessGate(self.B, eta, cfg.staleness.max_concurrent,
                                  adaptive_lead=cfg.staleness.lead == "adaptive")
        self.buffer = TrajectoryBuffer(eta, cfg.staleness.filter_uniform_groups)
        self.tally = GateTally(self.buffer)  # what the trainer tells the gate, the lead's counts too
        n_servers = max(1, split.rollout_devices // costs.decode.gpus_per_server)
        self.servers = [_Server(i) for i in range(n_servers)]
        self.cap = cfg.rollout.response_length
        self.turns = max(1, min(costs.episode.turns, cfg.agent.max_assistant_turns))
        cross = nodes > 1 or split.rollout_devices + split.train_devices > costs.devices_per_node
        self.sync_s = broadcast_s(costs, cross)
        self.clock = _Clock()
        self.trainer = _Trainer(snapshot_s(costs))
        self.counts = _RunCounters()
        self.started = 0
        self.groups = 0

    def contention(self) -> float:
        """How much slower compute runs now because busy threads outnumber the shared
        cores (`CostModel.shared_cores`; 1 with dedicated devices). Taken when a decode
        segment or a train step is planned."""
        cores = self.costs.shared_cores
        if cores is None:
            return 1.0
        b = self.cfg.train.backend
        ranks = b.tensor_parallel_size * b.data_parallel_size if b.type == "megatron" else b.world_size
        busy = sum(1 for s in self.servers if s.running) * self.cfg.rollout.server_threads
        busy += b.threads * ranks if self.trainer.in_compute else 0
        return max(1.0, busy / cores)

    def run(self) -> None:
        self.admit_groups()
        while self.trainer.version < self.steps and self.clock:
            t, kind, data = self.clock.pop()
            self.counts.integrate(t, self.servers, self.trainer)
            if kind == "server":
                sid, gen = data
                if gen == self.servers[sid].gen:
                    self.service(self.servers[sid])
            elif kind == "tool_done":
                self.submit(data)
            elif kind == "train_done":
                self.on_train_done(data)
            elif kind == "published":
                self.trainer.published()
            elif kind == "weights_sent":
                self.on_weights_delivered(data)
            elif kind == "weights_loaded":
                self.gate.set_loaded_version(data)
            self.admit_groups()
            self.try_train()
            if self.trainer.in_compute and self.costs.shared_cores is not None:
                self.retime_train()

    # -- rollout side: the gate admits whole groups
    def admit_groups(self) -> None:
        while self.gate.try_admit(self.n):
            self.spawn_group()

    def spawn_group(self) -> None:
        g = _Group(gid=f"g{self.groups}", uniform=self.rng.random() < self.costs.episode.uniform_group_fraction)
        self.groups += 1
        self.started += self.n
        for i in range(self.n):
            total = sample_length(self.costs.lengths, self.cap, self.rng)
            base, extra = divmod(total, self.turns)
            lengths = [base + (1 if k < extra else 0) for k in range(self.turns)]
            lengths = [x for x in lengths if x > 0] or [1]
            ep = _Episode(group=g, index=i, turn_lengths=lengths, server=self.pick_server())
            g.episodes.append(ep)
            self.submit(ep)

    def pick_server(self) -> int:
        """Least loaded server (episodes then stick to it, as sessions do for the prefix cache)."""
        return min(self.servers, key=lambda s: len(s.running) + len(s.queue)).sid

    def submit(self, ep: _Episode) -> None:
        """The episode's next generate call goes to its server."""
        e = self.costs.episode
        new = e.prompt_tokens if ep.turn == 0 else e.tool_response_tokens
        ep.context += new
        ep.tokens += new
        s = self.servers[ep.server]
        self.advance(s)
        s.queue.append(_Req(ep, new, float(ep.turn_lengths[ep.turn])))
        self.service(s)

    # -- a server between events: advance, retire, admit, replan
    def advance(self, s: _Server) -> None:
        """Credit the decode iterations done since the last replan."""
        if not s.running or s.iter_s <= 0:
            return
        dt = self.clock.now - s.decode_from
        if dt <= 0:
            return
        k = min(dt / s.iter_s, min(r.remaining for r in s.running))
        for r in s.running:
            r.remaining -= k
            r.episode.context += k
        s.decode_s += k * s.iter_s
        s.busy_s += k * s.iter_s
        s.decode_from = self.clock.now

    def service(self, s: _Server) -> None:
        self.advance(s)
        for r in [r for r in s.running if r.remaining <= 1e-6]:
            s.running.remove(r)
            self.finish_turn(r)
        d = self.costs.decode
        prefill = 0
        while s.queue and len(s.running) < d.max_batch:
            r = s.queue[0]
            need = r.episode.context + r.remaining
            held = sum(x.episode.context + x.remaining for x in s.running)
            if s.running and held + need > d.kv_capacity_tokens:
                break
            s.queue.popleft()
            s.running.append(r)
            prefill += r.new_tokens
            if r.episode.head_version < 0:
                r.episode.head_version = s.version  # the first token is sampled at this version
        if prefill:
            pause = prefill / d.prefill_tokens_per_s
            s.decode_from = max(s.decode_from, self.clock.now) + pause
            s.busy_s += pause
        self.replan(s)

    def replan(self, s: _Server) -> None:
        s.gen += 1
        if not s.running:
            s.iter_s = 0.0
            return
        d = self.costs.decode
        m = min(r.remaining for r in s.running)
        n = len(s.running)
        ctx = sum(r.episode.context for r in s.running) + n * m / 2  # mid-segment context
        s.iter_s = (d.base_s + d.per_seq_s * n + d.per_context_token_s * ctx) * self.contention()
        s.decode_from = max(s.decode_from, self.clock.now)
        self.clock.push(s.decode_from + m * s.iter_s, "server", (s.sid, s.gen))

    def finish_turn(self, r: _Req) -> None:
        ep = r.episode
        n = ep.turn_lengths[ep.turn]
        ep.tokens += n
        self.counts.generated += n
        ep.turn += 1
        if ep.turn < len(ep.turn_lengths):
            e = self.costs.episode
            lat = e.tool_latency_s * math.exp(e.tool_latency_sigma * self.rng.gauss(0.0, 1.0)) if e.tool_latency_s else 0
            self.clock.push(self.clock.now + lat, "tool_done", ep)
            return
        g = ep.group
        g.done += 1
        if g.done == len(g.episodes):
            self.deliver(g)

    def deliver(self, g: _Group) -> None:
        """A finished group goes to the trainer: real Trajectory objects into the real buffer."""
        trajs = [
            Trajectory(
                episode_id=f"{g.gid}-e{ep.index}", group_id=g.gid, prompt_ids=[1], response_ids=[1],
                response_mask=[1], response_logprobs=[-1.0], response_versions=[max(0, ep.head_version)],
                reward=1.0 if g.uniform else float(ep.index % 2), metrics={"tokens": float(ep.tokens)},
            )
            for ep in g.episodes
        ]
        self.gate.on_group_done(self.n, len(trajs))
        self.buffer.put(TrajectoryGroup(group_id=g.gid, trajectories=trajs))
        self.announce()

    # -- trainer side
    def try_train(self) -> None:
        if self.trainer.training or self.trainer.version >= self.steps:
            return  # busy, or the run's last version is out
        groups = self.buffer.pop_batch(self.trainer.version, self.cfg.train.batch_size)
        if groups is None:
            return
        if self.trainer.step_times:
            last = self.trainer.step_times[-1]
            self.tally.step_ended(last - self.trainer.started)
        self.tally.step_began(self.clock.now - last if self.trainer.step_times else 0.0, self.cfg.train.batch_size)
        tokens = int(sum(t.metrics["tokens"] for g in groups for t in g.trajectories))
        self.trainer.start(groups, train_step_s(self.costs, tokens, self.split.train_devices), self.clock.now, tokens)
        self.retime_train()

    def retime_train(self) -> None:
        """(Re)plan the end of the running train step at the contention of now."""
        end = self.trainer.replan(self.clock.now, self.contention())
        if end is not None:
            self.clock.push(end, "train_done", self.trainer.gen)

    def on_train_done(self, gen: int) -> None:
        if not self.trainer.is_current(gen):
            return  # re-planned since
        groups, published, delivered = self.trainer.finish(self.clock.now, self.sync_s)
        self.buffer.mark_trained(groups)
        self.announce()
        self.clock.push(published, "published")
        self.clock.push(delivered, "weights_sent", self.trainer.version + 1)

    def announce(self) -> None:
        """The trainer's cumulative counts reach the gate (drops free capacity; a step that
        took extra groups widens it). The step just trained makes version + 1."""
        c = self.tally.counts()
        self.gate.on_trainer_counts(c.consumed, c.dropped, trainer_version=self.trainer.version + 1,
                                    starved=c.starved, spare=c.spare)

    def on_weights_delivered(self, version: int) -> None:
        """Every server applies the version: pause, and under recompute re-prefill in-flight contexts."""
        d, mode = self.costs.decode, self.cfg.rollout.interrupt_mode
        now = self.clock.now
        done_at = now
        for s in self.servers:
            self.advance(s)
            pause = d.weight_load_s
            if s.running and mode != "wait":
                self.counts.interrupts += len(s.running)
                if mode == "recompute":
                    ctx = int(sum(r.episode.context for r in s.running))
                    self.counts.recomputed += ctx
                    pause += ctx / d.prefill_tokens_per_s
            elif s.running:  # wait: let the batch drain first (approximated by its longest remaining)
                pause += max(r.remaining for r in s.running) * max(s.iter_s, d.base_s)
            s.version = version
            s.decode_from = max(s.decode_from, now) + pause
            s.busy_s += pause
            done_at = max(done_at, s.decode_from)
            self.replan(s)
        self.clock.push(done_at, "weights_loaded", version)

    # -- results
    def result(self, warmup_steps: int) -> SimResult:
        st = self.trainer.step_times
        w = min(warmup_steps, max(0, len(st) - 2))
        t0 = st[w - 1] if w > 0 else 0.0
        span = max(st[-1] - t0, 1e-12) if st else 1e-12
        trained_after = (len(st) - w) * self.B
        wall = st[-1] if st else self.clock.now
        gaps = [b - a for a, b in zip([t0, *st[w:]], st[w:], strict=False)]
        phases = self.trainer.phases[w: w + len(gaps)]
        rollouts = [max(0.0, g - p) for g, p in zip(gaps, phases, strict=False)]
        lags = self.buffer.lag_history
        hist: dict[int, int] = {}
        for lag in lags:
            hist[lag] = hist.get(lag, 0) + self.n
        n_lag = max(1, sum(hist.values()))
        busy = sum(min(s.busy_s, wall) for s in self.servers)
        summary = self.buffer.summary(self.started, cancelled=self.gate.s.running)
        trained = max(1, summary["trained"])
        c = self.counts
        return SimResult(
            eta=self.eta, split=self.split, servers=len(self.servers), steps=len(st),
            samples_per_s=trained_after / span, step_s=span / max(1, len(st) - w),
            trainer_idle_ratio=max(0.0, 1 - self.trainer.busy_between(t0, t0 + span) / span),
            rollout_idle_ratio=max(0.0, 1 - busy / max(wall * len(self.servers), 1e-12)),
            lag=SimLag(hist=dict(sorted(hist.items())), max=max(lags, default=0),
                       mean=sum(k * v for k, v in hist.items()) / n_lag),
            interrupts=SimInterrupts(per_sample=c.interrupts / trained, recompute_tokens_per_sample=c.recomputed / trained,
                                     share=c.recomputed / max(1, c.generated)),
            straggler_wait_s_per_step=c.straggler_s / max(1, len(st)),
            overlap_s=c.overlap_s, train_phase_s=_median(phases), rollout_phase_s=_median(rollouts),
            weight_sync_s=self.sync_s, outcomes=summary, counts_add_up=TrajectoryBuffer.counts_add_up(summary),
            wall_s=wall, gate_refusals=self.gate.s.rejected_at_gate,
            train_tokens_per_step=sum(self.trainer.tokens[w:len(st)]) / max(1, len(st) - w),
        )


def _median(xs: list[float]) -> float:
    if not xs:
        return 0.0
    ys = sorted(xs)
    m = len(ys) // 2
    return ys[m] if len(ys) % 2 else (ys[m - 1] + ys[m]) / 2


def simulate(cfg: ExperimentConfig, costs: CostModel, split: Split, eta: int | None = None, *, steps: int = 16,
             seed: int = 0, nodes: int = 1, warmup_steps: int = 2) -> SimResult:
    """Simulate `steps` train steps of `cfg` on `split` at staleness bound `eta`
    (default: the config's); deterministic for a seed."""
    if split.rollout_devices < costs.decode.gpus_per_server or split.train_devices < 1:
        raise ValueError(f"split {split} leaves no rollout server or no trainer")
    sim = _Sim(cfg, costs, split, cfg.staleness.max_staleness if eta is None else eta, steps, seed, nodes)
    sim.run()
    return sim.result(warmup_steps)
