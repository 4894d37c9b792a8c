"""ToolAgentLoop against a scripted server: exact trajectories and every way an episode ends."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from areal_like.core.config import AgentConfig, ToolSpec
from areal_like.core.types import AgentLoopOutput, SamplingParams
from rollout_cluster.agent_loop import ChatTemplate, ToolAgentLoop, truncate_text
from rollout_cluster.agent_loop.chat import template_ids
from rollout_cluster.server_manager import ServerManager
from rollout_cluster.tools import BaseTool, CalculatorTool, FunctionTool, ToolResult

from ._agent_fakes import FakeServer, call_text, turn_logprobs

SAMPLE = {"prompt": [{"role": "user", "content": "123*45"}], "answer": "5535"}


def make_loop(
    tokenizer: Any,
    script: Any,
    *,
    tools: list[BaseTool] | None = None,
    response_length: int = 200,
    version: int = 3,
    **agent: Any,
) -> tuple[ToolAgentLoop, FakeServer]:
    server = FakeServer(tokenizer, script, version=version)
    loop = ToolAgentLoop(
        server_manager=ServerManager([server]),
        tokenizer=tokenizer,
        config=AgentConfig(**agent),
        response_length=response_length,
        tools=tools if tools is not None else [CalculatorTool("calculator")],
    )
    return loop, server


def run(loop: ToolAgentLoop, sample: dict[str, Any] = SAMPLE, **params: Any) -> AgentLoopOutput:
    out = asyncio.run(loop.run(SamplingParams(**params), episode_id="ep", **sample))
    assert out is not None
    return out


def enc(tokenizer: Any, text: str, eos: bool = True) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] if eos else [])


def tool_ids(tokenizer: Any, *contents: str) -> list[int]:
    msgs = [{"role": "tool", "content": c, "name": "calculator"} for c in contents]
    return ChatTemplate(tokenizer).observation_ids(msgs)


def test_two_turn_episode_has_exact_ids_mask_logprobs_versions(tokenizer: Any) -> None:
    loop, server = make_loop(tokenizer, [call_text("123*45"), "5535"])
    out = run(loop)

    schemas = [CalculatorTool("calculator").schema]
    prompt = template_ids(tokenizer, SAMPLE["prompt"], tools=schemas, add_generation_prompt=True)
    t1, obs, t2 = enc(tokenizer, call_text("123*45")), tool_ids(tokenizer, "5535"), enc(tokenizer, "5535")
    assert out.prompt_ids == prompt
    assert out.response_ids == t1 + obs + t2
    assert out.response_mask == [1] * len(t1) + [0] * len(obs) + [1] * len(t2)
    assert out.response_logprobs == turn_logprobs(0, len(t1)) + [0.0] * len(obs) + turn_logprobs(1, len(t2))
    assert out.response_versions == [3] * len(t1) + [-1] * len(obs) + [3] * len(t2)
    assert out.final_text == "5535"
    assert out.termination == "no_tool_call" and not out.truncated
    assert out.num_turns == 3
    assert [m["role"] for m in out.messages] == ["user", "assistant", "tool", "assistant"]
    # Each turn continues the exact sequence so far, with one sticky session per episode.
    assert [c[0] for c in server.calls] == ["ep/0", "ep/1"]
    assert server.calls[1][1] == prompt + t1 + obs
    # The end-of-turn token stops every turn; the budget caps max_tokens.
    assert tokenizer.eos_token_id in server.calls[0][2].stop_token_ids
    assert server.calls[0][2].max_tokens == 200
    assert server.calls[1][2].max_tokens == 200 - len(t1) - len(obs)


def test_assembled_ids_equal_template_of_full_conversation(tokenizer: Any) -> None:
    """Real tokenizer: the stripped tool tokens make prompt + response identical to the
    template of the whole conversation (token continuity, invariant 4)."""
    loop, _ = make_loop(tokenizer, [call_text("12+3"), call_text("15*2"), "30"])
    out = run(loop)
    full = template_ids(
        tokenizer,
        out.messages,
        tools=[CalculatorTool("calculator").schema],
        add_generation_prompt=False,
    )
    assert out.prompt_ids + out.response_ids == full
    # The tool part is exactly the tool message block plus the next assistant header, no system block.
    obs = tool_ids(tokenizer, "15")
    assert (
        tokenizer.decode(obs)
        == "<|im_start|>tool<tool_response>15</tool_response><|im_end|><|im_start|>assistant"
    )


def test_prefix_of_a_template_with_default_system_prompt_is_stripped(tokenizer: Any) -> None:
    class WithSystem:
        """Wraps the real tokenizer with a template that injects a default system message."""

        eos_token_id = tokenizer.eos_token_id

        def apply_chat_template(self, messages: list[dict[str, Any]], **kw: Any) -> Any:
            return tokenizer.apply_chat_template([{"role": "system", "content": "be brief"}, *messages], **kw)

    chat = ChatTemplate(WithSystem())
    msgs = [{"role": "tool", "content": "7"}]
    assert chat.observation_ids(msgs) == ChatTemplate(tokenizer).observation_ids(msgs)


def test_template_renders_are_cached_per_conversation_and_exact(tokenizer: Any) -> None:
    """A group's samples share one prompt render; cached ids equal fresh ones, a caller
    editing its list does not edit the cache, and a clock-reading template is never cached."""

    class Counting:
        eos_token_id = tokenizer.eos_token_id
        chat_template = "{{ messages }}"

        def __init__(self) -> None:
            self.renders = 0

        def apply_chat_template(self, messages: list[dict[str, Any]], **kw: Any) -> Any:
            self.renders += 1
            return tokenizer.apply_chat_template(messages, **kw)

    tools = [CalculatorTool("calculator").schema]
    fresh = ChatTemplate(tokenizer)
    fresh.cache_size = 0
    counting = Counting()
    chat = ChatTemplate(counting)
    for _ in range(8):
        ids = chat.prompt_ids(SAMPLE["prompt"], tools=tools)
        assert ids == fresh.prompt_ids(SAMPLE["prompt"], tools=tools)
        ids.append(-1)  # the caller's own copy
    assert counting.renders == 1
    other = [{"role": "user", "content": "9*9"}]
    assert chat.prompt_ids(other, tools=tools) == fresh.prompt_ids(other, tools=tools)
    assert chat.prompt_ids(SAMPLE["prompt"]) == fresh.prompt_ids(SAMPLE["prompt"])  # tools are in the key
    assert counting.renders == 3
    msgs = [{"role": "tool", "content": "5535", "name": "calculator"}]
    assert chat.observation_ids(msgs) == chat.observation_ids(msgs) == fresh.observation_ids(msgs)

    clock = Counting()
    clock.chat_template = "{{ strftime_now('%d %b %Y') }}{{ messages }}"
    dated = ChatTemplate(clock)
    dated.prompt_ids(SAMPLE["prompt"])
    dated.prompt_ids(SAMPLE["prompt"])
    assert clock.renders == 2


def test_max_assistant_turns_ends_without_a_tool_turn(tokenizer: Any) -> None:
    loop, server = make_loop(tokenizer, [call_text("1+1"), call_text("2+2"), "4"], max_assistant_turns=2)
    out = run(loop)
    assert out.termination == "max_assistant_turns"
    assert len(server.calls) == 2
    assert out.response_mask[-1] == 1  # the last turn is never a tool turn
    assert out.final_text == ""


def test_max_user_turns(tokenizer: Any) -> None:
    loop, server = make_loop(tokenizer, [call_text("1+1"), call_text("2+2"), "4"], max_user_turns=1)
    out = run(loop)
    assert out.termination == "max_user_turns"
    assert len(server.calls) == 2 and out.metrics["user_turns"] == 1
    assert out.response_mask[-1] == 1


def test_response_budget_counts_tool_tokens_and_never_ends_on_a_tool_turn(tokenizer: Any) -> None:
    t1 = enc(tokenizer, call_text("123*45"))
    obs = tool_ids(tokenizer, "5535")
    # Room for the first turn and the observation, but not one more generated token.
    loop, server = make_loop(tokenizer, [call_text("123*45"), "5535"], response_length=len(t1) + len(obs))
    out = run(loop)
    assert out.termination == "response_length" and out.truncated
    assert out.response_ids == t1 and len(server.calls) == 1
    # One token more: the observation fits and the second turn gets exactly one token.
    loop, server = make_loop(tokenizer, [call_text("123*45"), "5535"], response_length=len(t1) + len(obs) + 1)
    out = run(loop)
    assert len(out.response_ids) == len(t1) + len(obs) + 1 and out.truncated
    assert server.calls[1][2].max_tokens == 1
    assert out.stop_reason == "length"


def test_length_and_abort_stop_reasons_terminate(tokenizer: Any) -> None:
    loop, _ = make_loop(tokenizer, [(call_text("1+1")[:20], "length"), "never"])
    out = run(loop)
    assert out.termination == "response_length" and out.truncated
    loop, server = make_loop(tokenizer, [("<tool_call>", "abort"), "never"])
    out = run(loop)
    assert out.termination == "abort" and out.stop_reason == "abort"
    assert len(server.calls) == 1


def test_sampling_max_tokens_caps_each_turn(tokenizer: Any) -> None:
    loop, server = make_loop(tokenizer, ["a long answer that will be cut"])
    out = run(loop, max_tokens=5)
    assert len(out.response_ids) == 5 and out.truncated
    assert server.calls[0][2].max_tokens == 5


@pytest.mark.parametrize(
    ("side", "expected"),
    [("left", "...6789"), ("right", "0123..."), ("middle", "012...89")],
)
def test_truncate_text_sides(side: str, expected: str) -> None:
    assert truncate_text("0123456789", 4 if side != "middle" else 5, side) == expected
    assert truncate_text("short", 10, side) == "short"


def test_long_tool_answer_truncated_in_episode(tokenizer: Any) -> None:
    def digits(n: int) -> str:
        """Return n digits."""
        return "0123456789" * n

    loop, _ = make_loop(
        tokenizer,
        ['<tool_call>{"name": "digits", "arguments": {"n": 5}}</tool_call>', "done"],
        tools=[FunctionTool(digits)],
        max_tool_response_length=6,
        tool_response_truncate_side="left",
    )
    out = run(loop)
    assert out.messages[2]["content"] == "...456789"


@pytest.mark.parametrize(
    ("call", "error"),
    [
        ("<tool_call>{not json}</tool_call>", "not valid JSON"),
        ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "unknown tool 'search'"),
        ('<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>', "missing required"),
        (
            '<tool_call>{"name": "calculator", "arguments": {"expression": 7}}</tool_call>',
            "must be of type string",
        ),
        (call_text("1/0"), "unexpected character '/'"),
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+', "closing </tool_call>"),
    ],
)
def test_malformed_calls_are_answered_not_fatal(tokenizer: Any, call: str, error: str) -> None:
    loop, _ = make_loop(tokenizer, [call, "0"], max_tool_response_length=500)
    out = run(loop, max_tokens=100)
    tool_message = out.messages[2]
    assert tool_message["role"] == "tool" and tool_message["content"].startswith("Error")
    assert error in tool_message["content"]
    assert out.termination == "no_tool_call" and out.metrics["tool_calls"] == 1


def test_tool_timeout_becomes_error_message(tokenizer: Any) -> None:
    async def slow(x: str) -> str:
        """Never answers in time."""
        await asyncio.sleep(5)
        return x

    tool = FunctionTool(slow, timeout_s=0.05)
    loop, _ = make_loop(
        tokenizer,
        ['<tool_call>{"name": "slow", "arguments": {"x": "a"}}</tool_call>', "done"],
        tools=[tool],
        max_tool_response_length=500,
    )
    out = run(loop)
    assert out.messages[2]["content"] == "Error: slow timed out after 0.05s"
    assert out.metrics["tool_timeout"] == 1


def test_parallel_calls_run_concurrently_and_are_capped(tokenizer: Any) -> None:
    class Gate(BaseTool):
        """Counts concurrent executions; records creates and releases."""

        parameters = {"type": "object", "properties": {"expression": {"type": "string"}}}

        def __init__(self) -> None:
            super().__init__("calculator")
            self.active = self.peak = 0
            self.created: list[str] = []
            self.released: list[str] = []

        async def create(self, instance_id: str, **kwargs: Any) -> None:
            self.created.append(instance_id)

        async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
            self.active += 1
            self.peak = max(self.peak, self.active)
            await asyncio.sleep(0.02)
            self.active -= 1
            return ToolResult(arguments["expression"], reward=0.5)

        async def release(self, instance_id: str) -> None:
            self.released.append(instance_id)

    gate = Gate()
    turn = "".join(call_text(e) for e in ["a", "b", "c"])
    loop, server = make_loop(tokenizer, [turn, "done"], tools=[gate], max_parallel_calls=2)
    out = run(loop)
    tool_msgs = [m for m in out.messages if m["role"] == "tool"]
    assert [m["content"] for m in tool_msgs] == ["a", "b"]
    assert gate.peak == 2
    assert out.metrics["dropped_calls"] == 1 and out.extra["tool_rewards"] == [0.5, 0.5]
    assert gate.created == ["ep/calculator"] and gate.released == ["ep/calculator"]
    assert server.calls[1][1][-len(tool_ids(tokenizer, "a", "b")) :] == tool_ids(tokenizer, "a", "b")


def test_tool_response_in_yaml_config_tools(tokenizer: Any) -> None:
    """The default config offers the calculator; its answer is the integer as text."""
    loop, _ = make_loop(tokenizer, [call_text("007+1"), "8"], tools=None)
    out = run(loop)
    assert out.messages[2]["content"] == "8"
    assert ToolSpec(name="calculator").cls == "calculator"


def test_versions_can_differ_between_turns(tokenizer: Any) -> None:
    loop, server = make_loop(tokenizer, [call_text("1+1"), "2"], version=1)

    original = server.generate

    async def bump_after_first(**kw: Any) -> Any:
        result = await original(**kw)
        server.version = 2
        return result

    server.generate = bump_after_first  # type: ignore[method-assign]
    out = run(loop)
    gen_versions = [v for v, m in zip(out.response_versions, out.response_mask, strict=True) if m == 1]
    assert gen_versions[0] == 1 and gen_versions[-1] == 2
