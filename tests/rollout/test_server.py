"""RolloutServer in-process and over its OpenAI-compatible HTTP API (127.0.0.1, port 0)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch

from areal_like.core.config import EmbeddedEngineConfig
from areal_like.core.types import SamplingParams
from rollout_cluster.engine import InvalidSamplingParamsError, PromptTooLongError
from rollout_cluster.http_api import prometheus_text
from rollout_cluster.openai_protocol import sampling_from_openai
from rollout_cluster.server import RolloutServer
from rollout_cluster.sessions import SessionTokens

torch.set_num_threads(1)

CFG = EmbeddedEngineConfig(max_batch_size=8, max_seq_len=160)


def make_server(model_dir) -> RolloutServer:
    return RolloutServer(model_dir, engine_config=CFG, set_threads=False)


def test_in_process_generate_update_metrics_and_refusals(tiny_model_dir):
    async def main():
        server = make_server(tiny_model_dir)
        r = await server.generate(
            request_id="x", prompt_ids=[5, 6, 7], sampling_params=SamplingParams(max_tokens=6, seed=1)
        )
        assert 0 < len(r.token_ids) <= 6 and r.versions == [0] * len(r.token_ids)
        with pytest.raises(PromptTooLongError, match="max_seq_len is 160"):
            await server.generate(request_id="y", prompt_ids=[5] * 200)
        with pytest.raises(InvalidSamplingParamsError, match="temperature"):
            await server.generate(request_id="z", prompt_ids=[5], sampling_params={"temperature": -1})
        with pytest.raises(InvalidSamplingParamsError, match="unknown_knob"):
            await server.generate(request_id="z", prompt_ids=[5], sampling_params={"unknown_knob": 1})
        weights = [(n, p.detach().clone()) for n, p in server.engine.engine.model.named_parameters()]
        await server.update_weights(weights, 3)
        assert server.version == 3 and server.health()["version"] == 3
        m = server.metrics()
        for key in ("queue_depth", "kv_usage", "interrupts", "recompute_tokens", "generated_tokens"):
            assert key in m
        assert m["requests_refused"] == 3 and m["version"] == 3.0
        await server.close()

    asyncio.run(main())


def test_a_weight_load_counts_its_re_prefill_apart(tiny_model_dir):
    """A version's load counts until the server serves it (`weight_update_seconds_total`);
    re-prefilling the answers it interrupted counts apart (`weight_reprefill_seconds_total`),
    and the log line says both."""

    async def main():
        server = make_server(tiny_model_dir)
        weights = [(n, p.detach().clone()) for n, p in server.engine.engine.model.named_parameters()]
        await server.update_weights(weights, 1)  # nothing in flight: nothing to re-prefill
        m = server.metrics()
        assert m["weight_update_seconds_total"] > 0 and m["weight_reprefill_seconds_total"] == 0
        sp = SamplingParams(max_tokens=120, seed=1, ignore_eos=True)
        answer = asyncio.create_task(server.generate(request_id="long", prompt_ids=[5, 6, 7], sampling_params=sp))
        while server.metrics()["generated_tokens"] < 3:
            await asyncio.sleep(0.001)
        await server.engine.pause()  # the answer stays in its slot, mid-way
        await server.update_weights(weights, 2)
        await server.engine.resume()
        r = await answer
        m = server.metrics()
        assert set(r.versions) == {1, 2} and m["recompute_tokens"] > 0
        assert m["weight_reprefill_seconds_total"] > 0 and m["weight_update_seconds_total"] > 0
        await server.close()

    asyncio.run(main())


def test_openai_pure_translation():
    sp = sampling_from_openai({"model": "m", "max_tokens": 7, "temperature": 0.5, "top_k": 3, "seed": 1})
    assert (sp.max_tokens, sp.temperature, sp.top_k, sp.seed) == (7, 0.5, 3, 1)
    for bad, msg in [
        ({"echo": True}, "echo"),
        ({"stop": ["\n"]}, "stop_token_ids"),
        ({"mystery": 1}, "mystery"),
        ({"max_tokens": 0}, "max_tokens"),
    ]:
        with pytest.raises(InvalidSamplingParamsError, match=msg):
            sampling_from_openai(bad)
    text = prometheus_text({"kv_usage": 0.5, "weird-name": 1})
    assert "areal_rollout_kv_usage 0.5" in text and "areal_rollout_weird_name 1.0" in text


def test_session_tokens_prefix_match_and_fallback():
    sessions = SessionTokens()

    def render(msgs, gen):
        return "".join(f"<{m['role']}>{m['content']}|" for m in msgs) + ("<assistant>" if gen else "")

    def encode(text):
        return [ord(c) for c in text]

    first = [{"role": "user", "content": "hi"}]
    ids = sessions.prompt_ids("s", first, render, encode)
    produced = [900, 901, 902]  # ids that re-encoding the text would not give back
    sessions.remember("s", [*first, {"role": "assistant", "content": "yo"}], ids + produced)
    second = [*first, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}]
    again = sessions.prompt_ids("s", second, render, encode)
    assert again[: len(ids) + 3] == ids + produced
    assert again[len(ids) + 3 :] == encode("<user>more|<assistant>")
    assert sessions.counters == {"token_continuity_hits": 1.0, "retokenize_fallbacks": 0.0}
    edited = [*first, {"role": "assistant", "content": "changed"}, {"role": "user", "content": "more"}]
    assert sessions.prompt_ids("s", edited, render, encode) == encode(render(edited, True))
    assert sessions.counters["retokenize_fallbacks"] == 1.0


def test_http_api_round_trip(tiny_model_dir, tokenizer):
    async def main():
        server = make_server(tiny_model_dir)
        url = await server.start_http("127.0.0.1", 0, api_key="sekret")
        auth = {"Authorization": "Bearer sekret"}
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/health") as resp:
                assert resp.status == 200 and (await resp.json())["status"] == "ok"
            async with http.get(f"{url}/version") as resp:
                assert resp.status == 401
            async with http.get(f"{url}/version", headers=auth) as resp:
                assert (await resp.json()) == {"version": 0}

            body = {"prompt": [5, 6, 7, 8], "max_tokens": 5, "temperature": 0.0, "n": 2}
            async with http.post(f"{url}/v1/completions", json=body, headers=auth) as resp:
                assert resp.status == 200
                out = await resp.json()
            assert out["prompt_token_ids"] == [5, 6, 7, 8] and len(out["choices"]) == 2
            c = out["choices"][0]
            assert len(c["token_ids"]) == len(c["token_logprobs"]) == len(c["versions"]) > 0
            assert c["text"] == tokenizer.decode(c["token_ids"])

            body = {"prompt": "12+34=", "max_tokens": 4, "seed": 3}
            async with http.post(f"{url}/v1/completions", json=body, headers=auth) as resp:
                out = await resp.json()
            assert out["prompt_token_ids"] == tokenizer.encode("12+34=", add_special_tokens=False)

            async with http.post(f"{url}/v1/completions", json={"prompt": [5] * 300}, headers=auth) as resp:
                err = await resp.json()
                assert resp.status == 400 and err["error"]["code"] == "context_length_exceeded"
                assert "max_seq_len is 160" in err["error"]["message"]
            async with http.post(f"{url}/v1/completions", data=b"{not json", headers=auth) as resp:
                assert resp.status == 400

            # Two chat turns in one session: the second prompt reuses the first turn's ids.
            msgs = [{"role": "user", "content": "what is 2+2?"}]
            tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
            chat = {"messages": msgs, "tools": tools, "max_tokens": 8, "seed": 1, "session_id": "ep1"}
            async with http.post(f"{url}/v1/chat/completions", json=chat, headers=auth) as resp:
                assert resp.status == 200
                turn1 = await resp.json()
            choice = turn1["choices"][0]
            expected = tokenizer.apply_chat_template(
                msgs, tools=tools, add_generation_prompt=True, tokenize=False
            )
            assert turn1["prompt_token_ids"] == tokenizer.encode(expected, add_special_tokens=False)
            msgs2 = [*msgs, choice["message"], {"role": "user", "content": "and 3+3?"}]
            chat2 = {**chat, "messages": msgs2}
            async with http.post(f"{url}/v1/chat/completions", json=chat2, headers=auth) as resp:
                turn2 = await resp.json()
            reused = turn1["prompt_token_ids"] + choice["token_ids"]
            assert turn2["prompt_token_ids"][: len(reused)] == reused

            async with http.get(f"{url}/metrics", headers=auth) as resp:
                text = await resp.text()
            assert "areal_rollout_token_continuity_hits 1.0" in text
            assert "areal_rollout_retokenize_fallbacks 0.0" in text
            async with http.get(f"{url}/metrics?format=json", headers=auth) as resp:
                metrics = await resp.json()
            assert metrics["http_errors"] == 2 and metrics["generated_tokens"] > 0
        await server.close()

    asyncio.run(main())


def test_streaming_sends_text_while_the_reply_is_generated(tiny_model_dir, tokenizer):
    """`stream: true` on the embedded engine: the first text chunk arrives while the
    request is still running in the engine (read from the server's own metrics at that
    moment), and the streamed text is exactly the whole reply of the same seed."""
    import json as _json

    async def main():
        server = make_server(tiny_model_dir)
        url = await server.start_http("127.0.0.1", 0)
        async with aiohttp.ClientSession() as http:
            for path, body in (("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 120, "seed": 4}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 120, "seed": 4})):
                async with http.post(url + path, json=body) as resp:
                    whole = await resp.json()
                text_of = (lambda c: c["text"]) if "completions" == path[4:] else (lambda c: c["message"]["content"])
                want = text_of(whole["choices"][0])
                got, running_at_first, events = "", None, 0
                async with http.post(url + path, json={**body, "stream": True}) as resp:
                    assert resp.headers["Content-Type"].startswith("text/event-stream")
                    async for raw in resp.content:
                        line = raw.decode().strip()
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        choice = (_json.loads(line[6:])["choices"] or [{}])[0]
                        piece = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                        if piece:
                            events += 1
                            if running_at_first is None:
                                async with http.get(f"{url}/metrics?format=json") as m:
                                    running_at_first = (await m.json())["running"]
                            got += piece
                assert got == want and len(whole["choices"][0]["token_ids"]) > 20, (path, got, want)
                assert running_at_first == 1, f"{path}: the first piece came after generation ended"
                assert events > 5, events
        await server.close()

    asyncio.run(main())


def test_refused_http_start_stays_refused(tiny_model_dir):
    async def main():
        server = make_server(tiny_model_dir)
        try:
            for _ in range(2):  # the second call must not return a URL for a server that never listened
                with pytest.raises(PermissionError, match="without an api_key"):
                    await server.start_http("0.0.0.0", 0)
            assert server.health()["status"] == "ok"
        finally:
            await server.close()

    asyncio.run(main())


# ---- OpenAI conformance of the pure translation (docs/design.md §10.14) ------------------------------

HERMES_REPLY = 'Checking.<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'


def test_assistant_turn_parses_hermes_markup_into_tool_calls():
    from rollout_cluster.openai_protocol import assistant_turn
    from rollout_cluster.tool_parser import HermesToolParser

    parser = HermesToolParser()
    turn = assistant_turn(HERMES_REPLY, "stop", parser, "call_x")
    assert turn.finish_reason == "tool_calls" and turn.content == "Checking."
    assert turn.message() == {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            {
                "id": "call_x_0",
                "type": "function",
                "function": {"name": "calculator", "arguments": '{"expression": "2+2"}'},
            }
        ],
    }
    only_call = assistant_turn(HERMES_REPLY.removeprefix("Checking."), "stop", parser, "c")
    assert only_call.content is None and only_call.tool_calls
    # No parser (the request offered no tools), or only malformed calls: the text as written.
    assert assistant_turn(HERMES_REPLY, "stop", None, "c").content == HERMES_REPLY
    broken = "x<tool_call>{not json}</tool_call>"
    assert assistant_turn(broken, "stop", parser, "c") == assistant_turn(broken, "stop", None, "c")
    mixed = assistant_turn(HERMES_REPLY + "<tool_call>{bad}</tool_call>", "stop", parser, "c")
    assert len(mixed.tool_calls) == 1 and mixed.content == "Checking.<tool_call>{bad}</tool_call>"
    assert assistant_turn(HERMES_REPLY, "length", parser, "c").finish_reason == "length"


def test_messages_content_parts_and_template_arguments():
    from rollout_cluster.openai_protocol import ApiError, normalize_messages, template_messages

    msgs = normalize_messages(
        [
            {"role": "system", "content": None},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ]
    )
    assert [m["content"] for m in msgs] == ["", "ab"]
    for bad, why in [
        ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "'input_audio'"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "text must be a string"),
        ([{"role": "user", "content": 5}], "string or a list"),
        ([{"content": "no role"}], "'role'"),
        ([], "non-empty"),
    ]:
        with pytest.raises(ApiError, match=why) as e:
            normalize_messages(bad)
        assert e.value.status == 400
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    rendered = template_messages([{"role": "assistant", "content": "", "tool_calls": [call]}])
    assert rendered[0]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert call["function"]["arguments"] == '{"x": 1}'  # the caller's message is not modified


def test_output_options_are_checked_as_openai_checks_them():
    from rollout_cluster.openai_protocol import ApiError, OutputOptions, output_options

    assert output_options({"logprobs": True, "top_logprobs": 3}, chat=True) == OutputOptions(
        False, False, True, 3
    )
    assert output_options({"logprobs": 2, "stream": True}, chat=False) == OutputOptions(True, False, True, 2)
    assert output_options(
        {"stream": True, "stream_options": {"include_usage": True}}, chat=True
    ).include_usage
    for body, chat, param in [
        ({"top_logprobs": 2}, True, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, True, "top_logprobs"),
        ({"logprobs": "yes"}, True, "logprobs"),
        ({"logprobs": True}, False, "logprobs"),
        ({"stream_options": {"include_usage": True}}, True, "stream_options"),
        ({"stream": True, "stream_options": {"bogus": 1}}, True, "stream_options"),
    ]:
        with pytest.raises(ApiError) as e:
            output_options(body, chat=chat)
        assert e.value.status == 400 and e.value.param == param


def test_logprob_shapes_and_stream_chunks():
    from areal_like.core.types import GenerateResult
    from rollout_cluster.openai_protocol import AssistantTurn, chat_logprobs, completion_logprobs
    from rollout_cluster.openai_stream import (
        chat_stream_chunks,
        completion_stream_chunks,
        sse_event,
        text_pieces,
    )

    vocab = {1: "h", 2: "é", 3: "!", 9: "<eos>"}
    decode_token = vocab.__getitem__
    lp = chat_logprobs(
        [1, 2], [-0.5, float("-inf")], [[(1, -0.5), (3, -1.0)], [(2, -0.1), (1, -3.0)]], decode_token
    )
    assert lp["content"][1] == {
        "token": "é",
        "logprob": -9999.0,  # JSON has no -inf
        "bytes": [0xC3, 0xA9],
        "top_logprobs": [
            {"token": "é", "logprob": -0.1, "bytes": [0xC3, 0xA9]},
            {"token": "h", "logprob": -3.0, "bytes": [104]},
        ],
    }
    clp = completion_logprobs([1, 2, 3], [-1.0, -2.0, -3.0], None, decode_token)
    assert clp == {
        "tokens": ["h", "é", "!"],
        "token_logprobs": [-1.0, -2.0, -3.0],
        "top_logprobs": None,
        "text_offset": [0, 1, 2],
    }

    # A token that ends mid-character decodes to U+FFFD: its piece waits for the rest.
    def decode(ids):
        text = "".join({1: "h", 4: "\ufffd", 5: "é"}.get(i, "") for i in ids)
        return (
            text.replace("\ufffd", "") + ("\ufffd" if ids and ids[-1] == 4 else "") if 5 not in ids else "hé"
        )

    assert text_pieces([1, 4, 5], decode) == ["h", "", "é"]
    assert "".join(text_pieces([1, 2, 3], lambda ids: "".join(vocab[i] for i in ids))) == "hé!"

    r = GenerateResult(
        request_id="r",
        token_ids=[1, 3, 9],
        logprobs=[-1.0, -2.0, -3.0],
        versions=[0, 0, 0],
        stop_reason="stop",
    )
    turn = AssistantTurn("h!", None, "stop")
    chunks = chat_stream_chunks(
        "abc", "m", [7, 7], [r], [turn], [["h", "!", ""]], [None], include_usage=True, created=5
    )
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:3]] == ["h", "!"]
    final = chunks[-2]["choices"][0]
    assert final["finish_reason"] == "stop" and final["token_ids"] == [1, 3, 9]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 5
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-abc" for c in chunks)
    calls = [{"id": "c0", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    tool_chunks = chat_stream_chunks(
        "abc", "m", [7], [r], [AssistantTurn(None, calls, "tool_calls")], [["h", "!", ""]], [None]
    )
    assert tool_chunks[1]["choices"][0]["delta"] == {"tool_calls": [{"index": 0, **calls[0]}]}
    assert tool_chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    cmp = completion_stream_chunks("abc", "m", [7], [r], [["h", "!", "<eos>"]], [None])
    assert [c["choices"][0]["text"] for c in cmp] == ["h", "!", "<eos>", ""]
    assert sse_event("[DONE]") == b"data: [DONE]\n\n"
    with pytest.raises(ValueError):
        sse_event({"x": float("nan")})  # never invalid JSON on the wire


def test_http_errors_have_openai_shape(monkeypatch):
    """Unknown paths, wrong methods and oversized bodies: JSON errors the SDKs understand."""
    from rollout_cluster import http_api

    class Stub:
        version = 0
        model_name = "m"
        tokenizer = None
        counters = {"http_requests": 0.0, "http_errors": 0.0}

    monkeypatch.setattr(http_api, "MAX_BODY_BYTES", 1024)

    async def main():
        http = http_api.HttpServer(Stub())
        url = await http.start("127.0.0.1", 0)
        try:
            out = []
            async with aiohttp.ClientSession() as s:
                for method, path, kw in [
                    ("GET", "/v1/nothing", {}),
                    ("GET", "/v1/chat/completions", {}),
                    (
                        "POST",
                        "/v1/completions",
                        {"data": b"x" * 4096, "headers": {"Content-Type": "application/json"}},
                    ),
                    ("GET", "/v1/models/other", {}),
                    ("POST", "/v1/completions", {"json": {"prompt": [1], "model": "nope"}}),
                    ("POST", "/v1/completions", {"json": {"prompt": "text needs a tokenizer"}}),
                    ("POST", "/v1/completions", {"data": b'{"prompt": ' + b"[" * 300 + b"]" * 300 + b"}",
                                                 "headers": {"Content-Type": "application/json"}}),
                ]:
                    async with s.request(method, url + path, **kw) as r:
                        out.append((r.status, await r.json()))
            return out
        finally:
            await http.stop()

    got = asyncio.run(main())
    assert [status for status, _ in got] == [404, 405, 413, 404, 404, 400, 400]
    for _, body in got:
        assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]
    assert (
        "no such path" in got[0][1]["error"]["message"]
        and "limit is 1024 bytes" in got[2][1]["error"]["message"]
    )
    assert got[3][1]["error"]["code"] == got[4][1]["error"]["code"] == "model_not_found"
    assert "tokenizer" in got[5][1]["error"]["message"]
    assert "nests deeper than 64 levels" in got[6][1]["error"]["message"]  # used to be a 500


def test_json_too_deep_for_the_parser_is_a_400_not_a_500():
    """100 000 levels of nesting made the JSON decoder raise RecursionError: a 500."""
    from rollout_cluster import http_api

    class Stub:
        version = 0
        model_name = "m"
        tokenizer = None
        counters = {"http_requests": 0.0, "http_errors": 0.0}

    async def main():
        http = http_api.HttpServer(Stub())
        url = await http.start("127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as s:
                body = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
                async with s.post(url + "/v1/completions", data=body,
                                  headers={"Content-Type": "application/json"}) as r:
                    return r.status, await r.json()
        finally:
            await http.stop()

    status, body = asyncio.run(main())
    assert status == 400 and "nests deeper than 64 levels" in body["error"]["message"], body
