"""The msgpack wire codec: typed frames, arrays as raw bytes, never pickle.

A frame is a msgpack map ``{"t": <type name>, "b": <body>}``. The body is the
message's ``model_dump()``, except that token ids, logprobs, masks and versions
(the fields named in ``_ARRAY_FIELDS``) travel as ``{"__nd__": [dtype, shape,
bytes]}``: a 1k-token trajectory is then a few kilobytes of raw bytes instead of a
thousand msgpack integers. Any numpy array in a body travels the same way, which is
how tensors move (`TensorBundle`).

Decoding is defensive: a frame over ``max_bytes``, bytes that are not msgpack, an
unknown type, nesting deeper than ``_MAX_DEPTH``, an array whose byte count
disagrees with its dtype and shape (checked before anything is allocated), or a
body that fails validation raises `WireError` with a message saying which. The
receiver catches it, counts it, and keeps running.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from areal_like.core.types import (
    GenerateRequest,
    GenerateResult,
    RolloutStats,
    Trajectory,
    TrajectoryGroup,
    VersionAnnouncement,
    WeightUpdateMeta,
)

__all__ = ["WireError", "TensorBundle", "encode", "decode", "MESSAGE_TYPES", "DEFAULT_MAX_BYTES"]

DEFAULT_MAX_BYTES = 256 * 1024 * 1024

# dtype names allowed on the wire; bfloat16 travels as its raw 16-bit pattern.
_DTYPES = {
    "bool": np.bool_,
    "int8": np.int8,
    "uint8": np.uint8,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
    "float16": np.float16,
    "float32": np.float32,
    "float64": np.float64,
    "bfloat16": np.uint16,
}

_ARRAY_FIELDS = {
    "prompt_ids": np.int32,
    "response_ids": np.int32,
    "token_ids": np.int32,
    "response_mask": np.int8,
    "response_logprobs": np.float64,
    "logprobs": np.float64,
    "response_versions": np.int32,
    "versions": np.int32,
}
_ND = "__nd__"
_MAX_NDIM = 8
# No message nests deeper than a few levels; a deeper frame is refused before Python's
# recursion limit (msgpack itself allows ~1000 levels) could turn it into a crash.
_MAX_DEPTH = 32


class WireError(ValueError):
    """A frame was refused. The message says why; the receiver should keep running."""


class TensorBundle(BaseModel):
    """Named arrays (e.g. a train batch or a weight bucket's metadata test payload)."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)
    arrays: dict[str, np.ndarray]
    meta: dict[str, Any] = {}


MESSAGE_TYPES: dict[str, type[BaseModel]] = {
    "generate_request": GenerateRequest,
    "generate_result": GenerateResult,
    "trajectory": Trajectory,
    "trajectory_group": TrajectoryGroup,
    "rollout_stats": RolloutStats,
    "version": VersionAnnouncement,
    "weight_update": WeightUpdateMeta,
    "tensor_bundle": TensorBundle,
}
_TYPE_NAMES = {cls: name for name, cls in MESSAGE_TYPES.items()}


def _pack_array(a: np.ndarray, dtype_name: str | None = None) -> dict[str, Any]:
    a = np.ascontiguousarray(a)
    name = dtype_name or a.dtype.name
    if name not in _DTYPES:
        raise WireError(f"dtype {a.dtype} cannot travel on the wire (allowed: {sorted(_DTYPES)})")
    return {_ND: [name, list(a.shape), a.tobytes()]}


def _to_wire(obj: Any, key: str | None = None) -> Any:
    if isinstance(obj, dict):
        return {k: _to_wire(v, k) for k, v in obj.items()}
    if isinstance(obj, np.ndarray):
        return _pack_array(obj)
    if isinstance(obj, list):
        if key in _ARRAY_FIELDS:
            return _pack_array(np.asarray(obj, dtype=_ARRAY_FIELDS[key]))
        return [_to_wire(v) for v in obj]
    return obj


def _unpack_array(spec: Any) -> np.ndarray:
    if not (isinstance(spec, list) and len(spec) == 3):
        raise WireError("array entry must be [dtype, shape, bytes]")
    name, shape, data = spec
    if name not in _DTYPES:
        raise WireError(f"unknown array dtype {name!r}")
    if (
        not isinstance(shape, list)
        or len(shape) > _MAX_NDIM
        or not all(isinstance(d, int) and d >= 0 for d in shape)
    ):
        raise WireError(f"bad array shape {shape!r}")
    if not isinstance(data, bytes):
        raise WireError("array data must be bytes")
    dtype = np.dtype(_DTYPES[name])
    count = 1
    for d in shape:
        count *= d
    if count * dtype.itemsize != len(data):
        raise WireError(
            f"array of dtype {name} and shape {shape} needs {count * dtype.itemsize} bytes, "
            f"frame has {len(data)}"
        )
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def _from_wire(obj: Any, want_lists: bool, depth: int = 0) -> Any:
    if depth > _MAX_DEPTH:
        raise WireError(f"frame nests deeper than {_MAX_DEPTH} levels")
    if isinstance(obj, dict):
        if _ND in obj:
            if len(obj) != 1:
                raise WireError("array entry has extra keys")
            arr = _unpack_array(obj[_ND])
            return arr.tolist() if want_lists else arr
        return {k: _from_wire(v, want_lists, depth + 1) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_from_wire(v, want_lists, depth + 1) for v in obj]
    return obj


def encode(msg: BaseModel) -> bytes:
    """Serialise one typed message into a frame."""
    name = _TYPE_NAMES.get(type(msg))
    if name is None:
        raise WireError(f"{type(msg).__name__} is not a wire message type")
    if isinstance(msg, TensorBundle):
        body: Any = {"arrays": {k: _pack_array(v) for k, v in msg.arrays.items()}, "meta": msg.meta}
    else:
        body = _to_wire(msg.model_dump(mode="python"))
    return msgpack.packb({"t": name, "b": body}, use_bin_type=True)


def decode(frame: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES, expect: type[BaseModel] | None = None) -> Any:
    """Parse and validate one frame; raise `WireError` on anything wrong with it."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise WireError(f"frame must be bytes, got {type(frame).__name__}")
    if len(frame) > max_bytes:
        raise WireError(f"frame of {len(frame)} bytes exceeds the limit of {max_bytes}")
    try:
        raw = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            use_list=True,
        )
    except Exception as e:  # msgpack raises several unrelated types
        raise WireError(f"frame is not valid msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(raw, dict) or set(raw) != {"t", "b"}:
        raise WireError("frame must be a map with exactly the keys 't' and 'b'")
    name = raw["t"]
    cls = MESSAGE_TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise WireError(f"unknown message type {name!r} (known: {sorted(MESSAGE_TYPES)})")
    if expect is not None and cls is not expect:
        raise WireError(f"expected a {_TYPE_NAMES[expect]!r} frame, got {name!r}")
    if not isinstance(raw["b"], dict):
        raise WireError(f"{name} body must be a map")
    try:
        if cls is TensorBundle:
            body = _from_wire(raw["b"], want_lists=False)
            return TensorBundle.model_validate(body)
        return cls.model_validate(_from_wire(raw["b"], want_lists=True))
    except WireError:
        raise
    except ValidationError as e:
        raise WireError(f"invalid {name} message: {e}") from None
    except (TypeError, ValueError) as e:
        raise WireError(f"invalid {name} message: {e}") from None
