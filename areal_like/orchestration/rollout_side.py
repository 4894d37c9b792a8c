"""The rollout cluster's process: servers, agent runner, data, gate, the controller, and
its link to the trainer.

`RolloutSide.run()` starts one actor per inference server (`server_pool`), builds
the agent runner, data and gate, connects to the trainer at
`transport.data_addr` / `transport.control_addr` (docs/design.md §9.6) and drives the
`RolloutController` until the trainer announces the end. The controller is handed
plain callables (`run_episode`, `score`, `send`, `apply_weights`, `join_weights`,
`counters`) and knows nothing of servers, sockets or transports; this class owns those.
Weights never pass through here: each server receives them from the trainer itself
(`server_pool.ServerWeights` loads them and handles the servers that fail a version).

`drive_rollout` runs the controller beside `TrainerLink.listen`, a task on the same event
loop: it awaits the asyncio-native control subscriber (`zmq.asyncio`, no thread), hands
each announcement to the controller, passes the acknowledgements it carries to the data
pusher (which then resends what a reconnect may have lost) and judges the trainer's
silence. Sends go through `asyncio.to_thread` (`make_sender`) so a slow trainer
back-pressures one group, never the event loop. docs/design.md §10.22 draws the cycle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from areal_like.core.config import ConfigError, ExperimentConfig
from areal_like.core.types import (
    RolloutCounters,
    RolloutSeconds,
    SamplingParams,
    ServerPoolCounters,
    VersionAnnouncement,
)

if TYPE_CHECKING:
    from areal_like.orchestration.channels import ControlSubscriber, DataPusher
    from areal_like.orchestration.rollout_controller import RolloutController

__all__ = ["RolloutSide", "TrainerLink", "TrainerLostError", "drive_rollout", "make_sender"]

log = logging.getLogger(__name__)


class RolloutSide:
    """The rollout cluster: this controller (gate, data, agent loops, server manager) in
    one process or actor, and one actor per inference server (docs/design.md §10.2),
    placed in the rollout pool's placement group (given, or made here when the rollout
    side runs alone). `launcher` starts the servers (`areal_like.launcher`); without one
    (`areal-like rollout`), the one `cluster.launcher` picks, as for `run`: plain processes
    on this machine, or Ray (embedded, or the cluster at `cluster.ray_address`)."""

    def __init__(self, cfg: ExperimentConfig, data_addr: str | None = None, control_addr: str | None = None,
                 user: dict[str, Any] | None = None, placement_group: Any = None, launcher: Any = None) -> None:
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
        self._rows: dict[str, list[dict[str, Any]]] = {}  # "train", "eval": read while the servers start
        self._rates = _Rates()

    def run(self) -> dict[str, Any]:
        self.launcher.up()  # running alone (`areal-like rollout`): Ray starts, or joins its cluster, here
        try:
            return asyncio.run(self.main())
        finally:
            self.launcher.shutdown()

    async def main(self) -> dict[str, Any]:
        from areal_like.orchestration.channels import ControlSubscriber, DataPusher
        from areal_like.orchestration.fail_fast import FailFast
        from areal_like.orchestration.rollout_controller import RolloutController

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
                apply_weights=self.weights.apply,
                join_weights=self.join_weights,
                hold_servers=self.pool.hold,
                counters=self.counters,
                eval_rows=self._eval_rows(),
                eval_every=cfg.eval.every_n_steps,
                eval_timeout_s=cfg.eval.final_timeout_s,
                eval_sampling=sampling.model_copy(update={"temperature": cfg.eval.temperature}),
                loaded_version=0,
                seed=cfg.run.seed,
                episode_timeout_s=cfg.agent.episode_timeout_s,
                fail_fast=FailFast.from_config(cfg.agent),
            )
            closing = asyncio.create_task(self._no_restarts_once(controller), name="no-restarts-at-stop")
            try:
                await drive_rollout(controller, subscriber, cfg.transport.peer_timeout_s, cfg.transport.peer_dead_s,
                                    address=self.control_addr, pusher=pusher,
                                    flush_s=3 * cfg.transport.heartbeat_s + 1.0, started_at=self.started_at)
            finally:
                closing.cancel()
        finally:
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
        down) is not restarted."""
        await controller.stopping()
        if self.manager is not None:
            self.manager.begin_close()

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
            on_server_failure=lambda name, _e: self.pool.mark_dead(name),
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
                              skip_solved_after=cfg.dataset.skip_solved_after, solved_reward=cfg.dataset.solved_reward)
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
        return StalenessGate(cfg.samples_per_step, cfg.staleness.max_staleness, cfg.staleness.max_concurrent)

    # ---- what the controller calls ---------------------------------------------------------
    async def join_weights(self, ann: VersionAnnouncement) -> None:
        if ann.weight_store:
            await self.pool.join(ann.weight_store)

    def counters(self) -> RolloutCounters:
        per = [self.pool.metrics.get(n, {}) for n in self.pool.names]

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
                                    servers_waiting_for_weights=float(len(self.pool.waiting))),
            engine={k: total(k) / (len(per) if k.endswith("usage") else 1)  # a usage is a mean, counts add
                    for k in sorted({k for m in per for k in m if k.startswith("vllm_")})},
            per_server=self.pool.per_server(),
        )


# ---- the link to the trainer ---------------------------------------------------------------
def make_sender(pusher: DataPusher, timeout_s: float = 120.0) -> Any:
    async def send(msg: BaseModel) -> None:
        await asyncio.to_thread(pusher.send, msg, timeout_s)

    return send


class TrainerLostError(RuntimeError):
    """The trainer went silent past `transport.peer_timeout_s`."""


class TrainerLink:
    """The control channel's listener (a task on the controller's loop): announcements
    into `controller.announcements`, their acknowledgements to `pusher`, and the verdict
    on the trainer's silence (`lost`, the reason it gave up, once it has)."""

    def __init__(self, controller: RolloutController, subscriber: ControlSubscriber, *,
                 peer_timeout_s: float | None, peer_dead_s: float | None, address: str,
                 pusher: DataPusher | None, started_at: float | None) -> None:
        self.controller = controller
        self.subscriber = subscriber
        self.peer_timeout_s = peer_timeout_s
        self.peer_dead_s = peer_dead_s
        self.address = address
        self.pusher = pusher
        self.started = time.monotonic() if started_at is None else started_at  # (a time.monotonic() value)
        self.lost: str | None = None

    async def listen(self) -> str | None:
        """Until the trainer is lost (returns why) or the task is cancelled."""
        ctl, pusher = self.controller, self.pusher
        last: float | None = None
        gone = False
        next_note = self.started + 10.0
        while True:
            msg = await self.subscriber.recv(0.2)
            now = time.monotonic()
            if pusher is not None:
                if isinstance(msg, VersionAnnouncement) and msg.trainer.run_id == ctl.follow.run_id:
                    pusher.ack(msg.trainer.epoch, msg.acked.get(ctl.follow.sender, []))
                pusher.maintain()
            if isinstance(msg, VersionAnnouncement):
                if gone:
                    log.warning("the trainer is back after %.0fs of silence", now - (last or now))
                    gone = False
                last = now
                ctl.announcements.put_nowait(msg)
                continue
            if msg is not None:
                log.warning("unexpected message on the control channel: %s", type(msg).__name__)
                continue
            if last is None:
                if now >= next_note:
                    next_note = now + 10.0
                    log.warning("no trainer has answered at %s for %.0fs (is `areal-like train` running there?); "
                                "waiting up to transport.peer_timeout_s", self.address, now - self.started)
                if self.peer_timeout_s is not None and now - self.started > self.peer_timeout_s:
                    self.lost = (f"no trainer answered at {self.address} within {now - self.started:.0f}s "
                                 "(transport.peer_timeout_s): check transport.control_addr and that the trainer runs")
                    return self.lost
                continue
            silent = now - last
            if self.peer_dead_s is not None and not gone and silent > self.peer_dead_s:
                gone = True
                log.error("the trainer has been silent for %.0fs (transport.peer_dead_s): declared gone; "
                          "waiting up to transport.peer_timeout_s for it to come back", silent)
            if self.peer_timeout_s is not None and silent > self.peer_timeout_s:
                log.error("no announcement from the trainer for %.0fs (transport.peer_timeout_s): stopping", silent)
                self.lost = _lost_message(silent)
                return self.lost


async def drive_rollout(controller: RolloutController, subscriber: ControlSubscriber,
                        peer_timeout_s: float | None = None, peer_dead_s: float | None = None,
                        address: str = "the control address", pusher: DataPusher | None = None,
                        flush_s: float = 7.0, started_at: float | None = None) -> None:
    """Run the controller until the trainer says goodbye (or the task is cancelled).

    The trainer heartbeats every couple of seconds. Silence longer than `peer_dead_s`
    is logged at once (the trainer is declared gone); the controller keeps its state
    and goes on if the trainer comes back (a restarted trainer re-bases it through a
    newer epoch). Silence longer than `peer_timeout_s` — or no trainer ever heard at
    `address` for that long, counted from `started_at` (a `time.monotonic()` value; the
    rollout side's start, default now) — stops the controller and raises `TrainerLostError`.

    With the data channel's `pusher`, the announcements' acknowledgements release its
    frames, it resends what a reconnect may have lost, and a normal stop waits up to
    `flush_s` for the last frames (the final report) to be acknowledged.

    Giving up stops the controller; one that has not begun its schedule yet (still
    waiting for its first announcement, or for the weights that one named: a queue `get`
    that `stop()` does not wake) is cancelled instead, as it has nothing to wind down.
    """
    gave_up = False
    run_task: asyncio.Future[None] = asyncio.ensure_future(controller.run())
    link = TrainerLink(controller, subscriber, peer_timeout_s=peer_timeout_s, peer_dead_s=peer_dead_s,
                       address=address, pusher=pusher, started_at=started_at)

    def give_up(task: asyncio.Task[str | None]) -> None:
        nonlocal gave_up
        if task.cancelled() or task.exception() is not None or task.result() is None:
            if not task.cancelled() and task.exception() is not None:  # a bug in the listener: stop, say why
                log.error("the control channel's listener failed: %r", task.exception())
                controller.stop()
            return
        controller.stop()
        if not run_task.done() and not _schedule_running():
            gave_up = True
            run_task.cancel()

    listener = asyncio.create_task(link.listen(), name="control-sub")
    listener.add_done_callback(give_up)
    try:
        try:
            await run_task
        except asyncio.CancelledError:
            if gave_up and link.lost:  # we cancelled it (not a Ctrl-C): the trainer is lost
                raise TrainerLostError(link.lost) from None
            raise
        if pusher is not None and not link.lost:
            left = await asyncio.to_thread(pusher.flush, flush_s)
            if left:
                log.warning("%d data frames were not acknowledged by the trainer within %.0fs of stopping", left, flush_s)
    except TrainerLostError:
        raise
    except Exception as e:
        if link.lost:
            raise TrainerLostError(link.lost) from e
        raise
    finally:
        if not run_task.done():  # drive_rollout itself was cancelled before the controller began
            run_task.cancel()
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
    if link.lost:
        raise TrainerLostError(link.lost)
    if not listener.cancelled() and listener.exception() is not None:
        raise listener.exception()  # type: ignore[misc]


def _schedule_running() -> bool:
    """Whether the controller has begun its schedule: its control task exists once the
    first announcement (and the weights it names) are through (`RolloutController.run`)."""
    return any(t.get_name() == "rollout-control" and not t.done() for t in asyncio.all_tasks())


def _lost_message(silent_s: float) -> str:
    return (f"the trainer has announced nothing for {silent_s:.0f}s (transport.peer_timeout_s); it is gone or "
            "stuck, so the rollout side stopped. Restart both sides with --resume.")


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
