"""A rollout server dies mid-run: its episodes move to the other server, none is lost.

Real engines, real server manager, real agent loops and controller; the trainer is a
small fake consuming groups through the real buffer (docs/design.md §3 invariant 5, §9.5).
"""

from __future__ import annotations

import asyncio

import pytest

from areal_like.core.buffer import TrajectoryBuffer
from areal_like.core.config import load_config
from areal_like.core.staleness import StalenessGate
from areal_like.core.types import (
    GateCounts,
    Goodbye,
    RolloutStats,
    SamplingParams,
    TrajectoryGroup,
    VersionAnnouncement,
    WeightUpdateMeta,
)
from areal_like.orchestration.dataset import PromptSource, load_rows
from areal_like.orchestration.rollout_controller import RolloutController

pytestmark = pytest.mark.timeout(300)


def test_killed_server_mid_run_loses_no_episode(tiny_model_dir) -> None:
    from areal_like.models.tiny_model import load_tokenizer
    from rollout_cluster.agent_loop.runner import AgentRunner
    from rollout_cluster.server import RolloutServer
    from rollout_cluster.server_manager import ServerManager

    cfg = load_config("configs/quickstart.yaml", [f"model.path={tiny_model_dir}", "rollout.group_size=4",
                                                   "train.batch_size=2", "rollout.response_length=32"])

    async def main() -> tuple[TrajectoryBuffer, RolloutStats, ServerManager]:
        tok = load_tokenizer(tiny_model_dir)
        servers = {f"s{i}": RolloutServer(tiny_model_dir, tok, engine_config=cfg.rollout.engine, seed=i, set_threads=False)
                   for i in range(2)}
        manager = ServerManager(servers)
        runner = AgentRunner.from_config(cfg, server_manager=manager, tokenizer=tok)
        inbox: asyncio.Queue = asyncio.Queue()

        async def send(msg) -> None:
            await inbox.put(msg)

        from transformers import AutoModelForCausalLM

        weights = list(AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict().items())

        async def apply_weights(meta) -> int:  # same tensors, new version: the engines interrupt and go on
            for name in manager.server_names:
                await servers[name].update_weights(weights, meta.version)
            return meta.version

        ctl = RolloutController(
            gate=StalenessGate(cfg.samples_per_step, 1, 64),
            source=PromptSource(load_rows(cfg.dataset, "train", 0), seed=0),
            group_size=4, sampling=SamplingParams(max_tokens=32), run_episode=runner.run_episode,
            score=runner.score, send=send, apply_weights=apply_weights, stats_every_s=0.2,
        )
        ctl.announcements.put_nowait(VersionAnnouncement(version=0))
        task = asyncio.create_task(ctl.run())
        buf = TrajectoryBuffer(1, filter_uniform_groups=False)
        killed = asyncio.Event()

        async def kill_s0_mid_request() -> None:
            # Poll rather than check on each group's arrival: on a fast machine the engine can be
            # idle at every arrival. Pause first so no in-flight request can finish between the
            # check and the close; kill only if some are verifiably still inside the engine.
            engine = servers["s0"].engine
            while True:
                await asyncio.sleep(0.005)
                if manager.in_flight().get("s0", 0) == 0:
                    continue
                await engine.pause()
                if engine.metrics()["inflight_calls"] > 0:
                    await servers["s0"].close()  # the engine dies with requests in flight
                    killed.set()
                    return
                await engine.resume()

        killer = asyncio.create_task(kill_s0_mid_request())
        v, final = 0, None
        while final is None:
            msg = await asyncio.wait_for(inbox.get(), 120)
            if isinstance(msg, TrajectoryGroup):
                buf.put(msg)
            elif isinstance(msg, RolloutStats) and msg.kind == "final":
                final = msg
            batch = buf.pop_batch(v, 2)
            if batch is not None:
                buf.mark_trained(batch)
                v += 1
                assert v < 100 or killed.is_set(), "s0 was never caught with a request inside its engine"
            # a meta only with a new version, as the trainer announces one only with a transfer
            meta = WeightUpdateMeta(version=v, transport="disk", tensors=[], checksum="-") if batch else None
            # the run ends only after the kill, and 4 versions
            end = Goodbye() if v >= 4 and killed.is_set() else None
            ctl.announcements.put_nowait(VersionAnnouncement(version=v, weights=meta, counts=GateCounts(consumed=buf.consumed, dropped=buf.dropped_sent), end=end))
        await task
        killer.cancel()
        await servers["s1"].close()
        assert killed.is_set()
        return buf, final, manager

    buf, final, manager = asyncio.run(main())
    summary = buf.summary(final.started, final.cancelled)
    assert TrajectoryBuffer.counts_add_up(summary), summary
    assert manager.num_failures >= 1 and manager.server_names == ["s1"]
    assert summary["failed"] == 0, "episodes on the dead server should have moved, not failed"
    assert summary["trained"] >= 4 * 8
