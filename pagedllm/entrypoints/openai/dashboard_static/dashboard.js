// The live dashboard of a pagedllm server: scheduling rounds, KV block map, throughput and latency,
// requests. Data: GET /v1/engine/state (polled) and /v1/engine/events (server-sent step records).
// Everything is drawn on canvases, redrawn at most once per animation frame when data changed.
"use strict";

(function () {
  const COLORS = {
    prefill: "#4a7fd0", decode: "#3aa675", preempted: "#d64545", swapped: "#8e5cc7", waiting: "#d9dde2",
    free: "#eceef1", cached: "#f2c14e", used: "#5b9bd5", shared: "#1f4e8c",
    prompt: "#4a7fd0", output: "#3aa675", running: "#3aa675", waitingLine: "#d68a1f", budget: "#9aa3ad",
  };
  const STATE_POLL_MS = 1000;
  const MAX_STEPS_KEPT = 2048;
  const MAX_FINISHED_KEPT = 512;
  const TIME_WINDOW_S = 120;

  // The page's model, readable from the console (and by the browser tests).
  const D = (window.dashboard = {
    steps: new Map(), // step number -> record
    lastStep: 0,
    state: null, // the latest snapshot
    finished: new Map(), // request id -> summary (latest first when listed)
    timeline: { steps: [], rows: [], cells: {} },
    kv: { cells: 0, inUse: 0, cached: 0, free: 0, shared: 0, maxRef: 0 },
    table: [],
    polls: 0,
    events: 0,
    latency: [], // [{t, ttft50, ttft90, itl50, itl90}]
    paused: false,
    rank: null,
  });

  const $ = (id) => document.getElementById(id);
  const params = new URLSearchParams(location.search);
  let windowSteps = Number(params.get("steps")) || 64;
  $("window").value = String(windowSteps);
  let dirty = true;
  let selected = null;
  let source = null;

  // ---------------------------------------------------------------- legends
  function legend(el, items) {
    el.innerHTML = items
      .map(([label, color]) => `<span><span class="swatch" style="background:${color}"></span>${label}</span>`)
      .join("");
  }
  legend($("rounds-legend"), [
    ["prefill chunk (tokens)", COLORS.prefill], ["decode", COLORS.decode], ["preempted", COLORS.preempted],
    ["swapped out (KV in the host tier)", COLORS.swapped], ["waiting", COLORS.waiting], ["tokens used of the step's budget", COLORS.budget],
  ]);
  legend($("kv-legend"), [
    ["free", COLORS.free], ["cached, evictable (prefix reuse)", COLORS.cached], ["in use", COLORS.used],
    ["shared (number: reference count)", COLORS.shared],
  ]);
  legend($("tput-legend"), [["prompt", COLORS.prompt], ["output", COLORS.output]]);
  legend($("queue-legend"), [["running", COLORS.running], ["waiting", COLORS.waitingLine]]);

  // ---------------------------------------------------------------- data
  function addSteps(records) {
    for (const r of records) {
      if (!D.steps.has(r.step)) D.steps.set(r.step, r);
      if (r.step > D.lastStep) D.lastStep = r.step;
    }
    if (D.steps.size > MAX_STEPS_KEPT) {
      const keys = [...D.steps.keys()].sort((a, b) => a - b);
      for (const k of keys.slice(0, D.steps.size - MAX_STEPS_KEPT)) D.steps.delete(k);
    }
    if (records.length) dirty = true;
  }

  function rankQuery() {
    return D.rank === null ? "" : `&rank=${D.rank}`;
  }

  async function poll(force) {
    if (D.paused && !force) return;
    try {
      const res = await fetch(`/v1/engine/state?since=${D.lastStep}&steps=1024${rankQuery()}`, {
        credentials: "same-origin", cache: "no-store",
      });
      if (res.status === 401) { location.reload(); return; }
      if (!res.ok) { setStatus("error", `state: HTTP ${res.status}`); return; }
      const state = await res.json();
      if (D.state && state.step < D.state.step && state.rank === D.state.rank) { D.steps.clear(); D.lastStep = 0; }
      D.state = state;
      D.polls += 1;
      addSteps(state.steps);
      for (const f of state.finished) D.finished.set(f.request_id, f);
      while (D.finished.size > MAX_FINISHED_KEPT) D.finished.delete(D.finished.keys().next().value);
      if (D.rank === null) setRanks(state.ranks, state.rank);
      $("model").textContent = `${state.config.model} · ${state.config.num_kv_blocks} blocks × ${state.config.block_size} tokens · step ${state.step}`;
      recordLatency();
      dirty = true;
      if (!source || source.readyState === 2) setStatus("live", "live (polling)");
    } catch (err) {
      setStatus("error", "server unreachable");
    }
  }

  function setRanks(ranks, rank) {
    D.rank = rank;
    $("rank").innerHTML = ranks.map((r) => `<option ${r === rank ? "selected" : ""}>${r}</option>`).join("");
    $("rank").disabled = ranks.length < 2;
    openEvents();
  }

  function openEvents() {
    if (source) source.close();
    if (typeof EventSource === "undefined") return;
    source = new EventSource(`/v1/engine/events?since=${D.lastStep}${rankQuery()}`);
    source.addEventListener("steps", (ev) => {
      if (D.paused) return;
      D.events += 1;
      addSteps(JSON.parse(ev.data));
    });
    source.onopen = () => setStatus("live", "live");
    source.onerror = () => setStatus("", "reconnecting");
  }

  function setStatus(kind, text) {
    const el = $("status");
    el.className = `status ${kind}`;
    el.textContent = text;
  }

  function percentile(values, p) {
    if (!values.length) return null;
    const sorted = [...values].sort((a, b) => a - b);
    return sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))];
  }

  function recordLatency() {
    const recent = [...D.finished.values()].slice(-256);
    const ttft = recent.map((f) => f.ttft_s).filter((v) => v !== null);
    const itl = recent.map((f) => f.itl_s).filter((v) => v !== null);
    D.latency.push({
      t: Date.now() / 1000,
      ttft: [50, 90, 99].map((p) => percentile(ttft, p)),
      itl: [50, 90, 99].map((p) => percentile(itl, p)),
      n: recent.length,
    });
    if (D.latency.length > 600) D.latency.shift();
  }

  // ---------------------------------------------------------------- canvas helpers
  function prepare(canvas, cssHeight) {
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.parentElement.clientWidth || 600;
    canvas.style.height = `${cssHeight}px`;
    if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(cssHeight * ratio)) {
      canvas.width = Math.round(width * ratio);
      canvas.height = Math.round(cssHeight * ratio);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, cssHeight);
    return { ctx, width, height: cssHeight };
  }

  function fmt(v, digits = 0) {
    return v === null || v === undefined ? "–" : Number(v).toFixed(digits);
  }

  // ---------------------------------------------------------------- scheduling rounds
  const LABEL_W = 120;
  const HEAD_H = 34;

  function buildTimeline() {
    const steps = [...D.steps.values()].sort((a, b) => a.step - b.step).slice(-windowSteps);
    const order = new Map();
    const cells = {};
    const put = (rid, col, cell) => {
      if (!order.has(rid)) order.set(rid, order.size);
      (cells[rid] = cells[rid] || {})[col] = cell;
    };
    steps.forEach((s, col) => {
      for (const [rid, n, kind] of s.scheduled) put(rid, col, { kind, n });
      for (const rid of s.preempted) if (!(cells[rid] || {})[col]) put(rid, col, { kind: "preempted" });
      for (const rid of s.swapped_out) put(rid, col, { kind: "swapped" });
      for (const rid of s.swapped || []) if (!(cells[rid] || {})[col]) put(rid, col, { kind: "swapped" });
      for (const rid of s.waiting) if (!(cells[rid] || {})[col]) put(rid, col, { kind: "waiting" });
    });
    D.timeline = { steps, rows: [...order.keys()], cells };
  }

  function drawTimeline() {
    const { steps, rows, cells } = D.timeline;
    const rowH = rows.length > 120 ? Math.max(2, Math.floor(720 / rows.length)) : 14;
    const height = HEAD_H + Math.max(1, rows.length) * rowH + 4;
    const { ctx, width } = prepare($("timeline"), Math.min(760, height));
    const colW = (width - LABEL_W) / Math.max(windowSteps, 1);
    const offset = windowSteps - steps.length; // the newest step sits at the right edge
    ctx.font = "10px system-ui, sans-serif";
    ctx.textBaseline = "middle";
    steps.forEach((s, i) => {
      const x = LABEL_W + (offset + i) * colW;
      const used = s.num_batched_tokens / Math.max(1, s.max_num_batched_tokens);
      ctx.fillStyle = "#eef1f4";
      ctx.fillRect(x + 0.5, 2, colW - 1, 20);
      ctx.fillStyle = COLORS.budget;
      ctx.fillRect(x + 0.5, 22 - 20 * Math.min(1, used), colW - 1, 20 * Math.min(1, used));
      if (colW >= 18) {
        ctx.fillStyle = "#1d232b";
        ctx.textAlign = "center";
        ctx.fillText(String(s.batch_size), x + colW / 2, 28);
      }
    });
    ctx.textAlign = "left";
    ctx.fillStyle = "#6b7480";
    ctx.fillText("batch / tokens", 2, 12);
    rows.forEach((rid, r) => {
      const y = HEAD_H + r * rowH;
      if (rowH >= 9) {
        ctx.fillStyle = "#1d232b";
        ctx.textAlign = "left";
        ctx.fillText(rid.length > 18 ? `${rid.slice(0, 8)}…${rid.slice(-8)}` : rid, 2, y + rowH / 2);
      }
      const row = cells[rid];
      for (const col in row) {
        const cell = row[col];
        const x = LABEL_W + (offset + Number(col)) * colW;
        ctx.fillStyle = COLORS[cell.kind] || "#000";
        ctx.fillRect(x + 0.5, y + 0.5, Math.max(1, colW - 1), Math.max(1, rowH - 1));
        if (cell.kind === "prefill" && colW >= 22 && rowH >= 10) {
          ctx.fillStyle = "#fff";
          ctx.textAlign = "center";
          ctx.fillText(String(cell.n), x + colW / 2, y + rowH / 2);
        } else if (cell.kind === "preempted" && colW >= 10 && rowH >= 10) {
          ctx.fillStyle = "#fff";
          ctx.textAlign = "center";
          ctx.fillText("P", x + colW / 2, y + rowH / 2);
        }
      }
    });
    if (!rows.length) {
      ctx.fillStyle = "#6b7480";
      ctx.textAlign = "left";
      ctx.fillText("No step yet: the engine is idle.", LABEL_W, HEAD_H + 8);
    }
  }

  function timelineTip(x, y) {
    const { steps, rows, cells } = D.timeline;
    const width = $("timeline").clientWidth;
    const colW = (width - LABEL_W) / Math.max(windowSteps, 1);
    const i = Math.floor((x - LABEL_W) / colW) - (windowSteps - steps.length);
    const s = steps[i];
    if (!s) return null;
    const head = `step ${s.step}: batch ${s.batch_size}, ${s.num_batched_tokens} / ${s.max_num_batched_tokens} tokens, ` +
      `${fmt(s.duration_s * 1000, 2)} ms to schedule and launch\nrunning ${s.num_running}, waiting ${s.num_waiting}, ` +
      `KV blocks in use ${s.kv_blocks_used} / ${s.num_kv_blocks}`;
    const rowH = rows.length > 120 ? Math.max(2, Math.floor(720 / rows.length)) : 14;
    const r = Math.floor((y - HEAD_H) / rowH);
    if (y < HEAD_H || r >= rows.length) return head;
    const cell = (cells[rows[r]] || {})[i];
    const what = !cell ? "not in this step" : cell.kind === "prefill" ? `prefill chunk of ${cell.n} tokens`
      : cell.kind === "decode" ? (cell.n > 1 ? `decode verifying ${cell.n - 1} draft tokens` : "decode") : cell.kind;
    return `${rows[r]}: ${what}\n${head}`;
  }

  // ---------------------------------------------------------------- KV block map
  let kvGeom = { size: 10, cols: 1 };

  function ownersOf(state) {
    const owners = new Map();
    const bs = state.config.block_size;
    for (const req of [...state.running, ...state.waiting]) {
      if (!req.block_ids) continue;
      req.block_ids.forEach((b, i) => {
        if (b < 0) return;
        const end = Math.min((i + 1) * bs, Math.max(req.computed_tokens, i * bs + 1)) - 1;
        if (!owners.has(b)) owners.set(b, []);
        owners.get(b).push(`${req.request_id}: tokens ${i * bs}–${end}`);
      });
    }
    return owners;
  }

  function drawKv() {
    const state = D.state;
    const canvas = $("kvmap");
    if (!state) { prepare(canvas, 40); return; }
    const blocks = state.blocks;
    const n = blocks.length;
    const width = canvas.parentElement.clientWidth || 600;
    const size = Math.max(3, Math.min(26, Math.floor(Math.sqrt((width * 420) / Math.max(n, 1)))));
    const cols = Math.max(1, Math.floor(width / size));
    const rows = Math.ceil(n / cols);
    kvGeom = { size, cols };
    const { ctx } = prepare(canvas, Math.max(size, rows * size));
    const gap = size >= 6 ? 1 : 0;
    let inUse = 0, cached = 0, free = 0, shared = 0, maxRef = 0;
    ctx.font = `${Math.max(8, Math.floor(size * 0.55))}px system-ui, sans-serif`;
    ctx.textAlign = "center";
    ctx.textBaseline = "middle";
    for (let i = 0; i < n; i++) {
      const v = blocks[i];
      let color;
      if (v > 1) { color = COLORS.shared; inUse++; shared++; }
      else if (v === 1) { color = COLORS.used; inUse++; }
      else if (v < 0) { color = COLORS.cached; cached++; }
      else { color = COLORS.free; free++; }
      if (v > maxRef) maxRef = v;
      const x = (i % cols) * size, y = Math.floor(i / cols) * size;
      ctx.fillStyle = color;
      ctx.fillRect(x, y, size - gap, size - gap);
      if (v > 1 && size >= 12) {
        ctx.fillStyle = "#fff";
        ctx.fillText(String(v), x + (size - gap) / 2, y + (size - gap) / 2 + 0.5);
      }
    }
    D.kv = { cells: n, inUse, cached, free, shared, maxRef };
    const st = state.stats;
    const rows2 = [
      ["blocks", n], ["in use", `${inUse} (${fmt((100 * inUse) / Math.max(1, n), 1)} %)`],
      ["shared", shared], ["cached, evictable", cached], ["free", free],
      ["prefix hit rate", `${fmt(100 * st.prefix_cache_hit_rate, 1)} %`],
      ["prefix tokens hit", `${st.prefix_cache_hits} / ${st.prefix_cache_queries}`],
      ["block size", `${state.config.block_size} tokens`], ["preemptions", st.num_preemptions],
    ];
    $("kv-stats").innerHTML = rows2.map(([k, v]) => `<dt>${k}</dt><dd>${v}</dd>`).join("");
  }

  function kvTip(x, y) {
    const state = D.state;
    if (!state) return null;
    const i = Math.floor(y / kvGeom.size) * kvGeom.cols + Math.floor(x / kvGeom.size);
    if (x >= kvGeom.cols * kvGeom.size || i >= state.blocks.length) return null;
    const v = state.blocks[i];
    const what = v > 0 ? `in use, reference count ${v}` : v < 0 ? "cached, evictable" : "free";
    const owners = ownersOf(state).get(i) || [];
    return `block ${i}: ${what}` + (owners.length ? `\n${owners.join("\n")}` : "");
  }

  // ---------------------------------------------------------------- throughput, queues, latency
  function series() {
    const steps = [...D.steps.values()].sort((a, b) => a.step - b.step);
    const now = Date.now() / 1000;
    const buckets = new Map();
    const queues = [];
    for (const s of steps) {
      if (s.time < now - TIME_WINDOW_S) continue;
      const sec = Math.floor(s.time);
      const b = buckets.get(sec) || { prompt: 0, output: 0 };
      b.prompt += s.prompt_tokens;
      b.output += s.output_tokens;
      buckets.set(sec, b);
      queues.push({ t: s.time, running: s.num_running, waiting: s.num_waiting });
    }
    const tput = [];
    for (let sec = Math.floor(now) - TIME_WINDOW_S; sec < Math.floor(now); sec++) {
      const b = buckets.get(sec) || { prompt: 0, output: 0 };
      tput.push({ t: sec + 0.5, prompt: b.prompt, output: b.output });
    }
    return { tput, queues, now };
  }

  function lineChart(canvas, points, keys, now) {
    const { ctx, width, height } = prepare(canvas, 120);
    const left = 44, bottom = 16;
    let max = 1;
    for (const p of points) for (const [k] of keys) max = Math.max(max, p[k]);
    ctx.strokeStyle = "#dde1e6";
    ctx.fillStyle = "#6b7480";
    ctx.font = "10px system-ui, sans-serif";
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (const f of [0, 0.5, 1]) {
      const y = 4 + (1 - f) * (height - bottom - 4);
      ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(width, y); ctx.stroke();
      ctx.fillText(fmt(max * f, max >= 10 ? 0 : 1), left - 4, y);
    }
    ctx.textAlign = "left";
    ctx.fillText(`last ${TIME_WINDOW_S} s`, left, height - 6);
    const xOf = (t) => left + ((t - (now - TIME_WINDOW_S)) / TIME_WINDOW_S) * (width - left);
    for (const [k, color] of keys) {
      ctx.strokeStyle = color;
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      points.forEach((p, i) => {
        const x = xOf(p.t), y = 4 + (1 - p[k] / max) * (height - bottom - 4);
        if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
      });
      ctx.stroke();
      ctx.lineWidth = 1;
    }
  }

  function drawMetrics() {
    const { tput, queues, now } = series();
    lineChart($("tput"), tput, [["prompt", COLORS.prompt], ["output", COLORS.output]], now);
    lineChart($("queues"), queues, [["running", COLORS.running], ["waiting", COLORS.waitingLine]], now);
    const last = D.latency[D.latency.length - 1];
    const ms = (v) => fmt(v === null ? null : v * 1000, 1);
    const lastTput = tput.slice(-5);
    const avg = (k) => lastTput.reduce((a, p) => a + p[k], 0) / Math.max(1, lastTput.length);
    $("latency").innerHTML =
      `<tr><th></th><th class="num">p50</th><th class="num">p90</th><th class="num">p99</th></tr>` +
      (last ? `<tr><td>TTFT ms</td>${last.ttft.map((v) => `<td class="num">${ms(v)}</td>`).join("")}</tr>` +
        `<tr><td>inter-token ms</td>${last.itl.map((v) => `<td class="num">${ms(v)}</td>`).join("")}</tr>` : "") +
      `<tr><td colspan="4" class="muted">over the latest ${last ? last.n : 0} finished requests; ` +
      `prompt ${fmt(avg("prompt"))} tok/s, output ${fmt(avg("output"))} tok/s (last 5 s)</td></tr>`;
  }

  // ---------------------------------------------------------------- requests table
  function buildTable() {
    const state = D.state;
    if (!state) return [];
    const rows = [...state.running, ...(state.swapped || []), ...state.waiting];
    const live = new Set(rows.map((r) => r.request_id));
    const done = [...D.finished.values()].filter((f) => !live.has(f.request_id)).reverse();
    return [...rows, ...done];
  }

  function esc(s) {
    return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  }

  function drawTable() {
    D.table = buildTable();
    const body = $("request-table").tBodies[0];
    body.innerHTML = D.table.map((r) => {
      const cls = r.state.startsWith("finished") ? "finished" : r.state;
      return `<tr data-id="${esc(r.request_id)}" class="${r.request_id === selected ? "selected" : ""}">` +
        `<td>${esc(r.request_id)}</td><td class="state-${cls}">${esc(r.state)}</td>` +
        `<td class="num">${r.prompt_tokens}</td><td class="num">${r.output_tokens}</td>` +
        `<td class="num">${r.cached_tokens < 0 ? "–" : r.cached_tokens}</td>` +
        `<td class="num">${r.ttft_s === null ? "–" : fmt(r.ttft_s * 1000, 1)}</td>` +
        `<td class="num">${r.num_preemptions}</td><td>${r.finish_reason === null ? "" : esc(r.finish_reason)}</td></tr>`;
    }).join("");
    drawDetail();
  }

  function drawDetail() {
    const el = $("detail");
    const row = D.table.find((r) => r.request_id === selected);
    if (!row) { el.hidden = true; return; }
    el.hidden = false;
    const bs = D.state.config.block_size;
    const blocks = row.block_ids || [];
    const chips = blocks.map((b, i) => {
      const v = b < 0 ? 0 : D.state.blocks[b];
      const color = b < 0 ? "#9aa3ad" : v > 1 ? COLORS.shared : COLORS.used;
      const title = b < 0 ? "released (outside the attention window)" : `block ${b}, tokens ${i * bs}–${(i + 1) * bs - 1}, ref ${v}`;
      return `<span class="chip" style="background:${color}" title="${title}">${b < 0 ? "×" : b}</span>`;
    }).join("");
    el.innerHTML = `<b>${esc(row.request_id)}</b> · ${esc(row.state)} · prompt ${row.prompt_tokens}, output ${row.output_tokens}` +
      (row.computed_tokens !== undefined ? `, computed ${row.computed_tokens}` : "") +
      ` · ${blocks.length ? `block table (logical → physical, ${bs} tokens each):` : "holds no blocks"}` +
      `<div class="chips">${chips}</div>`;
  }

  $("request-table").addEventListener("click", (ev) => {
    const tr = ev.target.closest("tr[data-id]");
    if (!tr) return;
    selected = tr.dataset.id === selected ? null : tr.dataset.id;
    drawTable();
  });

  // ---------------------------------------------------------------- tooltips, controls, loop
  function hover(canvas, tip) {
    const box = $("tooltip");
    canvas.addEventListener("mousemove", (ev) => {
      const rect = canvas.getBoundingClientRect();
      const text = tip(ev.clientX - rect.left, ev.clientY - rect.top);
      if (!text) { box.hidden = true; return; }
      box.textContent = text;
      box.hidden = false;
      box.style.left = `${Math.min(ev.clientX + 14, window.innerWidth - 430)}px`;
      box.style.top = `${ev.clientY + 14}px`;
    });
    canvas.addEventListener("mouseleave", () => { box.hidden = true; });
  }
  hover($("timeline"), timelineTip);
  hover($("kvmap"), kvTip);

  $("window").addEventListener("change", () => { windowSteps = Number($("window").value); dirty = true; });
  $("rank").addEventListener("change", () => {
    D.rank = Number($("rank").value);
    D.steps.clear(); D.lastStep = 0; D.state = null; D.finished.clear();
    openEvents(); poll();
  });
  $("pause").addEventListener("click", () => {
    D.paused = !D.paused;
    $("pause").textContent = D.paused ? "Resume" : "Pause";
    if (!D.paused) poll();
  });
  window.addEventListener("resize", () => { dirty = true; });

  function render() {
    dirty = false;
    buildTimeline();
    drawTimeline();
    drawKv();
    drawMetrics();
    drawTable();
    D.frames = (D.frames || 0) + 1;
  }

  function frame() {
    if (dirty && !D.paused) render();
    requestAnimationFrame(frame);
  }

  // One snapshot fetched and drawn now, paused or not (a "refresh" for a paused page).
  D.refresh = async () => { await poll(true); render(); return D.kv; };
  // Redraw the four views from what the page holds (no request).
  D.redraw = () => { render(); return D.kv; };

  poll();
  setInterval(poll, STATE_POLL_MS);
  setInterval(() => { dirty = true; }, 1000); // the time axes move on
  requestAnimationFrame(frame);
})();
