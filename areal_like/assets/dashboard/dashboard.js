// areal_like live dashboard: polls api/data every 2 s and redraws hand-made SVG charts.
// Plain script, no library, nothing fetched but api/data (docs/design.md §9.22). Each chart
// element keeps a `data-points` attribute with the number of points (or non-empty bars)
// it plots, so a headless browser test can tell a drawn chart from an empty one.
"use strict";

(function () {
  const POLL_MS = 2000;
  const MAX_POINTS = 20000; // per series kept in the page; the server keeps ~5000 records
  const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777"];
  const SVG = "http://www.w3.org/2000/svg";

  // Line charts: [series name, legend label]; `extra` go to the legend only (other scales).
  const LINES = [
    { id: "chart-versions", step: true, series: [["trainer_version", "trainer"], ["rollout_version", "rollout (loaded)"]],
      extra: [["gate_lead", "lead L (versions, ≤ η)"]] },
    { id: "chart-gate", step: true, series: [["gate_capacity", "capacity (L+v+1)·B"], ["gate_accepted", "accepted"],
      ["gate_consumed", "consumed"]] },
    { id: "chart-gate-state", step: true, series: [["gate_running", "running"], ["gate_free", "free (L allows)"],
      ["gate_dropped", "dropped"], ["over_stale", "over-stale"]],
      extra: [["gate_rejected_at_gate", "refused admissions"]] },
    { id: "chart-buffer", step: true, series: [["buffer_depth", "buffer depth"]] },
    { id: "chart-throughput", series: [["gen_tokens_per_s", "generation"], ["train_tokens_per_s", "training"]] },
    { id: "chart-idle", yMax: 1, series: [["trainer_idle_ratio", "trainer pool"], ["rollout_idle_ratio", "rollout pool"]] },
    { id: "chart-cores", series: [["train_cores_used", "train pool"], ["rollout_cores_used", "rollout pool"]] },
    { id: "chart-pool", step: true, series: [["pool_size", "in the pool"], ["pool_serving", "serving"],
      ["pool_target", "asked for"]] },
    { id: "chart-interrupts", step: true, series: [["interrupted_tokens", "interrupted tokens"],
      ["recompute_tokens", "recompute tokens"]], extra: [["interrupts", "interrupts"]] },
    { id: "chart-pause-resume", series: [["pause_resume_latency_s_max", "pause→resume (max)"]] },
    { id: "chart-vllm", series: [["vllm_kv_cache_usage", "KV cache usage"], ["vllm_num_waiting", "waiting"],
      ["vllm_preemptions", "preemptions"]] },
    { id: "chart-weight-sync", dots: true, series: [["weight_sync_s", "weight sync"], ["straggler_wait_s", "straggler wait"]] },
    { id: "chart-weight-sync-bytes", dots: true, series: [["weight_sync_bytes", "bytes"]] },
    { id: "chart-reward", series: [["reward_mean", "reward (trained)"], ["reward_mean_all_groups", "reward (all groups)"], ["eval_accuracy", "eval accuracy"]], dotsFor: ["eval_accuracy"] },
    { id: "chart-logprob-gap", series: [["behav_prox_gap", "mean |behav − prox|"]] },
    { id: "chart-importance-weights", series: [["behav_weight_mean", "mean"], ["behav_weight_max", "max"],
      ["clip_frac", "clip fraction"]], extra: [["behav_capped", "capped"], ["behav_masked", "masked"]] },
  ];

  const token = new URLSearchParams(window.location.search).get("token");
  const state = { since: 0, start: null, series: {}, last: null };

  function fmt(v) {
    if (v === null || v === undefined || !isFinite(v)) return "–";
    const a = Math.abs(v);
    if (a >= 1e9) return (v / 1e9).toFixed(a >= 1e10 ? 0 : 1) + "G";
    if (a >= 1e6) return (v / 1e6).toFixed(a >= 1e7 ? 0 : 1) + "M";
    if (a >= 1e4) return (v / 1e3).toFixed(0) + "k";
    if (a >= 100 || Number.isInteger(v)) return String(Math.round(v));
    if (a >= 1) return v.toFixed(2);
    if (a === 0) return "0";
    return v.toPrecision(2);
  }

  function fmtTime(s) {
    if (s < 120) return Math.round(s) + "s";
    if (s < 7200) return (s / 60).toFixed(s < 600 ? 1 : 0) + "m";
    return (s / 3600).toFixed(1) + "h";
  }

  function niceTicks(lo, hi, n) {
    const span = hi - lo;
    const raw = span / n;
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => span / s <= n) || 10 * mag;
    const ticks = [];
    for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(t);
    return ticks;
  }

  function el(name, attrs, parent) {
    const e = document.createElementNS(SVG, name);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }

  function frame(box, height) {
    box.textContent = "";
    const width = Math.max(box.clientWidth, 240);
    const svg = el("svg", { width: width, height: height, viewBox: `0 0 ${width} ${height}` }, box);
    return { svg, width, height, m: { l: 46, r: 10, t: 8, b: 22 } };
  }

  function legend(box, items) {
    const div = document.createElement("div");
    div.className = "legend";
    for (const it of items) {
      const span = document.createElement("span");
      if (it.color) {
        const sw = document.createElement("i");
        sw.style.background = it.color;
        span.appendChild(sw);
      }
      span.appendChild(document.createTextNode(`${it.label} `));
      const b = document.createElement("b");
      b.textContent = it.value;
      span.appendChild(b);
      div.appendChild(span);
    }
    box.insertBefore(div, box.firstChild);
  }

  function empty(box, text) {
    box.textContent = "";
    const p = document.createElement("p");
    p.className = "empty";
    p.textContent = text;
    box.appendChild(p);
    box.setAttribute("data-points", "0");
  }

  // Keep at most ~2 points per pixel: long runs stay cheap to draw.
  function thin(points, maxN) {
    if (points.length <= maxN) return points;
    const stride = Math.ceil(points.length / maxN);
    const out = [];
    for (let i = 0; i < points.length; i += stride) out.push(points[i]);
    if (out[out.length - 1] !== points[points.length - 1]) out.push(points[points.length - 1]);
    return out;
  }

  function drawLines(spec) {
    const box = document.getElementById(spec.id);
    const latest = (state.last && state.last.latest) || {};
    const present = spec.series.filter(([name]) => (state.series[name] || []).length > 0);
    if (present.length === 0) {
      empty(box, "no data yet");
      return;
    }
    const f = frame(box, 190);
    const { svg, width, height, m } = f;
    const t0 = state.start;
    let xlo = Infinity, xhi = -Infinity, ylo = 0, yhi = -Infinity;
    for (const [name] of present) {
      for (const [t, v] of state.series[name]) {
        xlo = Math.min(xlo, t - t0); xhi = Math.max(xhi, t - t0);
        ylo = Math.min(ylo, v); yhi = Math.max(yhi, v);
      }
    }
    if (spec.yMax !== undefined) yhi = Math.max(yhi, spec.yMax);
    if (yhi <= ylo) yhi = ylo + 1;
    if (xhi <= xlo) { xlo -= 1; xhi += 1; }
    const X = (s) => m.l + ((s - xlo) / (xhi - xlo)) * (width - m.l - m.r);
    const Y = (v) => height - m.b - ((v - ylo) / (yhi - ylo)) * (height - m.t - m.b);
    for (const tv of niceTicks(ylo, yhi, 4)) {
      el("line", { x1: m.l, x2: width - m.r, y1: Y(tv), y2: Y(tv), class: "gridline" }, svg);
      el("text", { x: m.l - 4, y: Y(tv) + 4, class: "tick", "text-anchor": "end" }, svg).textContent = fmt(tv);
    }
    for (const tx of niceTicks(xlo, xhi, 5)) {
      el("text", { x: X(tx), y: height - 6, class: "tick", "text-anchor": "middle" }, svg).textContent = fmtTime(tx);
    }
    el("line", { x1: m.l, x2: width - m.r, y1: height - m.b, y2: height - m.b, class: "axis" }, svg);
    let plotted = 0;
    const items = [];
    spec.series.forEach(([name, label], i) => {
      const color = COLORS[i % COLORS.length];
      items.push({ color, label, value: fmt(latest[name]) });
      const pts = thin(state.series[name] || [], 2 * width);
      if (pts.length === 0) return;
      plotted += pts.length;
      const dots = spec.dots || (spec.dotsFor || []).includes(name) || pts.length === 1;
      let d = "";
      pts.forEach(([t, v], k) => {
        const x = X(t - t0), y = Y(v);
        if (k === 0) d += `M${x.toFixed(1)},${y.toFixed(1)}`;
        else if (spec.step) d += `H${x.toFixed(1)}V${y.toFixed(1)}`;
        else d += `L${x.toFixed(1)},${y.toFixed(1)}`;
      });
      el("path", { d, class: "line", stroke: color, "data-series": name }, svg);
      if (dots) {
        for (const [t, v] of pts.slice(-400)) el("circle", { cx: X(t - t0), cy: Y(v), r: 2.5, fill: color }, svg);
      }
    });
    for (const [name, label] of spec.extra || []) items.push({ label, value: fmt(latest[name]) });
    legend(box, items);
    box.setAttribute("data-points", String(plotted));
  }

  // Grouped bars: categories on x, one bar per group; each group normalised when asked.
  function drawBars(id, categories, groups, normalise) {
    const box = document.getElementById(id);
    const totals = groups.map((g) => g.values.reduce((a, b) => a + b, 0));
    if (categories.length === 0 || totals.every((s) => s === 0)) {
      empty(box, "no trained samples yet");
      return;
    }
    const f = frame(box, 190);
    const { svg, width, height, m } = f;
    const vals = groups.map((g, gi) => g.values.map((v) => (normalise ? v / (totals[gi] || 1) : v)));
    const yhi = Math.max(...vals.flat()) || 1;
    const Y = (v) => height - m.b - (v / yhi) * (height - m.t - m.b);
    for (const tv of niceTicks(0, yhi, 4)) {
      el("line", { x1: m.l, x2: width - m.r, y1: Y(tv), y2: Y(tv), class: "gridline" }, svg);
      el("text", { x: m.l - 4, y: Y(tv) + 4, class: "tick", "text-anchor": "end" }, svg).textContent = fmt(tv);
    }
    const slot = (width - m.l - m.r) / categories.length;
    const bw = Math.max(1, (slot * 0.8) / groups.length);
    let plotted = 0;
    categories.forEach((c, ci) => {
      const x0 = m.l + ci * slot + slot * 0.1;
      groups.forEach((g, gi) => {
        const v = vals[gi][ci];
        if (v > 0) plotted += 1;
        const r = el("rect", { x: x0 + gi * bw, y: Y(v), width: bw - 1, height: Y(0) - Y(v), fill: COLORS[gi % COLORS.length] }, svg);
        el("title", {}, r).textContent = `${g.label} ${c}: ${g.values[ci]}`;
      });
      el("text", { x: x0 + (bw * groups.length) / 2, y: height - 6, class: "tick", "text-anchor": "middle" }, svg).textContent = c;
    });
    el("line", { x1: m.l, x2: width - m.r, y1: Y(0), y2: Y(0), class: "axis" }, svg);
    legend(box, groups.map((g, gi) => ({ color: COLORS[gi % COLORS.length], label: g.label, value: `n=${fmt(totals[gi])}` })));
    box.setAttribute("data-points", String(plotted));
  }

  function drawLag(d) {
    const head = d.head_lag_hist || {}, tok = d.token_lag_hist || {};
    const lags = Array.from(new Set([...Object.keys(head), ...Object.keys(tok)].map(Number))).sort((a, b) => a - b);
    drawBars("chart-version-lag", lags.map(String), [
      { label: "head (samples)", values: lags.map((k) => head[k] || 0) },
      { label: "per token", values: lags.map((k) => tok[k] || 0) },
    ], true);
  }

  function drawRewardDist(d) {
    const buckets = (d.reward_hist && d.reward_hist.buckets) || [];
    const num = (le) => fmt(parseFloat(le));
    const labels = buckets.map((b, i) => {
      if (i === 0) return `≤${num(b.le)}`;
      if (b.le === "+Inf") return `>${num(buckets[i - 1].le)}`;
      return `${num(buckets[i - 1].le)}–${num(b.le)}`;
    });
    drawBars("chart-reward-dist", labels, [{ label: "samples", values: buckets.map((b) => b.count) }], false);
  }

  // The newest step's time budget: one stacked horizontal bar per row, each row on its own
  // scale (its total is in its title). The trainer's phases add up to the wall time since the
  // step before; the rollout side's rows (servers, controller, episodes) are seconds of work in
  // that interval, summed over servers and over episodes running side by side.
  const BUDGET_COLORS = ["#93c5fd", "#2563eb", "#1e3a8a", "#60a5fa", "#0891b2", "#fbbf24", "#f97316", "#dc2626",
    "#991b1b", "#fb7185", "#a78bfa", "#7c3aed", "#16a34a", "#9ca3af"];
  function drawBudget(d) {
    const box = document.getElementById("chart-budget");
    const b = d.budget;
    if (!b) {
      empty(box, "no step with a time budget yet");
      return;
    }
    const labels = b.labels || {};
    const rows = [{ pool: "trainer", title: `trainer ${fmt(b.wall_s)}s wall`, parts: b.trainer || {} }];
    for (const g of b.groups || []) {
      const parts = {};
      for (const name of g.phases) if (name in (b.rollout || {})) parts[name] = b.rollout[name];
      const sum = Object.values(parts).reduce((a, v) => a + v, 0);
      const name = g.name === "episodes" ? "episodes (Σ)" : `rollout ${g.name}`;
      rows.push({ pool: "rollout", title: `${name} ${fmt(sum)}s work`, parts });
    }
    const f = frame(box, 26 * rows.length + 12);
    const { svg, width } = f;
    const m = { l: 150, r: 10, t: 6 };
    let plotted = 0;
    const items = [];
    rows.forEach((row, ri) => {
      const y = m.t + ri * 26;
      el("text", { x: m.l - 6, y: y + 14, class: "tick", "text-anchor": "end" }, svg).textContent = row.title;
      const total = Object.values(row.parts).reduce((a, v) => a + (v > 0 ? v : 0), 0);
      if (!(total > 0)) return;
      const order = Object.keys(labels[row.pool] || {});
      const X = (v) => m.l + (v / total) * (width - m.l - m.r);
      let left = 0;
      for (const [name, v] of Object.entries(row.parts)) {
        if (!(v > 0)) continue;
        const i = order.indexOf(name);
        const color = i < 0 ? "#000000" : BUDGET_COLORS[i % BUDGET_COLORS.length];
        const label = (labels[row.pool] || {})[name] || name;
        const r = el("rect", { x: X(left), y, width: Math.max(0.5, X(left + v) - X(left)), height: 20, fill: color,
          "data-phase": name }, svg);
        el("title", {}, r).textContent = `${label}: ${fmt(v)} s (${Math.round((100 * v) / total)}%)`;
        left += v;
        plotted += 1;
        if (v >= 0.0005) items.push({ color, label, value: fmt(v) + "s" });
      }
    });
    legend(box, items);
    box.setAttribute("data-points", String(plotted));
  }

  function drawSummary(d) {
    const box = document.getElementById("summary");
    const s = d.summary;
    if (!s) return;
    const keys = ["started", "trained", "rejected", "filtered", "over_stale", "failed", "skipped", "buffered", "cancelled"];
    const table = document.createElement("table");
    for (const k of keys.filter((k) => k in s)) {
      const tr = document.createElement("tr");
      const th = document.createElement("th"); th.textContent = k;
      const td = document.createElement("td"); td.textContent = fmt(s[k]);
      tr.append(th, td); table.appendChild(tr);
    }
    box.textContent = "";
    box.appendChild(table);
    if ("counts_add_up" in s) {
      const p = document.createElement("p");
      p.className = s.counts_add_up ? "ok" : "bad";
      p.textContent = s.counts_add_up ? "counts add up" : "counts do NOT add up";
      box.appendChild(p);
    }
  }

  function setText(id, text) { document.getElementById(id).textContent = text; }

  function drawTiles(d) {
    const l = d.latest || {};
    setText("run-name", d.run_name || "");
    setText("tile-trainer-version", fmt(d.trainer_version));
    setText("tile-rollout-version", d.rollout_version === null ? "–" : fmt(d.rollout_version));
    setText("tile-steps", fmt(d.steps));
    setText("tile-buffer", fmt(l.buffer_depth));
    setText("tile-gate", `${fmt(l.gate_running)} / ${fmt(l.gate_capacity)}`);
    setText("tile-reward", fmt(l.reward_mean));
    setText("tile-eval", fmt(l.eval_accuracy));
    setText("tile-tps", `${fmt(l.gen_tokens_per_s)} · ${fmt(l.train_tokens_per_s)}`);
  }

  function render() {
    const d = state.last;
    if (!d) return;
    drawTiles(d);
    for (const spec of LINES) drawLines(spec);
    drawLag(d);
    drawRewardDist(d);
    drawBudget(d);
    drawSummary(d);
  }

  function merge(d) {
    if (state.start !== d.start_time) { // first reply, or the server restarted: start over
      state.series = {};
      state.start = d.start_time;
    }
    for (const name in d.series) {
      const have = state.series[name] || (state.series[name] = []);
      const lastT = have.length ? have[have.length - 1][0] : -Infinity;
      for (const p of d.series[name]) if (p[0] > lastT) have.push(p);
      if (have.length > MAX_POINTS) have.splice(0, have.length - MAX_POINTS);
    }
    state.since = d.latest_time;
    state.last = d;
  }

  async function poll() {
    const status = document.getElementById("status");
    try {
      const headers = token ? { Authorization: `Bearer ${token}` } : {};
      const r = await fetch(`api/data?since=${state.since}`, { headers, cache: "no-store" });
      if (!r.ok) throw new Error(`HTTP ${r.status}`);
      merge(await r.json());
      render();
      status.textContent = `live · updated ${new Date().toLocaleTimeString()}`;
      status.className = "status ok";
    } catch (e) {
      status.textContent = `disconnected (${e.message}); retrying`;
      status.className = "status bad";
    }
    setTimeout(poll, POLL_MS);
  }

  let resizeTimer = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(render, 150);
  });
  poll();
})();
