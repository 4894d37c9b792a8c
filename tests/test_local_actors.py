"""The local launcher's actors (areal_like/launcher/local.py), as the launch
code meets them: real processes forked from a real zygote, real sockets, real kills."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from areal_like.launcher import local as actors
from areal_like.launcher.local import ActorDiedError, Zygote
from tests._actor_bodies import Apply, AsyncEcho, Echo, Picky


@pytest.fixture(scope="module")
def zygote():
    z = Zygote.start(preload=("tests._actor_bodies",))
    yield z
    z.close()


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.time() + within_s
    while time.time() < deadline:
        try:
            p = psutil.Process(pid)
            if p.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_calls_run_in_a_process_of_their_own_in_order(zygote) -> None:
    a = zygote.spawn(Echo, ("e",), name="echo", threads=1)
    refs = [a.hello.remote(i) for i in range(5)]
    assert actors.get(refs) == [f"e:{i}:{i + 1}" for i in range(5)]  # in call order, one at a time
    pid = actors.get(a.getpid.remote())
    assert pid != os.getpid()
    assert psutil.Process(pid).ppid() == zygote.proc.pid  # forked by the zygote, not by us
    assert actors.get(a.threads.remote()) == 1
    actors.kill(a)


def test_an_error_comes_back_as_itself_with_the_actors_traceback(zygote) -> None:
    a = zygote.spawn(Echo, ("e",), name="echo")
    with pytest.raises(Picky, match="said the actor") as info:
        actors.get(a.fail.remote())
    assert any("in actor process" in n for n in getattr(info.value, "__notes__", []))
    assert not actors.is_actor_death(info.value)
    assert actors.get(a.hello.remote(1)) == "e:1:1"  # the actor goes on
    actors.kill(a)


def test_a_constructor_that_fails_fails_the_first_call(zygote) -> None:
    a = zygote.spawn(Echo, (), name="broken")  # Echo needs a tag
    with pytest.raises(TypeError):
        actors.get(a.hello.remote(1), timeout=30)


def test_async_methods_run_concurrently_and_refs_are_awaitable(zygote) -> None:
    a = zygote.spawn(AsyncEcho, name="async")

    async def main() -> list[int]:
        return await asyncio.gather(*(a.nap.remote(0.3) for _ in range(4)))

    t0 = time.time()
    peaks = asyncio.run(main())
    assert max(peaks) == 4  # all four were running at once
    assert time.time() - t0 < 1.1  # not 4 x 0.3 s one after the other
    actors.kill(a)


def test_killed_actor_fails_pending_and_later_calls(zygote) -> None:
    a = zygote.spawn(Echo, ("e",), name="victim")
    pid = actors.get(a.getpid.remote())
    pending = a.sleep.remote(30)
    time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)  # from outside, as the OOM killer would
    with pytest.raises(ActorDiedError) as info:
        actors.get(pending, timeout=10)
    assert actors.is_actor_death(info.value)
    with pytest.raises(ActorDiedError):
        actors.get(a.hello.remote(1), timeout=10)
    done, rest = actors.wait([a.hello.remote(2)], timeout=5)
    assert done and not rest
    assert _gone(pid)


def test_wait_returns_what_is_done_within_the_timeout(zygote) -> None:
    a = zygote.spawn(Echo, ("e",), name="waiter")
    b = zygote.spawn(Echo, ("f",), name="waiter2")
    slow, fast = a.sleep.remote(2.0), b.sleep.remote(0.05)
    done, pending = actors.wait([slow, fast], num_returns=1, timeout=5)
    assert done == [fast] and pending == [slow]
    done, pending = actors.wait([slow], timeout=0)
    assert done == [] and pending == [slow]
    actors.kill(a)
    actors.kill(b)


def test_an_actor_goes_when_the_process_that_asked_for_it_dies(zygote, tmp_path) -> None:
    """The rollout controller asks for its servers: when it dies, they must not linger."""
    script = tmp_path / "asker.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(os.getcwd())!r})
        from areal_like.launcher import local as actors
        from areal_like.launcher.local import Zygote
        from tests._actor_bodies import Echo
        a = Zygote({zygote.address!r}).spawn(Echo, ("x",), name="orphan")
        print(actors.get(a.getpid.remote()), flush=True)
        time.sleep(600)
    """))
    asker = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(asker.stdout.readline())
        assert psutil.pid_exists(pid)
        asker.kill()
        asker.wait()
        assert _gone(pid), "the actor outlived the process that asked for it"
    finally:
        asker.kill()


def test_the_zygote_goes_with_the_process_that_started_it(tmp_path) -> None:
    script = tmp_path / "starter.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(os.getcwd())!r})
        from areal_like.launcher import local as actors
        from areal_like.launcher.local import Zygote
        from tests._actor_bodies import Echo
        z = Zygote.start(preload=("tests._actor_bodies",))
        a = z.spawn(Echo, ("x",), name="child")
        print(z.proc.pid, actors.get(a.getpid.remote()), flush=True)
        time.sleep(600)
    """))
    starter = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        zpid, apid = map(int, starter.stdout.readline().split())
        starter.kill()
        starter.wait()
        assert _gone(zpid) and _gone(apid)
    finally:
        starter.kill()


def test_what_cannot_travel_is_refused_at_the_caller(zygote) -> None:
    import threading

    with pytest.raises(Exception, match="pickle|lock"):
        zygote.spawn(Echo, (threading.Lock(),), name="nope")


def test_user_callables_travel_by_value_and_keep_their_file_name(zygote) -> None:
    """A lambda, a closure and a callable object defined here (not importable by the
    actor) reach it by value, as the API hands them on; a function that raises there
    names this file in its traceback (the user's file:line leads the console line)."""
    offset = 10

    class Scale:
        def __init__(self, k: int) -> None:
            self.k = k

        def __call__(self, x: int) -> int:
            return self.k * x

    def shifted(x: int) -> int:
        return x + offset

    def broken(row: dict) -> str:
        return row["q"]

    a = zygote.spawn(Apply, name="apply")
    assert actors.get(a.call.remote(lambda x: x + 1, 1), timeout=30) == 2
    assert actors.get(a.call.remote(shifted, 1), timeout=30) == 11
    assert actors.get(a.call.remote(Scale(3), 2), timeout=30) == 6
    with pytest.raises(KeyError) as err:
        actors.get(a.call.remote(broken, {}), timeout=30)
    assert f"{os.path.basename(__file__)}\", line" in "".join(err.value.__notes__)
    actors.kill(a)


def test_an_argument_the_actor_cannot_rebuild_fails_that_call_only(zygote) -> None:
    """A class of a module only the caller has (here one made at run time) arrives as a
    reference the actor cannot resolve: that call fails with the actor's own error, and
    the actor still answers the next (its reader once died silently instead, and the
    caller waited forever)."""
    import types

    ghost = types.ModuleType("ghost_module_of_the_caller")
    exec("class Thing:\n    pass\n", ghost.__dict__)
    ghost.Thing.__module__ = ghost.__name__
    sys.modules[ghost.__name__] = ghost
    try:
        a = zygote.spawn(Apply, name="apply2")
        with pytest.raises(Exception, match="ghost_module_of_the_caller"):
            actors.get(a.call.remote(print, ghost.Thing()), timeout=30)
        assert actors.get(a.ping.remote(), timeout=30) == "pong"
        actors.kill(a)
    finally:
        del sys.modules[ghost.__name__]


def test_killing_one_actor_never_disturbs_the_next(zygote) -> None:
    """`actors.kill` used to close the handle's socket under its reader thread; the number
    was soon the next actor's socket, and that reader took its replies (a call hung, or
    the next actor looked dead). One in ~20 rounds of this loop failed before the fix."""
    for i in range(40):
        a = zygote.spawn(Echo, ("k",), name=f"round{i}")
        with pytest.raises(Picky):
            actors.get(a.fail.remote(), timeout=30)
        assert actors.get(a.hello.remote(i), timeout=30) == f"k:{i}:1"
        actors.kill(a)


def test_the_cli_starts_its_zygote_before_its_own_heavy_imports(tmp_path) -> None:
    """`areal-like run` starts the local launcher's zygote first thing (areal_like/launcher/
    early.py): when the zygote's process starts, the CLI has imported neither typer nor
    pydantic, numpy or torch (the zygote's imports are the first step's longest wait).
    Checked by the modules loaded at the Popen, not by a clock."""
    code = textwrap.dedent("""
        import json, subprocess, sys
        sys.argv = ["areal-like", "run", "no-such-config.yaml"]
        seen = []
        class Spy(subprocess.Popen):
            def __init__(self, args, *a, **k):
                heavy = ("typer", "pydantic", "numpy", "torch", "transformers", "zmq")
                seen.append((list(args), sorted(m for m in heavy if m in sys.modules)))
                super().__init__(args, *a, **k)
        subprocess.Popen = Spy
        import areal_like.orchestration.cli  # as the console script does, before main()
        from areal_like.launcher import early
        proc = early._early[2]
        early.discard()  # what the exit of a command that never opened a launcher does
        print(json.dumps({"seen": seen, "killed": proc.poll() is not None}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=os.getcwd(), timeout=120)
    assert out.returncode == 0, out.stderr
    import json

    got = json.loads(out.stdout.strip().splitlines()[-1])
    (args, loaded), = got["seen"]
    assert "areal_like.launcher.local_process" in args and loaded == []
    assert got["killed"]


def test_a_prestarted_zygote_is_adopted_once_or_discarded() -> None:
    from areal_like.launcher import early

    early.prestart(preload=("tests._actor_bodies",))
    address = early._early[0]
    z = Zygote.start(preload=("tests._actor_bodies",))
    try:
        assert z.address == address and early._early is None
        a = z.spawn(Echo, ("e",), name="early")
        assert actors.get(a.hello.remote(1)) == "e:1:1"
        a.actor_kill()
    finally:
        z.close()
    early.prestart(preload=("tests._actor_bodies",))
    proc = early._early[2]
    other = Zygote.start(preload=())  # another preload: not that one, which goes
    try:
        assert other.proc is not proc and proc.poll() is not None and early._early is None
    finally:
        other.close()
    early.prestart(preload=())
    proc = early._early[2]
    from areal_like.core.config import ExperimentConfig
    from areal_like.launcher import open_launcher

    open_launcher(ExperimentConfig(), kind="ray")  # the config picked Ray: the zygote goes
    assert proc.poll() is not None and early._early is None
