"""Wire codec: typed round trips with raw arrays; bad frames refused clearly."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from areal_like.core.types import (
    GateCounts,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    TensorMeta,
    Trajectory,
    TrajectoryGroup,
    VersionAnnouncement,
    WeightUpdateMeta,
)
from areal_like.core.wire import TensorBundle, WireError, decode, encode


def _traj(i: int = 0, n: int = 1000) -> Trajectory:
    rng = np.random.default_rng(i)
    mask = [0 if n // 2 <= k < n // 2 + n // 10 else 1 for k in range(n)]
    return Trajectory(
        episode_id=f"e{i}",
        group_id="g0",
        prompt_ids=list(range(1, 20)),
        response_ids=rng.integers(0, 100, n).tolist(),
        response_mask=mask,
        response_logprobs=[-float(x) if m else 0.0 for x, m in zip(rng.random(n), mask, strict=True)],
        response_versions=[3 if m else -1 for m in mask],
        reward=1.0,
    )


def test_trajectory_group_round_trip_exact() -> None:
    group = TrajectoryGroup(group_id="g0", trajectories=[_traj(i) for i in range(4)], failed=1, failure_reasons=["x"])
    frame = encode(group)
    back = decode(frame)
    assert back == group
    # arrays travel as raw bytes: 4 (id) + 1 (mask) + 8 (logprob) + 4 (version) per token
    assert len(frame) < 4 * (1000 * 17 + 1000)


@pytest.mark.parametrize(
    "msg",
    [
        GenerateRequest(request_id="r", prompt_ids=[1, 2, 3], sampling_params=SamplingParams(temperature=0.5, seed=3)),
        GenerateResult(request_id="r", token_ids=[4, 5], logprobs=[-0.1, -0.2], versions=[0, 1], stop_reason="stop"),
        VersionAnnouncement(version=3, counts=GateCounts(consumed=10, dropped=2)),
        WeightUpdateMeta(version=1, transport="dist", tensors=[TensorMeta(name="w", dtype="float32", shape=[2, 3])], checksum="ab"),
    ],
)
def test_messages_round_trip(msg) -> None:
    assert decode(encode(msg)) == msg


def test_tensor_bundle_round_trip() -> None:
    arrays = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.array([1, 2], dtype=np.int64)}
    back = decode(encode(TensorBundle(arrays=arrays, meta={"step": 1})))
    for k, v in arrays.items():
        assert back.arrays[k].dtype == v.dtype and np.array_equal(back.arrays[k], v)
    assert back.meta == {"step": 1}


def test_refusals_are_specific() -> None:
    good = encode(_traj(0, 10))
    with pytest.raises(WireError, match="exceeds the limit"):
        decode(good, max_bytes=10)
    with pytest.raises(WireError, match="not valid msgpack"):
        decode(b"\xc1\xc1garbage")
    with pytest.raises(WireError, match="unknown message type 'pickle'"):
        decode(msgpack.packb({"t": "pickle", "b": {}}))
    with pytest.raises(WireError, match="exactly the keys"):
        decode(msgpack.packb([1, 2, 3]))
    with pytest.raises(WireError, match="expected a 'version' frame"):
        decode(good, expect=VersionAnnouncement)
    # array whose byte count disagrees with its shape
    raw = msgpack.unpackb(good, raw=False)
    raw["b"]["response_ids"]["__nd__"][1] = [999]
    with pytest.raises(WireError, match="needs 3996 bytes"):
        decode(msgpack.packb(raw, use_bin_type=True))
    # invalid content: provenance broken
    raw = msgpack.unpackb(good, raw=False)
    raw["b"]["reward"] = "high"
    with pytest.raises(WireError, match="invalid trajectory message"):
        decode(msgpack.packb(raw, use_bin_type=True))
    with pytest.raises(WireError, match="unknown array dtype"):
        decode(msgpack.packb({"t": "tensor_bundle", "b": {"arrays": {"x": {"__nd__": ["object", [1], b"x"]}}}}, use_bin_type=True))


def test_receiver_survives_fuzzed_frames() -> None:
    """Random mutations of a valid frame either decode to a valid message or raise WireError."""
    rng = np.random.default_rng(0)
    good = bytearray(encode(_traj(0, 50)))
    refused = 0
    for _ in range(500):
        frame = bytearray(good)
        for _ in range(rng.integers(1, 6)):
            frame[rng.integers(0, len(frame))] = rng.integers(0, 256)
        try:  # any exception other than WireError fails the test
            assert isinstance(decode(bytes(frame)), Trajectory)
        except WireError:
            refused += 1
    assert refused > 0
