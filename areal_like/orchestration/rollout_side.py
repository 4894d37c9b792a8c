"""The rollout cluster's process: servers, agent runner, data, gate and the controller.

`RolloutSide.run()` builds everything from the config, connects to the trainer at
`transport.data_addr` / `transport.control_addr` (docs/design.md §9.6) and drives the
`RolloutController` until the trainer announces the end. The controller is handed
plain callables (`run_episode`, `score`, `send`, `apply_weights`, `join_weights`,
`counters`) and knows nothing of servers, sockets or transports; this class owns those.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from areal_like.core.config import ConfigError, ExperimentConfig
from areal_like.core.types import RolloutCounters, SamplingParams, VersionAnnouncement, WeightUpdateMeta

__all__ = ["RolloutSide"]

log = logging.getLogger(__name__)


class RolloutSide:
    """Everything the rollout cluster runs, in one process (or one Ray actor)."""

    def __init__(self, cfg: ExperimentConfig, data_addr: str | None = None, control_addr: str | None = None,
                 user: dict[str, Any] | None = None) -> None:
        self.cfg = cfg
        self.user = user or {}
        """Objects given through the Python API instead of the config: `rows`, `eval_rows`,
        `reward_fn`, `tools`, `loops` (docs/design.md §9.10)."""
        self.data_addr = data_addr or cfg.transport.data_addr
        self.control_addr = control_addr or cfg.transport.control_addr
        for name, addr in (("data_addr", self.data_addr), ("control_addr", self.control_addr)):
            if addr.endswith(":0"):
                raise ConfigError(
                    f"transport.{name}={addr}: the rollout side connects, so it needs the trainer's real port "
                    "(port 0 only works when `areal-like run` starts both sides)"
                )
        self.servers: list[Any] = []
        self._rates = _Rates()
        self._weights_lock = asyncio.Lock()
        self._last_weights: tuple[int, list[Any]] | None = None

    def run(self) -> dict[str, Any]:
        return asyncio.run(self.main())

    async def main(self) -> dict[str, Any]:
        import torch

        from areal_like.orchestration.bridge import drive_rollout, make_sender
        from areal_like.orchestration.channels import ControlSubscriber, DataPusher
        from areal_like.orchestration.fail_fast import FailFast
        from areal_like.orchestration.rollout_controller import RolloutController

        cfg = self.cfg
        logging.getLogger().setLevel(cfg.run.log_level)
        torch.set_num_threads(cfg.rollout.server_threads)
        runner = self._build_servers_and_runner()
        self.receiver = self._build_receiver()
        pusher = DataPusher(self.data_addr, cfg.transport.secret, int(cfg.transport.max_frame_mb * 2**20))
        subscriber = ControlSubscriber(self.control_addr, cfg.transport.secret)
        sampling = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                  top_k=cfg.rollout.top_k, max_tokens=cfg.rollout.response_length)
        if sampling.approximate_logprobs:
            log.warning("rollout.top_p/top_k truncate sampling: importance weights are approximate")
        controller = RolloutController(
            gate=self._build_gate(),
            source=self._build_source(runner),
            group_size=cfg.rollout.group_size,
            sampling=sampling,
            run_episode=runner.run_episode,
            score=runner.score,
            send=make_sender(pusher),
            apply_weights=self.apply_weights,
            join_weights=self.join_weights,
            counters=self.counters,
            eval_rows=self._eval_rows(),
            eval_every=cfg.eval.every_n_steps,
            eval_sampling=sampling.model_copy(update={"temperature": cfg.eval.temperature}),
            loaded_version=0,
            seed=cfg.run.seed,
            episode_timeout_s=cfg.agent.episode_timeout_s,
            fail_fast=FailFast.from_config(cfg.agent),
        )
        try:
            await drive_rollout(controller, subscriber, cfg.transport.peer_timeout_s, cfg.transport.peer_dead_s,
                                address=self.control_addr)
        finally:
            await self.manager.close()
            for s in self.servers:
                await _close_quietly(s)
            self.receiver.close()
            pusher.close()
            subscriber.close()
        return {"started": controller.started, "cancelled": controller.cancelled, **controller.outcomes}

    # ---- building ------------------------------------------------------------------------
    def _build_servers_and_runner(self) -> Any:
        from areal_like.models.tiny_model import load_tokenizer
        from areal_like.orchestration.preflight import resolve_model_path
        from rollout_cluster.agent_loop.runner import AgentRunner
        from rollout_cluster.server_manager import ServerManager

        cfg = self.cfg
        model_path = resolve_model_path(cfg)
        self.tokenizer = load_tokenizer(model_path)
        self._model_path = model_path
        self.servers = [self._new_server(i) for i in range(cfg.rollout.num_servers)]
        self.manager = ServerManager(
            {f"server-{i}": s for i, s in enumerate(self.servers)},
            max_sticky_sessions=cfg.rollout.max_sticky_sessions,
            restart=self._restart_server, max_restarts=cfg.rollout.server_restarts,
            restart_backoff_s=cfg.rollout.server_restart_backoff_s,
        )
        overrides = {k: self.user[k] for k in ("reward_fn", "tools", "loops") if self.user.get(k) is not None}
        return AgentRunner.from_config(cfg, server_manager=self.manager, tokenizer=self.tokenizer, **overrides)

    def _new_server(self, i: int) -> Any:
        from rollout_cluster.server import RolloutServer

        cfg = self.cfg
        return RolloutServer(self._model_path, self.tokenizer, engine_config=cfg.rollout.engine,
                             interrupt_mode=cfg.rollout.interrupt_mode, seed=cfg.run.seed + 17 * i, set_threads=False)

    async def _restart_server(self, name: str, error: BaseException) -> Any:
        """The server manager's restart hook: a fresh server in place of a dead one, with
        the weights the others serve loaded before it takes any call."""
        i = int(name.rsplit("-", 1)[1])
        await _close_quietly(self.servers[i])
        server = await asyncio.to_thread(self._new_server, i)
        async with self._weights_lock:
            if self._last_weights is not None:
                version, named = self._last_weights
                await server.update_weights(named, version)
        self.servers[i] = server
        return server

    def _build_source(self, runner: Any) -> Any:
        from areal_like.orchestration.dataset import PromptSource, load_rows

        cfg = self.cfg
        tools = [t.schema for t in runner.tools] if runner.tools else None

        def prompt_len(row: dict[str, Any]) -> int:
            use_tools = tools if (row.get("agent_name") or cfg.agent.default_loop) == "tool_agent" else None
            out = self.tokenizer.apply_chat_template(row["prompt"], tools=use_tools, add_generation_prompt=True,
                                                     tokenize=True)
            return len(out["input_ids"] if not isinstance(out, list) else out)

        rows = self.user.get("rows") or load_rows(cfg.dataset, "train", cfg.run.seed,
                                                  max_eval_rows=cfg.eval.num_samples)
        source = PromptSource(rows, cfg.run.seed, cfg.dataset.shuffle, prompt_len, cfg.rollout.max_prompt_len)
        if source.filtered_too_long:
            log.warning("%d prompts longer than rollout.max_prompt_len=%d were filtered at load",
                        source.filtered_too_long, cfg.rollout.max_prompt_len)
        return source

    def _eval_rows(self) -> list[dict[str, Any]]:
        from areal_like.orchestration.dataset import load_rows

        cfg = self.cfg
        rows = self.user.get("eval_rows")
        if rows is None:  # [] from the API means "no evaluation", never the config's dataset
            rows = load_rows(cfg.dataset, "eval", cfg.run.seed, max_eval_rows=cfg.eval.num_samples)
        return rows[: cfg.eval.num_samples]

    def _build_gate(self) -> Any:
        from areal_like.core.staleness import StalenessGate

        cfg = self.cfg
        return StalenessGate(cfg.samples_per_step, cfg.staleness.max_staleness, cfg.staleness.max_concurrent)

    def _build_receiver(self) -> Any:
        from weight_sync import make_receiver

        return make_receiver(self.cfg.weight_sync, f"rollout-{socket.gethostname()}-{os.getpid()}",
                             default_disk_path=Path(self.cfg.run.dir) / "weight_sync")

    # ---- what the controller calls ---------------------------------------------------------
    async def apply_weights(self, meta: WeightUpdateMeta) -> int:
        """Receive version `meta.version` and load it into every server (each interrupts,
        drops its KV, loads, re-prefills and resumes by itself)."""
        from rollout_cluster.engine.base import EngineDeadError

        async with self._weights_lock:
            version, tensors = await asyncio.to_thread(self.receiver.receive, meta)
            named = list(tensors)  # views into the receive buffer: every server copies them in
            self._last_weights = (version, named)  # for a server restarted later
            live = set(self.manager.server_names)
            for i, s in enumerate(self.servers):
                if f"server-{i}" not in live:
                    continue  # dead or restarting: a restart loads the latest weights itself
                try:
                    await s.update_weights(named, version)
                except EngineDeadError as e:  # one dead engine must not keep the others on old weights
                    self.manager.mark_failed(f"server-{i}", e)
        return version

    async def join_weights(self, ann: VersionAnnouncement) -> None:
        if ann.weight_store:
            await asyncio.to_thread(self.receiver.join, ann.weight_store)

    def counters(self) -> RolloutCounters:
        per = [s.metrics() for s in self.servers]

        def total(key: str) -> float:
            return float(sum(m.get(key, 0.0) for m in per))

        manager = self.manager.metrics()
        busy = any(m.get("running", 0.0) > 0 or m.get("queue_depth", 0.0) > 0 for m in per)
        generated = total("generated_tokens")
        return RolloutCounters(
            generated_tokens=generated,
            interrupts=total("interrupts"),
            interrupted_tokens=total("interrupted_tokens"),
            recompute_tokens=total("recompute_tokens"),
            pause_resume_latency_s_max=max((m.get("pause_resume_latency_s_max", 0.0) for m in per), default=0.0),
            queue_depth=total("queue_depth"),
            requests_running=total("running"),
            kv_usage=total("kv_usage"),
            gen_tokens_per_s=self._rates.rate("gen", generated),
            rollout_idle_ratio=self._rates.idle(not busy),
            servers=manager["servers"],
            server_failures=manager["server_failures"],
            generate_retries=manager["generate_retries"],
            server_restarts=manager.get("server_restarts", 0.0),
            engine={k: total(k) / (len(per) if k.endswith("usage") else 1)  # a usage is a mean, counts add
                    for k in sorted({k for m in per for k in m if k.startswith("vllm_")})},
        )


async def _close_quietly(server: Any) -> None:
    """Close a server whose engine may be dead already: shutting a dead engine down can
    raise, and must not hide why the run is stopping."""
    try:
        await server.close()
    except Exception as e:
        log.warning("closing a rollout server failed: %s: %s", type(e).__name__, e)


class _Rates:
    """Token rates and idle ratios from cumulative counters, sampled by the stats loop."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, float]] = {}
        self._idle_t = 0.0
        self._all_t = 0.0
        self._t = time.time()

    def rate(self, key: str, value: float) -> float:
        now = time.time()
        t0, v0 = self._last.get(key, (now, value))
        self._last[key] = (now, value)
        return (value - v0) / (now - t0) if now > t0 else 0.0

    def idle(self, idle_now: bool) -> float:
        now = time.time()
        dt, self._t = now - self._t, now
        self._all_t += dt
        self._idle_t += dt if idle_now else 0.0
        return self._idle_t / self._all_t if self._all_t > 0 else 0.0
