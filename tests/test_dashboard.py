"""The dashboard's HTTP contract: `/api/data` fields and values, `/metrics`, auth, bind rules.

A synthetic run (records of every kind the trainer side writes, with the registry fed
the way `TrainerController` feeds it) stands in for a real one: the dashboard only
reads `MetricsLog.recent` and the registry, so the edges are faked and the server is real.
"""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from areal_like.core.metrics import MetricsLog, MetricsRegistry
from areal_like.orchestration.dashboard import SERIES, Dashboard, build_data


@dataclass
class SyntheticRun:
    """What `feed_synthetic_run` wrote, for the tests to check the dashboard against."""

    head_hist: dict[str, int] = field(default_factory=dict)
    token_hist: dict[str, int] = field(default_factory=dict)
    rewards: list[float] = field(default_factory=list)
    steps: int = 0
    rollout_records: int = 0
    evals: list[float] = field(default_factory=list)
    last_rollout: dict[str, Any] = field(default_factory=dict)
    times: list[float] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    """Cumulative rollout-side counters, so a second call continues the same run."""


def _write(mlog: MetricsLog, t: float, kind: str, trainer_version: int, **fields: Any) -> dict[str, Any]:
    rec = mlog.write(kind, trainer_version, **fields)
    rec["time"] = t  # spread the records over a realistic span (the same dict sits in mlog.recent)
    return rec


def feed_synthetic_run(mlog: MetricsLog, registry: MetricsRegistry, *, steps: int = 40, batch: int = 64,
                       skip_step: int | None = 17, summary: bool = True, t0: float | None = None,
                       start_step: int = 1, out: SyntheticRun | None = None) -> SyntheticRun:
    """A run of `steps` train steps (η=2, B=`batch`), ~1.5 s apart, with rollout stats
    twice per step, an eval every 10 versions and (optionally) the final summary.
    Step `skip_step` is skipped (its lags must not count as trained)."""
    rng = random.Random(start_step)
    out = out or SyntheticRun()
    t = (time.time() - 1.5 * steps) if t0 is None else t0
    c = out.counters
    for k in ("gen_tokens", "interrupts", "interrupted", "recompute", "sent", "trained"):
        c.setdefault(k, 0)
    for v in range(start_step, start_step + steps):
        for _ in range(2):
            t += 0.75
            c["sent"] += batch // 2 + 1  # a little ahead of training: the buffer holds some
            if rng.random() < 0.5:
                c["interrupts"] += 1
                n = rng.randint(100, 400)
                c["interrupted"] += n
                c["recompute"] += n + rng.randint(50, 150)
            c["gen_tokens"] += rng.randint(8000, 12000)
            sent = c["sent"]
            fields = {
                "loaded_version": v - 1, "started": sent + 32, "episodes_running": 32,
                "gate_version": v - 1, "gate_running": 32, "gate_sent": sent, "gate_dropped": v // 5,
                "gate_consumed": (v - 1) * batch, "gate_sent_base": 0, "gate_rejected_at_gate": 3 * v,
                "gate_capacity": (2 + v) * batch, "outcome_sent": sent, "outcome_rejected": 0, "outcome_failed": 0,
                "generated_tokens": c["gen_tokens"], "gen_tokens_per_s": 1200 + rng.uniform(-150, 150),
                "interrupts": c["interrupts"], "interrupted_tokens": c["interrupted"], "recompute_tokens": c["recompute"],
                "pause_resume_latency_s_max": 0.02 + rng.uniform(0, 0.08), "queue_depth": 0, "running": 32,
                "kv_usage": 0.4, "rollout_idle_ratio": 0.05 + rng.uniform(0, 0.1),
            }
            _write(mlog, t, "rollout", v - 1, **fields)
            out.rollout_records += 1
            out.last_rollout = fields
            out.times.append(t)
        t += 0.1
        skipped = v == skip_step
        heads = [rng.choice([0, 0, 0, 1, 1, 2]) for _ in range(batch // 8)]  # groups of 8
        tokens = [lag for h in heads for lag in [h] * 40 + [max(h - 1, 0)] * 20]
        p = min(0.9, 0.15 + 0.02 * v)
        rewards = [1.0 if rng.random() < p else rng.choice([0.0, 0.0, 0.1]) for _ in range(batch)]
        head_hist: dict[str, int] = {}
        for h in heads:
            head_hist[str(h)] = head_hist.get(str(h), 0) + 8
        token_hist: dict[str, int] = {}
        for lag in tokens:
            token_hist[str(lag)] = token_hist.get(str(lag), 0) + 1
        if not skipped:
            for src, dst in ((head_hist, out.head_hist), (token_hist, out.token_hist)):
                for k, n in src.items():
                    dst[k] = dst.get(k, 0) + n
            c["trained"] += batch
            for r in rewards:
                registry.samples.reward.observe(r)
            out.rewards.extend(rewards)
        new_v = v - 1 if skipped else v
        rec = {
            "step": new_v, "skipped": skipped, "reward_mean": sum(rewards) / len(rewards), "samples": batch,
            "max_version_lag": max(heads), "mean_version_lag": sum(heads) / len(heads),
            "head_lag_hist": head_hist, "token_lag_hist": token_hist, "response_len_mean": 60.0,
            "buffer_depth": rng.randint(0, 2 * batch), "loss": 0.1 - 0.001 * v + rng.uniform(-0.02, 0.02),
            "clip_frac": rng.uniform(0.0, 0.05), "behav_weight_mean": 1.0 + rng.uniform(-0.02, 0.02),
            "behav_weight_max": 1.2 + rng.uniform(0, 0.6), "behav_capped": rng.randint(0, 5), "behav_masked": 0,
            "behav_prox_gap": 0.01 + 0.01 * max(heads) + rng.uniform(0, 0.005), "entropy": 1.2,
            "grad_norm": 0.5, "lr": 3e-4, "tokens_per_s": 900 + rng.uniform(-100, 100),
            "rollout_version": v - 1, "trainer_idle_ratio": 0.4 * 0.97**v, "over_stale": v // 10,
        }
        if not skipped:
            rec["weight_sync_s"] = 0.05 + rng.uniform(0, 0.05)
            rec["weight_sync_bytes"] = 18_000_000
        registry.versions.trainer_version.set(new_v)
        registry.samples.reward_mean.set(rec["reward_mean"])
        registry.samples.buffer_depth.set(rec["buffer_depth"])
        for h in heads:
            registry.versions.head_lag.observe(h)
        _write(mlog, t, "train_step", new_v, **rec)
        out.steps += 1
        out.times.append(t)
        if v % 10 == 0:
            t += 0.05
            acc = min(0.95, 0.2 + 0.015 * v)
            _write(mlog, t, "eval", new_v, version=v - 1, accuracy=acc, reward_mean=acc, seconds=2.0, num_samples=128.0)
            out.evals.append(acc)
            out.times.append(t)
    registry.versions.server_version.labels(server="rollout").set(start_step + steps - 2)
    registry.samples.gate.labels(state="capacity").set(out.last_rollout["gate_capacity"])
    if summary:
        t += 0.5
        last_v = start_step + steps - 1
        skipped, dropped, over_stale = out.steps * batch - c["trained"], last_v // 5, last_v // 10
        _write(mlog, t, "summary", last_v, started=c["sent"] + 32, trained=c["trained"], rejected=0,
               filtered=dropped - over_stale, over_stale=over_stale, failed=0, skipped=skipped,
               buffered=c["sent"] - c["trained"] - skipped - dropped, cancelled=32, counts_add_up=True, evals=[])
        out.times.append(t)
    return out


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture
def run(tmp_path):
    mlog = MetricsLog(tmp_path / "metrics.jsonl")
    registry = MetricsRegistry()
    written = feed_synthetic_run(mlog, registry)
    yield mlog, registry, written
    mlog.close()


def test_api_data_reports_every_documented_field(run) -> None:
    mlog, registry, w = run
    dash = Dashboard(mlog, registry, run_name="synthetic")
    url = dash.start()
    try:
        assert url.startswith("http://127.0.0.1:") and dash.port > 0
        status, body = _get(url + "api/data")
        assert status == 200
        d = json.loads(body)
    finally:
        dash.stop()

    assert d["run_name"] == "synthetic"
    assert d["trainer_version"] == 40 and d["rollout_version"] == 39 and d["steps"] == w.steps == 40
    assert d["start_time"] == pytest.approx(min(w.times))
    assert d["latest_time"] == pytest.approx(max(w.times))
    # Lag histograms: summed over trained steps only (step 17 was skipped).
    assert d["head_lag_hist"] == dict(sorted(w.head_hist.items(), key=lambda kv: int(kv[0])))
    assert d["token_lag_hist"] == dict(sorted(w.token_hist.items(), key=lambda kv: int(kv[0])))
    assert sum(d["head_lag_hist"].values()) == 39 * 64
    # Reward distribution from the registry histogram, per bucket.
    rh = d["reward_hist"]
    assert rh["count"] == len(w.rewards) and rh["sum"] == pytest.approx(sum(w.rewards))
    by_le = {b["le"]: b["count"] for b in rh["buckets"]}
    assert by_le["0.0"] == w.rewards.count(0.0) and by_le["0.25"] == w.rewards.count(0.1)
    assert by_le["1.0"] == w.rewards.count(1.0) and by_le["+Inf"] == 0
    # Every documented series is there; the per-kind ones have one point per record.
    s = d["series"]
    assert set(s) == {name for name, _, _ in SERIES}
    for name in ("rollout_version", "gate_capacity", "gate_running", "gate_accepted", "gate_free", "gate_rejected_at_gate",
                 "gen_tokens_per_s", "rollout_idle_ratio", "interrupts", "interrupted_tokens",
                 "recompute_tokens", "pause_resume_latency_s_max"):
        assert len(s[name]) == w.rollout_records, name
    for name in ("buffer_depth", "train_tokens_per_s", "trainer_idle_ratio", "reward_mean", "loss",
                 "behav_prox_gap", "behav_weight_mean", "behav_weight_max", "behav_capped", "behav_masked",
                 "clip_frac", "over_stale"):
        assert len(s[name]) == w.steps, name
    assert len(s["weight_sync_s"]) == len(s["weight_sync_bytes"]) == w.steps - 1  # the skipped step did not sync
    assert len(s["trainer_version"]) == w.steps + w.rollout_records
    assert [v for _, v in s["eval_accuracy"]] == pytest.approx(w.evals)
    for points in s.values():
        assert [p[0] for p in points] == sorted(p[0] for p in points)
    last = w.last_rollout
    accepted = last["gate_sent"] - last["gate_dropped"]
    assert d["latest"]["gate_accepted"] == accepted
    assert d["latest"]["gate_free"] == last["gate_capacity"] - accepted - last["gate_running"]
    assert d["latest"]["gate_capacity"] == last["gate_capacity"] == (2 + 39 + 1) * 64
    assert d["latest"]["recompute_tokens"] == last["recompute_tokens"] > last["interrupted_tokens"] > 0
    assert d["latest"]["weight_sync_bytes"] == 18_000_000
    assert d["summary"]["trained"] == 39 * 64 and d["summary"]["counts_add_up"] is True


def test_since_returns_only_newer_points_but_whole_aggregates(run) -> None:
    mlog, registry, w = run
    full = build_data(mlog.recent, registry)
    cut = sorted(w.times)[-5]
    part = build_data(mlog.recent, registry, since=cut)
    assert all(p[0] > cut for points in part["series"].values() for p in points)
    assert sum(len(p) for p in part["series"].values()) < sum(len(p) for p in full["series"].values())
    assert part["head_lag_hist"] == full["head_lag_hist"] and part["latest"] == full["latest"]
    assert part["trainer_version"] == full["trainer_version"]
    nothing_new = build_data(mlog.recent, registry, since=full["latest_time"])
    assert not any(nothing_new["series"].values()) and nothing_new["latest_time"] == full["latest_time"]


def test_summary_absent_until_written(tmp_path) -> None:
    mlog = MetricsLog(tmp_path / "metrics.jsonl")
    registry = MetricsRegistry()
    empty = build_data(mlog.recent, registry)
    assert empty["trainer_version"] == 0 and empty["rollout_version"] is None and empty["steps"] == 0
    assert empty["head_lag_hist"] == {} and "summary" not in empty
    feed_synthetic_run(mlog, registry, steps=3, summary=False)
    assert "summary" not in build_data(mlog.recent, registry)
    mlog.close()


def test_page_assets_and_prometheus_metrics(run) -> None:
    mlog, registry, _ = run
    dash = Dashboard(mlog, registry)
    url = dash.start()
    try:
        status, page = _get(url)
        assert status == 200 and b'id="chart-version-lag"' in page and b"static/dashboard.js" in page
        assert b"http://" not in page and b"https://" not in page  # nothing fetched from elsewhere
        status, js = _get(url + "static/dashboard.js")
        assert status == 200 and b"api/data" in js and b"data-points" in js
        assert _get(url + "static/../dashboard.py")[0] == 404
        assert _get(url + "nope")[0] == 404
        assert _get(url + "api/data?since=yesterday")[0] == 400
        status, body = _get(url + "health")
        assert status == 200 and json.loads(body) == {"ok": True}
        status, text = _get(url + "metrics")
        assert status == 200
    finally:
        dash.stop()
    families = {f.name: f for f in text_string_to_metric_families(text.decode())}
    assert {"areal_like_trainer_version", "areal_like_reward", "areal_like_version_lag_head",
            "areal_like_gate_samples", "areal_like_server_version"} <= families.keys()
    (tv,) = families["areal_like_trainer_version"].samples
    assert tv.value == 40


def test_token_is_required_when_set(run) -> None:
    mlog, registry, _ = run
    dash = Dashboard(mlog, registry, token="s3cret")
    url = dash.start()
    try:
        assert "s3cret" not in url
        for path in ("", "api/data", "metrics"):
            assert _get(url + path)[0] == 401, path
            assert _get(url + path + "?token=wrong")[0] == 401, path
            assert _get(url + path, {"Authorization": "Bearer wrong"})[0] == 401, path
            assert _get(url + path + "?token=s3cret")[0] == 200, path
            assert _get(url + path, {"Authorization": "Bearer s3cret"})[0] == 200, path
        assert _get(url + "health")[0] == 200
    finally:
        dash.stop()


def test_non_loopback_bind_needs_a_token(run) -> None:
    mlog, registry, _ = run
    for host in ("0.0.0.0", "::", "192.168.1.10", "example.org"):
        with pytest.raises(ValueError, match="without a token"):
            Dashboard(mlog, registry, host=host)
    with pytest.raises(ValueError, match="non-empty"):
        Dashboard(mlog, registry, host="0.0.0.0", token="")
    Dashboard(mlog, registry, host="localhost")
    Dashboard(mlog, registry, host="0.0.0.0", token="t")  # allowed: constructing binds nothing


def test_stop_frees_the_port(run) -> None:
    mlog, registry, _ = run
    dash = Dashboard(mlog, registry)
    url = dash.start()
    assert dash.start() == url  # idempotent
    dash.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url + "health", timeout=2)
    dash.stop()  # idempotent


def test_grafana_dashboard_queries_only_registry_metrics() -> None:
    """docs/grafana_dashboard.json must follow renames in MetricsRegistry, or its panels go blank."""
    import re
    from pathlib import Path

    dash = json.loads((Path(__file__).resolve().parents[1] / "docs" / "grafana_dashboard.json").read_text())
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    known = {f.name + s for f in MetricsRegistry().registry.collect() for s in suffixes[f.type]}
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {name for e in exprs for name in re.findall(r"areal_like_[a-z_]+", e)}
    assert used and used <= known, sorted(used - known)
    # Every registry metric appears on some panel.
    assert {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in used} >= {f.name for f in MetricsRegistry().registry.collect()}


def test_a_given_port_is_used_a_busy_one_raises_and_ipv6_urls_are_bracketed(run) -> None:
    """`metrics.dashboard_port` as given; a port in use is an OSError from `start()` (the
    caller sees it before the run goes on); an IPv6 bind prints `http://[::1]:port/`."""
    import errno
    import socket

    mlog, registry, _ = run
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    dash = Dashboard(mlog, registry, port=free)
    assert dash.start() == f"http://127.0.0.1:{free}/"
    try:
        busy = Dashboard(mlog, registry, port=free)
        with pytest.raises(OSError) as e:
            busy.start()
        assert e.value.errno == errno.EADDRINUSE and busy.url == ""
        busy.stop()  # nothing started: a no-op
        assert _get(dash.url + "health")[0] == 200
        with pytest.raises(urllib.error.HTTPError) as post:
            urllib.request.urlopen(urllib.request.Request(dash.url + "health", data=b"x", method="POST"), timeout=10)
        assert post.value.code == 501  # only GET is served
    finally:
        dash.stop()
    if socket.has_ipv6:
        six = Dashboard(mlog, registry, host="::1")
        try:
            url = six.start()
        except OSError:
            return  # no IPv6 loopback here
        try:
            assert url == f"http://[::1]:{six.port}/" and _get(url + "health")[0] == 200
        finally:
            six.stop()
