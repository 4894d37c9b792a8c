"""`RolloutServer`: one engine, its weight-update entry point, health, metrics and HTTP.

The server is what the orchestrator and the agent loops talk to (docs/design.md §4). It
adds nothing to generation itself; it:

- hosts one `AsyncGenerateEngine` (the embedded engine behind `AsyncEngine`, or the
  vLLM adapter), built from the rollout config by `build_engine`;
- refuses bad requests up front with `RequestError` subclasses (ValueErrors whose
  message names the broken limit), the same for in-process and HTTP callers: this
  is the one place a request is validated; the engine gets an `EngineRequest` and
  trusts it;
- keeps a metrics dict (engine counters, queue depth, KV usage, HTTP counters);
- serves the OpenAI-compatible API (`rollout_cluster.http_api`) when asked,
  on 127.0.0.1 by default, optionally behind a bearer token.

In-process use and a Ray actor use the same object: wrap it in
`ray.remote(RolloutServer)` or call it directly; every public method is either
async or cheap.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from areal_like.core.config import EmbeddedEngineConfig, VLLMEngineConfig
from areal_like.core.types import GenerateResult, SamplingParams
from rollout_cluster.engine.base import (
    AsyncGenerateEngine,
    EngineRequest,
    InterruptMode,
    NamedTensors,
    validate_request,
)

__all__ = ["RolloutServer", "build_engine"]

logger = logging.getLogger(__name__)


def build_engine(
    model_path: str | Path,
    config: EmbeddedEngineConfig | VLLMEngineConfig | None = None,
    *,
    interrupt_mode: InterruptMode = "recompute",
    seed: int = 0,
    set_threads: bool = True,
    dtype: str = "float32",
) -> AsyncGenerateEngine:
    """The engine a `rollout.engine` config asks for, ready to serve.

    `set_threads` applies `EmbeddedEngineConfig.threads` with `torch.set_num_threads`,
    which is process-wide: right in a rollout server's own process (or Ray actor),
    wrong in a process shared with a trainer, so it can be turned off. `dtype` is
    `model.dtype` (`auto` resolved for the engine's device); vLLM keeps its own choice
    (the checkpoint's dtype).
    """
    config = config or EmbeddedEngineConfig()
    if isinstance(config, VLLMEngineConfig):
        from rollout_cluster.engine.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, config, interrupt_mode=interrupt_mode, seed=seed)
    import torch

    from rollout_cluster.engine.async_engine import AsyncEngine
    from rollout_cluster.engine.embedded import EmbeddedEngine

    if set_threads:
        torch.set_num_threads(config.threads)
    from areal_like.core.precision import bound_onednn_cache, resolve_dtype, torch_dtype

    bound_onednn_cache()
    dt = torch_dtype(resolve_dtype(dtype, config.device))
    return AsyncEngine(EmbeddedEngine(model_path, config, interrupt_mode=interrupt_mode, seed=seed, dtype=dt))


def _maybe_tokenizer(model_path: Path) -> Any | None:
    """The model folder's tokenizer, or None (token-id prompts still work) if it has none."""
    from areal_like.models.tiny_model import load_tokenizer

    if not any((model_path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        logger.warning("%s has no tokenizer; the HTTP API will accept token ids only", model_path)
        return None
    return load_tokenizer(model_path)


class RolloutServer:
    """Hosts one engine: generate, weight updates, health, metrics, OpenAI HTTP API.

    From config (also the Ray form: `ray.remote(RolloutServer).remote(path, engine_config=...)`):
    `RolloutServer(model_path, engine_config=rollout_config.engine,
    interrupt_mode=rollout_config.interrupt_mode, seed=run.seed)` builds the engine and
    loads the tokenizer from the model folder. Or pass an engine you built (tests,
    custom engines) and optionally a tokenizer, which HTTP text prompts and chat need.
    """

    def __init__(
        self,
        engine: AsyncGenerateEngine | str | Path,
        tokenizer: Any | None = None,
        *,
        engine_config: EmbeddedEngineConfig | VLLMEngineConfig | None = None,
        interrupt_mode: InterruptMode = "recompute",
        seed: int = 0,
        set_threads: bool = True,
        model_name: str | None = None,
        max_sessions: int = 10000,
        dtype: str = "float32",
    ) -> None:
        from rollout_cluster.sessions import SessionTokens

        if isinstance(engine, (str, Path)):
            model_path = Path(engine)
            engine = build_engine(
                model_path, engine_config, interrupt_mode=interrupt_mode, seed=seed, set_threads=set_threads,
                dtype=dtype,
            )
            if tokenizer is None:
                tokenizer = _maybe_tokenizer(model_path)
            model_name = model_name or model_path.name
        self.engine: AsyncGenerateEngine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name or "areal_like"
        self.sessions = SessionTokens(max_sessions)
        self.started_at = time.time()
        self.weights_epoch = 0
        """The trainer epoch of the served weights (`weight_sync.meta.newer_weights`)."""
        self.counters: dict[str, float] = {
            "http_requests": 0.0,
            "http_errors": 0.0,
            "requests_refused": 0.0,
            "weight_update_seconds_total": 0.0,
            "weight_reprefill_seconds_total": 0.0,
            "held_seconds_total": 0.0,
        }
        self._held_since: float | None = None
        self._http: Any = None  # http_api.HttpServer while serving
        self._receiver: Any = None
        self._receiver_name = "server"
        self._receive_timeout_s = 120.0
        self._joined: str | None = None

    @classmethod
    def from_config(
        cls,
        model_path: str | Path,
        engine_config: EmbeddedEngineConfig | VLLMEngineConfig | None = None,
        *,
        interrupt_mode: InterruptMode = "recompute",
        seed: int = 0,
        set_threads: bool = True,
    ) -> RolloutServer:
        """`RolloutServer(model_path, engine_config=...)`, with the config positional."""
        return cls(
            model_path,
            engine_config=engine_config,
            interrupt_mode=interrupt_mode,
            seed=seed,
            set_threads=set_threads,
        )

    # ---- generation -------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def max_seq_len(self) -> int:
        return self.engine.max_seq_len

    def check_request(
        self,
        request_id: str,
        prompt_ids: Any,
        sampling_params: SamplingParams | Mapping[str, Any] | None,
        *,
        allow_n: bool = False,
    ) -> EngineRequest:
        """Validate against the engine's limits without running; counts refusals."""
        try:
            return validate_request(
                request_id,
                prompt_ids,
                sampling_params,
                max_seq_len=self.engine.max_seq_len,
                vocab_size=self.engine.vocab_size,
                allow_n=allow_n,
            )
        except ValueError:
            self.counters["requests_refused"] += 1
            raise

    async def generate(
        self,
        *,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        on_tokens: Any = None,
    ) -> GenerateResult:
        """One response (token ids, behaviour logprobs, per-token versions, stop reason).

        `on_tokens(new_ids)`, when the engine can stream (the embedded engine), is called
        as tokens are generated; otherwise not at all (the result is whole either way)."""
        request = self.check_request(request_id, prompt_ids, sampling_params)
        if on_tokens is not None and self.can_stream:
            return await self.engine.submit(request, on_tokens=on_tokens)
        return await self.engine.submit(request)

    @property
    def can_stream(self) -> bool:
        """Whether the engine hands out tokens as they are generated (`on_tokens`)."""
        return self.engine.streams_tokens

    async def generate_n(
        self,
        *,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
    ) -> list[GenerateResult]:
        """`sampling_params.n` responses for one prompt, ids `"{request_id}:{i}"`.

        Submitted together, so the embedded engine prefills the shared prompt once.
        """
        request = self.check_request(request_id, prompt_ids, sampling_params, allow_n=True)
        return list(await asyncio.gather(*(self.engine.submit(r) for r in request.samples())))

    async def top_logprobs(
        self, prompt_ids: list[int], token_ids: list[int], k: int, temperature: float
    ) -> list[list[tuple[int, float]]]:
        """The `k` most likely tokens and their logprobs at each position of `token_ids`.

        The engine returns only the sampled token's logprob (all RL needs), so OpenAI's
        `top_logprobs` are computed by scoring prompt + response once with the
        engine's own model (`AsyncEngine.top_logprobs`: on the engine thread between
        steps, as costly as one prefill; nothing runs unless a request asks). Same
        distribution as the behaviour logprobs: `log_softmax(logits / T)`, T = 1 for
        greedy requests. Only the embedded engine exposes its model; others refuse with
        a `RequestError` (the `AsyncGenerateEngine` default).
        """
        return await self.engine.top_logprobs(prompt_ids, token_ids, k, temperature)

    async def abort(self, request_ids: Iterable[str]) -> list[GenerateResult]:
        return await self.engine.abort(request_ids)

    async def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Load a new version; in-flight generate calls continue (per interrupt mode)."""
        t0, before = time.perf_counter(), self._reprefill_s()
        await self.engine.update_weights(named_tensors, version)
        logger.info("loaded weights version %d in %s", version, self._count_weights(t0, before))

    async def hold(self, on: bool) -> None:
        """`cluster.colocate`: pause the engine for the trainer's step (a vLLM engine on
        GPU also sleeps, freeing its memory) or let it run again; requests keep their
        state. Idempotent."""
        if on == (self._held_since is not None):
            return
        await self.engine.hold(on)  # an engine that cannot refuses (`AsyncGenerateEngine.hold`)
        if on:
            self._held_since = time.perf_counter()
        else:
            self.counters["held_seconds_total"] += time.perf_counter() - (self._held_since or time.perf_counter())
            self._held_since = None

    # ---- weights straight from the trainer -----------------------------------------

    def attach_receiver(self, receiver: Any, name: str, timeout_s: float = 120.0) -> None:
        """Give this server its own end of the weight transport (a `WeightReceiver`), so
        the trainer's versions reach it directly (docs/design.md §10.5). `name` is this
        server's member name in the weight group."""
        self._receiver, self._receiver_name, self._receive_timeout_s = receiver, name, timeout_s

    async def join_weights(self, rendezvous: str) -> None:
        """Register in the trainer's weight group at `rendezvous`, so the next version
        includes this server (a transfer reaches only members registered before it)."""
        if self.engine.receives_weights:  # the engine receives in its own workers (vLLM)
            await self.engine.join_weights(rendezvous, self._receiver_name)
            return
        if self._receiver is not None and rendezvous != self._joined:
            await asyncio.to_thread(self._receiver.join, rendezvous)
            self._joined = rendezvous

    def _reprefill_s(self) -> float:
        return float(self.engine.metrics().get("reprefill_s_total", 0.0))

    def _count_weights(self, t0: float, reprefill_before: float) -> str:
        """Split a weight update's seconds into receive + load (until the new version is
        served: `weight_update_seconds_total`) and the re-prefill of the answers it
        interrupted (`weight_reprefill_seconds_total`); the log line's text."""
        dt = time.perf_counter() - t0
        reprefill = min(dt, max(0.0, self._reprefill_s() - reprefill_before))
        self.counters["weight_update_seconds_total"] += dt - reprefill
        self.counters["weight_reprefill_seconds_total"] += reprefill
        return f"{dt:.3f}s (serving it after {dt - reprefill:.3f}s; {reprefill:.3f}s re-prefilling the answers in flight)"

    async def receive_weights(self, meta: Any, rendezvous: str | None = None) -> int:
        """Receive version `meta.version` from the trainer and load it (in-flight requests
        interrupted, KV dropped and re-prefilled per `interrupt_mode`). A failed receive
        raises `WeightSyncError` and leaves the server on its old version, serving."""
        t0, before = time.perf_counter(), self._reprefill_s()
        if self.engine.receives_weights:  # vLLM: every worker is a member and loads in place
            version = await self.engine.receive_weights(meta, rendezvous, self._receiver_name,
                                                        self._receive_timeout_s)
        else:
            if self._receiver is None:
                raise RuntimeError("this server has no weight receiver (attach_receiver was not called)")
            if rendezvous:
                await self.join_weights(rendezvous)
            from weight_sync.meta import newer_weights

            newer = newer_weights(meta, self.weights_epoch, self.version)
            loop = asyncio.get_running_loop()
            going: list[concurrent.futures.Future[Any]] = []

            def load(named: list[tuple[str, Any]]) -> concurrent.futures.Future[Any] | None:
                """On the shared-memory lane, from the receive thread: the engine reads the
                verified version straight from the sender's file (no copy of it here); the
                receiver votes once it has read it, while the engine re-prefills."""
                if newer:
                    going.append(asyncio.run_coroutine_threadsafe(self.engine.update_weights(named, meta.version), loop))
                    return going[0]
                going.append(concurrent.futures.Future())
                going[0].set_result(None)
                return None

            try:
                if self.engine.loads_in_place and self._receiver.loads_in_place:
                    version, tensors = await asyncio.to_thread(self._receiver.receive, meta, load)
                else:
                    version, tensors = await asyncio.to_thread(self._receiver.receive, meta)
            finally:
                if going:  # a load under way ends before this returns, the receive's outcome either way
                    await asyncio.wait([asyncio.wrap_future(going[0])])
            if going:
                going[0].result()  # the load's own error (after the vote), if any
            if not newer:
                return self.version  # sent again for a restarted sibling: nothing to load
            if not going:
                await self.engine.update_weights(list(tensors), version)
        if version == meta.version:  # loaded (or served already): the epoch of what is served
            self.weights_epoch = int(meta.epoch)
        logger.info("received and loaded weights version %d in %s", version, self._count_weights(t0, before))
        return version

    async def export_weights(self) -> list[tuple[str, Any]]:
        """The served weights by HF name (copies), for a restarted sibling to start from
        the version the others serve. The embedded engine only."""
        return await self.engine.export_weights()

    # ---- health and metrics ---------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """`status` is "dead" once the engine reported itself dead (`engine_dead`: vLLM's
        engine core crashed or was killed; every call then raises `EngineDeadError`)."""
        dead = bool(self.engine.metrics().get("engine_dead", 0.0))
        return {
            "status": "dead" if dead else "ok",
            "version": self.version,
            "uptime_s": time.time() - self.started_at,
            "http": self._http.url if self._http is not None else None,
        }

    def metrics(self) -> dict[str, float]:
        """Engine counters and gauges (queue_depth, running, kv_usage, interrupts,
        interrupted_tokens, recompute_tokens, pause_resume_latency_s_*, ...) plus
        server counters (http_*, token continuity hits/fallbacks). The vLLM engine adds
        its own scheduler's view as `vllm_kv_cache_usage`, `vllm_num_running`,
        `vllm_num_waiting`, `vllm_preemptions`, `vllm_prefix_cache_queries`,
        `vllm_prefix_cache_hits`, and `engine_dead`."""
        m = dict(self.engine.metrics())
        m.update(self.counters)
        m.update(self.sessions.counters)
        m["version"] = float(self.version)
        return m

    # ---- HTTP -------------------------------------------------------------------------

    async def start_http(
        self, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None, tool_parser: Any = None,
        stop_token_ids: Iterable[int] = (),
    ) -> str:
        """Serve the OpenAI-compatible API; returns the base URL (`http://host:port`).

        `tool_parser` (a `ToolParser`, default hermes) reads `tool_calls` out of chat
        replies; pass the run's (`agent.tool_parser`) so HTTP agents see what in-process
        agents see. `stop_token_ids` (the run's `rollout.stop_token_ids`) end every answer,
        besides the eos ids and a request's own.
        """
        from rollout_cluster.http_api import HttpServer

        if self._http is not None:
            return self._http.url
        # HttpServer refuses a non-loopback host without an api_key.
        http = HttpServer(self, api_key=api_key, tool_parser=tool_parser, stop_token_ids=stop_token_ids)
        url = await http.start(host, port)
        self._http = http  # only once it listens: a refused start raises again next time
        return url

    async def stop_http(self) -> None:
        if self._http is not None:
            await self._http.stop()
            self._http = None

    async def close(self) -> None:
        await self.stop_http()
        await self.engine.close()
