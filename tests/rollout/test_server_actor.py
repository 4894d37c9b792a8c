"""A rollout server in a process of its own (the local launcher's `ServerActor`), met
through the handle the rollout side uses (`ActorServer`)."""

from __future__ import annotations

import asyncio
import time

import pytest

from areal_like.core.types import SamplingParams
from areal_like.launcher.local import Zygote
from rollout_cluster.server_actor import ServerActor
from rollout_cluster.server_manager import ActorServer


@pytest.fixture
def server_actor(tiny_model_dir, tmp_path):
    zygote = Zygote.start(preload=())
    handle = zygote.spawn(
        ServerActor, ("server-0", str(tiny_model_dir), {"type": "embedded", "max_batch_size": 4, "max_seq_len": 512}),
        {"interrupt_mode": "recompute", "seed": 0, "threads": 1, "weight_sync": {"type": "disk"},
         "default_disk_path": str(tmp_path / "weights"), "log_file": None, "console": False},
        name="server-0", threads=1)
    try:
        yield handle
    finally:
        zygote.kill(handle)
        zygote.close()


async def _until(handle, what, timeout_s: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = await handle.metrics.remote()
        if what(m):
            return m
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {m}"
        await asyncio.sleep(0.02)


def test_a_cancelled_call_stops_its_request_in_the_server_process(server_actor) -> None:
    """The rollout side cancels episodes nobody will train (a run's end, a restarted
    trainer): their requests must leave the server's batch, not decode to the end."""

    async def main() -> None:
        await server_actor.start.remote()
        server = ActorServer(server_actor, name="server-0")
        call = asyncio.create_task(server.generate(
            request_id="r", prompt_ids=[5, 6, 7],
            sampling_params=SamplingParams(max_tokens=400, ignore_eos=True, seed=0)))
        await _until(server_actor, lambda m: m["generated_tokens"] > 0)
        await server_actor.hold.remote(True)  # no step runs from here: the request is mid-answer
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        m = await _until(server_actor, lambda m: m["requests_aborted"] >= 1)
        await server_actor.hold.remote(False)
        await asyncio.sleep(0.5)
        after = await server_actor.metrics.remote()
        assert after["requests_finished"] == 0 and after["requests_aborted"] == 1
        assert after["generated_tokens"] == m["generated_tokens"] < 400  # not one token more

    asyncio.run(main())
