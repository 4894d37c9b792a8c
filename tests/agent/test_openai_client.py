"""OpenAI-shaped agents keep exact tokens: assistant turns are reused, never re-tokenized."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from areal_like.core.config import AgentConfig
from areal_like.core.types import AgentLoopOutput, SamplingParams
from rollout_cluster.agent_loop import AgentRunner, ToolAgentLoop, resolve_agent_loop
from rollout_cluster.agent_loop.chat import template_ids
from rollout_cluster.openai_client import ChatClient, OpenAIAgentLoop, RejectEpisode, make_openai_agent_loop
from rollout_cluster.server_manager import ServerManager
from rollout_cluster.tools import CalculatorTool

from ._agent_fakes import FakeServer, call_text

TOOLS = [CalculatorTool("calculator").schema]
SCRIPT = [call_text("123*45"), "5535"]


async def calculator_agent(client: ChatClient, sample: dict[str, Any], *, as_dict: bool = False) -> None:
    """A typical OpenAI-style tool agent: append the message, answer each tool call."""
    messages: list[Any] = [{"role": "user", "content": sample["prompt"]}]
    for _ in range(4):
        reply = await client.chat.completions.create(messages=messages, tools=TOOLS)
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True) if as_dict else msg)
        if reply.choices[0].finish_reason != "tool_calls":
            return
        for call in msg.tool_calls or []:
            from areal_like.tasks.arithmetic import calculate

            result = calculate(json.loads(call.function.arguments)["expression"])
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "name": "calculator", "content": str(result)}
            )


def run_loop(
    tokenizer: Any, agent: Any, script: Any = SCRIPT, response_length: int = 200
) -> AgentLoopOutput | None:
    loop_cls = make_openai_agent_loop(agent)
    loop = loop_cls(
        server_manager=ServerManager([FakeServer(tokenizer, script, version=2)]),
        tokenizer=tokenizer,
        config=AgentConfig(),
        response_length=response_length,
    )
    return asyncio.run(loop.run(SamplingParams(), episode_id="ep", prompt="123*45"))


def test_openai_agent_records_the_same_trajectory_as_the_tool_loop(tokenizer: Any) -> None:
    for as_dict in (False, True):

        async def agent(client: ChatClient, sample: dict[str, Any], as_dict: bool = as_dict) -> None:
            await calculator_agent(client, sample, as_dict=as_dict)

        out = run_loop(tokenizer, agent)
        assert out is not None
        tool_loop = ToolAgentLoop(
            server_manager=ServerManager([FakeServer(tokenizer, SCRIPT, version=2)]),
            tokenizer=tokenizer,
            config=AgentConfig(),
            response_length=200,
            tools=[CalculatorTool("calculator")],
        )
        expected = asyncio.run(tool_loop.run(SamplingParams(), episode_id="ep", prompt="123*45"))
        assert expected is not None
        assert out.prompt_ids == expected.prompt_ids
        assert out.response_ids == expected.response_ids
        assert out.response_mask == expected.response_mask
        assert out.response_logprobs == expected.response_logprobs
        assert out.response_versions == expected.response_versions
        assert out.metrics["fallback_retokenizations"] == 0
        assert out.final_text == "5535" and out.num_turns == 3
        full = template_ids(tokenizer, out.messages, tools=TOOLS, add_generation_prompt=False)
        assert out.prompt_ids + out.response_ids == full


def test_generated_ids_are_reused_even_when_retokenizing_would_differ(tokenizer: Any) -> None:
    """The model put the call's prefix together from characters rather than the single
    added token: re-tokenizing the message would give different ids. The recorded ids win."""
    odd = list(call_text("2+2"))  # char by char
    char_ids = [tokenizer.convert_tokens_to_ids(ch) for ch in odd]
    assert tokenizer.encode(call_text("2+2"), add_special_tokens=False) != char_ids

    def script(episode: str, turn: int) -> Any:
        return [(tokenizer.decode(char_ids), "stop"), "4"][turn]

    server = FakeServer(tokenizer, script)
    server.turn_ids = lambda entry: (  # type: ignore[method-assign]
        (char_ids + [tokenizer.eos_token_id], "stop")
        if isinstance(entry, tuple)
        else (tokenizer.encode(entry, add_special_tokens=False) + [tokenizer.eos_token_id], "stop")
    )
    client = ChatClient(ServerManager([server]), tokenizer, episode_id="ep", response_length=200)

    async def main() -> None:
        messages: list[Any] = [{"role": "user", "content": "2+2"}]
        reply = await client.chat.completions.create(messages=messages, tools=TOOLS)
        assert reply.choices[0].finish_reason == "tool_calls"
        messages += [reply.choices[0].message, {"role": "tool", "content": "4"}]
        await client.chat.completions.create(messages=messages, tools=TOOLS)

    asyncio.run(main())
    assert client.num_fallbacks == 0
    assert client.record.ids[: len(char_ids) + 1] == char_ids + [tokenizer.eos_token_id]
    assert server.calls[1][1][len(client.record.prompt_ids) :][: len(char_ids)] == char_ids


def test_edited_history_falls_back_and_is_counted(tokenizer: Any) -> None:
    async def agent(client: ChatClient, sample: dict[str, Any]) -> None:
        messages: list[Any] = [{"role": "user", "content": sample["prompt"]}]
        reply = await client.chat.completions.create(messages=messages, tools=TOOLS)
        # The agent rewrites what the model said before continuing.
        messages += [{"role": "assistant", "content": "let me think"}, {"role": "tool", "content": "5535"}]
        await client.chat.completions.create(messages=messages, tools=TOOLS)
        assert reply.choices[0].message.tool_calls

    out = run_loop(tokenizer, agent)
    assert out is not None and out.metrics["fallback_retokenizations"] == 1
    # Tokens that no longer match are gone; the re-rendered tail is observation (mask 0).
    full = template_ids(
        tokenizer,
        [
            {"role": "user", "content": "123*45"},
            {"role": "assistant", "content": "let me think"},
            {"role": "tool", "content": "5535"},
        ],
        tools=TOOLS,
        add_generation_prompt=True,
    )
    second = out.response_ids[-(len(tokenizer.encode("5535", add_special_tokens=False)) + 1) :]
    assert out.prompt_ids + out.response_ids[: len(out.response_ids) - len(second)] == full
    assert out.response_mask == [0] * (len(full) - len(out.prompt_ids)) + [1] * len(second)


def test_budget_ends_the_episode_without_trailing_observation(tokenizer: Any) -> None:
    t1 = len(tokenizer.encode(call_text("123*45"), add_special_tokens=False)) + 1
    out = run_loop(tokenizer, calculator_agent, response_length=t1 + 5)
    assert out is not None and out.truncated and out.termination == "response_length"
    assert out.response_mask == [1] * t1


def test_rejected_and_silent_agents_yield_no_sample(tokenizer: Any) -> None:
    async def rejecting(client: ChatClient, sample: dict[str, Any]) -> None:
        await client.chat.completions.create(messages=[{"role": "user", "content": "x"}])
        raise RejectEpisode

    async def silent(client: ChatClient, sample: dict[str, Any]) -> None:
        return None

    assert run_loop(tokenizer, rejecting) is None
    assert run_loop(tokenizer, silent) is None


def test_agent_function_from_user_code_runs_through_the_runner(tokenizer: Any, tmp_path: Path) -> None:
    (tmp_path / "my_agent.py").write_text(
        "async def agent(client, sample):\n"
        "    await client.chat.completions.create(messages=[{'role': 'user', 'content': sample['prompt']}])\n"
    )
    assert issubclass(resolve_agent_loop("my_agent.py:agent", base_dir=tmp_path), OpenAIAgentLoop)
    runner = AgentRunner(
        server_manager=ServerManager([FakeServer(tokenizer, ["5535"])]),
        tokenizer=tokenizer,
        config=AgentConfig(default_loop="my_agent.py:agent"),
        response_length=50,
        base_dir=tmp_path,
    )
    sample = {"prompt": "123*45", "answer": "5535"}

    async def main() -> tuple[Any, float]:
        out = await runner.run_episode(sample, SamplingParams(), "ep-1")
        return out, await runner.score(sample, out)

    out, reward = asyncio.run(main())
    assert reward == 1.0 and out.final_text == "5535"
