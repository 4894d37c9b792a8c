"""Typed messages shared by every component.

These are the contracts of docs/design.md §4: what a generate call takes and returns,
what an agent loop produces, what crosses from the rollout cluster to the trainer
(a `TrajectoryGroup`), and what the trainer announces back (`VersionAnnouncement`,
`WeightUpdateMeta`). They import nothing heavy, so `import areal_like` stays light.

Provenance (invariant 2) is checked here, once, in `Trajectory`'s validator: every
response token carries a mask, a behaviour logprob and a version; tokens with mask
0 (tool and observation tokens) have logprob 0 and version -1.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "SamplingParams", "GenerateRequest", "GenerateResult", "StopReason", "AgentLoopOutput",
    "LoopExtra", "Trajectory", "TrajectoryGroup", "RolloutStats", "EpisodeFailures", "Origin",
    "GateSnapshot", "EpisodeOutcomes", "RolloutCounters", "RolloutSeconds", "ServerPoolCounters",
    "ServerCounters", "EvalResult", "VersionAnnouncement", "GateCounts", "TrainerId", "Goodbye",
    "WeightUpdateMeta", "TensorMeta", "head_version",
]

StopReason = Literal["stop", "length", "abort"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=False)


class SamplingParams(_Strict):
    """How one request is sampled. Temperature 0 means greedy."""

    temperature: float = Field(1.0, ge=0.0, le=100.0)
    """Softmax temperature; behaviour logprobs are `log_softmax(logits / T)`."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling; RL runs leave it at 1 (importance weights become approximate)."""
    top_k: int = Field(-1, ge=-1)
    """Top-k sampling; -1 disables it."""
    max_tokens: int = Field(256, ge=1)
    """Upper bound on generated tokens for this request."""
    stop_token_ids: list[int] = Field(default_factory=list)
    """Generation stops after emitting any of these ids (the id is kept)."""
    ignore_eos: bool = False
    """Keep decoding past the model's end-of-sequence token (vLLM's `ignore_eos`);
    `stop_token_ids` still stop. Benchmarks use it to force response lengths."""
    seed: int | None = None
    """Per-request seed; randomness is a function of (seed, position) so resumed
    requests draw the same numbers they would have drawn uninterrupted."""
    n: int = Field(1, ge=1, le=1024)
    """Number of samples for this prompt (engine level)."""
    priority: int = Field(0, ge=0, le=100)
    """Lower goes first (vLLM's meaning): an engine starts a waiting request of priority 0
    before any of priority 1. Evaluations run at 1, so they take the capacity that training
    episodes leave, not the next batch's (the embedded engine; vLLM's default FCFS ignores it)."""

    @property
    def approximate_logprobs(self) -> bool:
        """True when top-k/top-p truncate the distribution the token was drawn from."""
        return self.top_p < 1.0 or self.top_k > 0


class GenerateRequest(_Strict):
    request_id: str = Field(min_length=1)
    prompt_ids: list[int] = Field(min_length=1)
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)


class GenerateResult(_Strict):
    """One generate call's answer. Lengths of the three lists always agree."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    stop_reason: StopReason
    num_interrupts: int = 0
    """How many weight updates interrupted this request while it was decoding."""
    stop_token_id: int | None = None
    """The id that ended the answer (the last of `token_ids`) when `stop_reason` is `stop`; else None."""

    @model_validator(mode="after")
    def _lengths(self) -> GenerateResult:
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"GenerateResult lengths disagree: token_ids={n} logprobs={len(self.logprobs)} "
                f"versions={len(self.versions)}"
            )
        return self


def _check_provenance(
    prefix: str, ids: list[int], mask: list[int], logprobs: list[float], versions: list[int]
) -> None:
    n = len(ids)
    if not (len(mask) == len(logprobs) == len(versions) == n):
        raise ValueError(
            f"{prefix}: lengths disagree: response_ids={n} response_mask={len(mask)} "
            f"response_logprobs={len(logprobs)} response_versions={len(versions)}"
        )
    for i, (m, lp, v) in enumerate(zip(mask, logprobs, versions, strict=True)):
        if m not in (0, 1):
            raise ValueError(f"{prefix}: response_mask[{i}]={m}, expected 0 or 1")
        if not math.isfinite(lp):
            raise ValueError(f"{prefix}: response_logprobs[{i}]={lp} is not finite")
        if v < -1:
            raise ValueError(f"{prefix}: response_versions[{i}]={v} < -1")
        if m == 1:
            if v < 0:
                raise ValueError(f"{prefix}: generated token {i} has version {v}; expected >= 0")
            if lp > 1e-6:
                raise ValueError(f"{prefix}: response_logprobs[{i}]={lp} > 0")
        elif lp != 0.0 or v != -1:
            raise ValueError(
                f"{prefix}: tool/observation token {i} must have logprob 0 and version -1, "
                f"got logprob {lp} version {v}"
            )


_MOVED_FROM_EXTRA = ("final_text", "messages", "episode_id", "stop_reason", "termination")
"""Keys loops once put in `AgentLoopOutput.extra`; each is now a field of its own."""


class LoopExtra(dict):
    """`AgentLoopOutput.extra`: a plain dict, except for the keys that moved to fields.

    A reward written when the final text was `output.extra["final_text"]` would get a bare
    `KeyError` (or, with `.get(..., "")`, an empty string scored 0 on every episode). Both
    `extra[key]` and `extra.get(key)` of a moved key that the loop did not put there raise
    a `KeyError` naming the field to read instead (`output.final_text`), so the episode
    fails with that reason and the reward is fixed once, not trained on silently."""

    def __missing__(self, key: Any) -> Any:
        raise _moved(key) if key in _MOVED_FROM_EXTRA else KeyError(key)

    def get(self, key: Any, default: Any = None) -> Any:
        if key in _MOVED_FROM_EXTRA and key not in self:
            raise _moved(key)
        return super().get(key, default)


def _moved(key: str) -> KeyError:
    return KeyError(f"output.extra[{key!r}] is no longer set: read output.{key} (AgentLoopOutput.{key}) instead")


class AgentLoopOutput(_Strict):
    """What `AgentLoopBase.run` returns: one episode, prompt and response tokens."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    response_versions: list[int]
    reward: float | None = None
    num_turns: int = 0
    metrics: dict[str, float] = Field(default_factory=dict)
    """Per-episode numbers the loop wants on the dashboard (means per train step)."""
    truncated: bool = False
    """The response budget cut the episode."""
    final_text: str = ""
    """Decoded text of the last assistant turn, tool calls removed (what rewards read)."""
    messages: list[dict[str, Any]] = Field(default_factory=list)
    """The chat so far, OpenAI-shaped."""
    episode_id: str | None = None
    stop_reason: StopReason | None = None
    """Of the last generate call (`abort` means the engine gave up on the episode)."""
    stop_token_id: int | None = None
    """The token that ended the last answer (an eos, end-of-turn or stop id); None when cut or aborted."""
    termination: str | None = None
    """Why the loop ended (`stop`, `length`, `max_turns`, ...)."""
    extra: Annotated[dict[str, Any], AfterValidator(LoopExtra)] = Field(default_factory=LoopExtra)
    """The loop's own data; the pipeline never reads it. A `LoopExtra`: reading a key that
    moved to a field (`extra["final_text"]`) raises a `KeyError` naming the field."""

    @model_validator(mode="before")
    @classmethod
    def _lift_known_extra(cls, data: Any) -> Any:
        """Loops written against the old dict (`extra={"final_text": ...}`) keep working."""
        if isinstance(data, dict) and isinstance(data.get("extra"), dict):
            known = {"final_text", "messages", "episode_id", "stop_reason", "termination"}
            lifted = {k: v for k, v in data["extra"].items() if k in known and k not in data}
            if lifted:
                data = {**data, **lifted, "extra": {k: v for k, v in data["extra"].items() if k not in lifted}}
        return data

    @model_validator(mode="after")
    def _provenance(self) -> AgentLoopOutput:
        _check_provenance("AgentLoopOutput", self.response_ids, self.response_mask, self.response_logprobs,
                          self.response_versions)
        return self


def head_version(versions: list[int], mask: list[int]) -> int:
    """Smallest version among generated (mask 1) tokens; -1 if none were generated."""
    gen = [v for v, m in zip(versions, mask, strict=True) if m == 1]
    return min(gen) if gen else -1


class Trajectory(_Strict):
    """One scored episode, the unit the trainer consumes (and `trajectories.jsonl` records)."""

    episode_id: str
    group_id: str
    prompt_ids: list[int] = Field(min_length=1)
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    response_versions: list[int]
    reward: float
    temperature: float = Field(1.0, gt=0.0)
    truncated: bool = False
    num_turns: int = 0
    metrics: dict[str, float] = Field(default_factory=dict)
    stop_token_id: int | None = None
    """The token that ended the answer; None when the length cut it (records of old runs: None)."""

    @model_validator(mode="after")
    def _provenance(self) -> Trajectory:
        _check_provenance(f"Trajectory {self.episode_id}", self.response_ids, self.response_mask,
                          self.response_logprobs, self.response_versions)
        if not math.isfinite(self.reward):
            raise ValueError(f"Trajectory {self.episode_id}: reward {self.reward} is not finite")
        return self

    @property
    def head_version(self) -> int:
        return head_version(self.response_versions, self.response_mask)


class Origin(_Strict):
    """Who sent a data frame, for which run and trainer epoch (docs/design.md §10.7).

    The trainer refuses (and logs and counts, never trains on) frames of another run,
    of an older trainer epoch, or of a second rollout controller. `started` is the
    sender's cumulative episode count in this epoch when it sent the frame: if the
    sender dies, the trainer still knows how many of its episodes never arrived.

    `seq` numbers the sender's frames of one epoch from 1 (0: not numbered), set by the
    data channel, which keeps each frame until the trainer acknowledges it; `low` says
    that no frame below it will be sent again (acknowledged or given up), so the
    trainer's acknowledgements never wait for it.
    """

    run_id: str
    epoch: int = Field(ge=0)
    sender: str
    seq: int = Field(0, ge=0)
    low: int = Field(0, ge=0)
    started: int = Field(0, ge=0)


class TrajectoryGroup(_Strict):
    """The `group_size` episodes of one prompt, sent together (groups are admitted whole).

    `failed` counts members that produced no trajectory (reward raised, engine died,
    ...); `rejected` counts members the workflow returned nothing for. Those members
    are not in `trajectories` and are already released from the gate's running count.
    """

    group_id: str
    trajectories: list[Trajectory]
    failed: int = Field(0, ge=0)
    rejected: int = Field(0, ge=0)
    failure_reasons: list[str] = Field(default_factory=list)
    origin: Origin | None = None

    @property
    def size(self) -> int:
        return len(self.trajectories) + self.failed + self.rejected

    @property
    def head_version(self) -> int:
        heads = [t.head_version for t in self.trajectories if t.head_version >= 0]
        return min(heads) if heads else -1


class GateSnapshot(_Strict):
    """The staleness gate as the rollout side last saw it (samples; docs/design.md §9.3)."""

    version: int = 0
    running: int = 0
    sent: int = 0
    dropped: int = 0
    consumed: int = 0
    sent_base: int = 0
    rejected_at_gate: int = 0
    ahead: int = 0
    """Samples the trainer consumed beyond B per step (steps that took extra groups)."""
    capacity: int = 0
    """(L + v + 1) · B + ahead, L the lead (≤ η, docs/design.md §10.50)."""
    lead: int = 0


class EpisodeOutcomes(_Strict):
    """How the rollout side's finished episodes ended (cumulative, samples)."""

    sent: int = 0
    rejected: int = 0
    failed: int = 0
    reward_sum: float = 0.0
    """Rewards of every sent trajectory, groups the trainer will filter included: the
    policy's reward as sampled, beside the trained mean (which skips uniform groups)."""


class ServerCounters(_Strict):
    """One inference server's place and progress (its own Ray actor, docs/design.md §10.2)."""

    node: str = ""
    """Ray node id the server runs on."""
    device: str = ""
    pid: int = 0
    alive: bool = True
    version: int = 0
    """The weight version it serves."""
    generated_tokens: float = 0.0
    requests_running: float = 0.0


class ServerPoolCounters(_Strict):
    """The rollout side's servers: how many serve, and what failing cost (cumulative)."""

    servers: float = 0.0
    server_failures: float = 0.0
    generate_retries: float = 0.0
    server_restarts: float = 0.0
    servers_waiting_for_weights: float = 0.0
    """Restarted or added servers with no live sibling to copy the served version from:
    out of rotation until the trainer sends its current version again. Below: the elastic
    pool (§10.24; `servers` counts those in rotation, a drained one is no failure)."""
    pool_size: float = 0.0
    servers_target: float = 0.0
    servers_starting: float = 0.0
    servers_draining: float = 0.0
    servers_added: float = 0.0
    servers_drained: float = 0.0
    max_concurrent: float = 0.0
    resize_error: str = ""  # why the pool could not reach `servers_target`


class RolloutSeconds(_Strict):
    """The rollout side's part of the step's time budget (docs/design.md §10.19):
    cumulative seconds by what they went to. In metrics.jsonl each is `<name>_seconds_total`."""

    generate: float = 0.0
    """The servers' engines stepping (generation, prefill and recompute), summed over
    servers (the embedded engine; vLLM's engine core does not report it: 0)."""
    engine_idle: float = 0.0
    """The servers' engines had nothing to step (not counting holds), summed."""
    weights: float = 0.0
    """The servers receiving and loading weights until each serves the new version, summed."""
    reprefill: float = 0.0
    """The servers re-prefilling, with a new version, the answers its load interrupted, summed
    (the embedded engine; vLLM re-prefills in its own schedule, counted in `generate`)."""
    agent_loop: float = 0.0
    """Episodes in their agent loop outside generate calls and tool calls, summed over
    episodes (loops that report `generate_s`: the built-in ones)."""
    tools: float = 0.0
    """Episodes in tool calls, summed over episodes."""
    reward: float = 0.0
    """Computing rewards, summed over episodes."""
    send: float = 0.0
    """The rollout controller encoding and sending to the trainer."""
    wait_gate: float = 0.0
    """The controller admitted nothing because η's bound was reached: it waits for the
    trainer's next version to be loaded."""
    wait_concurrency: float = 0.0
    """It admitted nothing because `staleness.max_concurrent` episodes were running."""
    wait_weights: float = 0.0
    """It admitted nothing while awaiting a restarted trainer's weights."""


class RolloutCounters(_Strict):
    """Engine and routing numbers of one rollout process (cumulative counters and gauges)."""

    generated_tokens: float = 0.0
    interrupts: float = 0.0
    interrupted_tokens: float = 0.0
    recompute_tokens: float = 0.0
    pause_resume_latency_s_max: float = 0.0
    queue_depth: float = 0.0
    requests_running: float = 0.0
    kv_usage: float = 0.0
    gen_tokens_per_s: float = 0.0
    rollout_idle_ratio: float = 0.0
    rollout_cpu_s: float = 0.0
    """CPU seconds the rollout side's processes used so far (its controller and its
    servers' own processes; a restarted server starts again from 0)."""
    rollout_cores_used: float = 0.0
    """CPU cores the rollout side used since its previous report (CPU seconds / wall)."""
    rollout_held_s: float = 0.0
    """`cluster.colocate`: seconds the servers were paused for the trainer's steps, summed
    over servers."""
    rollout_borrowed_thread_s: float = 0.0
    """Seconds the servers generated with threads borrowed from an idle train pool
    (`cluster.lend_idle_threads`), summed over servers."""
    seconds: RolloutSeconds = Field(default_factory=RolloutSeconds)
    """Where the rollout side's time went (the step's time budget)."""
    pool: ServerPoolCounters = Field(default_factory=ServerPoolCounters)
    """The servers' health: live, failed, restarted, waiting for weights."""
    engine: dict[str, float] = Field(default_factory=dict)
    """An engine's own numbers beside the engine-agnostic ones, summed over servers (vLLM:
    `vllm_kv_cache_usage`, `vllm_num_waiting`, `vllm_preemptions`, ...)."""
    per_server: dict[str, ServerCounters] = Field(default_factory=dict)
    """Each server by name: node, device, version served, tokens generated."""


class EvalResult(_Strict):
    """Sampled accuracy on the held-out rows with the weights of one version."""

    accuracy: float
    reward_mean: float
    seconds: float
    num_samples: int
    max_token_version: int | None = None
    """The newest weights any evaluated token came from: above the evaluated version when a
    weight update landed while the evaluation ran (its remaining tokens use the new weights)."""


class EvalProgress(_Strict):
    """A held-out evaluation under way: `done` of `total` samples scored with `version`'s
    weights (the trainer says it while it waits for the last one at the end of a run)."""

    version: int = Field(ge=0)
    done: int = Field(ge=0)
    total: int = Field(ge=0)


class EpisodeFailures(_Strict):
    """Why the rollout side's episodes fail, for the trainer's console (the rollout side's
    own log is not on it): the first error, led by the user's file and line when user
    code raised it (`my_task/reward.py:12: KeyError: 'q'`); counts are in `outcomes`."""

    first: str
    traceback: str = ""
    """The first error's traceback (the user's frames, then ours), bounded."""
    stopped: str | None = None
    """Why the rollout side stopped because of them (fail-fast), or None while it goes on;
    `judging`: no episode succeeded yet and fail-fast's first groups have not all ended."""
    judging: bool = False


class RolloutStats(_Strict):
    """Rollout-side numbers sent to the trainer over the data channel (docs/design.md §9.6).

    `kind`: `stats` (periodic), `eval` (a held-out evaluation at `loaded_version`, in
    `eval`), `final` (the rollout side stopped; `cancelled` is final).
    """

    kind: Literal["stats", "eval", "final"] = "stats"
    time: float
    loaded_version: int
    started: int
    running: int
    cancelled: int = 0
    gate: GateSnapshot = Field(default_factory=GateSnapshot)
    outcomes: EpisodeOutcomes = Field(default_factory=EpisodeOutcomes)
    data_position: dict[str, int | str] = Field(default_factory=dict)
    """Where the prompt stream stands (what a checkpoint stores for `--resume`; a string
    value is state, such as the difficulty streaks, and stays out of the metrics)."""
    counters: RolloutCounters = Field(default_factory=RolloutCounters)
    eval: EvalResult | None = None
    origin: Origin | None = None
    held: int = Field(0, ge=0)
    """`cluster.colocate`: the trainer's `hold` number the servers are paused for (0: they run)."""
    running_groups: dict[str, int] = Field(default_factory=dict)
    """Group id → the version loaded when it was admitted (a lower bound of its head
    version), for every group still running: the trainer waits for a straggler rather
    than step past it (docs/design.md §10.4)."""
    failures: EpisodeFailures | None = None
    """Set once an episode has failed (docs/design.md §10.13)."""
    stopping: bool = False
    """The rollout side is winding down (it had the trainer's goodbye): cancelling its
    episodes, finishing the last evaluation, then the `final` report."""
    eval_progress: EvalProgress | None = None
    """The evaluation under way, if any."""

    def flat(self) -> dict[str, float]:
        """One flat record for metrics.jsonl and the dashboard (`gate_*`, `outcome_*`,
        `data_*` and the counters by name)."""
        out: dict[str, float] = {f"gate_{k}": float(v) for k, v in self.gate.model_dump().items()}
        out.update({f"outcome_{k}": float(v) for k, v in self.outcomes.model_dump().items()})
        out.update({f"data_{k}": float(v) for k, v in self.data_position.items() if not isinstance(v, str)})
        counters = self.counters.model_dump()
        out.update({f"{k}_seconds_total": float(v) for k, v in counters.pop("seconds").items()})
        out.update(counters.pop("pool"))
        out.update(counters.pop("engine"))
        for name, srv in counters.pop("per_server").items():
            out.update({f"{name}_version": float(srv["version"]),
                        f"{name}_generated_tokens": float(srv["generated_tokens"])})
        out.update(counters)
        return out


class GateCounts(_Strict):
    """What became of the samples the rollout side sent (cumulative since the run began):
    the gate frees capacity by them (docs/design.md §9.3)."""

    consumed: int = Field(0, ge=0)
    dropped: int = Field(0, ge=0)
    sent_base: int = Field(0, ge=0)
    """Samples the trainer side had received before this run was resumed: the rollout
    gate counts them as sent, so `accepted` is right across recovery."""
    starved: int = Field(0, ge=0)
    """Train steps that waited for data (`GateTally`, docs/design.md §10.50)."""
    spare: int = Field(0, ge=0)
    """Train steps that began with the next step's data buffered. The lead follows both."""


class TrainerId(_Strict):
    """Which trainer speaks, and which rollout controller it serves."""

    run_id: str = ""
    """The run this trainer serves (stable across resumes)."""
    epoch: int = Field(0, ge=0)
    """Bumped on every trainer start: a rollout side that sees a newer epoch re-bases its
    gate, counts and version on this announcement."""
    rollout_id: str | None = None
    """The rollout controller this trainer accepted in this epoch; any other is refused."""


class Goodbye(_Strict):
    """Goodbye: the run is over (or the trainer is stopping): the rollout side stops
    admitting, cancels what runs, reports final counts and exits."""

    final_eval: bool = True
    """Evaluate the last version before the final report (false after Ctrl-C: the user
    asked for the run to stop now)."""


class VersionAnnouncement(_Strict):
    """Trainer → rollout on the control channel: a new version exists, in typed parts by
    concern: the gate's counts, the weights and where their group meets, where the prompt
    stream resumes, the end of the run, who speaks, the colocate hold, the acks."""

    version: int = Field(ge=0)
    counts: GateCounts = Field(default_factory=GateCounts)
    weights: WeightUpdateMeta | None = None
    weight_store: str | None = None
    """host:port of the dist weight group's store: the rollout side registers there before
    admitting anything, so it is a member from the first version on."""
    data_position: dict[str, int | str] | None = None
    """Where the rollout side's prompt stream resumes (set after `--resume`); applied once,
    before the first episode is admitted."""
    end: Goodbye | None = None
    """Set on the goodbye (`stop`)."""
    trainer: TrainerId = Field(default_factory=TrainerId)
    hold: int = Field(0, ge=0)
    """`cluster.colocate`: nonzero while the trainer wants the devices for a train step (a
    number new for each step): the rollout side pauses its servers and answers with a
    report whose `held` is this number. 0: the servers may run."""
    acked: dict[str, list[int]] = Field(default_factory=dict)
    """Sender → `[upto, *more]`: every data frame of this epoch up to seq `upto` has reached
    the trainer, and so have those in `more`; the sender stops keeping them for a resend
    (docs/design.md §10.7)."""
    servers: int = Field(0, ge=0)
    """Rollout servers asked for (`areal-like pool`, §10.24); 0: none asked."""

    @property
    def stop(self) -> bool:
        """The goodbye: the run is over."""
        return self.end is not None


class TensorMeta(_Strict):
    name: str
    dtype: str
    shape: list[int]


class WeightUpdateMeta(_Strict):
    """Describes one version's weights: what the receiver must preallocate and verify."""

    version: int = Field(ge=0)
    transport: Literal["dist", "disk"]
    tensors: list[TensorMeta]
    epoch: int = Field(0, ge=0)
    """The trainer epoch that sent it: a version number names one set of weights only
    within an epoch (a resumed trainer reuses the numbers its dead predecessor reached),
    so a receiver loads any version of a newer epoch, even a lower number."""
    checksum: str
    """Hex digest over names, dtypes, shapes and bytes; verified before activation."""
    bucket_bytes: int = Field(0, ge=0)
    path: str | None = None
    """Folder of the version for the disk transport."""

    @property
    def nbytes(self) -> int:
        """The version's size in bytes (with LoRA, the adapter's: docs/lora.md)."""
        return sum(math.prod(t.shape) * _ITEMSIZE.get(t.dtype, 4) for t in self.tensors)


_ITEMSIZE = {"float64": 8, "int64": 8, "float32": 4, "int32": 4, "float16": 2, "bfloat16": 2, "int16": 2,
             "int8": 1, "uint8": 1, "bool": 1}

VersionAnnouncement.model_rebuild()
