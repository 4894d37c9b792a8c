"""`TrainWorkerGroup`: N train workers as actors behind the `TrainEngine` calls (Ray
actors or plain processes, whichever launcher starts them: `areal_like.launcher`).

Each actor holds one `TorchTrainEngine`. The actors form their own
torch.distributed group on a fresh TCPStore hosted by rank 0 (never Ray's
collective library, never the weight-sync group), so DDP/FSDP collectives run
directly between them. The group looks like one engine to the orchestrator:

- `train_step(batch)` takes the *global* batch, shards it token-balanced across
  ranks (advantages were already computed on the whole batch), runs the step on
  every rank and returns rank 0's stats (already reduced over ranks);
- `compute_logprobs(batch)` scatters and gathers back in the global order;
- `export_weights(path)`: rank 0 writes HF safetensors itself, tensor by tensor (every
  rank takes part: FSDP/Megatron gather); only the path and file names cross the launcher;
- `named_weights()` comes from rank 0 through the caller (tests, small models);
- `save`/`load` run on every rank (each stores its RNG state).

Threads are pinned per worker: each actor sets `torch.set_num_threads(threads)`
and gets OMP/MKL thread variables to match, and reserves that many CPUs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_like.core.config import LoraConfig, MegatronBackendConfig, TrainConfig
from areal_like.core.types import Trajectory

if TYPE_CHECKING:
    # The driver imports this module; torch is the workers' (a single data shard's batch is
    # built in the workers, so the driver of the quickstart never imports torch: its 2 s of
    # a core went to the start-up's critical path; docs/design.md §10.34).
    import torch

    from train_cluster.batch import TrainBatch

__all__ = ["TrainWorkerGroup", "TrainWorkerDied", "WorkerWeightSender"]

logger = logging.getLogger(__name__)


class TrainWorkerDied(RuntimeError):
    """A train worker's process is gone: the group cannot go on (its state is torn)."""


def _get(workers: list[Any], refs: list[Any], what: str, poll: Callable[[], None] | None = None,
         every_s: float = 0.02) -> list[Any]:
    """`get` of one call per worker that turns a dead worker into one short, clear
    error, as soon as it is known (the live ranks may be blocked in a collective with it).
    `poll`, if given, is called every `every_s` while the workers run (the trainer takes in
    data meanwhile)."""
    from areal_like import launcher as actors

    try:
        pending = list(refs)
        while pending:
            done, pending = actors.wait(pending, num_returns=1, timeout=None if poll is None else every_s)
            if not done:
                poll()  # type: ignore[misc]
                continue
            actors.get(done)  # raises now if that worker died
        return actors.get(refs)
    except Exception as e:
        if not actors.is_actor_death(e):
            raise
        first = (str(e).strip().splitlines() or [""])[0]
        raise TrainWorkerDied(
            f"a train worker (of {len(workers)}) died during {what} ({type(e).__name__}: {first})"
        ) from e


class _TrainWorker:
    """Body of one actor: joins the trainers' group, then owns a `TorchTrainEngine`."""

    def __init__(self, rank: int, world_size: int, log_level: str, log_file: str | None = None,
                 console: bool = True) -> None:
        from areal_like.core.logs import process_logging

        process_logging(f"train[{rank}]", log_level, log_file, console)
        self.rank, self.world_size = rank, world_size
        self.engine: Any = None
        self.offload = False  # set by `setup`
        self.ledger: Any = None
        """The machine's `CoreLedger` where this rank lends threads (set by `setup`)."""
        self.sender: Any = None
        """Rank 0's weight sender (`start_weight_sender`)."""

    def store_addr(self) -> str:
        """Rank 0 hosts the TCPStore: its node address and a free port (the loopback
        address under the local launcher: every rank is on this machine)."""
        from areal_like.launcher import here
        from train_cluster.torch_engine import free_port

        ip = here()["node_ip"]
        return f"{ip}:{free_port(ip)}"

    def setup(self, store_addr: str, model_path: str, train_cfg: dict[str, Any], dtype: str,
              seed: int, lend: dict[str, Any] | None = None, offload: bool = False,
              lora: dict[str, Any] | None = None) -> tuple[int, int]:
        """Join the group, build the engine the backend asks for; returns (version, dp rank).
        `lend` ({"path", "borrow"}): the machine's core ledger (docs/design.md §10.16).
        `offload`: `cluster.colocate` on CUDA: the model and optimizer live in host memory
        between steps (docs/design.md §10.17)."""
        self.offload = offload
        import torch

        from train_cluster.torch_engine import TorchTrainEngine, init_train_group

        cfg = TrainConfig.model_validate(train_cfg)
        self.loss_cfg = cfg.loss
        if self.world_size > 1:
            init_train_group(self.rank, self.world_size, store_addr, cfg.backend.device)
        if isinstance(cfg.backend, MegatronBackendConfig):
            from train_cluster.megatron.engine import MegatronTrainEngine

            torch.set_num_threads(cfg.backend.threads)
            # Megatron's parallel state (TP innermost, then DP) is built inside, on this group.
            self.engine = MegatronTrainEngine(model_path, cfg, dtype=dtype, seed=seed)
            return self.engine.version, self.engine.dp_rank
        self.engine = TorchTrainEngine(model_path, cfg, dtype=dtype, seed=seed,
                                       lora=LoraConfig.model_validate(lora) if lora else None)
        if offload:
            self.engine.offload()
        if lend and cfg.backend.device == "cpu":
            from areal_like.core.cores import CoreLedger, ThreadLender

            self.ledger = CoreLedger(lend["path"], "train", self.rank)
            self.ledger.working(False)
            self.engine.thread_lender = ThreadLender(self.ledger, own=cfg.backend.threads,
                                                     borrow=int(lend["borrow"]), other="rollout",
                                                     grace_s=float(lend.get("grace_s", 0.1)),
                                                     crowded_hold_s=float(lend.get("crowded_hold_s", 1.0)))
        return self.engine.version, self.rank

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        import time

        ledger = self.ledger
        if ledger is not None:
            ledger.working(True)
        offload = self.offload
        try:
            if offload:
                self.engine.onload()
            stats = self.engine.train_step(batch)
            if offload:
                self.engine.offload()
        finally:
            if ledger is not None:
                ledger.working(False)
                self.engine.thread_lender.done()
                self.engine.thread_lender.published()
        # this process's CPU seconds so far, every thread: the train pool's cores used
        stats = {**stats, "cpu_s": time.process_time()}
        if ledger is not None:
            stats["borrowed_thread_s"] = self.engine.thread_lender.borrowed_s
        return stats

    def train_on(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """`train_step` on the batch this worker builds from `trajectories` (the whole
        batch: one data shard); `batch_time_s` is the time building it took."""
        from train_cluster.batch import build_batch

        t0 = time.perf_counter()
        batch = build_batch(trajectories, self.loss_cfg)
        built = time.perf_counter() - t0
        return {**self.train_step(batch), "batch_time_s": built}

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        if not self.offload:
            return self.engine.compute_logprobs(batch)
        self.engine.onload()
        try:
            return self.engine.compute_logprobs(batch)
        finally:
            self.engine.offload()

    def named_weights(self) -> list[tuple[str, torch.Tensor]] | None:
        """Rank 0's weights as CPU copies (final export, recorded weights); every rank takes
        part in the gathers, only rank 0 copies."""
        if self.rank != 0:
            for _ in self.engine.named_weights():
                pass
            return None
        return [(n, t.to("cpu", copy=True)) for n, t in self.engine.named_weights()]

    def export_weights(self, path: str, max_shard_bytes: int | None = None) -> dict[str, Any]:
        """HF safetensors of the current weights under `path`, written by rank 0 one tensor at
        a time in bounded shards (every rank takes part in the gathers). Only the folder's
        path comes in and a few names go back: the weights never leave this process."""
        return self.engine.export_weights(path, max_shard_bytes)

    # ---- the direct weight path (docs/design.md §10.5) -----------------------------------
    def start_weight_sender(self, weight_sync: dict[str, Any], device: str, disk_path: str) -> str | None:
        """Rank 0 hosts the weight sender (dist: its TCPStore and group; disk: the writer);
        returns its rendezvous. Other ranks hold nothing."""
        if self.rank != 0:
            return None
        from pydantic import TypeAdapter

        from areal_like.core.config import WeightSyncConfig
        from weight_sync import make_sender

        cfg = TypeAdapter(WeightSyncConfig).validate_python(weight_sync)
        self.sender = make_sender(cfg, device=device, default_disk_path=disk_path)
        return self.sender.rendezvous

    def send_weights(self, version: int) -> dict[str, Any] | None:
        """Snapshot the weights as `version` into rank 0's sender, one tensor at a time
        straight from the engine (FSDP/Megatron gather per tensor on every rank); the
        broadcast to the servers runs on the sender's thread. Returns the meta (rank 0)."""
        weights = self.engine.named_weights()
        if self.rank != 0:
            for _ in weights:
                pass
            return None
        return self.sender.send(version, weights).model_dump(mode="json")

    def weights_wait(self, timeout: float | None) -> tuple[Any, str | None]:
        """(last transfer stats, None), or (None, why) while the transfer still runs."""
        try:
            return self.sender.wait(timeout), None
        except Exception as e:
            return None, str(e)

    def weights_forget(self) -> None:
        """Rank 0: the rollout side is gone; its sender stops waiting for its receivers."""
        if self.sender is not None:
            self.sender.forget_receivers()

    def close_weight_sender(self) -> None:
        sender = self.sender
        if sender is not None:
            self.sender = None
            sender.close()

    def save(self, path: str, extra: dict[str, Any] | None) -> None:
        self.engine.save(path, extra)

    def load(self, path: str) -> dict[str, Any]:
        return self.engine.load(path)

    def version(self) -> int:
        return self.engine.version


class TrainWorkerGroup:
    """`train.backend.world_size` actors training one model together (module docstring).

    `launcher` starts them (`areal_like.launcher`); without one, the Ray this process is
    in (call `ray.init(...)` first). Pass the train pool's `placement_group` to keep the
    actors inside it.
    """

    def __init__(
        self,
        model_path: str | Path,
        train_cfg: TrainConfig,
        *,
        dtype: str = "float32",
        seed: int = 0,
        placement_group: Any = None,
        log_level: str = "INFO",
        log_file: str | Path | None = None,
        console: bool = True,
        launcher: Any = None,
        lend: dict[str, Any] | None = None,
        colocate: bool = False,
        lora: LoraConfig | None = None,
    ) -> None:
        from areal_like import launcher as actors

        backend = train_cfg.backend
        if launcher is None:
            try:
                launcher = actors.connect("ray")
            except RuntimeError:
                raise RuntimeError("TrainWorkerGroup needs Ray (call ray.init() first) or a launcher") from None
        self.launcher = launcher
        if isinstance(backend, MegatronBackendConfig):
            # tp × dp ranks; the ranks of one TP group share a data shard (dp shards in all)
            self.world_size = backend.tensor_parallel_size * backend.data_parallel_size
            self.dp_size = backend.data_parallel_size
            layout = f"megatron tp={backend.tensor_parallel_size} dp={backend.data_parallel_size}"
        else:
            self.world_size = self.dp_size = backend.world_size
            layout = backend.strategy
        self.loss_cfg = train_cfg.loss
        threads = str(backend.threads)
        log_file = str(log_file) if log_file is not None else None
        self.workers = [
            launcher.spawn(_TrainWorker, (r, self.world_size, log_level, log_file, console), name=f"train-{r}",
                           cpus=backend.threads,
                           # colocated: half a GPU, the other half is the rollout server's (pools.py)
                           gpus=(0.5 if colocate else 1) if backend.device == "cuda" else 0,
                           threads=backend.threads, env={"TOKENIZERS_PARALLELISM": "false"},
                           stdio=None if console or log_file is None else log_file,
                           # one bundle per rank (the train pool may span nodes), or all in its one bundle
                           placement=actors.Placement.of_rank(placement_group, r, self.world_size),
                           zero_copy_tensors=True)
            for r in range(self.world_size)]
        store = actors.get(self.workers[0].store_addr.remote())
        cfg = train_cfg.model_dump(mode="json")
        offload = colocate and backend.device == "cuda"
        lora_cfg = lora.model_dump(mode="json") if lora is not None and lora.enabled else None
        setups = _get(self.workers, [w.setup.remote(store, str(model_path), cfg, dtype, seed, lend, offload, lora_cfg)
                                     for w in self.workers], "setup")
        self._version = setups[0][0]
        self._dp_ranks = [int(dp) for _, dp in setups]  # each worker's data shard
        logger.info("TrainWorkerGroup: %d workers (%s, %s threads each, %s), store %s", self.world_size,
                    layout, threads, backend.device, store)

    @property
    def version(self) -> int:
        return self._version

    def _shards(self, batch: TrainBatch) -> list[list[int]]:
        """One token-balanced shard per data-parallel rank (`dp_size` of them; torch: every worker)."""
        from train_cluster.batch import balanced_partition

        if batch.num_seqs < self.dp_size:
            raise ValueError(f"{batch.num_seqs} sequences cannot feed {self.dp_size} data-parallel train ranks")
        return balanced_partition(batch.seq_lens.tolist(), self.dp_size)

    def train_step(self, batch: TrainBatch, poll: Callable[[], None] | None = None) -> dict[str, float]:
        """One step on every rank; `poll` is called every 20 ms while they compute."""
        # All ranks of one TP group get the same shard (the same object: Ray stores it once).
        parts = [batch.select(idx) for idx in self._shards(batch)]
        return self._step([w.train_step.remote(parts[dp]) for w, dp in zip(self.workers, self._dp_ranks, strict=True)],
                          poll)

    def _step(self, refs: list[Any], poll: Callable[[], None] | None) -> dict[str, float]:
        """Rank 0's stats of one step, with the CPU and borrowed threads summed over ranks."""
        stats = _get(self.workers, refs, "train_step", poll=poll)
        self._version = int(stats[0]["version"])
        out = {**stats[0], "train_cpu_s": sum(s.get("cpu_s", 0.0) for s in stats)}
        if any("borrowed_thread_s" in s for s in stats):  # summed over ranks, like the CPU
            out["train_borrowed_thread_s"] = sum(s.get("borrowed_thread_s", 0.0) for s in stats)
        out.pop("borrowed_thread_s", None)
        return out

    def train_on(self, trajectories: list[Trajectory], poll: Callable[[], None] | None = None) -> dict[str, float]:
        """One train step on a batch of trajectories: group-normalised advantages, packing
        and the decoupled PPO update all happen here, in the train cluster. `poll` runs in
        this process every 20 ms while the workers compute. `batch_time_s` in the stats is
        the time building the batch took (the step's time budget)."""
        if self.dp_size == 1:  # one data shard: every rank builds the whole batch itself
            return self._step([w.train_on.remote(trajectories) for w in self.workers], poll)
        from train_cluster.batch import build_batch

        t0 = time.perf_counter()
        batch = build_batch(trajectories, self.loss_cfg)
        built = time.perf_counter() - t0
        return {**self.train_step(batch, poll=poll), "batch_time_s": built}

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        shards = self._shards(batch)
        inputs = [batch.select(idx) for idx in shards]
        got = _get(self.workers, [w.compute_logprobs.remote(inputs[dp])
                                  for w, dp in zip(self.workers, self._dp_ranks, strict=True)], "compute_logprobs")
        parts: list[torch.Tensor] = [None] * self.dp_size  # type: ignore[list-item]
        for dp, lp in zip(self._dp_ranks, got, strict=True):  # TP ranks of a shard agree: keep the first
            if parts[dp] is None:
                parts[dp] = lp
        import torch

        out = torch.zeros(batch.num_tokens)
        offs = batch.offsets().tolist()
        for idx, lp in zip(shards, parts, strict=True):
            pos = 0
            for s in idx:
                n = offs[s + 1] - offs[s]
                out[offs[s]:offs[s + 1]] = lp[pos:pos + n]
                pos += n
        return out

    def export_weights(self, path: str | Path, max_shard_bytes: int | None = None) -> dict[str, Any]:
        """Rank 0 writes the weights as HF safetensors under `path` (the final export, recorded
        weights): this call carries the path, the answer the file names. Nothing of the
        weights reaches the caller (`bench/scale_out.py` measures the driver's memory)."""
        return _get(self.workers, [w.export_weights.remote(str(path), max_shard_bytes) for w in self.workers],
                    "export_weights")[0]

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Rank 0's HF-named weights (copies on CPU; tied duplicates dropped), through this
        process: for tests and small models. A run exports with `export_weights`."""
        yield from _get(self.workers, [w.named_weights.remote() for w in self.workers], "named_weights")[0]

    def weight_sender(self, weight_sync: Any, device: str, disk_path: str | Path) -> WorkerWeightSender:
        """The trainer's weight publisher: the sender lives in rank 0, so versions go from
        the train workers straight to the servers, never through this driver."""
        refs = [w.start_weight_sender.remote(weight_sync.model_dump(mode="json"), device, str(disk_path))
                for w in self.workers]
        rendezvous = _get(self.workers, refs, "start_weight_sender")[0]
        return WorkerWeightSender(self, rendezvous)

    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        _get(self.workers, [w.save.remote(str(path), extra) for w in self.workers], "save")

    def load(self, path: str | Path) -> dict[str, Any]:
        from areal_like import launcher as actors

        extras = actors.get([w.load.remote(str(path)) for w in self.workers])
        self._version = actors.get(self.workers[0].version.remote())
        return extras[0]

    def shutdown(self) -> None:
        for w in self.workers:
            self.launcher.kill(w)
        self.workers = []


class WorkerWeightSender:
    """The `WeightPublisher` the trainer controller sees when rank 0 holds the sender.

    `publish(version, trainer)` asks every rank to hand its weights to rank 0's sender
    (the meta comes back, a few KB); `wait` and `last_transfer` ask rank 0. Nothing of
    the weights crosses the launcher's calls or reaches the driver.
    """

    def __init__(self, group: TrainWorkerGroup, rendezvous: str | None) -> None:
        self.group = group
        self._rendezvous = rendezvous
        self._last: Any = None

    @property
    def rendezvous(self) -> str | None:
        return self._rendezvous

    @property
    def last_transfer(self) -> Any:
        return self._last

    def publish(self, version: int, trainer: Any = None) -> Any:
        """The weights go from the ranks to rank 0's sender, never through here: `trainer`
        (the group itself) is not read."""
        from areal_like.core.types import WeightUpdateMeta

        metas = _get(self.group.workers, [w.send_weights.remote(version) for w in self.group.workers],
                     "send_weights")
        return WeightUpdateMeta.model_validate(metas[0])

    def forget_receivers(self) -> None:
        """Tell rank 0's sender, without waiting for the answer: rank 0 may be inside a
        `weights_wait` slice, and the point is not to wait."""
        self.group.workers[0].weights_forget.remote()

    def wait(self, timeout: float | None = None) -> Any:
        from weight_sync.base import WeightSyncError

        stats, error = _get(self.group.workers[:1], [self.group.workers[0].weights_wait.remote(timeout)],
                            "weights_wait")[0]
        if error is not None:
            raise WeightSyncError(error)
        self._last = stats
        return stats

    def close(self) -> None:
        from areal_like import launcher as actors

        if self.group.workers:
            try:
                actors.get(self.group.workers[0].close_weight_sender.remote(), timeout=60)
            except Exception as e:  # the worker may be gone; its store goes with it
                logger.debug("closing rank 0's weight sender: %s", e)
