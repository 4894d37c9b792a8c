"""The dashboard of a real short run, in headless Chromium (issue: dashboards).

The run is paused inside the trainer at step 4 (the step callback runs on the trainer's
thread; the dashboard serves from its own), Chromium opens the live page and waits for
the version-lag chart to get data, and a screenshot is saved to test-output/.
"""

from __future__ import annotations

import asyncio
import base64
import json

import aiohttp
import pytest

from areal_like.core.config import load_config
from tests.test_dashboard_browser import _CDP, CHROMIUM, OUT_DIR, _start_chromium, _terminate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


async def _look(ws_url: str, page_url: str) -> tuple[dict[str, int], bytes]:
    async with aiohttp.ClientSession() as session, session.ws_connect(ws_url, max_msg_size=0) as ws:
        cdp = _CDP(ws)
        await cdp.call("Runtime.enable")
        await cdp.call("Page.enable")
        await cdp.call("Page.navigate", url=page_url)
        js = ("JSON.stringify(Object.fromEntries(['chart-version-lag','chart-versions','chart-reward','chart-gate']"
              ".map(id => [id, +document.getElementById(id).dataset.points])))")
        points = json.loads(await cdp.wait_for(
            f"(() => {{ const p = JSON.parse({js}); return p['chart-version-lag'] > 0 && p['chart-versions'] > 0 "
            f"&& JSON.stringify(p); }})()", "the version-lag chart to have data"))
        height = await cdp.eval("document.documentElement.scrollHeight")
        await cdp.call("Emulation.setDeviceMetricsOverride", width=1400, height=int(height), deviceScaleFactor=1,
                       mobile=False)
        await asyncio.sleep(0.5)
        shot = await cdp.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        assert not cdp.exceptions(), cdp.exceptions()
    return points, base64.b64decode(shot["data"])


def test_dashboard_of_a_real_run(tiny_model_dir, tmp_path) -> None:
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium)")
    from areal_like.orchestration.launch import run_both

    cfg = load_config("configs/quickstart.yaml", [
        f"model.path={tiny_model_dir}", f"run.dir={tmp_path / 'run'}", "train.total_steps=6", "train.batch_size=2",
        "rollout.group_size=4", "staleness.filter_uniform_groups=false", "eval.num_samples=4",
        "metrics.dashboard_token=t0ken",
    ])
    side: dict = {}
    seen: dict = {}

    def on_start(trainer) -> None:
        side["url"] = trainer.dashboard_url

    def on_step(rec) -> None:
        if rec["step"] != 4:
            return
        proc, ws_url = _start_chromium(tmp_path / "profile")
        try:
            seen["points"], seen["png"] = asyncio.run(_look(ws_url, side["url"] + "?token=t0ken"))
        finally:
            _terminate(proc)

    summary = run_both(cfg, on_start=on_start, on_step=on_step)
    assert summary["trained"] == 6 * 8
    assert seen["points"]["chart-version-lag"] > 0 and seen["points"]["chart-versions"] > 0
    assert seen["png"].startswith(b"\x89PNG")
    OUT_DIR.mkdir(exist_ok=True)
    (OUT_DIR / "dashboard_real_run.png").write_bytes(seen["png"])
