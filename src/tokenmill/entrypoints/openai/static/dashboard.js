// tokenmill live dashboard: reads /v1/dashboard/stream (server-sent events, one snapshot per tick,
// built by entrypoints/openai/dashboard_feed.py) and draws it. Plain DOM and canvas; no library.
"use strict";

(function () {
  const HISTORY = 240; // points kept per series: 60 s at the server's 0.25 s cadence
  const key = new URLSearchParams(window.location.search).get("api_key");
  const model = new URLSearchParams(window.location.search).get("model");
  const history = { running: [], waiting: [], preempted: [], prefill: [], decode: [], draft: [], stepMs: [],
                    kvUsed: [], kvCached: [], kvFree: [], ttft50: [], ttft99: [], itl99: [], hitRate: [] };
  let updates = 0;
  let lastEngine = null; // for a redraw on resize

  const $ = (id) => document.getElementById(id);
  const css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();

  function push(name, value) {
    const series = history[name];
    series.push(value === null || value === undefined || Number.isNaN(value) ? null : value);
    if (series.length > HISTORY) series.shift();
  }

  function fmtInt(v) { return v === null || v === undefined ? "–" : Math.round(v).toLocaleString("en-US"); }
  function fmtNum(v, digits) { return v === null || v === undefined ? "–" : v.toFixed(digits); }
  function fmtPct(v) { return v === null || v === undefined ? "–" : (100 * v).toFixed(1) + "%"; }
  function fmtSec(v) {
    if (v === null || v === undefined) return "–";
    if (v < 1) return (v * 1000).toFixed(v < 0.01 ? 2 : 1) + " ms";
    return v.toFixed(2) + " s";
  }
  function setText(id, text) { const el = $(id); if (el.textContent !== text) el.textContent = text; }

  function niceMax(v) {
    if (!(v > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 4, 8, 10]) if (m * p >= v) return m * p; // quarters stay round
    return 10 * p;
  }

  // One chart: `series` [{values, color, fill}] share the left axis, stacked when opts.stacked;
  // opts.right [{values, color}] is a line on its own right axis.
  function drawChart(canvas, series, opts) {
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth, h = canvas.clientHeight;
    if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
      canvas.width = Math.round(w * dpr); canvas.height = Math.round(h * dpr);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    const left = opts.format ? 58 : 44, right = opts.rightFormat ? 62 : opts.right ? 44 : 8, top = 6, bottom = 16;
    const pw = w - left - right, ph = h - top - bottom;
    const n = HISTORY;
    const x = (i, len) => left + pw * (n - len + i) / (n - 1);
    const stackTops = [];
    let max = opts.max || 0;
    const len = series.length ? series[0].values.length : 0;
    for (let i = 0; i < len; i++) {
      let acc = 0;
      const tops = [];
      for (const s of series) {
        const v = s.values[i] || 0;
        acc = opts.stacked ? acc + v : v;
        tops.push(acc);
        if (!opts.max) max = Math.max(max, acc);
      }
      stackTops.push(tops);
    }
    max = opts.max || niceMax(max);
    // grid and left labels
    ctx.strokeStyle = css("--line"); ctx.fillStyle = css("--muted"); ctx.font = "11px system-ui, sans-serif";
    ctx.lineWidth = 1; ctx.textAlign = "right"; ctx.textBaseline = "middle";
    for (let g = 0; g <= 4; g++) {
      const y = top + ph - ph * g / 4;
      ctx.beginPath(); ctx.moveTo(left, y + 0.5); ctx.lineTo(left + pw, y + 0.5); ctx.stroke();
      ctx.fillText(opts.format ? opts.format(max * g / 4) : fmtInt(max * g / 4), left - 4, y);
    }
    ctx.textAlign = "left"; ctx.textBaseline = "top";
    ctx.fillText("60 s", left, top + ph + 3);
    ctx.textAlign = "right"; ctx.fillText("now", left + pw, top + ph + 3);
    const y = (v, m) => top + ph - ph * Math.min(v, m) / m;
    // stacked areas (or lines), last series drawn first so the first sits on top of the stack's base
    for (let k = series.length - 1; k >= 0; k--) {
      const s = series[k];
      if (!len) break;
      ctx.beginPath();
      for (let i = 0; i < len; i++) {
        const px = x(i, len), py = y(stackTops[i][k], max);
        if (i === 0) ctx.moveTo(px, py); else ctx.lineTo(px, py);
      }
      if (s.fill) {
        ctx.lineTo(x(len - 1, len), top + ph); ctx.lineTo(x(0, len), top + ph); ctx.closePath();
        ctx.fillStyle = s.color; ctx.fill();
      } else {
        ctx.strokeStyle = s.color; ctx.lineWidth = 2; ctx.stroke();
      }
    }
    if (opts.right) {
      let rmax = 0;
      for (const s of opts.right) for (const v of s.values) if (v !== null) rmax = Math.max(rmax, v);
      rmax = niceMax(rmax);
      ctx.fillStyle = css("--muted"); ctx.textAlign = "left"; ctx.textBaseline = "middle";
      const rfmt = opts.rightFormat || ((v) => fmtNum(v, rmax < 10 ? 1 : 0));
      for (let g = 0; g <= 4; g += 2) ctx.fillText(rfmt(rmax * g / 4), left + pw + 4, top + ph - ph * g / 4);
      for (const s of opts.right) {
        ctx.beginPath(); ctx.strokeStyle = s.color; ctx.lineWidth = 1.5;
        let started = false;
        s.values.forEach((v, i) => {
          if (v === null) { started = false; return; }
          const px = x(i, s.values.length), py = y(v, rmax);
          if (started) ctx.lineTo(px, py); else { ctx.moveTo(px, py); started = true; }
        });
        ctx.stroke();
      }
    }
  }

  // Rows whose keys are unchanged keep their elements (only their text changes), so a link is not
  // replaced under the pointer between mousedown and click.
  function fillTable(tbody, rows, emptyText, columns, keys) {
    const signature = keys ? keys.join("\n") : null;
    if (signature !== null && rows.length && tbody.dataset.keys === signature) {
      rows.forEach((cells, r) => cells.forEach((cell, c) => {
        const td = tbody.rows[r].cells[c];
        if (!(cell instanceof Node) && td.textContent !== cell) td.textContent = cell;
      }));
      return;
    }
    tbody.dataset.keys = signature === null ? "" : signature;
    tbody.replaceChildren();
    if (!rows.length) {
      const td = document.createElement("td");
      td.className = "empty"; td.colSpan = columns; td.textContent = emptyText;
      tbody.appendChild(document.createElement("tr")).appendChild(td);
      return;
    }
    for (const cells of rows) {
      const tr = document.createElement("tr");
      for (const cell of cells) {
        const td = document.createElement("td");
        if (cell instanceof Node) td.appendChild(cell); else td.textContent = cell;
        tr.appendChild(td);
      }
      tbody.appendChild(tr);
    }
  }

  function latencyRow(id, p) {
    const cells = $(id).children;
    const values = p ? [fmtInt(p.count), fmtSec(p.p50), fmtSec(p.p90), fmtSec(p.p99), fmtSec(p.max)]
                     : ["–", "–", "–", "–", "–"];
    values.forEach((v, i) => { cells[i + 1].textContent = v; });
  }

  async function showTimeline(item) {
    const panel = $("timeline-panel");
    panel.style.display = "block";
    setText("timeline-title", "timeline of " + item.request_id);
    $("timeline-body").textContent = "loading…";
    try {
      const response = await fetch(item.timeline_url, { headers: key ? { Authorization: "Bearer " + key } : {} });
      const body = await response.json();
      $("timeline-body").textContent = response.ok ? describeTimeline(body) : (body.error || {}).message || response.status;
    } catch (err) {
      $("timeline-body").textContent = "could not load the timeline: " + err;
    }
  }

  function describeTimeline(body) {
    const lines = [];
    for (const seq of body.sequences || []) {
      lines.push(seq.id + " (" + seq.status + (seq.finish_reason ? ", " + seq.finish_reason : "") + ")");
      const f = seq.frontend || {};
      lines.push("  API process: sent to scheduler " + fmtSec(f.sent_to_scheduler) + ", first text " +
                 fmtSec(f.first_text) + ", last text " + fmtSec(f.last_text));
      const e = seq.engine;
      if (e) {
        lines.push("  engine: queue " + fmtSec(e.queue_time) + ", prefill " + fmtSec(e.prefill_time) +
                   ", first token " + fmtSec(e.first_token_latency) + ", decode " +
                   fmtNum(e.decode_throughput, 1) + " tok/s, " + e.num_preemptions + " preemption(s)");
        for (const ev of e.events || []) {
          lines.push("    " + fmtSec(ev.at).padStart(10) + "  " + ev.stage + (ev.tokens ? " " + ev.tokens + " tokens" : "") +
                     (ev.reason ? " (" + ev.reason + ")" : ""));
        }
      }
    }
    return lines.join("\n");
  }

  function renderReplicas(replicas) {
    const section = $("replicas");
    if (replicas.length < 2) { section.style.display = "none"; return; }
    section.style.display = "block";
    const list = $("replica-list");
    list.replaceChildren();
    for (const r of replicas) {
      const div = document.createElement("div");
      div.className = "tile";
      const name = "replica " + r.replica + (r.live ? "" : " (down)") + ": ";
      div.textContent = name + (r.rates === undefined ? "no stats yet" : r.running + " running, " + r.waiting +
        " waiting, " + r.preempted + " preempted, KV " + fmtPct(r.kv_pages_total ? r.kv_pages_in_use / r.kv_pages_total : null) +
        " in use, " + fmtNum(r.rates.generation_tokens_per_s, 1) + " tok/s, step " + fmtNum(r.step.time_ms, 1) + " ms");
      list.appendChild(div);
    }
  }

  function render(snap) {
    updates += 1;
    setText("updates", String(updates));
    setText("updated", "at " + new Date(snap.time * 1000).toLocaleTimeString());
    setText("model", "model: " + (snap.model || "…"));
    const status = $("status");
    status.textContent = snap.status;
    status.className = "badge " + (snap.status === "up" ? "ok" : snap.status === "unhealthy" ? "bad" : "warn");
    setText("queued", fmtInt(snap.queued_frontend));
    const e = snap.engine;
    if (e) {
      setText("running", fmtInt(e.running)); setText("waiting", fmtInt(e.waiting)); setText("preempted", fmtInt(e.preempted));
      setText("gen-tps", fmtNum(e.rates.generation_tokens_per_s, 1));
      setText("prompt-tps", fmtNum(e.rates.prompt_tokens_per_s, 0));
      setText("step-ms", e.rates.mean_step_ms === null ? "–" : fmtNum(e.rates.mean_step_ms, 1) + " ms");
      setText("busy", fmtPct(e.rates.busy));
      setText("gen-total", fmtInt(e.generation_tokens_total));
      const s = e.step;
      setText("step-last", "last step: " + s.prefill_tokens + " prefill tokens, " + s.decode_rows + " decode rows, " +
        s.num_tokens + " / " + s.token_budget + " budget tokens (" + fmtPct(s.token_budget ? s.num_tokens / s.token_budget : null) +
        "), " + fmtNum(s.time_ms, 1) + " ms; " + fmtInt(s.count_total) + " steps so far");
      setText("kv-last", fmtInt(e.kv_pages_in_use) + " in use, " + fmtInt(e.kv_pages_cached) + " cached, " +
        fmtInt(e.kv_pages_free) + " free of " + fmtInt(e.kv_pages_total) + " pages" +
        (e.kv_groups && e.kv_groups.length ? "; by KV group (in use / cached): " + e.kv_groups.map((g) =>
          (g.window ? "window " + g.window : "full") + " " + fmtInt(g.pages_in_use) + " / " + fmtInt(g.pages_cached)
        ).join(", ") : ""));
      setText("hit-rate", fmtPct(e.prefix_cache_hit_rate));
      setText("hit-rate-recent", fmtPct(e.rates.prefix_cache_hit_rate));
      fillTable($("prefix-table").tBodies[0], (e.prefix_tree_top || []).map((p, i) => [
        "#" + (i + 1) + (p.salted ? " (salted)" : ""), fmtInt(p.tokens), fmtInt(p.lock_ref), fmtInt(p.branches)]),
        "nothing shared yet", 4, null);
      push("running", e.running); push("waiting", e.waiting); push("preempted", e.preempted);
      push("prefill", s.prefill_tokens); push("decode", s.decode_rows); push("draft", s.draft_tokens);
      push("stepMs", e.rates.mean_step_ms);
      push("hitRate", e.prefix_cache_hit_rate);
      push("kvUsed", e.kv_pages_in_use); push("kvCached", e.kv_pages_cached); push("kvFree", e.kv_pages_free);
    }
    const lat = snap.latency;
    if (lat) {
      setText("latency-window", "last " + lat.window_s + " s (measured in the API process from the HTTP arrival)");
      latencyRow("lat-ttft", lat.ttft); latencyRow("lat-itl", lat.itl); latencyRow("lat-e2e", lat.e2e);
      push("ttft50", lat.ttft.p50); push("ttft99", lat.ttft.p99); push("itl99", lat.itl.p99);
      // Held still under the pointer: the ranking changes as requests finish, and a row must not
      // move away from a click.
      if (!$("slowest-table").matches(":hover")) fillTable($("slowest-table").tBodies[0], lat.slowest.map((item) => {
        const a = document.createElement("a");
        a.href = item.timeline_url; a.textContent = item.id;
        a.dataset.requestId = item.request_id;
        return [a, fmtSec(item.e2e_s), fmtInt(item.output_tokens), item.finish_reason || "–", fmtSec(item.ago_s)];
      }), "no finished requests in the window", 5, lat.slowest.map((item) => item.id));
    }
    renderReplicas(snap.replicas || []);
    lastEngine = e || lastEngine;
    draw();
  }

  function draw() {
    const e = lastEngine;
    drawChart($("chart-requests"), [
      { values: history.running, color: css("--run") }, { values: history.waiting, color: css("--wait") },
      { values: history.preempted, color: css("--pre") }], {});
    drawChart($("chart-step"), [
      { values: history.prefill, color: css("--prefill"), fill: true }, { values: history.decode, color: css("--decode"), fill: true },
      { values: history.draft, color: css("--draft"), fill: true }],
      { stacked: true, right: [{ values: history.stepMs, color: css("--time") }] });
    drawChart($("chart-kv"), [
      { values: history.kvUsed, color: css("--used"), fill: true }, { values: history.kvCached, color: css("--cached"), fill: true },
      { values: history.kvFree, color: css("--free"), fill: true }],
      { stacked: true, max: e ? e.kv_pages_total : 0 });
    drawChart($("chart-hit"), [{ values: history.hitRate, color: css("--cached") }], { max: 1, format: fmtPct });
    drawChart($("chart-latency"), [{ values: history.ttft50, color: css("--run") }, { values: history.ttft99, color: css("--pre") }],
      { format: fmtSec, right: [{ values: history.itl99, color: css("--decode") }], rightFormat: fmtSec });
  }

  function showError(text) {
    const el = $("error");
    el.style.display = text ? "block" : "none";
    el.textContent = text || "";
  }

  function connect() {
    // ?model=NAME picks one of several models (the server's model router); ?api_key= as below.
    const query = new URLSearchParams();
    if (key) query.set("api_key", key);
    if (model) query.set("model", model);
    const url = "v1/dashboard/stream" + (query.toString() ? "?" + query.toString() : "");
    const source = new EventSource(url);
    source.onmessage = (ev) => { showError(""); render(JSON.parse(ev.data)); };
    source.addEventListener("end", () => {
      source.close();
      $("status").textContent = "server shutting down"; $("status").className = "badge bad";
    });
    source.onerror = () => {
      $("status").textContent = "disconnected"; $("status").className = "badge bad";
      showError("lost the stream: reconnecting… (a 401 means the page needs ?api_key=<key>)");
    };
  }

  // One listener for the table, whatever rows it holds now: the timeline of the clicked request.
  $("slowest-table").addEventListener("click", (ev) => {
    const a = ev.target.closest("a");
    if (!a) return;
    ev.preventDefault();
    showTimeline({ request_id: a.dataset.requestId, timeline_url: a.getAttribute("href") });
  });
  window.addEventListener("resize", draw);
  connect();
})();
