"""Loading in place on the shared-memory lane (docs/design.md §10.44, revised): an engine
that writes tensors itself (`loads_in_place`) gets the version as slices of the sender's
staging file, verified first and loaded before the receiver votes, so no buffer on the
receiving side ever holds the version; a load that fails is that receiver's refusal, a
scribbled file is refused before anything is loaded, and the broadcast lane (other hosts)
still arrives in the buffer."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from areal_like.core.config import DistWeightSyncConfig
from areal_like.core.types import WeightUpdateMeta
from tests.weight_sync.conftest import TIMEOUT_S
from weight_sync import DistWeightReceiver, DistWeightSender, WeightSyncError
from weight_sync.meta import streamed_digest, tensor_digest
from weight_sync.shm import FileSlice


def _receiver(sender: DistWeightSender, rid: str = "r", shared_memory: bool = True) -> DistWeightReceiver:
    r = DistWeightReceiver(DistWeightSyncConfig(type="dist", timeout_s=TIMEOUT_S, shared_memory=shared_memory), rid)
    r.connect(sender.store_addr)
    sender.wait_for_receivers(1)
    return r


def _receive(r: DistWeightReceiver, meta: WeightUpdateMeta, load: Callable[[list[Any]], None]) -> Any:
    """`r.receive(meta, load)` on its own thread (the sender's side runs here): the
    iterator's pairs, cloned, or the error."""
    out: list[Any] = []

    def run() -> None:
        try:
            _, named = r.receive(meta, load)
            out.append([(n, t.clone()) for n, t in named])
        except WeightSyncError as e:
            out.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join(6 * TIMEOUT_S)
    return out[0]


def _tensors(k: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((300, 70), k), "b": torch.arange(5.0) * k, "e": torch.empty(0)}


def test_a_version_loads_straight_from_the_senders_file(sender: DistWeightSender) -> None:
    r = _receiver(sender)
    for version in (1, 2):
        tensors = _tensors(version)
        dst = {"w": torch.zeros(300, 70), "b": torch.zeros(5, dtype=torch.bfloat16), "e": torch.empty(0)}
        seen: list[str] = []

        def load(named: list[tuple[str, Any]], dst: dict[str, torch.Tensor] = dst,
                 tensors: dict[str, torch.Tensor] = tensors, seen: list[str] = seen) -> None:
            for name, piece in named:
                assert isinstance(piece, FileSlice) and piece.shape == tensors[name].shape
                piece.into(dst[name])  # the bf16 destination converts
                seen.append(name)

        got = _receive(r, sender.send(version, tensors.items()), load)
        assert got == [] and seen == ["w", "b", "e"]
        assert torch.equal(dst["w"], tensors["w"]) and torch.equal(dst["b"], tensors["b"].to(torch.bfloat16))
        assert r._flat is None  # nothing on this side held the version
        stats = sender.wait()
        assert stats is not None and stats.ok and stats.accepted == 1 and stats.lane == "shm"
    r.close()


def test_the_vote_waits_for_the_reading_not_for_the_rest_of_the_load(sender: DistWeightSender) -> None:
    """A load that goes on after reading the file (the engine re-prefills its interrupted
    requests) returns a future: the receiver votes once every slice was read, and a load
    that fails before reading everything is the refusal."""
    import concurrent.futures
    import time

    r = _receiver(sender)
    later: concurrent.futures.Future[None] = concurrent.futures.Future()
    dst = {"w": torch.zeros(300, 70), "b": torch.zeros(5), "e": torch.empty(0)}

    def load(named: list[tuple[str, Any]]) -> concurrent.futures.Future[None]:
        for name, piece in named:
            piece.into(dst[name])
        threading.Timer(3.0, later.set_result, (None,)).start()  # "re-prefilling" for 3 s
        return later

    t0 = time.perf_counter()
    assert _receive(r, sender.send(1, _tensors(1).items()), load) == []
    assert time.perf_counter() - t0 < 2.5 and not later.done()  # voted once the file was read
    assert torch.equal(dst["w"], _tensors(1)["w"])
    failed: concurrent.futures.Future[None] = concurrent.futures.Future()
    failed.set_exception(ValueError("load_weights: w has shape [1], expected [300, 70]"))
    got = _receive(r, sender.send(2, _tensors(2).items()), lambda named: failed)
    assert isinstance(got, WeightSyncError) and "expected [300, 70]" in str(got)
    stats = sender.wait()
    assert stats is not None and stats.accepted == 0
    r.close()


def test_a_load_that_fails_is_this_receivers_refusal(sender: DistWeightSender) -> None:
    r = _receiver(sender)

    def load(named: list[tuple[str, Any]]) -> None:
        raise KeyError("load_weights: unknown weight 'w'")

    got = _receive(r, sender.send(1, _tensors(1).items()), load)
    assert isinstance(got, WeightSyncError) and "not loaded" in str(got) and "unknown weight" in str(got)
    stats = sender.wait()
    assert stats is not None and stats.accepted == 0
    r.close()


def test_a_scribbled_file_is_refused_before_anything_is_loaded(sender: DistWeightSender) -> None:
    r = _receiver(sender)
    calls: list[int] = []
    meta = sender.send(1, _tensors(1).items())
    assert sender._shm.path is not None
    with open(sender._shm.path, "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xfe")
    got = _receive(r, meta, lambda named: calls.append(1))
    assert isinstance(got, WeightSyncError) and "checksum mismatch" in str(got) and calls == []
    sender.wait()
    r.close()


def test_the_broadcast_lane_arrives_in_the_buffer_and_does_not_call_load(sender: DistWeightSender) -> None:
    r = _receiver(sender, shared_memory=False)
    calls: list[int] = []
    got = _receive(r, sender.send(1, _tensors(1).items()), lambda named: calls.append(1))
    assert calls == [] and {n: t for n, t in got}.keys() == _tensors(1).keys()
    assert all(torch.equal(t, _tensors(1)[n]) for n, t in got)
    stats = sender.wait()
    assert stats is not None and stats.lane == "gloo" and stats.accepted == 1
    r.close()


@pytest.mark.parametrize("nbytes", [0, 8, 200, 65536, 3 * 65536 + 200, 5 * 65536 + 7])
def test_a_streamed_digest_is_the_tensors_digest(nbytes: int) -> None:
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    piece = 2 * 65536
    pieces = [raw[i:i + piece].clone() for i in range(0, nbytes, piece)]
    assert streamed_digest(pieces, nbytes) == tensor_digest(raw)
    if nbytes > 8:
        bad = raw.clone()
        bad[nbytes // 2] ^= 1
        assert streamed_digest([bad[i:i + piece].clone() for i in range(0, nbytes, piece)], nbytes) != tensor_digest(raw)


def test_an_embedded_server_loads_the_version_in_place(tiny_model_dir) -> None:  # noqa: ANN001
    """The server path: an embedded engine's server receives on the shared-memory lane,
    its engine serves the sent weights, and the receiver holds no buffer."""
    from rollout_cluster.server import RolloutServer

    async def main() -> None:
        server = RolloutServer(tiny_model_dir, set_threads=False)
        r = DistWeightReceiver(DistWeightSyncConfig(type="dist", timeout_s=TIMEOUT_S), "s0")
        server.attach_receiver(r, "s0", TIMEOUT_S)
        s = DistWeightSender(DistWeightSyncConfig(type="dist", timeout_s=TIMEOUT_S, store_addr="127.0.0.1:0"))
        try:
            await server.join_weights(s.store_addr)
            await asyncio.to_thread(s.wait_for_receivers, 1)
            state = await server.export_weights()
            new = [(n, t + 0.5) for n, t in state]
            meta = await asyncio.to_thread(s.send, 1, new)
            assert await server.receive_weights(meta) == 1
            stats = await asyncio.to_thread(s.wait)
            assert stats is not None and stats.accepted == 1 and stats.lane == "shm"
            served = dict(await server.export_weights())
            assert all(torch.equal(served[n], t) for n, t in new) and r._flat is None
        finally:
            s.close()
            r.close()
            await server.close()

    asyncio.run(main())
