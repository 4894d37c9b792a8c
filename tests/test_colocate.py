"""`cluster.colocate`: rollout and training take turns on the same devices
(docs/design.md §10.17). The protocol over real channels is in
tests/test_orchestration_fake.py; the GPU side (vLLM sleep, trainer offload) in
tests/gpu/test_colocate_gpu.py."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_like.core.config import ConfigError, EmbeddedEngineConfig, VLLMEngineConfig, load_config
from areal_like.core.types import SamplingParams
from areal_like.orchestration.pools import check_pools, rollout_bundles, train_bundles
from areal_like.orchestration.trainer_side import weight_sync_device
from rollout_cluster.engine import AsyncEngine, EmbeddedEngine
from rollout_cluster.engine.vllm_translate import engine_args_kwargs
from rollout_cluster.server import RolloutServer

ROOT = Path(__file__).resolve().parents[1]

GPU = ["cluster.colocate=true", "cluster.train_pool.num_gpus=1", "train.backend.device=cuda"]


def test_colocated_gpus_are_shared_half_and_half() -> None:
    cfg = load_config(None, [*GPU, "rollout.engine.type=vllm"])
    assert rollout_bundles(cfg) == [{"CPU": 1.0, "GPU": 0.5}]
    assert train_bundles(cfg) == [{"CPU": 1.0, "GPU": 0.5}]
    check_pools(cfg)  # one server on the train pool's one GPU fits
    assert cfg.rollout.engine.enable_sleep_mode  # the server frees the GPU while the trainer trains
    assert weight_sync_device(cfg) == "cpu"  # NCCL refuses two ranks on one GPU: gloo
    two = load_config(None, [*GPU, "rollout.engine.type=vllm", "rollout.num_servers=2",
                             "cluster.rollout_pool.num_cpus=2"])
    with pytest.raises(ConfigError, match="shares one of the train pool's GPUs"):
        check_pools(two)


def test_the_colocated_example_in_the_launching_guide_places_as_it_says(tmp_path) -> None:
    text = (ROOT / "docs" / "launching.md").read_text().split("## Colocated", 1)[1]
    example = text.split("```yaml", 1)[1].split("```", 1)[0]
    (tmp_path / "c.yaml").write_text(example)
    cfg = load_config(tmp_path / "c.yaml")
    check_pools(cfg)
    assert cfg.cluster.colocate and cfg.rollout.engine.enable_sleep_mode
    assert [b["GPU"] for b in rollout_bundles(cfg) + train_bundles(cfg)] == [0.5, 0.5]  # one GPU, shared


@pytest.mark.parametrize("sets, message", [
    (["cluster.rollout_pool.num_gpus=1"], "rollout_pool.num_gpus=0"),
    (["rollout.engine.type=vllm", "rollout.engine.tensor_parallel_size=2"], "tensor_parallel_size must be 1"),
    (["train.backend.type=megatron"], "megatron on cuda is not built"),
])
def test_colocate_refuses_what_it_cannot_share(sets, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*GPU, *sets])


def test_vllm_sleeps_only_on_gpu() -> None:
    cfg = VLLMEngineConfig(enable_sleep_mode=True)
    assert engine_args_kwargs("m", cfg, 0, cpu=False)["enable_sleep_mode"] is True
    assert "enable_sleep_mode" not in engine_args_kwargs("m", cfg, 0, cpu=True)
    assert "enable_sleep_mode" not in engine_args_kwargs("m", VLLMEngineConfig(), 0, cpu=False)


def test_a_held_server_makes_no_tokens_and_its_requests_finish_after(tiny_model_dir) -> None:
    async def main() -> None:
        engine = AsyncEngine(EmbeddedEngine(tiny_model_dir, EmbeddedEngineConfig(max_batch_size=4, max_seq_len=96),
                                            eos_token_ids=[]))
        server = RolloutServer(engine)
        sp = SamplingParams(temperature=1.0, max_tokens=40, seed=1)
        task = asyncio.create_task(server.generate(request_id="r", prompt_ids=[5, 6, 7], sampling_params=sp))
        while engine.metrics().get("generated_tokens", 0) < 5:
            await asyncio.sleep(0.005)
        await server.hold(True)
        await server.hold(True)  # idempotent
        held_at = engine.metrics()["generated_tokens"]
        await asyncio.sleep(0.3)
        assert engine.metrics()["generated_tokens"] == held_at and not task.done()
        await server.hold(False)
        result = await asyncio.wait_for(task, 30)
        assert len(result.token_ids) == 40  # the request went on where it stopped
        assert server.metrics()["held_seconds_total"] >= 0.3
        await server.close()

    asyncio.run(main())


def test_a_colocated_run_trains_every_step_on_both_pools_threads(tiny_model_dir, tmp_path) -> None:
    """The quickstart shape with `cluster.colocate=true`, from the command line: every step
    waited for the servers to hold and ran on the rollout pool's thread too; the servers
    report the time they held; the counts add up."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
    sets = [f"model.path={tiny_model_dir}", f"run.dir={run_dir}", "train.total_steps=4", "train.batch_size=2",
            "rollout.group_size=4", "rollout.response_length=24", "staleness.filter_uniform_groups=false",
            "eval.every_n_steps=0", "cluster.colocate=true", "cluster.lend_idle_threads=false"]
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "areal_like.orchestration.cli", "run", "configs/quickstart.yaml",
                        *[x for s in sets for x in ("--set", s)]], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=280)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in recs if r["kind"] == "train_step"]
    assert len(steps) == 4
    assert all(0 <= r["colocate_wait_s"] < time.time() - t0 for r in steps)
    borrowed = [0.0] + [r["train_borrowed_thread_s"] for r in steps]  # cumulative
    # lending is off, yet every step ran on the servers' thread: colocated pools share
    assert all(b > a for a, b in zip(borrowed, borrowed[1:], strict=False)), borrowed
    held = max(r.get("rollout_held_s", 0.0) for r in recs if r["kind"] == "rollout")
    assert held > 0
    assert recs[-1]["kind"] == "summary" and recs[-1]["counts_add_up"]


def test_colocated_clusters_started_in_two_shells_take_turns(tiny_model_dir, tmp_path) -> None:
    """`areal-like train` and `areal-like rollout` as separate commands: the hold travels
    on the channels they already share, so every step waits for the servers to hold."""
    run_dir = tmp_path / "run"
    port = 23000 + os.getpid() % 500 * 20
    sets = [f"model.path={tiny_model_dir}", f"run.dir={run_dir}", "train.total_steps=3", "train.batch_size=2",
            "rollout.group_size=4", "staleness.filter_uniform_groups=false", "eval.every_n_steps=0",
            "eval.num_samples=4", "cluster.colocate=true",
            f"transport.data_addr=tcp://127.0.0.1:{port}", f"transport.control_addr=tcp://127.0.0.1:{port + 1}",
            f"weight_sync.store_addr=127.0.0.1:{port + 2}"]
    args = [x for s in sets for x in ("--set", s)]
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
    cli = [sys.executable, "-m", "areal_like.orchestration.cli"]
    train = subprocess.Popen([*cli, "train", "configs/quickstart.yaml", *args], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rollout = subprocess.Popen([*cli, "rollout", "configs/quickstart.yaml", *args], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out_t, _ = train.communicate(timeout=300)
    out_r, _ = rollout.communicate(timeout=300)
    assert train.returncode == 0, out_t[-3000:]
    assert rollout.returncode == 0, out_r[-3000:]
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in recs if r["kind"] == "train_step"]
    assert len(steps) == 3 and all("colocate_wait_s" in r for r in steps)
    logs = out_t + ((run_dir / "run.log").read_text() if (run_dir / "run.log").is_file() else "")
    assert "did not say within cluster.colocate_timeout_s" not in logs  # each hold was answered
    assert max(r.get("rollout_held_s", 0.0) for r in recs if r["kind"] == "rollout") > 0
    assert recs[-1]["kind"] == "summary" and recs[-1]["counts_add_up"]
