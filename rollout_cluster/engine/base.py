"""The engine contract: what every rollout backend offers the server above it.

Two levels, in the spirit of vLLM v1 (`EngineCore.step` driven by a client):

- `Engine` is synchronous and step-driven: `enqueue` (or `add_request` from raw
  arguments), `step() -> outputs`, `abort`, `pause`/`resume`, `load_weights`, and
  `update_weights`, which owns the whole interrupt protocol of docs/design.md §9.1
  (stop at a step boundary, keep every sampled token with its logprob and version,
  free all KV computed with old weights, prefix cache included, load, set the
  version, re-prefill prompt + partial, go on). The embedded engine implements it;
  tests drive it directly, one step at a time.
- `AsyncGenerateEngine` is what a `RolloutServer` hosts: `async submit(request)`
  (or `generate(...)` from raw arguments) returning one `GenerateResult` per call
  (even across weight updates), `async update_weights(...)`, `abort`, `version`,
  `metrics`. `AsyncEngine` turns any `Engine` into one by driving `step()` on a
  background thread; the vLLM adapter is one natively (AsyncLLM is already async).

Requests are validated once, at the edge: `validate_request` turns raw input (ids,
a dict or `SamplingParams`) into an `EngineRequest` checked against the engine's
limits, and everything inward takes that type and trusts it (`submit`, `enqueue`).
The edge is `RolloutServer` (in-process and HTTP callers) or, for callers without a
server, the raw-argument `generate` / `add_request`; each validates and goes on with
the typed request. Every backend so refuses the same bad requests with the same
`ValueError` subclasses and messages.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from pydantic import ValidationError

from areal_like.core.types import GenerateResult, SamplingParams, StopReason, WeightUpdateMeta

if TYPE_CHECKING:
    import torch

__all__ = [
    "InterruptMode",
    "INTERRUPT_MODES",
    "RequestError",
    "PromptTooLongError",
    "InvalidSamplingParamsError",
    "DuplicateRequestError",
    "EngineClosedError",
    "EngineDeadError",
    "RequestOutput",
    "EngineCounters",
    "Engine",
    "AsyncGenerateEngine",
    "NamedTensors",
    "EngineRequest",
    "coerce_sampling_params",
    "validate_request",
]

InterruptMode = Literal["recompute", "keep", "wait"]
INTERRUPT_MODES: tuple[str, ...] = ("recompute", "keep", "wait")
NamedTensors = Iterable[tuple[str, "torch.Tensor"]]


class RequestError(ValueError):
    """A request the engine will not run; the message says which limit it broke."""


class PromptTooLongError(RequestError):
    """The prompt leaves no room for a generated token within `max_seq_len`."""


class InvalidSamplingParamsError(RequestError):
    """Sampling parameters out of range, of the wrong type, or unsupported here."""


class DuplicateRequestError(RequestError):
    """A request id that is already in flight; ids must be unique while running."""


class EngineClosedError(RuntimeError):
    """The engine was shut down; in-flight and new calls fail with this."""


class EngineDeadError(RuntimeError):
    """The engine can serve nothing any more (its process died, or it hit a fatal error):
    the server hosting it is dead, not the request.

    Raised by every call on a dead engine, so the server manager takes the server out
    of rotation and resubmits its calls elsewhere instead of failing episode after
    episode on it. `root_cause` is the engine's own error, first line first
    (`RuntimeError: CPU Generator does not use offset`, `engine core process killed
    by SIGKILL`): the line a user needs to see first. `details` is whatever traceback
    text the engine could recover. The message starts with the root cause.
    """

    def __init__(self, root_cause: str, details: str = "") -> None:
        super().__init__(root_cause)
        self.root_cause = root_cause
        self.details = details

    def __reduce__(self) -> tuple[Any, ...]:  # crosses Ray and process boundaries intact
        return (type(self), (self.root_cause, self.details))


@dataclass(slots=True)
class RequestOutput:
    """One request's progress in one `step()`: the tokens it gained (a delta).

    `result` is set exactly once, on the step that finishes the request, and holds
    the whole response (all deltas joined) so a caller that only waits for the end
    never has to accumulate.
    """

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    result: GenerateResult | None = None

    @property
    def finished(self) -> bool:
        return self.result is not None


@dataclass
class EngineCounters:
    """Cumulative counters every engine keeps (docs/design.md §5 interrupt metrics)."""

    generated_tokens: int = 0
    prompt_tokens: int = 0
    prefill_tokens: int = 0
    """Prompt tokens actually run through the model (prefix-cache hits excluded)."""
    prefix_cache_hit_tokens: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    weight_updates: int = 0
    interrupts: int = 0
    """Weight updates that found requests decoding (one per update, not per request)."""
    interrupted_requests: int = 0
    interrupted_tokens: int = 0
    """Tokens already generated by requests in flight at an update."""
    recompute_tokens: int = 0
    """Prompt + partial tokens re-prefilled with new weights after an update."""
    reprefill_s_total: float = 0.0
    """Seconds weight updates spent re-prefilling interrupted requests after the new version
    was in place (part of the pause; 0 for an engine that re-prefills in its own schedule)."""
    pause_resume_latency_s_last: float = 0.0
    pause_resume_latency_s_max: float = 0.0
    pause_resume_latency_s_total: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    def record_pause(self, seconds: float) -> None:
        self.pause_resume_latency_s_last = seconds
        self.pause_resume_latency_s_max = max(self.pause_resume_latency_s_max, seconds)
        self.pause_resume_latency_s_total += seconds

    def as_dict(self) -> dict[str, float]:
        d = {k: float(v) for k, v in vars(self).items() if k != "extra"}
        d.update(self.extra)
        return d


def coerce_sampling_params(sampling_params: SamplingParams | Mapping[str, Any] | None) -> SamplingParams:
    """Accept a `SamplingParams`, a plain dict (HTTP, Ray) or None (defaults).

    Pydantic's validation error is re-raised as `InvalidSamplingParamsError`, a
    `ValueError`, so callers catch one family of errors for every bad request.
    """
    if sampling_params is None:
        return SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return sampling_params
    if not isinstance(sampling_params, Mapping):
        raise InvalidSamplingParamsError(
            f"sampling_params must be SamplingParams or a dict, got {type(sampling_params).__name__}"
        )
    try:
        return SamplingParams.model_validate(dict(sampling_params))
    except ValidationError as e:
        parts = [f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()]
        raise InvalidSamplingParamsError("invalid sampling_params: " + "; ".join(parts)) from None


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """A generate request that passed `validate_request` for one engine's limits.

    The only form layers behind the edge accept; they trust it and do not check
    again (an engine keeps at most cheap asserts of its own invariants).
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams

    def samples(self) -> list[EngineRequest]:
        """The n one-sample requests of this one: ids `"{request_id}:{i}"`, and when a
        seed is given, seeds `mix_seed(seed, i + 1)` (different but reproducible)."""
        from rollout_cluster.engine.sampling import mix_seed

        one = self.params.model_copy(update={"n": 1})
        return [
            EngineRequest(
                f"{self.request_id}:{i}",
                self.prompt_ids,
                one if one.seed is None else one.model_copy(update={"seed": mix_seed(one.seed, i + 1)}),
            )
            for i in range(self.params.n)
        ]


def validate_request(
    request_id: Any,
    prompt_ids: Any,
    sampling_params: SamplingParams | Mapping[str, Any] | None,
    *,
    max_seq_len: int,
    vocab_size: int,
    allow_n: bool = False,
) -> EngineRequest:
    """Check one raw request against an engine's limits; the one validation it gets.

    A prompt must leave room for at least one generated token: `len(prompt) <
    max_seq_len`. A request asking for more tokens than remain is not refused; it
    stops with `length` at `max_seq_len` (as vLLM does with `max_model_len`).
    `allow_n` admits `n > 1` (split later with `EngineRequest.samples`); a call
    that returns one result refuses it.
    """
    params = coerce_sampling_params(sampling_params)
    if not isinstance(request_id, str) or not request_id:
        raise RequestError("request_id must be a non-empty string")
    if params.n != 1 and not allow_n:
        raise InvalidSamplingParamsError(
            f"request {request_id}: n={params.n}, but this call returns one sample (n=1); "
            "use generate_n for n samples of one prompt"
        )
    try:
        ids = tuple(int(t) for t in prompt_ids)
    except (TypeError, ValueError):
        raise RequestError("prompt_ids must be a list of integer token ids") from None
    if not ids:
        raise RequestError(f"request {request_id}: prompt_ids is empty")
    if len(ids) >= max_seq_len:
        raise PromptTooLongError(
            f"request {request_id}: prompt has {len(ids)} tokens; the engine's max_seq_len is "
            f"{max_seq_len}, so prompts may have at most {max_seq_len - 1} tokens"
        )
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise RequestError(
            f"request {request_id}: token id {bad} is outside the vocabulary [0, {vocab_size})"
        )
    bad_stop = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if bad_stop:
        raise InvalidSamplingParamsError(
            f"request {request_id}: stop_token_ids {bad_stop} are outside the vocabulary [0, {vocab_size})"
        )
    return EngineRequest(request_id, ids, params)


class Engine(abc.ABC):
    """A step-driven generation engine (synchronous; one thread drives it).

    Thread-safety is the driver's job: `AsyncEngine` calls every method from its one
    engine thread. Weight updates happen between steps, which is what makes "stop at
    a step boundary" (invariant 3a) true by construction.
    """

    interrupt_mode: InterruptMode
    max_seq_len: int
    vocab_size: int
    counters: EngineCounters

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """The weight version the next sampled token will carry."""

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
    ) -> None:
        """Validate a raw request and queue it (the edge for callers that drive steps)."""
        self.enqueue(
            validate_request(
                request_id,
                prompt_ids,
                sampling_params,
                max_seq_len=self.max_seq_len,
                vocab_size=self.vocab_size,
            )
        )

    @abc.abstractmethod
    def enqueue(self, request: EngineRequest) -> None:
        """Queue a validated request; it joins the running batch at a later step.

        Raises `DuplicateRequestError` if its id is in flight (engine state, which
        no edge can check for it)."""

    @abc.abstractmethod
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step (admit + prefill new requests, decode the running
        ones); return each touched request's new tokens. Returns [] while paused."""

    @abc.abstractmethod
    def has_unfinished(self) -> bool:
        """True while some request is waiting or running."""

    @abc.abstractmethod
    def abort(self, request_ids: Iterable[str]) -> list[GenerateResult]:
        """Stop these requests now; return what each generated so far (stop reason
        `abort`). Unknown ids are ignored."""

    @abc.abstractmethod
    def pause(self) -> None:
        """Stop scheduling: `step()` does nothing until `resume()`; state is kept."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Undo `pause()`."""

    @abc.abstractmethod
    def load_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Copy weights in by HF name and set the version. Only the raw load: KV of
        in-flight requests is left as it is (use `update_weights` for the protocol)."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: NamedTensors, version: int) -> list[RequestOutput]:
        """The interrupt protocol of docs/design.md §9.1 for this engine's `interrupt_mode`.

        Returns outputs produced during the update (in `wait` mode, the drained
        requests' last tokens; in `recompute` mode, the first tokens sampled from the
        re-prefill), which the driver must deliver like the outputs of `step()`.
        """

    @abc.abstractmethod
    def metrics(self) -> dict[str, float]:
        """Counters plus gauges (queue depth, running, KV usage), as plain floats."""

    @property
    def model(self) -> torch.nn.Module | None:
        """The HF module the engine runs, where it exposes one (the embedded engine):
        what `AsyncEngine.top_logprobs` scores with and `export_weights` copies. Default:
        None, this engine does not."""
        return None


@runtime_checkable
class AsyncGenerateEngine(Protocol):
    """What `RolloutServer` hosts: `AsyncEngine(EmbeddedEngine)` or `VLLMEngine`.

    The optional capabilities are part of the contract, with explicit defaults (an
    engine subclasses this protocol to inherit them), so the server calls them instead
    of probing the engine for methods: `streams_tokens`, `lends_threads`, `hold`, `top_logprobs`,
    `export_weights`, and the weight group's engine side (`receives_weights`,
    `join_weights`, `receive_weights`). A default either says "not here" (False) or
    refuses with the error a caller of an engine without the capability gets.
    """

    max_seq_len: int
    vocab_size: int

    streams_tokens: bool = False
    """`submit(request, on_tokens=...)` hands out tokens as they are generated (the
    embedded engine); otherwise `submit` takes the request only."""

    lends_threads: bool = False
    """On a machine shared with the trainer, the engine can borrow and lend CPU threads
    through a `core.cores.ThreadLender` in `lender` (the embedded engine); the server
    actor sets one only where this is True."""

    lender: Any = None
    """That `ThreadLender`, or None (not lending)."""

    receives_weights: bool = False
    """The engine's own workers are members of the trainer's weight group and load what
    they receive (vLLM: `join_weights`, `receive_weights`); otherwise the server's
    receiver takes the version and hands it to `update_weights`."""

    loads_in_place: bool = False
    """`update_weights` takes tensors that write themselves (`into(dst)`: slices of the
    weight sender's shared-memory file), so a receiver on that lane hands the version
    straight to the engine and holds no copy of it (the embedded engine)."""

    @property
    def version(self) -> int: ...

    async def submit(self, request: EngineRequest) -> GenerateResult:
        """Generate one response for a request validated at the edge (n == 1)."""
        ...

    async def generate(
        self,
        *,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
    ) -> GenerateResult:
        """Validate raw arguments, then `submit` (for callers without a server)."""
        ...

    async def update_weights(self, named_tensors: NamedTensors, version: int) -> None: ...

    async def abort(self, request_ids: Iterable[str]) -> list[GenerateResult]: ...

    def metrics(self) -> dict[str, float]: ...

    async def close(self) -> None: ...

    # ---- optional capabilities, with their defaults ------------------------------------

    async def hold(self, on: bool) -> None:
        """`cluster.colocate`: pause for the trainer's step (`True`), requests kept, or
        run again. Default: this engine cannot."""
        raise RuntimeError(f"the engine {type(self).__name__} cannot hold for a train step "
                           "(cluster.colocate): it has no hold(on)")

    async def top_logprobs(
        self, prompt_ids: list[int], token_ids: list[int], k: int, temperature: float
    ) -> list[list[tuple[int, float]]]:
        """The `k` most likely tokens and their logprobs at each position of `token_ids`
        (`RolloutServer.top_logprobs`). Default: refused, with a `RequestError`."""
        raise RequestError(
            f"top_logprobs needs the embedded engine; {type(self).__name__} returns sampled-token "
            "logprobs only (ask for logprobs without top_logprobs)"
        )

    async def export_weights(self) -> list[tuple[str, Any]]:
        """The served weights by HF name (CPU copies). Default: this engine cannot."""
        raise RuntimeError(f"{type(self).__name__} cannot export its weights")

    async def join_weights(self, rendezvous: str, name: str, timeout_s: float = 120.0) -> list[str]:
        """`receives_weights` engines: register the engine's workers in the weight group
        at `rendezvous`; returns their member names. Default: not such an engine."""
        raise NotImplementedError(f"{type(self).__name__} has no weight-group members of its own")

    async def receive_weights(
        self, meta: WeightUpdateMeta, rendezvous: str | None, name: str, timeout_s: float
    ) -> int:
        """`receives_weights` engines: receive version `meta.version` in the engine's own
        workers and load it; returns the version. Default: not such an engine."""
        raise NotImplementedError(f"{type(self).__name__} has no weight-group members of its own")


def finished_result(
    request_id: str,
    token_ids: list[int],
    logprobs: list[float],
    versions: list[int],
    stop_reason: StopReason,
    num_interrupts: int,
    stop_token_id: int | None = None,
) -> GenerateResult:
    """Build the final result without re-validating lengths the engine already keeps equal.
    `stop_token_id` (the id that ended the answer) is kept only with `stop_reason` `stop`."""
    return GenerateResult.model_construct(
        request_id=request_id,
        token_ids=list(token_ids),
        logprobs=list(logprobs),
        versions=list(versions),
        stop_reason=stop_reason,
        num_interrupts=num_interrupts,
        stop_token_id=stop_token_id if stop_reason == "stop" else None,
    )
