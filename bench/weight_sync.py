"""Weight-sync throughput: the dist transport against a raw gloo broadcast of the same bytes.

Run: `python bench/weight_sync.py [--receivers 1] [--bucket-mb 64] [--reps 10] [--lanes both] [--smoke]`
(`--smoke`: one rep, and a 1-layer, 128-wide model in place of the 100M one).

For the quickstart model and a ~100M-parameter Qwen2-like layout (random tensors),
the trainer side (this process) sends versions through `DistWeightSender`; receiver
processes get each meta as wire bytes (as the control channel carries it) and call
`DistWeightReceiver.receive`. Two lanes, one sender each, interleaved per rep: `shm`,
what receivers on the trainer's host get (they read the sender's shared-memory staging
file, `weight_sync/shm.py`), and `gloo`, the bucketed broadcast that receivers on other
hosts get. The baseline is one `broadcast` of a preallocated flat buffer of the same
size over a gloo group between the same processes: the best this machine's gloo can
do, with no layout, bucketing, checksum or commit.

Reported per model, for the default lane at the top and the other under `gloo_lane`:
`bytes`; medians over reps of `send_s`, the trainer's blocking part (snapshot into the
staging buffer + checksum), `transfer_s`, the receiver's time from the group being
ready to verified weights (header, bytes, digests, commit vote), `rendezvous_s`,
waiting for the sender's plan, `end_to_end_s`, `send_s` plus the receiver's whole
`receive`, and `raw_broadcast_s`; GB/s from the medians and from the best reps.
`ratio_to_raw_broadcast` is the median over reps of raw_broadcast_s / transfer_s, the
two measured back to back so that both see the same load from other jobs on a shared
box; the ratio of medians and the ratio of best reps are reported too. The top-level
`ratio_to_raw_broadcast` is the 100M model's on the default lane,
`broadcast_lane_ratio_to_raw_broadcast` the same on the broadcast.
`verified_raw_ratio_to_raw_broadcast` is the ceiling for any lane that checks every
byte it receives (docs/design.md: checksums are verified before a version is
activated): the raw broadcast against itself in the lane's buckets with each bucket
digested on arrival (`raw_verified_s`), paired per rep. Progress goes to
stderr, the last line of stdout is one JSON object (bench/_record.py).

A receiver that fails (an import, the rendezvous, a transfer) fails this process within a
second with the receiver's traceback, instead of leaving it in a rendezvous until timeout.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _record  # noqa: E402

# Run as a script, this file's folder comes first on sys.path and its name would
# shadow the `weight_sync` package it measures.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

log = logging.getLogger("bench.weight_sync")
FAIL_ENV = "AREAL_BENCH_WEIGHT_SYNC_FAIL"


def qwen2_like(
    vocab: int = 32000, hidden: int = 768, layers: int = 12, intermediate: int = 2304, kv_dim: int = 128
) -> dict[str, torch.Tensor]:
    """Random tensors in Qwen2's layout (tied embeddings): ~105M parameters by default."""
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    out = {"model.embed_tokens.weight": r(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": r(hidden, hidden),
            p + "self_attn.q_proj.bias": r(hidden),
            p + "self_attn.k_proj.weight": r(kv_dim, hidden),
            p + "self_attn.k_proj.bias": r(kv_dim),
            p + "self_attn.v_proj.weight": r(kv_dim, hidden),
            p + "self_attn.v_proj.bias": r(kv_dim),
            p + "self_attn.o_proj.weight": r(hidden, hidden),
            p + "mlp.gate_proj.weight": r(intermediate, hidden),
            p + "mlp.up_proj.weight": r(intermediate, hidden),
            p + "mlp.down_proj.weight": r(hidden, intermediate),
            p + "input_layernorm.weight": r(hidden),
            p + "post_attention_layernorm.weight": r(hidden),
        }
    out["model.norm.weight"] = r(hidden)
    return out


def quickstart() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from areal_like.models.tiny_model import init_model

    with tempfile.TemporaryDirectory() as d:
        return load_file(str(init_model(Path(d), seed=0) / "model.safetensors"))


def _raw_group(store: Any, rank: int, size: int, timeout_s: float) -> Any:
    """A plain gloo group, built exactly as the transport builds its groups."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(dist.PrefixStore("raw/", store), rank, size, opts)


def _timed_raw_broadcast(group: Any, buf: torch.Tensor, verify_bucket: int = 0) -> float:
    """One broadcast of `buf`; with `verify_bucket`, the least any lane that verifies every
    byte must do instead: `buf` in buckets of that size, two in flight as the transport
    sends them, and the receivers digest each bucket once it has landed, with the
    transport's own digest (no layout, header or commit vote)."""
    group.barrier().wait()
    t0 = time.perf_counter()
    if not verify_bucket:
        group.broadcast(buf, 0).wait()
        return time.perf_counter() - t0
    from weight_sync.dist import _WINDOW
    from weight_sync.meta import tensor_digest

    receiving = group.rank() != 0
    in_flight: list[tuple[Any, torch.Tensor]] = []
    for start in range(0, buf.numel(), verify_bucket):
        piece = buf[start:start + verify_bucket]
        in_flight.append((group.broadcast(piece, 0), piece))
        while len(in_flight) >= _WINDOW or (in_flight and start + verify_bucket >= buf.numel()):
            work, landed = in_flight.pop(0)
            work.wait()
            if receiving:
                tensor_digest(landed)
    return time.perf_counter() - t0


def receiver_main(
    rid: str, rank: int, size: int, store_addrs: dict[str, str], raw_port: int, inbox: Any, outbox: Any, errbox: Any
) -> None:
    """A receiver process; its error, if any, goes to `errbox` before it exits non-zero."""
    try:
        _receiver(rid, rank, size, store_addrs, raw_port, inbox, outbox)
    except BaseException:
        errbox.put((rid, traceback.format_exc()))
        errbox.close()
        errbox.join_thread()
        raise


def _receiver(
    rid: str, rank: int, size: int, store_addrs: dict[str, str], raw_port: int, inbox: Any, outbox: Any
) -> None:
    """Answers each wire-encoded meta with its timings; one receiver per lane (sender)."""
    torch.set_num_threads(1)
    from areal_like.core import wire
    from areal_like.core.config import DistWeightSyncConfig
    from areal_like.core.types import WeightUpdateMeta
    from weight_sync import DistWeightReceiver

    if os.environ.get(FAIL_ENV):  # tests/test_bench_smoke.py: a receiver that fails before the rendezvous
        raise RuntimeError(f"injected receiver failure ({FAIL_ENV} is set)")
    receivers = {lane: DistWeightReceiver(DistWeightSyncConfig(type="dist", timeout_s=120,
                                                               shared_memory=lane == "shm"), rid)
                 for lane in store_addrs}
    for lane, addr in store_addrs.items():
        receivers[lane].connect(addr)
    raw_store = dist.TCPStore("127.0.0.1", raw_port, None, False, timeout=datetime.timedelta(seconds=120))
    raw_group = _raw_group(raw_store, rank, size, 120)
    buffers: dict[int, torch.Tensor] = {}
    outbox.put({"id": rid, "event": "started"})
    while True:
        kind, payload = inbox.get()
        if kind == "stop":
            break
        if kind == "raw":
            n, verify_bucket = payload
            buf = buffers.setdefault(n, torch.empty(n, dtype=torch.uint8))
            outbox.put({"id": rid, "seconds": _timed_raw_broadcast(raw_group, buf, verify_bucket)})
            continue
        receiver = receivers[kind]
        meta = wire.decode(payload, expect=WeightUpdateMeta)
        version, named = receiver.receive(meta)
        n = sum(1 for _ in named)
        stats = receiver.last_transfer
        assert stats is not None and n == len(meta.tensors) and stats.lane == kind, (stats, kind)
        outbox.put({"id": rid, "seconds": stats.seconds, "rendezvous_s": stats.rendezvous_s})
    for receiver in receivers.values():
        receiver.close()
    del raw_group, raw_store


def _gather(outbox: Any, n: int) -> list[dict[str, Any]]:
    return [outbox.get(timeout=300) for _ in range(n)]


def _one_transfer(lane: str, sender: Any, version: int, tensors: dict[str, torch.Tensor], inboxes: list[Any],
                  outbox: Any) -> dict[str, float]:
    from areal_like.core import wire

    t0 = time.perf_counter()
    meta = sender.send(version, tensors.items())
    send_s = time.perf_counter() - t0
    frame = wire.encode(meta)
    for q in inboxes:
        q.put((lane, frame))
    answers = _gather(outbox, len(inboxes))
    stats = sender.wait()
    assert stats is not None and stats.ok and stats.lane == lane, (stats, lane)
    slowest = max(answers, key=lambda a: a["seconds"])
    return {
        "send_s": send_s,
        "transfer_s": slowest["seconds"] - slowest["rendezvous_s"],
        "rendezvous_s": slowest["rendezvous_s"],
        "end_to_end_s": send_s + slowest["seconds"],
    }


def bench_model(
    name: str,
    tensors: dict[str, torch.Tensor],
    senders: dict[str, Any],
    raw_group: Any,
    inboxes: list[Any],
    outbox: Any,
    reps: int,
) -> dict[str, Any]:
    """The default lane's figures at the top; the other lanes' (the broadcast, what
    receivers on other hosts get) under `<lane>_lane`, each rep paired with the same
    raw broadcast."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    params = sum(t.numel() for t in tensors.values())
    log.info("%s: %.1fM parameters, %.1f MB", name, params / 1e6, nbytes / 1e6)
    flat = torch.empty(nbytes, dtype=torch.uint8).random_(0, 255)
    bucket = next(iter(senders.values())).bucket_bytes
    rows: dict[str, list[dict[str, float]]] = {lane: [] for lane in senders}
    # Interleaved, so that load from other processes on the box hits all alike.
    for rep in range(reps + 1):  # rep 0 warms up: buffers allocated, groups formed
        got = {lane: _one_transfer(lane, sender, rep + 1, tensors, inboxes, outbox)
               for lane, sender in senders.items()}
        raw_s, verified_s = (_raw_rep(raw_group, flat, verify_bucket, inboxes, outbox)
                             for verify_bucket in (0, bucket))
        for lane, row in got.items():
            row["raw_broadcast_s"] = raw_s
            row["raw_verified_s"] = verified_s
            log.info("%s %s rep %d%s: %s", name, lane, rep, " (warm-up)" if rep == 0 else "",
                     {k: round(v, 4) for k, v in row.items()})
            if rep:
                rows[lane].append(row)
    first, *others = senders
    result = {"lane": first, "tensors": len(tensors), **_summarise(rows[first], params, nbytes)}
    for lane in others:
        result[f"{lane}_lane"] = _summarise(rows[lane], params, nbytes)
    log.info("%s: %s", name, result)
    return result


def _raw_rep(raw_group: Any, flat: torch.Tensor, verify_bucket: int, inboxes: list[Any], outbox: Any) -> float:
    for q in inboxes:
        q.put(("raw", (flat.numel(), verify_bucket)))
    own = _timed_raw_broadcast(raw_group, flat, verify_bucket)
    return max([own] + [a["seconds"] for a in _gather(outbox, len(inboxes))])


def _summarise(rows: list[dict[str, float]], params: int, nbytes: int) -> dict[str, Any]:
    result: dict[str, Any] = {"params": params, "bytes": nbytes, "reps": len(rows)}
    for key in rows[0]:
        result[key] = round(statistics.median(r[key] for r in rows), 4)
    best_transfer = min(r["transfer_s"] for r in rows)
    best_raw = min(r["raw_broadcast_s"] for r in rows)
    result["gb_per_s"] = round(nbytes / result["transfer_s"] / 1e9, 3)
    result["raw_gb_per_s"] = round(nbytes / result["raw_broadcast_s"] / 1e9, 3)
    result["best_gb_per_s"] = round(nbytes / best_transfer / 1e9, 3)
    result["best_raw_gb_per_s"] = round(nbytes / best_raw / 1e9, 3)
    # Each rep's transfer and raw broadcast run back to back, so their ratio sees the
    # same load from the other jobs on the box; the median of those paired ratios is
    # the headline. Ratios of the medians and of the bests are there for comparison.
    paired = [r["raw_broadcast_s"] / r["transfer_s"] for r in rows]
    result["ratio_to_raw_broadcast"] = round(statistics.median(paired), 3)
    result["ratio_paired_min_max"] = [round(min(paired), 3), round(max(paired), 3)]
    result["ratio_of_medians"] = round(result["raw_broadcast_s"] / result["transfer_s"], 3)
    result["ratio_of_bests"] = round(best_raw / best_transfer, 3)
    # The ceiling on this machine for a lane that verifies what it receives: the raw
    # broadcast against itself bucketed and digested (paired per rep, as above).
    result["verified_raw_ratio_to_raw_broadcast"] = round(
        statistics.median(r["raw_broadcast_s"] / r["raw_verified_s"] for r in rows), 3)
    return result


def _watch(procs: list[Any], errbox: Any, stopping: threading.Event) -> None:
    """Fail this process as soon as a receiver fails, with the receiver's traceback.

    The main thread may be blocked in a gloo rendezvous or broadcast that only a timeout
    ends; this thread reports the receiver's error and exits the process instead."""
    while not stopping.wait(0.2):
        try:
            rid, tb = errbox.get_nowait()
        except queue.Empty:
            dead = [p for p in procs if p.exitcode is not None]
            if not dead or stopping.is_set():
                continue
            try:
                rid, tb = errbox.get(timeout=2)
            except queue.Empty:
                rid, tb = dead[0].name, f"exited with code {dead[0].exitcode} before it was told to stop\n"
        if stopping.is_set():
            return
        sys.stderr.write(f"bench/weight_sync.py: receiver {rid} failed, stopping:\n{tb}")
        sys.stderr.flush()
        for p in procs:
            if p.is_alive():
                p.kill()
        os._exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--receivers", type=int, default=1)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--lanes", choices=["both", "shm", "gloo"], default="both",
                        help="shm: same-host receivers read the staging file; gloo: the broadcast")
    parser.add_argument("--big-layers", type=int, default=12, help="layers of the ~100M Qwen2-layout model")
    parser.add_argument("--big-hidden", type=int, default=768, help="hidden size of the ~100M Qwen2-layout model")
    args, rec = _record.parse(parser, __file__, smoke={"reps": 1, "big_layers": 1, "big_hidden": 128})
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    from areal_like.core.config import DistWeightSyncConfig
    from weight_sync import DistWeightSender

    # The shared-memory lane is what same-host receivers get (the default); the
    # broadcast is what receivers on other hosts get.
    lanes = ["shm", "gloo"] if args.lanes == "both" else [args.lanes]
    senders = {lane: DistWeightSender(DistWeightSyncConfig(
        type="dist", bucket_mb=args.bucket_mb, timeout_s=120, store_addr="127.0.0.1:0",
        shared_memory=lane == "shm")) for lane in lanes}
    raw_store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    outbox = ctx.Queue()
    errbox = ctx.Queue()
    inboxes = [ctx.Queue() for _ in range(args.receivers)]
    size = args.receivers + 1
    procs = [
        ctx.Process(
            target=receiver_main,
            args=(f"r{i}", i + 1, size, {lane: s.store_addr for lane, s in senders.items()}, raw_store.port, q,
                  outbox, errbox),
            name=f"r{i}",
            daemon=True,
        )
        for i, q in enumerate(inboxes)
    ]
    for p in procs:
        p.start()
    stopping = threading.Event()
    threading.Thread(target=_watch, args=(procs, errbox, stopping), daemon=True).start()
    try:
        raw_group = _raw_group(raw_store, 0, size, 120)
        _gather(outbox, args.receivers)
        for sender in senders.values():
            sender.wait_for_receivers(args.receivers, timeout=120)
        models = {"quickstart": quickstart(),
                  "qwen2_100m": qwen2_like(hidden=args.big_hidden, layers=args.big_layers)}
        results = {
            name: bench_model(name, tensors, senders, raw_group, inboxes, outbox, args.reps)
            for name, tensors in models.items()
        }
    finally:
        stopping.set()
        for q in inboxes:
            q.put(("stop", None))
        for p in procs:
            p.join(30)
        for sender in senders.values():
            sender.close()
    big = results["qwen2_100m"]
    rec.finish({
        "bench": "weight_sync",
        "transport": "dist/" + "+".join(lanes),
        "receivers": args.receivers,
        "bucket_mb": args.bucket_mb,
        "threads": torch.get_num_threads(),
        **results,
        "ratio_to_raw_broadcast": big["ratio_to_raw_broadcast"],
        **({"broadcast_lane_ratio_to_raw_broadcast": big["gloo_lane"]["ratio_to_raw_broadcast"]}
           if "gloo_lane" in big else {}),
        "verified_raw_ratio_to_raw_broadcast": big["verified_raw_ratio_to_raw_broadcast"],
    })


if __name__ == "__main__":
    main()
