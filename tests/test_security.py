"""Security (issue #10, item 3; docs/design.md §9.7).

- No pickle, marshal, eval/exec, unsafe YAML or `torch.load` without `weights_only=True`
  in our packages (a source scan — the scanner itself is tested on bad snippets), and
  behaviourally: a pickled payload is refused by the wire decoder and by checkpoint
  loading without ever running.
- Every listener defaults to loopback; beyond loopback it needs a token or secret
  (dashboard: tests/test_dashboard.py; ZMQ channels: tests/test_channels.py; the
  OpenAI-compatible HTTP API: here).
- The python tool's sandbox: tests/agent/test_python_tool.py.
- Outputs stay in the run folder; a run folder that holds more than the run is refused.
"""

from __future__ import annotations

import ast
import asyncio
import os
from pathlib import Path

import psutil
import pytest

from areal_like.core.config import ConfigError, ExperimentConfig, load_config

ROOT = Path(__file__).parent.parent
PACKAGES = ["areal_like", "rollout_cluster", "train_cluster", "weight_sync"]

_BANNED_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib"}
_BANNED_BUILTINS = {"eval", "exec"}
_UNSAFE_YAML = {"load", "unsafe_load", "full_load", "load_all", "unsafe_load_all", "full_load_all"}


def scan_source(source: str, filename: str = "<src>") -> list[str]:
    """Findings `file:line: what` for unsafe deserialisation or code execution."""
    out = []
    tree = ast.parse(source, filename)
    for node in ast.walk(tree):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            out += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in _BANNED_MODULES]
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in _BANNED_MODULES:
                out.append(f"{where}: from {node.module} import")
        elif isinstance(node, ast.Call):
            fn = node.func
            kw = {k.arg: k.value for k in node.keywords}
            if isinstance(fn, ast.Name) and fn.id in _BANNED_BUILTINS:
                out.append(f"{where}: {fn.id}()")
            elif isinstance(fn, ast.Attribute):
                owner = fn.value.id if isinstance(fn.value, ast.Name) else None
                if owner == "yaml" and fn.attr in _UNSAFE_YAML:
                    loader = kw.get("Loader")
                    safe = isinstance(loader, ast.Attribute) and loader.attr in ("SafeLoader", "CSafeLoader")
                    if not safe:
                        out.append(f"{where}: yaml.{fn.attr} without SafeLoader")
                elif owner == "torch" and fn.attr == "load":
                    wo = kw.get("weights_only")
                    if not (isinstance(wo, ast.Constant) and wo.value is True):
                        out.append(f"{where}: torch.load without weights_only=True")
                elif owner in ("np", "numpy") and fn.attr == "load":
                    ap = kw.get("allow_pickle")
                    if isinstance(ap, ast.Constant) and ap.value is True:
                        out.append(f"{where}: numpy.load(allow_pickle=True)")
                elif owner == "os" and fn.attr in ("system", "popen"):
                    out.append(f"{where}: os.{fn.attr}")
                elif owner == "builtins" and fn.attr in _BANNED_BUILTINS:
                    out.append(f"{where}: builtins.{fn.attr}()")
            if "shell" in kw and isinstance(kw["shell"], ast.Constant) and kw["shell"].value is True:
                out.append(f"{where}: subprocess with shell=True")
    return out


@pytest.mark.parametrize(
    "snippet",
    [
        "import pickle", "import cloudpickle as cp", "from marshal import loads", "import dill",
        "eval('1')", "exec(code)", "builtins.eval(x)",
        "yaml.load(s)", "yaml.load(s, Loader=yaml.Loader)", "yaml.unsafe_load(s)", "yaml.full_load(s)",
        "torch.load(p)", "torch.load(p, weights_only=False)", "torch.load(p, map_location='cpu')",
        "np.load(p, allow_pickle=True)", "os.system('x')", "subprocess.run(c, shell=True)",
    ],
)
def test_scanner_catches_unsafe_code(snippet: str) -> None:
    assert scan_source(snippet), f"scanner missed {snippet!r}"


@pytest.mark.parametrize(
    "snippet",
    ["yaml.safe_load(s)", "yaml.load(s, Loader=yaml.SafeLoader)", "torch.load(p, weights_only=True)",
     "model.eval()", "np.load(p)", "subprocess.run([a, b])", "json.loads(s)", "msgpack.unpackb(b)"],
)
def test_scanner_allows_safe_code(snippet: str) -> None:
    assert scan_source(snippet) == []


# The one module that pickles, and why it may (docs/design.md §10.15): the local launcher's
# actor calls travel over Unix socket pairs between our own processes on one machine, whose
# ends it hands out itself, after checking the peer is the same user (SO_PEERCRED; the test
# below). No network peer ever sends it a frame; network wires stay msgpack.
LOCAL_IPC = {"areal_like/launcher/local.py": {"import pickle", "import cloudpickle"},
             "areal_like/launcher/local_process.py": {"import pickle"}}
"""The local launcher pickles (cloudpickle for call arguments, as Ray does) between two of
our own processes of one user, over a Unix socket pair: never a network wire."""


def test_no_unsafe_deserialisation_or_eval_in_our_packages() -> None:
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(files) > 20
    findings = []
    for p in files:
        rel = str(p.relative_to(ROOT))
        allowed = LOCAL_IPC.get(rel, set())
        findings += [f for f in scan_source(p.read_text(), rel) if f.split(": ", 1)[1] not in allowed]
    assert findings == [], "unsafe code crossing a boundary:\n" + "\n".join(findings)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user")
def test_the_local_launchers_zygote_forks_for_no_other_user() -> None:
    """Another local user who finds the zygote's socket name gets nothing: no actor, no pickle
    read from them."""
    import socket
    import struct

    from areal_like.launcher.local import Zygote

    z = Zygote.start(preload=())
    try:
        z._connect().close()  # up, and ours (an empty request: it says so on stderr and goes on)
        kids_before = {c.pid for c in psutil.Process(z.proc.pid).children()}
        pid = os.fork()
        if pid == 0:  # another user tries to get an actor
            code = 1
            try:
                os.setgid(65534)
                os.setuid(65534)
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect("\0" + z.address)
                a, b = socket.socketpair()
                head = b'{"name": "x", "threads": null, "env": {}, "stdio": null}'
                try:
                    socket.send_fds(s, [struct.pack("!I", len(head)) + head], [b.fileno()])
                    code = 0 if s.recv(4) == b"" else 2  # closed without a pid: refused
                except OSError:  # closed on us (reset, broken pipe): refused too
                    code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert {c.pid for c in psutil.Process(z.proc.pid).children()} == kids_before  # nothing forked
    finally:
        z.close()


def test_checkpoint_with_a_pickled_payload_is_refused_without_running_it(tiny_model_dir, tmp_path) -> None:
    import torch

    from areal_like.core.config import TrainConfig
    from train_cluster.torch_engine import TorchTrainEngine

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):  # noqa: ANN204
            return (os.system, (f"touch {marker}",))

    engine = TorchTrainEngine(tiny_model_dir, TrainConfig())
    ckpt = tmp_path / "ckpt"
    engine.save(ckpt)
    torch.save({"state": Evil()}, ckpt / "optimizer.pt")
    with pytest.raises(Exception, match="(?i)weights.only|unpickl|unsupported"):
        engine.load(ckpt)
    assert not marker.exists()


# ---- listeners -----------------------------------------------------------------------------------
def _host(addr: str) -> str:
    return addr.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")


def _listening(proc) -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in proc.net_connections(kind="inet") if c.status == "LISTEN"}


def test_every_listener_binds_loopback_by_default(tmp_path) -> None:
    """Open each listener with the default config and read what the kernel says it bound
    (the weight-group TCPStore used to listen on every interface)."""
    import psutil

    from areal_like.core.metrics import MetricsLog, MetricsRegistry
    from areal_like.orchestration.channels import ControlPublisher, DataPuller
    from areal_like.orchestration.dashboard import Dashboard
    from weight_sync import make_sender

    cfg = ExperimentConfig()
    me = psutil.Process()
    before = _listening(me)
    puller = DataPuller(cfg.transport.data_addr)
    publisher = ControlPublisher(cfg.transport.control_addr)
    sender = make_sender(cfg.weight_sync)
    mlog = MetricsLog(tmp_path / "metrics.jsonl")
    dash = Dashboard(mlog, MetricsRegistry(), host=cfg.metrics.dashboard_host, port=0)
    dash.start()
    try:
        opened = _listening(me) - before
        ports = {int(a.rsplit(":", 1)[1]) for a in (puller.addr, publisher.addr, sender.rendezvous)}
        assert ports <= {p for _, p in opened}, (ports, opened)
        assert len(opened) >= 4
        assert all(ip == "127.0.0.1" for ip, _ in opened), opened
    finally:
        dash.stop()
        sender.close()
        puller.close()
        publisher.close()
        mlog.close()
    from areal_like.orchestration.launch import ray_env

    assert ray_env()["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"  # embedded Ray binds 127.0.0.1


def test_zmq_channel_beyond_loopback_needs_a_secret() -> None:
    from areal_like.orchestration.channels import ChannelError, ControlPublisher, DataPuller

    for cls in (DataPuller, ControlPublisher):
        with pytest.raises(ChannelError, match="without transport.secret"):
            cls("tcp://0.0.0.0:0")


class _StubServer:
    """Enough of a RolloutServer for the auth middleware (handlers never run unauthorised)."""

    version = 0


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "example.com"])
def test_http_api_beyond_loopback_needs_an_api_key(host: str) -> None:
    from rollout_cluster.http_api import HttpServer

    with pytest.raises(PermissionError, match="without an api_key"):
        asyncio.run(HttpServer(_StubServer()).start(host, 0))  # type: ignore[arg-type]


def test_http_api_with_a_key_refuses_requests_without_it() -> None:
    import aiohttp

    from rollout_cluster.http_api import HttpServer

    async def main() -> list[int]:
        http = HttpServer(_StubServer(), api_key="k3y")  # type: ignore[arg-type]
        url = await http.start("127.0.0.1", 0)
        try:
            codes = []
            async with aiohttp.ClientSession() as s:
                for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "k3y"}):
                    for path in ("/v1/completions", "/v1/chat/completions"):
                        async with s.post(url + path, json={"prompt": [1]}, headers=headers) as r:
                            codes.append(r.status)
                    async with s.get(url + "/metrics", headers=headers) as r:
                        codes.append(r.status)
            return codes
        finally:
            await http.stop()

    assert set(asyncio.run(main())) == {401}


# ---- outputs stay in the run folder ----------------------------------------------------------------
@pytest.mark.parametrize("bad", [".", "..", "/", "./", "../..", ""])
def test_run_dir_that_holds_more_than_the_run_is_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="run.dir"):
        load_config(None, [f"run.dir={bad}"])


def test_run_dir_home_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ConfigError, match="home folder"):
        load_config(None, [f"run.dir={tmp_path}"])
    assert load_config(None, [f"run.dir={tmp_path / 'runs' / 'a'}"]).run.dir == str(tmp_path / "runs" / "a")
