"""`areal-like serve` as a user drives it: the CLI in a real process, the official `openai` SDK.

One serve process on the shipped quickstart config is shared by the module (it is
stopped with SIGINT by the last test). Tool calls need a model that emits them on
demand, so they are checked against servers whose engine returns a fixed token
sequence holding hermes markup, through the same `start_serving` path and the real
tool parser, tokenizer and chat template.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")

from areal_like.core.types import GenerateResult  # noqa: E402
from rollout_cluster.engine.base import AsyncGenerateEngine  # noqa: E402

ROOT = Path(__file__).parent.parent
QUICKSTART_MODEL = ROOT / "areal_like" / "assets" / "quickstart_model"
CLI = [sys.executable, "-m", "areal_like.orchestration.cli"]
STARTUP_TIMEOUT_S = 120
URL_RE = re.compile(r"base_url: (http://\S+/v1)")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]


class Served:
    def __init__(self, proc: subprocess.Popen[str], base_url: str, lines: list[str]) -> None:
        self.proc = proc
        self.base_url = base_url
        self.lines = lines
        self.client = openai.OpenAI(
            base_url=base_url, api_key="unused-on-loopback", max_retries=0, timeout=60
        )
        self.model = self.client.models.list().data[0].id


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        [*CLI, "serve", "configs/quickstart.yaml", "--port", "0"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    found: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            m = URL_RE.search(line)
            if m:
                found.put(m.group(1))

    threading.Thread(target=pump, daemon=True).start()
    try:
        base_url = found.get(timeout=STARTUP_TIMEOUT_S)
    except queue.Empty:
        proc.kill()
        pytest.fail("areal-like serve printed no URL:\n" + "".join(lines)[-3000:])
    try:
        yield Served(proc, base_url, lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_chat_completion_and_content_parts(served: Served) -> None:
    c, model = served.client, served.model
    assert model == "quickstart_model"
    r = c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "12+30="}], max_tokens=12, seed=1
    )
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == model
    assert isinstance(choice.message.content, str) and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length") and choice.logprobs is None
    assert r.usage.completion_tokens == len(choice.token_ids) > 0  # RL extras ride along
    assert len(choice.token_logprobs) == len(choice.versions) == len(choice.token_ids)
    parts = [{"type": "text", "text": "12+"}, {"type": "text", "text": "30="}]
    p = c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": parts}], max_tokens=12, seed=1
    )
    assert p.prompt_token_ids == r.prompt_token_ids  # parts are joined as text, not a Python repr
    assert p.choices[0].message.content == choice.message.content


def test_logprobs_and_top_logprobs(served: Served) -> None:
    c, model = served.client, served.model
    r = c.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "7+8="}],
        max_tokens=6,
        seed=2,
        logprobs=True,
        top_logprobs=3,
    )
    choice = r.choices[0]
    content = choice.logprobs.content
    assert len(content) == len(choice.token_ids)
    for entry, lp in zip(content, choice.token_logprobs, strict=True):
        assert entry.logprob == pytest.approx(lp) and entry.bytes == list(entry.token.encode())
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob <= tops[0] + 1e-3  # nothing is likelier than the most likely
        same = [t.logprob for t in entry.top_logprobs if t.token == entry.token]
        if same:  # the sampled token's logprob, scored again: the same distribution
            assert same[0] == pytest.approx(entry.logprob, abs=1e-3)
    cmp = c.completions.create(model=model, prompt="7+8=", max_tokens=4, seed=2, logprobs=2)
    lp = cmp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(cmp.choices[0].token_ids)
    assert all(1 <= len(row) <= 2 for row in lp.top_logprobs)


def test_models_endpoint_and_unknown_ids(served: Served) -> None:
    c, model = served.client, served.model
    assert c.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.models.retrieve("gpt-imaginary")
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-imaginary", messages=[{"role": "user", "content": "hi"}])
    assert e.value.code == "model_not_found"
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(served.base_url + "/no/such/path", timeout=30)
    assert http.value.code == 404 and "no such path" in json.loads(http.value.read())["error"]["message"]


def test_streaming_equals_the_whole_reply(served: Served) -> None:
    c, model = served.client, served.model
    messages = [{"role": "user", "content": "45+17="}]
    whole = c.chat.completions.create(model=model, messages=messages, max_tokens=16, seed=5)
    stream = c.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=16,
        seed=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    deltas, finish, usage = [], None, None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if not chunk.choices:
            usage = chunk.usage
            continue
        deltas.append(chunk.choices[0].delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(deltas) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens

    whole_c = c.completions.create(model=model, prompt="45+17=", max_tokens=10, seed=6)
    pieces = [
        ch.choices[0].text
        for ch in c.completions.create(model=model, prompt="45+17=", max_tokens=10, seed=6, stream=True)
        if ch.choices
    ]
    assert "".join(pieces) == whole_c.choices[0].text


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "type 'image_url' are not supported",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs needs logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": ["\n"]}, "stop_token_ids"),
        ({"messages": []}, "messages must be a non-empty list"),
        ({"messages": [{"role": "user", "content": "1" * 400}]}, "max_seq_len"),
    ],
)
def test_bad_input_is_a_400_that_says_why(served: Served, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(openai.BadRequestError, match=re.escape(message)):
        served.client.chat.completions.create(model=served.model, **kwargs)


def test_sigint_stops_serve_cleanly(served: Served) -> None:
    """Runs last in this module: it stops the shared process."""
    port = int(served.base_url.rsplit(":", 1)[1].split("/")[0])
    t0 = time.monotonic()
    served.proc.send_signal(signal.SIGINT)
    assert served.proc.wait(timeout=60) == 0, "".join(served.lines)[-3000:]
    assert time.monotonic() - t0 < 60
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=5):
        pass


# ---- tool calls, end to end, against a scripted engine ---------------------------------------------


class ScriptedEngine(AsyncGenerateEngine):
    """An `AsyncGenerateEngine` that answers every request with the same token ids."""

    max_seq_len = 512
    version = 0

    def __init__(self, token_ids: list[int], vocab_size: int) -> None:
        self.token_ids = token_ids
        self.vocab_size = vocab_size
        self.prompts: list[list[int]] = []

    async def submit(self, request: Any) -> GenerateResult:
        """Takes the server's validated `EngineRequest` (the one validation is at the edge)."""
        self.prompts.append(list(request.prompt_ids))
        n = len(self.token_ids)
        return GenerateResult(
            request_id=request.request_id,
            token_ids=list(self.token_ids),
            logprobs=[-0.25] * n,
            versions=[0] * n,
            stop_reason="stop",
        )

    def metrics(self) -> dict[str, float]:
        return {}

    async def close(self) -> None:
        return None


@pytest.fixture(scope="module")
def scripted() -> Iterator[tuple[Any, ScriptedEngine, Any]]:
    """A serve-path server (config's tool parser, real tokenizer) over `ScriptedEngine`, on a thread."""
    from areal_like.core.config import load_config
    from areal_like.models.tiny_model import load_tokenizer
    from areal_like.orchestration.serve import start_serving
    from rollout_cluster.server import RolloutServer
    from rollout_cluster.tool_parser import get_tool_parser

    cfg = load_config(ROOT / "configs" / "quickstart.yaml", [])
    tok = load_tokenizer(QUICKSTART_MODEL)
    text = (
        'Let me compute.<tool_call>{"name": "calculator", "arguments": {"expression": "12+30"}}</tool_call>'
    )
    engine = ScriptedEngine(tok.encode(text, add_special_tokens=False) + [tok.eos_token_id], len(tok))
    server = RolloutServer(engine, tok, model_name="scripted")
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    serving = asyncio.run_coroutine_threadsafe(
        start_serving([server], port=0, tool_parser=get_tool_parser(cfg.agent.tool_parser)), loop
    ).result(60)
    client = openai.OpenAI(base_url=serving.api_urls[0], api_key="x", max_retries=0, timeout=60)
    try:
        yield client, engine, tok
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)


def test_tool_calls_are_parsed_over_http(scripted: tuple[Any, ScriptedEngine, Any]) -> None:
    client, engine, tok = scripted
    messages: list[Any] = [{"role": "user", "content": "what is 12+30?"}]
    r = client.chat.completions.create(
        model="scripted", messages=messages, tools=TOOLS, extra_body={"session_id": "ep-1"}
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me compute."  # the markup is gone
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "calculator" and call.id
    assert json.loads(call.function.arguments) == {"expression": "12+30"}
    # The tools reach the chat template as the in-process path renders them.
    expected = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert engine.prompts[-1] == tok.encode(expected, add_special_tokens=False)

    # The agent sends the SDK's message back with the tool result: the exact ids are reused.
    messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "42"}]
    r2 = client.chat.completions.create(
        model="scripted", messages=messages, tools=TOOLS, extra_body={"session_id": "ep-1"}
    )
    first = r.prompt_token_ids + choice.token_ids
    assert r2.prompt_token_ids[: len(first)] == first

    # Without tools the same text is plain content.
    plain = client.chat.completions.create(model="scripted", messages=messages[:1])
    assert plain.choices[0].message.tool_calls is None and "<tool_call>" in plain.choices[0].message.content

    # Streamed: the tool call arrives as a tool_calls delta.
    stream = client.chat.completions.create(model="scripted", messages=messages[:1], tools=TOOLS, stream=True)
    content, calls, finish = "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Let me compute." and finish == "tool_calls"
    assert calls == {0: {"name": "calculator", "arguments": call.function.arguments}}


def test_beyond_loopback_without_a_key_is_refused_before_loading() -> None:
    out = subprocess.run(
        [*CLI, "serve", "configs/quickstart.yaml", "--host", "0.0.0.0", "--port", "0"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "AREAL_LIKE_API_KEY": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "without an api key" in out.stderr, out.stderr[-2000:]
