"""`areal-like serve`: a config's rollout servers behind the OpenAI-compatible API, alone.

For agent-SDK development and evaluation (docs/design.md §10.14): the same engine,
model and tool parser a run uses (`rollout.*`, `model.path` resolved as `run`
resolves it, `agent.tool_parser`), with no trainer, no Ray and no run folder: one
plain process, one asyncio loop, each server's engine on its own thread.

Several servers (`rollout.num_servers > 1`) get one port each (`--port N` gives N,
N+1, ...; port 0 lets the OS pick each), every one a complete API with its own
session memory: a client balances over the printed URLs itself. One front port
would hide that, but it would also hide which server holds a session's prefix cache.

Ctrl-C or SIGTERM stops it: listeners close, engines shut down, the process exits 0.
A second signal during that teardown exits at once (130).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from areal_like.core.config import ExperimentConfig

__all__ = ["Serving", "build_servers", "serve", "serve_main", "start_serving"]

log = logging.getLogger(__name__)

TEARDOWN_TIMEOUT_S = 30.0
"""Closing listeners and engines gets this long; then the process exits anyway."""


@dataclass(frozen=True)
class Serving:
    """What is being served: one base URL per server (`http://host:port`) and the model name."""

    urls: list[str]
    model: str

    @property
    def api_urls(self) -> list[str]:
        """The URLs an OpenAI SDK takes as `base_url`."""
        return [f"{u}/v1" for u in self.urls]


def build_servers(cfg: ExperimentConfig) -> list[Any]:
    """`rollout.num_servers` rollout servers, built exactly as the rollout side builds them."""
    import torch

    from areal_like.models.tiny_model import load_tokenizer
    from areal_like.orchestration.preflight import resolve_model_path
    from rollout_cluster.server import RolloutServer

    torch.set_num_threads(cfg.rollout.server_threads)
    model_path = resolve_model_path(cfg)
    tokenizer = load_tokenizer(model_path)
    servers = [
        RolloutServer(
            model_path,
            tokenizer,
            engine_config=cfg.rollout.engine,
            interrupt_mode=cfg.rollout.interrupt_mode,
            seed=cfg.run.seed + 17 * i,
            set_threads=False,
            dtype=cfg.model.dtype,
        )
        for i in range(cfg.rollout.num_servers)
    ]
    lora = cfg.model.lora
    if lora.enabled and lora.init_from:  # a run's adapter on its base model (docs/lora.md)
        from areal_like.models.lora import adapter_wire

        wire = adapter_wire(lora.init_from)
        for s in servers:
            s.engine.engine.load_weights(iter(wire), 0)
    return servers


async def start_serving(
    servers: Sequence[Any],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    tool_parser: Any = None,
    stop_token_ids: Sequence[int] = (),
) -> Serving:
    """Start each server's HTTP API (port, port+1, ...; all OS-picked for port 0); every
    answer also stops at `stop_token_ids` (the config's `rollout.stop_token_ids`).

    A host beyond loopback without `api_key` is refused (`PermissionError`) by the
    HTTP server itself; if any server fails to bind, the ones already listening stop.
    """
    urls: list[str] = []
    try:
        for i, server in enumerate(servers):
            urls.append(
                await server.start_http(
                    host, port + i if port else 0, api_key=api_key, tool_parser=tool_parser,
                    stop_token_ids=stop_token_ids,
                )
            )
    except BaseException:
        for server in servers:
            await server.stop_http()
        raise
    return Serving(urls, servers[0].model_name)


async def _close(servers: Sequence[Any]) -> None:
    for server in servers:
        await server.stop_http()
    await asyncio.gather(*(server.close() for server in servers), return_exceptions=True)


async def serve_main(
    cfg: ExperimentConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    on_ready: Callable[[Serving], None] | None = None,
    stop: asyncio.Event | None = None,
    servers: Sequence[Any] | None = None,
) -> Serving:
    """Serve until `stop` is set or SIGINT/SIGTERM arrives; returns what was served.

    `servers` replaces the config's (tests pass servers over fake engines); the tool
    parser and the extra stop ids are always the config's (`agent.tool_parser`,
    `rollout.stop_token_ids`: answers stop where a rollout's do).
    """
    from rollout_cluster.http_api import is_loopback_host
    from rollout_cluster.tool_parser import get_tool_parser

    if not is_loopback_host(host) and not api_key:  # before loading a model, not after
        raise PermissionError(
            f"refusing to serve on {host!r} without an api key (--api-key or AREAL_LIKE_API_KEY); "
            "only 127.0.0.1 / localhost / ::1 may go without one"
        )
    if servers is None:  # the model folder fits the engine: one line, before anything loads
        from areal_like.orchestration.paths import check_model

        check_model(cfg)
    logging.getLogger().setLevel(cfg.run.log_level)
    parser = get_tool_parser(cfg.agent.tool_parser)
    stop = stop or asyncio.Event()
    servers = list(servers) if servers is not None else build_servers(cfg)
    loop = asyncio.get_running_loop()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            log.warning("second %s during shutdown: exiting now", sig.name)
            os._exit(130)
        log.info("%s: stopping the API and the engines", sig.name)
        stop.set()

    try:
        serving = await start_serving(servers, host=host, port=port, api_key=api_key, tool_parser=parser,
                                      stop_token_ids=cfg.rollout.stop_token_ids)
        for sig in previous:
            loop.add_signal_handler(sig, on_signal, sig)
        if on_ready is not None:
            on_ready(serving)
        await stop.wait()
        return serving
    finally:
        try:
            await asyncio.wait_for(_close(servers), TEARDOWN_TIMEOUT_S)
        except TimeoutError:
            log.warning("closing the servers took more than %.0fs; exiting anyway", TEARDOWN_TIMEOUT_S)
        for sig, handler in previous.items():
            loop.remove_signal_handler(sig)
            signal.signal(sig, handler)


def serve(
    cfg: ExperimentConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    on_ready: Callable[[Serving], None] | None = None,
) -> Serving:
    """`serve_main` in a fresh event loop (the `areal-like serve` command)."""
    return asyncio.run(serve_main(cfg, host=host, port=port, api_key=api_key, on_ready=on_ready))
