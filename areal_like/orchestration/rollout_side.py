"""The rollout cluster's process: servers, agent runner, data, gate, and the controller.

`RolloutSide.run()` starts one actor per inference server (`server_pool`), builds
the agent runner, data and gate, connects to the trainer at
`transport.data_addr` / `transport.control_addr` (docs/design.md §9.6) and drives the
`RolloutController` (with its link to the trainer, `rollout_controller.drive_rollout`)
until the trainer announces the end. The controller is handed plain callables
(`run_episode`, `score`, `send`, `apply_weights`, `join_weights`, `counters`) and knows
nothing of servers, sockets or transports; this class owns those. Weights never pass
through here: each server receives them from the trainer itself
(`server_pool.ServerWeights` loads them and handles the servers that fail a version).

It is also the rollout side's actor under `areal-like run` (`launch.run_both` spawns
it with the config as JSON and the launcher's address): one class for the role, in
a process of its own or in the CLI's. docs/design.md §10.22 draws the cycle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from areal_like.core.config import ConfigError, ExperimentConfig
from areal_like.core.types import (
    RolloutCounters,
    RolloutSeconds,
    SamplingParams,
    ServerPoolCounters,
    VersionAnnouncement,
)

__all__ = ["RolloutSide"]

log = logging.getLogger(__name__)


class RolloutSide:
    """The rollout cluster: this controller (gate, data, agent loops, server manager) in
    one process or actor, and one actor per inference server (docs/design.md §10.2),
    placed in the rollout pool's placement group (given, or made here when the rollout
    side runs alone). `launcher` starts the servers (`areal_like.launcher`); without one
    (`areal-like rollout`), the one `cluster.launcher` picks, as for `run`: plain processes
    on this machine, or Ray (embedded, or the cluster at `cluster.ray_address`).

    As `areal-like run`'s rollout actor (docs/design.md §10.2) it is spawned with the
    config as JSON (`cfg` a dict: this process's logging goes to the run's log first) and
    `launcher` the address of the driver's launcher (`areal_like.launcher.connect`): the
    server actors it starts are owned by it and go with it."""

    def __init__(self, cfg: ExperimentConfig | dict[str, Any], data_addr: str | None = None,
                 control_addr: str | None = None, user: dict[str, Any] | None = None, placement_group: Any = None,
                 launcher: Any = None) -> None:
        if isinstance(cfg, dict):  # an actor of `run_both`
            from areal_like.core.logs import process_logging, run_log_path

            run = cfg["run"]
            process_logging("rollout", run["log_level"], run_log_path(run["dir"]), console=run.get("verbose", False))
            cfg = ExperimentConfig.model_validate(cfg)
        if isinstance(launcher, str):
            from areal_like.launcher import connect

            launcher = connect(launcher)
        self.cfg = cfg
        self.started_at = time.monotonic()
        """`transport.peer_timeout_s` without a trainer counts from here, not from when the
        servers are up (they take most of a minute to start under Ray)."""
        if launcher is None:
            from areal_like.launcher import open_launcher

            launcher = open_launcher(cfg, num_cpus=cfg.cluster.rollout_pool.num_cpus)
        self.launcher = launcher
        """Who starts the servers (`areal_like.launcher`); `run` brings it up and shuts down
        what it started (nothing, for a launcher an actor connected to)."""
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
        self.placement_group = placement_group
        self.pool: Any = None
        self.manager: Any = None  # a `ServerManager` once the servers are built
        self.runner: Any = None  # the `AgentRunner` over them
        self.weights: Any = None  # a `ServerWeights` once the servers are built
        self.sizer: Any = None  # a `PoolSizer` (the elastic pool, docs/design.md §10.24) over them
        self._rows: dict[str, list[dict[str, Any]]] = {}  # "train", "eval": read while the servers start
        self._rates = _Rates()

    def run(self) -> dict[str, Any]:
        """The rollout side in this process (`areal-like rollout`): its launcher comes up
        (Ray starts, or joins its cluster), then `main` on a new event loop."""
        self.launcher.up()
        try:
            return asyncio.run(self.main())
        finally:
            self.launcher.shutdown()

    async def serve(self) -> dict[str, Any]:
        """The rollout side as `run_both`'s actor: `main` on the actor's own event loop (an
        actor with coroutine methods runs every call on it, under Ray and locally alike),
        through the launcher it connected to (nothing to bring up or shut down here). An
        error `--resume` cannot fix (the configuration, the model, user code) leaves as a
        `RolloutFailedError`, which ends the run without the resume line."""
        from areal_like.orchestration.fail_fast import beyond_resume

        try:
            return await self.main(in_run=True)
        except Exception as e:
            final = beyond_resume(e)
            if final is not None:
                raise final from None
            raise

    async def main(self, in_run: bool = False) -> dict[str, Any]:
        from areal_like.orchestration.channels import ControlSubscriber, DataPusher
        from areal_like.orchestration.elastic import PoolSizer
        from areal_like.orchestration.fail_fast import FailFast
        from areal_like.orchestration.rollout_controller import RolloutController, drive_rollout, make_sender

        cfg = self.cfg
        logging.getLogger().setLevel(cfg.run.log_level)
        own_pg = None
        if self.placement_group is None:  # running alone: its own pool (a launcher that places nothing: None)
            from areal_like.orchestration.pools import rollout_bundles

            self.placement_group = own_pg = await asyncio.to_thread(
                self.launcher.place, "rollout_pool", rollout_bundles(cfg), cfg.cluster.rollout_pool.strategy)
        pusher = subscriber = None
        try:
            runner = self.runner = await self._build_servers_and_runner()
            t = cfg.transport
            pusher = DataPusher(self.data_addr, t.secret, int(t.max_frame_mb * 2**20), heartbeat_s=t.heartbeat_s,
                                dead_s=t.peer_dead_s, resend_after_s=t.resend_after_s, max_resends=t.max_resends)
            subscriber = ControlSubscriber(self.control_addr, cfg.transport.secret)
            sampling = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                      top_k=cfg.rollout.top_k, max_tokens=cfg.rollout.response_length,
                                      stop_token_ids=list(cfg.rollout.stop_token_ids))
            if sampling.approximate_logprobs:
                log.warning("rollout.top_p/top_k truncate sampling: importance weights are approximate")
            gate = self._build_gate()
            self.sizer = PoolSizer(cfg, self.pool, self.weights, self.manager, gate,
                                   request_capacity=self.launcher.request_capacity)
            controller = RolloutController(
                gate=gate,
                source=self._build_source(runner),
                group_size=cfg.rollout.group_size,
                sampling=sampling,
                run_episode=runner.run_episode,
                score=runner.score,
                send=make_sender(pusher),
                apply_weights=self.weights.apply,
                join_weights=self.join_weights,
                hold_servers=self.pool.hold,
                resize_pool=self.sizer.request,
                counters=self.counters,
                eval_rows=self._eval_rows(),
                eval_every=cfg.eval.every_n_steps,
                eval_timeout_s=cfg.eval.final_timeout_s,
                eval_sampling=sampling.model_copy(update={"temperature": cfg.eval.temperature}),
                loaded_version=0,
                seed=cfg.run.seed,
                episode_timeout_s=cfg.agent.episode_timeout_s,
                fail_fast=FailFast.from_config(cfg.agent),
                grow_groups_to=cfg.group_growth,
                first_eval_after=cfg.train.batch_size,
                uniform_filtered=cfg.staleness.filter_uniform_groups,
            )
            # a death that leaves no server (found by a weight update or the metrics poll) stops
            # the run within a second (the controller's loop looks each second), not at an
            # episode that may never start
            self.manager.on_none_left = controller.fail_fast.no_server_left
            closing = asyncio.create_task(self._no_restarts_once(controller), name="no-restarts-at-stop")
            try:
                await drive_rollout(controller, subscriber, cfg.transport.peer_timeout_s, cfg.transport.peer_dead_s,
                                    address=self.control_addr, pusher=pusher,
                                    flush_s=3 * cfg.transport.heartbeat_s + 1.0, started_at=self.started_at,
                                    in_run=in_run)
            finally:
                closing.cancel()
        finally:
            if self.sizer is not None:
                await self.sizer.stop()
            if self.manager is not None:
                await self.manager.close()
            if self.pool is not None:
                await self.pool.close()
            for ch in (pusher, subscriber):
                if ch is not None:
                    ch.close()
            self.launcher.remove(own_pg)
        book = controller.book
        return {"started": book.started, "cancelled": book.cancelled, **book.outcomes,
                "servers": {n: s.model_dump() for n, s in self.pool.per_server().items()}}

    async def _no_restarts_once(self, controller: Any) -> None:
        """From the trainer's goodbye on, a server that fails (the run's end tearing things
        down) is not restarted, and the pool is not resized."""
        await controller.stopping()
        if self.manager is not None:
            self.manager.begin_close()
        if self.sizer is not None:
            await self.sizer.stop()

    # ---- building ------------------------------------------------------------------------
    async def _build_servers_and_runner(self) -> Any:
        from areal_like.orchestration.preflight import resolve_model_path
        from areal_like.orchestration.server_pool import ServerPool, ServerWeights
        from rollout_cluster.agent_loop.runner import AgentRunner
        from rollout_cluster.server_manager import ServerManager

        cfg = self.cfg
        model_path = resolve_model_path(cfg)
        self.pool = ServerPool(cfg, model_path, self.placement_group, launcher=self.launcher)
        # The servers build their engines in processes of their own: the tokenizer and the
        # rows load here meanwhile (a third of a second of the quickstart's start-up).
        data = asyncio.ensure_future(asyncio.to_thread(self._load_data, model_path))
        try:
            servers = await self.pool.start()
        except BaseException:
            await asyncio.gather(data, return_exceptions=True)  # no thread of ours outlives the failed start
            raise
        self.tokenizer, self._rows = await data
        self.weights = ServerWeights(self.pool)
        self.manager = self.weights.manager = ServerManager(
            servers,
            max_sticky_sessions=cfg.rollout.max_sticky_sessions,
            restart=self.weights.restart, max_restarts=cfg.rollout.server_restarts,
            restart_backoff_s=cfg.rollout.server_restart_backoff_s,
            on_server_failure=lambda name, _e: self.pool.mark_dead(name), explain=self.pool.explain,
        )
        self.pool.on_death = self.manager.mark_failed  # found dead by the metrics poll
        overrides = {k: self.user[k] for k in ("reward_fn", "tools", "loops") if self.user.get(k) is not None}
        return AgentRunner.from_config(cfg, server_manager=self.manager, tokenizer=self.tokenizer, **overrides)

    def _build_source(self, runner: Any) -> Any:
        from areal_like.orchestration.dataset import PromptSource

        cfg = self.cfg
        tools = [t.schema for t in runner.tools] if runner.tools else None

        def prompt_len(row: dict[str, Any]) -> int:
            use_tools = tools if (row.get("agent_name") or cfg.agent.default_loop) == "tool_agent" else None
            out = self.tokenizer.apply_chat_template(row["prompt"], tools=use_tools, add_generation_prompt=True,
                                                     tokenize=True)
            return len(out["input_ids"] if not isinstance(out, list) else out)

        rows = self._rows["train"]
        source = PromptSource(rows, cfg.run.seed, cfg.dataset.shuffle, prompt_len, cfg.rollout.max_prompt_len,
                              uniform_after=cfg.dataset.uniform_after, floor=cfg.dataset.difficulty_floor)
        if source.filtered_too_long:
            log.warning("%d prompts longer than rollout.max_prompt_len=%d were filtered at load",
                        source.filtered_too_long, cfg.rollout.max_prompt_len)
        return source

    def _load_data(self, model_path: Any) -> tuple[Any, dict[str, list[dict[str, Any]]]]:
        """The tokenizer and the train and eval rows (the API's, else the config's dataset)."""
        from areal_like.models.tiny_model import load_tokenizer
        from areal_like.orchestration.dataset import load_rows

        cfg = self.cfg
        tokenizer = load_tokenizer(model_path)
        train = self.user.get("rows") or load_rows(cfg.dataset, "train", cfg.run.seed,
                                                   max_eval_rows=cfg.eval.num_samples)
        rows = self.user.get("eval_rows")
        if rows is None:  # [] from the API means "no evaluation", never the config's dataset
            rows = load_rows(cfg.dataset, "eval", cfg.run.seed, max_eval_rows=cfg.eval.num_samples)
        return tokenizer, {"train": train, "eval": rows[: cfg.eval.num_samples]}

    def _eval_rows(self) -> list[dict[str, Any]]:
        return self._rows["eval"]

    def _build_gate(self) -> Any:
        from areal_like.core.staleness import StalenessGate

        cfg = self.cfg
        return StalenessGate(cfg.samples_per_step, cfg.staleness.max_staleness, cfg.staleness.max_concurrent,
                             adaptive_lead=cfg.staleness.lead == "adaptive")

    # ---- what the controller calls ---------------------------------------------------------
    async def join_weights(self, ann: VersionAnnouncement) -> None:
        if ann.weight_store:
            await self.pool.join(ann.weight_store)

    def counters(self) -> RolloutCounters:
        live = [self.pool.metrics.get(n, {}) for n in self.pool.names]
        per = live + [self.pool.retired]  # the counters of servers drained out of the pool still count

        def total(key: str) -> float:
            return float(sum(m.get(key, 0.0) for m in per))

        manager = self.manager.metrics()
        busy = any(m.get("running", 0.0) > 0 or m.get("queue_depth", 0.0) > 0 for m in per)
        generated = total("generated_tokens")
        cpu = time.process_time() + total("process_cpu_s")
        episodes = self.runner.seconds if self.runner is not None else {}
        return RolloutCounters(
            seconds=RolloutSeconds(generate=total("engine_step_seconds_total"),
                                   engine_idle=total("engine_idle_seconds_total"),
                                   weights=total("weight_update_seconds_total"),
                                   reprefill=total("weight_reprefill_seconds_total"),
                                   agent_loop=episodes.get("agent_loop", 0.0), tools=episodes.get("tools", 0.0),
                                   reward=episodes.get("reward", 0.0)),
            rollout_cpu_s=cpu,
            rollout_borrowed_thread_s=total("borrowed_thread_s"),
            rollout_held_s=total("held_seconds_total"),
            rollout_cores_used=max(0.0, self._rates.rate("cpu", cpu, window_s=2.0)),
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
            pool=ServerPoolCounters(servers=manager["servers"], server_failures=manager["server_failures"],
                                    generate_retries=manager["generate_retries"],
                                    server_restarts=manager.get("server_restarts", 0.0),
                                    servers_waiting_for_weights=float(len(self.pool.waiting)),
                                    **(self.sizer.counters() if self.sizer is not None else {})),
            engine={k: total(k) / ((len(live) or 1) if k.endswith("usage") else 1)  # a usage is a mean, counts add
                    for k in sorted({k for m in per for k in m if k.startswith("vllm_")})},
            per_server=self.pool.per_server(),
        )


class _Rates:
    """Token rates and idle ratios from cumulative counters, sampled by the stats loop."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, float]] = {}
        self._rate: dict[str, float] = {}
        self._idle_t = 0.0
        self._all_t = 0.0
        self._t = time.time()

    def rate(self, key: str, value: float, window_s: float = 0.0) -> float:
        """Change per second since the previous call; with `window_s`, since the first call
        at least that long ago (the last rate is repeated meanwhile), so reports that come
        close together do not make it noise."""
        now = time.time()
        t0, v0 = self._last.get(key, (now, value))
        if window_s and now - t0 < window_s and key in self._rate:
            return self._rate[key]
        self._last[key] = (now, value)
        self._rate[key] = (value - v0) / (now - t0) if now > t0 else 0.0
        return self._rate[key]

    def idle(self, idle_now: bool) -> float:
        now = time.time()
        dt, self._t = now - self._t, now
        self._all_t += dt
        self._idle_t += dt if idle_now else 0.0
        return self._idle_t / self._all_t if self._all_t > 0 else 0.0
