"""One inference server as its own actor (docs/design.md §10.2; a Ray actor or a plain
process, whichever launcher started it: `areal_like.launcher`).

`ServerActor` is the body of the actor: a `RolloutServer` (embedded engine or vLLM)
with its own device — the CPU threads of its placement-group bundle, or the GPUs Ray
gave it — and its own end of the weight transport, so versions go from the trainer's
rank 0 straight into this process (or, for vLLM, into its workers), never through the
rollout controller. The controller holds only the handle: it routes generate calls
(`ActorServer` in `server_manager`), tells the server to join the weight group and to
receive a version, and polls its metrics.

Async actor: generate calls run concurrently on the actor's event loop; the engine
itself is built in `start()`, on that loop, because the engine's asyncio face binds to
the loop that runs it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from areal_like.core.types import GenerateResult, SamplingParams

__all__ = ["ServerActor", "ServerStartError"]

log = logging.getLogger(__name__)


class ServerStartError(RuntimeError):
    """A server could not start: the message names the server and its device first."""


class ServerActor:
    """Body of one server actor; start it with a launcher's `spawn(ServerActor, ...)`."""

    def __init__(self, name: str, model_path: str, engine_config: dict[str, Any], *, interrupt_mode: str,
                 seed: int, threads: int, weight_sync: dict[str, Any], default_disk_path: str,
                 log_level: str = "INFO", log_file: str | None = None, console: bool = True,
                 lend: dict[str, Any] | None = None, dtype: str = "float32") -> None:
        from areal_like.core.logs import process_logging

        process_logging(name, log_level, log_file, console)
        self.name = name
        self._args = (model_path, engine_config, interrupt_mode, seed, threads, weight_sync, default_disk_path)
        self.dtype = dtype
        self.server: Any = None
        self.started_at = time.time()
        self.lend = lend
        """{"path", "index", "borrow"}: the machine's core ledger (docs/design.md §10.16)."""

    async def start(self) -> dict[str, Any]:
        """Build the engine and the weight receiver; returns `info()`. A failure raises
        `ServerStartError` naming this server and its device."""
        import torch
        from pydantic import TypeAdapter

        from areal_like.core.config import EmbeddedEngineConfig, EngineConfig, WeightSyncConfig
        from rollout_cluster.server import RolloutServer
        from weight_sync import make_receiver

        model_path, engine_json, interrupt_mode, seed, threads, ws_json, disk_path = self._args
        engine_cfg = TypeAdapter(EngineConfig).validate_python(engine_json)
        device = engine_cfg.device if isinstance(engine_cfg, EmbeddedEngineConfig) else "cpu"
        ws_cfg = TypeAdapter(WeightSyncConfig).validate_python(ws_json)
        torch.set_num_threads(threads)
        try:
            self.server = RolloutServer(model_path, engine_config=engine_cfg, interrupt_mode=interrupt_mode,
                                        seed=seed, set_threads=False, dtype=self.dtype)
        except Exception as e:
            where = self.device()
            if device != "cpu":
                where = f"{device}, {where}"
            first = (str(e).strip().splitlines() or [""])[0]
            raise ServerStartError(
                f"rollout server {self.name} on {where} could not start: {type(e).__name__}: {first}"
            ) from e
        receiver = make_receiver(ws_cfg, self.name, device=device,
                                 default_disk_path=disk_path)
        self.server.attach_receiver(receiver, self.name, ws_cfg.timeout_s)
        if self.lend and self.server.engine.lends_threads:  # the embedded engine on CPU
            from areal_like.core.cores import CoreLedger, ThreadLender

            ledger = CoreLedger(self.lend["path"], "rollout", int(self.lend["index"]))
            self.server.engine.lender = ThreadLender(ledger, own=threads, borrow=int(self.lend["borrow"]),
                                                     other="train")
        return self.info()

    def device(self) -> str:
        """`cuda:<ids>` of the GPUs the launcher gave this actor, else `cpu (<n> threads)`."""
        from areal_like.launcher import here

        gpus = here()["gpu_ids"]
        if gpus:
            return "cuda (GPU " + ",".join(str(g) for g in gpus) + ")"
        return f"cpu ({self._args[4]} threads)"

    def info(self) -> dict[str, Any]:
        from areal_like.launcher import here

        where = here()  # a plain process of the local launcher: "local", the loopback address
        return {"name": self.name, "node_id": where["node_id"], "node_ip": where["node_ip"],
                "pid": os.getpid(), "device": self.device(),
                "version": self.server.version if self.server is not None else 0}

    async def generate(self, *, request_id: str, prompt_ids: list[int],
                       sampling_params: SamplingParams) -> GenerateResult:
        return await self.server.generate(request_id=request_id, prompt_ids=prompt_ids,
                                          sampling_params=sampling_params)

    async def abort(self, request_ids: list[str]) -> int:
        """Stop generating these requests (their callers were cancelled); how many were found."""
        return len(await self.server.abort(request_ids))

    async def join_weights(self, rendezvous: str) -> None:
        await self.server.join_weights(rendezvous)

    async def receive_weights(self, meta: dict[str, Any], rendezvous: str | None = None) -> int:
        from areal_like.core.types import WeightUpdateMeta

        return await self.server.receive_weights(WeightUpdateMeta.model_validate(meta), rendezvous)

    async def hold(self, on: bool) -> None:
        await self.server.hold(on)

    async def export_weights(self) -> tuple[int, list[tuple[str, Any]]]:
        return self.server.version, await self.server.export_weights()

    async def load_weights(self, exported: tuple[int, list[tuple[str, Any]]]) -> int:
        """Load what a sibling's `export_weights` returned (a restart catching up)."""
        version, named = exported
        if version > self.server.version:  # a newer version may have arrived meanwhile: keep it
            await self.server.update_weights(named, version)
        return self.server.version

    def metrics(self) -> dict[str, float]:
        m = self.server.metrics() if self.server is not None else {}
        lender = self.server.engine.lender if self.server is not None else None
        if lender is not None:
            m["borrowed_thread_s"] = lender.borrowed_s
        # CPU seconds of this process, every thread (the dashboard's cores used per pool);
        # a vLLM engine's own worker processes are not in it
        return {**m, "process_cpu_s": time.process_time()}

    def health(self) -> dict[str, Any]:
        return self.server.health()

    async def close(self) -> None:
        if self.server is not None:
            server, self.server = self.server, None
            receiver = server._receiver
            await server.close()
            if receiver is not None:
                receiver.close()
