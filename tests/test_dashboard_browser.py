"""The dashboard page in a real headless Chromium: charts get drawn and follow new data live.

Driven over the Chrome DevTools protocol with aiohttp's websocket client (already a
dependency), so nothing is downloaded: only the Debian `chromium` package is needed.
The page is opened with a token, which also proves it passes the token to
`/api/data`. A screenshot goes to `test-output/dashboard.png` for humans to look at.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from areal_like.core.metrics import MetricsLog, MetricsRegistry
from areal_like.orchestration.dashboard import Dashboard
from tests.test_dashboard import feed_synthetic_run

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
OUT_DIR = Path(__file__).resolve().parents[1] / "test-output"
CHARTS = (
    "chart-versions", "chart-version-lag", "chart-gate", "chart-gate-state", "chart-buffer", "chart-throughput",
    "chart-idle", "chart-interrupts", "chart-pause-resume", "chart-weight-sync", "chart-weight-sync-bytes",
    "chart-reward", "chart-reward-dist", "chart-logprob-gap", "chart-importance-weights",
)
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
    "--window-size=1400,1000", "--remote-debugging-port=0",
)
# Generous: the CI machines are 2 shared cores.
DEADLINE_S = 90.0


class _CDP:
    """Just enough of the DevTools protocol: numbered calls, events kept aside."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.n = 0
        self.events: list[dict[str, Any]] = []

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.n += 1
        await self.ws.send_json({"id": self.n, "method": method, "params": params})
        while True:
            msg = await self.ws.receive_json(timeout=60)
            if msg.get("id") == self.n:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]
            self.events.append(msg)

    async def eval(self, expression: str) -> Any:
        res = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return res["result"].get("value")

    async def wait_for(self, expression: str, what: str) -> Any:
        deadline = time.time() + DEADLINE_S
        while time.time() < deadline:
            value = await self.eval(expression)
            if value:
                return value
            await asyncio.sleep(0.25)
        raise AssertionError(f"timed out after {DEADLINE_S:.0f}s waiting for {what}")

    def exceptions(self) -> list[str]:
        return [json.dumps(e["params"]["exceptionDetails"])[:500] for e in self.events
                if e.get("method") == "Runtime.exceptionThrown"]


def _points_js() -> str:
    ids = json.dumps(CHARTS)
    return f"JSON.stringify(Object.fromEntries({ids}.map(id => [id, +document.getElementById(id).dataset.points])))"


def _start_chromium(profile: Path) -> tuple[subprocess.Popen[bytes], str]:
    assert CHROMIUM is not None
    with (profile.parent / "chromium.log").open("wb") as log:  # the child keeps its own copy of the fd
        proc = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                stdout=log, stderr=subprocess.STDOUT)
    port_file = profile / "DevToolsActivePort"
    deadline = time.time() + DEADLINE_S
    while not (port_file.is_file() and port_file.read_text().strip()):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"chromium did not start (exit {proc.poll()}); see {profile.parent / 'chromium.log'}")
        time.sleep(0.1)
    port = int(port_file.read_text().split()[0])
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30) as r:
        pages = [t for t in json.load(r) if t["type"] == "page"]
    return proc, pages[0]["webSocketDebuggerUrl"]


async def _drive(ws_url: str, page_url: str, on_first_render: Any) -> tuple[dict[str, int], dict[str, int], bytes]:
    async with aiohttp.ClientSession() as session, session.ws_connect(ws_url, max_msg_size=0) as ws:
        cdp = _CDP(ws)
        await cdp.call("Runtime.enable")
        await cdp.call("Page.enable")
        await cdp.call("Page.navigate", url=page_url)
        await cdp.wait_for("document.readyState === 'complete' && !!document.getElementById('chart-version-lag')",
                           "the page to load")
        first = json.loads(await cdp.wait_for(
            f"(() => {{ const p = JSON.parse({_points_js()}); return Object.values(p).every(n => n > 0) && "
            f"JSON.stringify(p); }})()", "every chart to have data"))
        versions_before = first["chart-versions"]
        await cdp.eval("window.__same_page = 1")  # survives only if the page never reloads
        on_first_render()
        await cdp.wait_for(
            f"JSON.parse({_points_js()})['chart-versions'] > {versions_before} && "
            "document.getElementById('tile-trainer-version').textContent === '45' && "
            "!!document.querySelector('#summary table')", "the page to show the new steps and the summary")
        assert await cdp.eval("window.__same_page") == 1, "the page reloaded instead of updating in place"
        assert (await cdp.eval("document.getElementById('status').textContent")).startswith("live")
        second = json.loads(await cdp.eval(_points_js()))
        height = await cdp.eval("document.documentElement.scrollHeight")
        await cdp.call("Emulation.setDeviceMetricsOverride", width=1400, height=int(height), deviceScaleFactor=1,
                       mobile=False)
        await asyncio.sleep(0.5)  # the page redraws on resize after 150 ms
        shot = await cdp.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        assert not cdp.exceptions(), cdp.exceptions()
    return first, second, base64.b64decode(shot["data"])


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_dashboard_page_renders_and_updates_live(tmp_path) -> None:
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium)")
    mlog = MetricsLog(tmp_path / "metrics.jsonl")
    registry = MetricsRegistry()
    t0 = time.time() - 65.0
    written = feed_synthetic_run(mlog, registry, steps=40, summary=False, t0=t0)
    dash = Dashboard(mlog, registry, token="browser-secret", run_name="synthetic η=2")
    url = dash.start()
    proc, ws_url = _start_chromium(tmp_path / "profile")

    def more_steps() -> None:
        feed_synthetic_run(mlog, registry, steps=5, start_step=41, skip_step=None, t0=max(written.times) + 0.1,
                           out=written)

    try:
        first, second, png = asyncio.run(_drive(ws_url, url + "?token=browser-secret", more_steps))
    finally:
        _terminate(proc)
        dash.stop()
        mlog.close()
    assert first["chart-version-lag"] > 0
    assert second["chart-version-lag"] >= first["chart-version-lag"]
    assert second["chart-versions"] > first["chart-versions"] and second["chart-reward"] > first["chart-reward"]
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    OUT_DIR.mkdir(exist_ok=True)
    (OUT_DIR / "dashboard.png").write_bytes(png)
