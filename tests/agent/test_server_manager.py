"""ServerManager: least in-flight on the first turn, sticky later turns, failover."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from areal_like.core.config import AgentConfig
from areal_like.core.types import SamplingParams
from rollout_cluster.agent_loop import ToolAgentLoop
from rollout_cluster.server_manager import ActorServer, NoServerAvailableError, ServerManager
from rollout_cluster.tools import CalculatorTool

from ._agent_fakes import FakeServer, call_text

SP = SamplingParams(max_tokens=16)


def servers(tokenizer: Any, n: int, **kw: Any) -> list[FakeServer]:
    return [FakeServer(tokenizer, lambda e, t: "ok", name=f"s{i}", **kw) for i in range(n)]


def test_first_turns_balance_by_in_flight_and_later_turns_stick(tokenizer: Any) -> None:
    pool = servers(tokenizer, 3, delay=0.01)
    manager = ServerManager(pool)

    async def episode(k: int) -> None:
        for turn in range(3):
            await manager.generate(
                request_id=f"e{k}/{turn}", session_id=f"e{k}", prompt_ids=[1], sampling_params=SP
            )

    async def main() -> None:
        await asyncio.gather(*(episode(k) for k in range(9)))

    asyncio.run(main())
    # Every episode's turns all went to one server ...
    where = {}
    for s in pool:
        for request_id, _, _ in s.calls:
            where.setdefault(request_id.split("/")[0], set()).add(s.name)
    assert all(len(names) == 1 for names in where.values()) and len(where) == 9
    # ... and the nine concurrent episodes were spread evenly.
    assert sorted(len(s.calls) for s in pool) == [9, 9, 9]
    assert manager.in_flight() == {"s0": 0, "s1": 0, "s2": 0}


def test_least_in_flight_prefers_the_idle_server(tokenizer: Any) -> None:
    slow, fast = FakeServer(tokenizer, lambda e, t: "x", name="slow", delay=0.2), servers(tokenizer, 1)[0]
    manager = ServerManager([slow, fast])

    async def main() -> None:
        first = asyncio.create_task(
            manager.generate(request_id="a", prompt_ids=[1], sampling_params=SP)
        )  # goes to slow (tie → first)
        await asyncio.sleep(0.01)
        assert manager.in_flight() == {"slow": 1, "s0": 0}
        for k in range(3):  # slow is busy: every new session goes to the idle one
            await manager.generate(request_id=f"b{k}", prompt_ids=[1], sampling_params=SP)
        await first

    asyncio.run(main())
    assert len(slow.calls) == 1 and len(fast.calls) == 3


def test_sticky_map_is_lru_bounded(tokenizer: Any) -> None:
    manager = ServerManager(servers(tokenizer, 2), max_sticky_sessions=3)

    async def main() -> None:
        for k in range(5):
            await manager.generate(request_id=f"e{k}", prompt_ids=[1], sampling_params=SP)

    asyncio.run(main())
    assert manager.metrics()["sticky_sessions"] == 3
    manager.release_session("e4")
    assert manager.metrics()["sticky_sessions"] == 2


def test_server_failure_mid_episode_completes_on_another_server(tokenizer: Any) -> None:
    script = [call_text("2+2"), call_text("4*4"), "16"]
    a, b = FakeServer(tokenizer, script, name="a"), FakeServer(tokenizer, script, name="b")
    failed: list[str] = []
    manager = ServerManager([a, b], on_server_failure=lambda name, e: failed.append(name))
    loop = ToolAgentLoop(
        server_manager=manager,
        tokenizer=tokenizer,
        config=AgentConfig(),
        response_length=200,
        tools=[CalculatorTool("calculator")],
    )
    original = a.generate

    async def dies_on_second_turn(**kw: Any) -> Any:
        if kw["request_id"].endswith("/1"):
            raise ConnectionError("actor died")
        return await original(**kw)

    a.generate = dies_on_second_turn  # type: ignore[method-assign]
    out = asyncio.run(loop.run(SamplingParams(), episode_id="ep", prompt="2+2"))
    assert out is not None and out.final_text == "16"
    assert [c[0] for c in a.calls] == ["ep/0"] and [c[0] for c in b.calls] == ["ep/1", "ep/2"]
    assert failed == ["a"] and manager.server_names == ["b"]
    assert manager.metrics()["server_failures"] == 1 and manager.metrics()["generate_retries"] == 1
    # The retried turn continued the same token sequence on the new server.
    assert b.calls[0][1][: len(a.calls[0][1])] == a.calls[0][1]


def test_all_servers_failing_raises_no_server(tokenizer: Any) -> None:
    manager = ServerManager(servers(tokenizer, 2, fail_with=RuntimeError("engine dead")))
    with pytest.raises(NoServerAvailableError):
        asyncio.run(manager.generate(request_id="r", prompt_ids=[1], sampling_params=SP))
    assert manager.server_names == []


def test_request_errors_do_not_take_the_server_out(tokenizer: Any) -> None:
    manager = ServerManager(servers(tokenizer, 1, fail_with=ValueError("prompt too long")))
    with pytest.raises(ValueError, match="prompt too long"):
        asyncio.run(manager.generate(request_id="r", prompt_ids=[1], sampling_params=SP))
    assert manager.server_names == ["s0"] and manager.in_flight() == {"s0": 0}


def test_add_and_remove_servers_move_sessions(tokenizer: Any) -> None:
    a, b = servers(tokenizer, 2)
    manager = ServerManager([a])

    async def call(rid: str) -> None:
        await manager.generate(request_id=rid, session_id="e", prompt_ids=[1], sampling_params=SP)

    asyncio.run(call("e/0"))
    manager.add_server(b)
    asyncio.run(call("e/1"))  # sticky: stays on a even though b is idle
    manager.remove_server("s0")
    asyncio.run(call("e/2"))
    assert [c[0] for c in a.calls] == ["e/0", "e/1"] and [c[0] for c in b.calls] == ["e/2"]
    with pytest.raises(ValueError, match="already registered"):
        manager.add_server(b)
    with pytest.raises(KeyError):
        manager.remove_server("nope")


def test_ray_actor_adapter_awaits_remote_calls(tokenizer: Any) -> None:
    """A stand-in for an actor handle: `.generate.remote(**kw)` returns an awaitable."""
    inner = servers(tokenizer, 1)[0]

    class _Method:
        def remote(self, **kw: Any) -> Any:
            return asyncio.ensure_future(inner.generate(**kw))

    class _Handle:
        generate = _Method()

    manager = ServerManager([ActorServer(_Handle(), name="actor-0")])
    result = asyncio.run(manager.generate(request_id="r", prompt_ids=[1], sampling_params=SP))
    assert result.token_ids == tokenizer.encode("ok", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert manager.server_names == ["actor-0"] and inner.calls[0][0] == "r"


def test_an_error_the_actor_raised_is_the_requests_not_a_dead_server() -> None:
    """The launcher hands back what a server actor raised as itself (Ray's wrapping is
    undone in `areal_like/launcher/ray_launcher.py`, tests/test_launcher.py): a refused
    request does not take a healthy server out of rotation; a dead actor (`ActorDied`) does."""
    from areal_like.launcher import ActorDied

    class _Method:
        def __init__(self, error: BaseException) -> None:
            self.error = error

        def remote(self, **kw: Any) -> Any:
            async def fail() -> None:
                raise self.error
            return fail()

    class _Handle:
        def __init__(self, error: BaseException) -> None:
            self.generate = _Method(error)

    refused = ValueError("prompt of 9000 tokens exceeds max_seq_len")
    manager = ServerManager([ActorServer(_Handle(refused), name="actor-0")])
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        asyncio.run(manager.generate(request_id="r", prompt_ids=[1], sampling_params=SP))
    assert manager.server_names == ["actor-0"] and manager.num_failures == 0
    manager = ServerManager([ActorServer(_Handle(ActorDied("actor-0 is gone")), name="actor-0")])
    with pytest.raises(NoServerAvailableError):
        asyncio.run(manager.generate(request_id="r", prompt_ids=[1], sampling_params=SP))
    assert manager.server_names == [] and manager.num_failures == 1


class _DyingServer:
    """A server whose engine died: every call raises EngineDeadError naming the root cause."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls = 0

    async def generate(self, **kw: Any) -> Any:
        from rollout_cluster.engine.base import EngineDeadError

        self.calls += 1
        raise EngineDeadError("RuntimeError: CPU Generator does not use offset", "traceback text")


def test_dead_engine_is_a_dead_server_and_the_call_moves_on(tokenizer: Any) -> None:
    dead, live = _DyingServer("dead"), servers(tokenizer, 1)[0]
    manager = ServerManager([dead, live])
    out = asyncio.run(manager.generate(request_id="r", prompt_ids=[1], sampling_params=SP))
    assert out.token_ids and manager.server_names == ["s0"] and dead.calls == 1
    assert manager.metrics()["server_failures"] == 1


def test_no_server_left_names_the_engine_root_cause(tokenizer: Any) -> None:
    manager = ServerManager([_DyingServer("a"), _DyingServer("b")])
    with pytest.raises(NoServerAvailableError) as info:
        asyncio.run(manager.generate(request_id="r", prompt_ids=[1], sampling_params=SP))
    assert info.value.root_cause == "RuntimeError: CPU Generator does not use offset"
    assert str(info.value).startswith("RuntimeError: CPU Generator does not use offset")


def test_dead_server_restarts_with_backoff_and_calls_wait_for_it(tokenizer: Any) -> None:
    """One server, its engine dies: the call waits for the restart (backoff 0.05 s) and
    completes on the new server, which is back in rotation under the same name."""
    fresh = servers(tokenizer, 1)[0]
    restarts: list[tuple[str, str]] = []

    async def restart(name: str, error: BaseException) -> Any:
        restarts.append((name, type(error).__name__))
        return fresh

    async def main() -> Any:
        manager = ServerManager({"server-0": _DyingServer("x")}, restart=restart, max_restarts=2,
                                restart_backoff_s=0.05)
        out = await asyncio.wait_for(manager.generate(request_id="r", prompt_ids=[1], sampling_params=SP), 10)
        return manager, out

    manager, out = asyncio.run(main())
    assert out.token_ids and restarts == [("server-0", "EngineDeadError")]
    assert manager.server_names == ["server-0"] and len(fresh.calls) == 1
    m = manager.metrics()
    assert m["server_restarts"] == 1 and m["servers_restarting"] == 0 and m["server_failures"] == 1


def test_restart_budget_is_bounded_then_no_server(tokenizer: Any) -> None:
    """Restarts that come back dead (or fail) spend the budget; then the call ends with
    NoServerAvailableError naming the root cause, never looping."""
    attempts: list[float] = []

    async def restart(name: str, error: BaseException) -> Any:
        attempts.append(asyncio.get_running_loop().time())
        if len(attempts) == 1:
            raise OSError("could not start the engine")
        return _DyingServer(name)

    async def main() -> None:
        manager = ServerManager({"server-0": _DyingServer("x")}, restart=restart, max_restarts=2,
                                restart_backoff_s=0.05)
        with pytest.raises(NoServerAvailableError) as info:
            await asyncio.wait_for(manager.generate(request_id="r", prompt_ids=[1], sampling_params=SP), 10)
        assert "CPU Generator does not use offset" in info.value.root_cause
        assert manager.num_restarts == 1 and len(attempts) == 2

    asyncio.run(main())
    assert attempts[1] - attempts[0] >= 0.1 * 0.9  # the second attempt waited twice the backoff


def test_sticky_map_evicts_the_least_recently_used_session(tokenizer: Any) -> None:
    """A session used again is the most recent (cachetools' LRUCache); taking a server out
    forgets its sessions without touching the others' order."""
    manager = ServerManager(servers(tokenizer, 2), max_sticky_sessions=3)
    for s in ("s0", "s1", "s2"):
        manager._pick(s)
    manager._pick("s0")  # used again: s1 is now the oldest
    manager._pick("s3")
    assert set(manager._sticky) == {"s0", "s2", "s3"}
    gone = manager._sticky["s2"]
    manager.remove_server(gone)
    assert all(manager._sticky[s] != gone for s in manager._sticky)
