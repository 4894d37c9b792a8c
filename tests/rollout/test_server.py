"""RolloutServer in-process and over its OpenAI-compatible HTTP API (127.0.0.1, port 0)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch

from areal_like.core.config import EmbeddedEngineConfig
from areal_like.core.types import SamplingParams
from rollout_cluster.engine import InvalidSamplingParamsError, PromptTooLongError
from rollout_cluster.http_api import prometheus_text, sampling_from_openai
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
