"""Scale-out: server actors, and the direct weight path against the old one.

Run: `python bench/scale_out.py [--servers 1,2,4] [--total-threads 4] [--sizes 25,100]
[--reps 3] [--learn-steps 0] [--parts rollout,weights,export] [--max-shard-mb 2048]` (CPU; embedded Ray on this machine). Progress goes to
stderr; the last stdout line is one JSON object (bench/_record.py). `--smoke`: one server
actor of 1 thread, 8 requests of 8 tokens, the weight paths once into one server on a
tiny model (Ray included: the default environment has it). What it measures:

1. `rollout`: generation tokens/s with 1, 2, 4 inference-server actors (each its own
   Ray actor and process, as `areal-like run` starts them) at a fixed total torch thread
   count (`--total-threads` split evenly), routed by the real `ServerManager`
   (least-request); 64 concurrent requests of 32 random prompt tokens and 64 forced
   response tokens, one warm-up round first.
2. `weight_sync`: for Qwen2-layout models of ~25M and ~100M parameters, a train worker
   (a Ray actor, as in a run) and two embedded server actors; per version:
   - `old` (the path before issue 14): the driver pulls rank 0's weights through Ray's
     object store (`TrainWorkerGroup.named_weights`), snapshots them into a sender it
     hosts, and the servers receive from it;
   - `new`: rank 0 hosts the sender (`TrainWorkerGroup.weight_sender`): the driver sends
     one small call and gets the meta back; the bytes go worker → servers.
   `blocked_s` is what the trainer's schedule waits per step (send + wait for the
   broadcast), `sync_s` until both servers (`--weight-servers`) have loaded the version, and
   `driver_peak_rss_mb` the driver's peak resident memory above its level before the
   path ran (sampled every 5 ms): it grows with model size on the old path only.
3. `export`: the final HF export (and `run.record_weights`) of a train worker (a plain
   process under the local launcher, as in the quickstart), per model size (`--sizes`;
   1, 25, 100 and 500M exist):
   - `old` (before #33): the driver pulls the weights (`TrainWorkerGroup.named_weights`)
     and writes the folder itself;
   - `new`: the driver hands rank 0 a path (`run_dir.save_hf_folder(out, group, …)`) and
     rank 0 writes safetensors one tensor at a time into bounded shards
     (`--max-shard-mb`).
   `driver_peak_rss_mb` is the driver's peak resident memory above its level before the
   export (sampled every 5 ms), `worker_peak_rss_mb` rank 0's; both grow with model size
   on the old path, the driver's stays flat on the new one and rank 0's stays near one
   shard.
4. `learning` (with `--learn-steps N`): the quickstart config for N steps with 1 and
   with 2 server actors: reward of the last 10 steps, the counts, wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _record  # noqa: E402

# This folder (sys.path[0] when run as a script) holds weight_sync.py, which would shadow
# the `weight_sync` package: the repository root goes first.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

log = logging.getLogger("bench.scale_out")

_SIZES = {  # ~params: hidden, intermediate, layers, heads, kv heads
    1: dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=2),  # --smoke; the quickstart's shape
    25: dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=8,
             num_key_value_heads=4),
    100: dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=6, num_attention_heads=16,
              num_key_value_heads=8),
    500: dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=10, num_attention_heads=16,
              num_key_value_heads=8),  # ~0.47B
}


def _n_params(model: Path) -> int:
    """Parameters in the model folder, from the safetensors header (no tensor is loaded)."""
    import math

    from safetensors import safe_open

    with safe_open(str(model / "model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118


def _model(size: int, root: Path) -> Path:
    from areal_like.models.tiny_model import init_model

    out = root / f"model_{size}m"
    if not (out / "config.json").is_file():
        init_model(out, **_SIZES[size], max_position_embeddings=512)
    return out


class _PeakRSS:
    """A process's peak RSS (the driver's by default) above its level at `start`, sampled
    on a thread."""

    def __init__(self, pid: int | None = None) -> None:
        import psutil

        self.proc = psutil.Process(pid)
        self.base = self.peak = 0
        self._stop = threading.Event()

    def __enter__(self) -> _PeakRSS:
        self.base = self.peak = self.proc.memory_info().rss
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.005)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()

    @property
    def mb(self) -> float:
        return (self.peak - self.base) / 2**20


def _cfg(model: Path, run_dir: Path, *extra: str) -> Any:
    """The quickstart config; thread lending off (docs/design.md §10.16): the servers keep the
    thread counts measured, with no train side to lend them more."""
    from areal_like.core.config import load_config

    run_dir.mkdir(parents=True, exist_ok=True)
    return load_config(ROOT / "configs/quickstart.yaml", [f"model.path={model}", f"run.dir={run_dir}",
                                                          "cluster.lend_idle_threads=false", *extra])


# ---- 1. rollout throughput -------------------------------------------------------------
async def _rollout_rate(cfg: Any, model: Path, n_requests: int, prompt_len: int, gen_len: int) -> dict[str, Any]:
    import random

    from areal_like.core.types import SamplingParams
    from areal_like.launcher import connect
    from areal_like.orchestration.pools import rollout_bundles
    from areal_like.orchestration.server_pool import ServerPool
    from rollout_cluster.server_manager import ServerManager

    launcher = connect("ray")
    pg = await asyncio.to_thread(launcher.place, "rollout_pool", rollout_bundles(cfg))
    pool = ServerPool(cfg, model, pg, launcher=launcher)
    try:
        manager = ServerManager(await pool.start())
        rng = random.Random(0)
        sp = SamplingParams(max_tokens=gen_len, ignore_eos=True)

        async def round_(tag: str) -> float:
            prompts = [[rng.randrange(10, 100) for _ in range(prompt_len)] for _ in range(n_requests)]
            t0 = time.perf_counter()
            outs = await asyncio.gather(*(manager.generate(request_id=f"{tag}-{i}", prompt_ids=p, sampling_params=sp)
                                          for i, p in enumerate(prompts)))
            dt = time.perf_counter() - t0
            return sum(len(o.token_ids) for o in outs) / dt

        await round_("warm")
        rates = [await round_(f"r{k}") for k in range(2)]
        return {"tokens_per_s": round(statistics.median(rates), 1)}
    finally:
        await pool.close()
        launcher.remove(pg)


def bench_rollout(model: Path, root: Path, servers: list[int], total_threads: int, requests: int = 64,
                  prompt_len: int = 32, gen_len: int = 64) -> dict[str, Any]:
    out = {}
    for n in servers:
        threads = max(1, total_threads // n)
        cfg = _cfg(model, root / f"roll{n}", f"rollout.num_servers={n}", f"rollout.server_threads={threads}",
                   f"cluster.rollout_pool.num_cpus={os.cpu_count() or 1}", "rollout.engine.max_batch_size=64")
        r = asyncio.run(_rollout_rate(cfg, model, requests, prompt_len, gen_len))
        out[str(n)] = {"threads_per_server": threads, **r}
        log.info("rollout: %d server actor(s) × %d threads: %.1f tokens/s", n, threads, r["tokens_per_s"])
    return out


# ---- 2. weight sync: old path against new path -------------------------------------------
def _servers(cfg: Any, model: Path, tag: str) -> tuple[Any, Any]:
    from areal_like.launcher import connect
    from areal_like.orchestration.pools import rollout_bundles
    from areal_like.orchestration.server_pool import ServerPool

    launcher = connect("ray")
    pg = launcher.place("rollout_pool", rollout_bundles(cfg))
    pool = ServerPool(cfg, model, pg, launcher=launcher)
    pool.names = [f"{tag}-{n}" for n in pool.names]  # two pools side by side: names of their own
    pool.seats = {f"{tag}-{n}": seat for n, seat in pool.seats.items()}
    return pool, pg


async def _start(pool: Any) -> None:
    await pool.start()


def bench_weight_sync(size: int, root: Path, reps: int, servers: int = 2) -> dict[str, Any]:
    from areal_like.core.config import DistWeightSyncConfig
    from areal_like.launcher import connect
    from train_cluster.worker_group import TrainWorkerGroup
    from weight_sync.dist import DistWeightSender

    model = _model(size, root)
    cfg = _cfg(model, root / f"ws{size}", f"rollout.num_servers={servers}", f"cluster.rollout_pool.num_cpus={servers}",
               "weight_sync.timeout_s=300")
    group = TrainWorkerGroup(model, cfg.train, seed=0)
    n_params = _n_params(model)
    results: dict[str, Any] = {"params_m": round(n_params / 1e6, 1)}
    loop = asyncio.new_event_loop()
    try:
        for path in ("old", "new"):
            pool = None
            pg = None
            try:
                pool, pg = _servers(cfg, model, path)
                loop.run_until_complete(_start(pool))
                if path == "old":
                    sender: Any = DistWeightSender(DistWeightSyncConfig(timeout_s=300))
                else:
                    sender = group.weight_sender(cfg.weight_sync, "cpu", root / "ws")
                loop.run_until_complete(pool.join(sender.rendezvous))
                blocked, sync = [], []
                with _PeakRSS() as rss:
                    for v in range(1, reps + 1):
                        t0 = time.perf_counter()
                        meta = sender.send(v, group.named_weights()) if path == "old" else sender.publish(v, group)
                        t_sent = time.perf_counter()
                        receiving = loop.create_task(pool.receive(meta))
                        waited: list[float] = []

                        def wait_broadcast(sender: Any = sender, waited: list[float] = waited) -> None:
                            sender.wait(300)
                            waited.append(time.perf_counter())

                        th = threading.Thread(target=wait_broadcast)
                        th.start()
                        ok, failed = loop.run_until_complete(receiving)
                        th.join()
                        t1 = time.perf_counter()
                        if failed or len(ok) != servers or not waited:
                            raise RuntimeError(f"{path} v{v}: servers failed: {failed}")
                        blocked.append(waited[0] - t0)  # what the trainer's schedule waits: send + broadcast
                        sync.append(t1 - t0)
                        log.info("weights %dM %s v%d: send %.2fs, trainer blocked %.2fs, all servers loaded after "
                                 "%.2fs", size, path, v, t_sent - t0, waited[0] - t0, t1 - t0)
                results[path] = {"blocked_s": round(statistics.median(blocked), 3),
                                 "sync_s": round(statistics.median(sync), 3),
                                 "driver_peak_rss_mb": round(rss.mb, 1)}
                sender.close()
            finally:
                if pool is not None:
                    loop.run_until_complete(pool.close())
                connect("ray").remove(pg)
    finally:
        loop.close()
        group.shutdown()
    return results


# ---- 3. the final export: through the driver, or written by rank 0 --------------------------
def bench_export(size: int, root: Path, max_shard_mb: int, old: bool = True) -> dict[str, Any]:
    from areal_like.launcher.local import Zygote
    from areal_like.models.hf_folder import has_hf_weights
    from areal_like.orchestration.run_dir import save_hf_folder
    from train_cluster.worker_group import TrainWorkerGroup

    model = _model(size, root)
    cfg = _cfg(model, root / f"ex{size}")
    results: dict[str, Any] = {"params_m": round(_n_params(model) / 1e6, 1), "max_shard_mb": max_shard_mb}
    zygote = Zygote.start()
    try:
        group = TrainWorkerGroup(model, cfg.train, seed=0, launcher=zygote, log_level="WARNING")
        try:
            rank0 = group.workers[0]
            paths = {"new": lambda out: save_hf_folder(out, _Shards(group, max_shard_mb), model)}
            if old:
                paths["old"] = lambda out: save_hf_folder(out, dict(group.named_weights()), model)
            # once, unmeasured: the worker's weights are mapped from the model file until first
            # read (a trained model's are its own memory); its RSS would count those pages
            group.export_weights(root / f"export{size}_warm")
            for path, export in paths.items():
                out = root / f"export{size}_{path}"
                with _PeakRSS() as driver, _PeakRSS(rank0.actor_pid) as worker:
                    t0 = time.perf_counter()
                    export(out)
                    took = time.perf_counter() - t0
                if not has_hf_weights(out):
                    raise RuntimeError(f"{path}: no weights in {out}")
                files = sorted(p.name for p in out.glob("*.safetensors"))
                results[path] = {"export_s": round(took, 2), "driver_peak_rss_mb": round(driver.mb, 1),
                                 "worker_peak_rss_mb": round(worker.mb, 1), "weight_files": len(files)}
                log.info("export %dM %s: %.2fs, driver +%.0f MB, rank 0 +%.0f MB, %d file(s)", size, path, took,
                         driver.mb, worker.mb, len(files))
                import shutil

                shutil.rmtree(out, ignore_errors=True)
        finally:
            group.shutdown()
    finally:
        zygote.close()
    return results


class _Shards:
    """The group, exporting with shards of `mb` MB (what `save_hf_folder` calls)."""

    def __init__(self, group: Any, mb: int) -> None:
        self.group, self.mb = group, mb

    def export_weights(self, path: Path) -> Any:
        return self.group.export_weights(path, self.mb * 2**20)


# ---- 4. learning with 1 and 2 server actors -----------------------------------------------
def bench_learning(root: Path, steps: int) -> dict[str, Any]:
    from areal_like.core.metrics import read_jsonl
    from areal_like.orchestration.launch import run_both

    out = {}
    for n in (1, 2):
        run_dir = root / f"learn{n}"
        cfg = _cfg(ROOT / "areal_like/assets/quickstart_model", run_dir, f"train.total_steps={steps}",
                   f"rollout.num_servers={n}", "eval.every_n_steps=0")
        t0 = time.time()
        summary = run_both(cfg)
        recs = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "train_step"]
        last = [r["reward_mean"] for r in recs[-10:]]
        out[str(n)] = {"reward_last10": round(statistics.mean(last), 3),
                       "reward_first10": round(statistics.mean(r["reward_mean"] for r in recs[:10]), 3),
                       "wall_s": round(time.time() - t0, 1), "counts": summary}
        log.info("learning with %d server(s): reward %.3f -> %.3f in %.0fs", n, out[str(n)]["reward_first10"],
                 out[str(n)]["reward_last10"], out[str(n)]["wall_s"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="1,2,4")
    ap.add_argument("--total-threads", type=int, default=4)
    ap.add_argument("--sizes", default="25,100")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--learn-steps", type=int, default=0)
    ap.add_argument("--parts", default="rollout,weights,export",
                    help="of rollout,weights,export (learning runs with --learn-steps)")
    ap.add_argument("--max-shard-mb", type=int, default=2048, help="export: the largest safetensors shard")
    ap.add_argument("--no-old-export", action="store_true", help="export: skip the old path (through the driver)")
    ap.add_argument("--requests", type=int, default=64, help="concurrent requests per rollout round")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=64, help="forced response tokens per request")
    ap.add_argument("--weight-servers", type=int, default=2, help="server actors receiving the weights")
    args, recorder = _record.parse(ap, __file__, smoke={
        "max_shard_mb": 1, "servers": "1", "total_threads": 1, "sizes": "1", "reps": 1, "weight_servers": 1, "requests": 8, "prompt_len": 8, "gen_len": 8})
    parts = set(args.parts.split(","))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    from areal_like.launcher.ray_launcher import RayLauncher, ray_env

    for k, v in ray_env().items():
        os.environ.setdefault(k, v)
    result: dict[str, Any] = {"bench": "scale_out", "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if parts & {"rollout", "weights"}:
            launcher = RayLauncher(num_cpus=8)  # an embedded Ray of at least 8 CPUs (this machine's, if more)
            launcher.up()
            try:
                if "rollout" in parts:
                    result["rollout"] = bench_rollout(ROOT / "areal_like/assets/quickstart_model", root,
                                                      [int(x) for x in args.servers.split(",")], args.total_threads,
                                                      args.requests, args.prompt_len, args.gen_len)
                if "weights" in parts:
                    result["weight_sync"] = {f"{s}M": bench_weight_sync(s, root, args.reps, args.weight_servers)
                                             for s in (int(x) for x in args.sizes.split(","))}
            finally:
                launcher.shutdown()
        if "export" in parts:
            result["export"] = {f"{s}M": bench_export(s, root, args.max_shard_mb, not args.no_old_export)
                                for s in (int(x) for x in args.sizes.split(","))}
        if args.learn_steps:
            result["learning"] = bench_learning(root, args.learn_steps)
    recorder.finish(result)


if __name__ == "__main__":
    main()
