// The vgpu-schedd dashboard: live charts from the daemon's event stream (/events), a table of
// VMs with their parameters, and controls that POST to /api/* with the token from the URL's
// fragment (#token=...), which the browser never sends to the server by itself.
"use strict";

const WINDOW_S = 300; // the longest time axis: the last 5 minutes (the history the daemon keeps)
const MIN_SPAN_S = 60; // the shortest: a young daemon's first minute fills the chart
const COLOURS = ["#4aa3ff", "#ff9f43", "#3ecf8e", "#ff6b9a", "#b68cff", "#f9d65c",
  "#45d0e0", "#ff6b6b", "#9ccc65", "#d69e6e"];
// The mean the budget chart draws: each point is the mean of the last this many seconds (a
// budget refilled every few ms, sampled once a second, is otherwise noise).
const BUDGET_MEAN_S = 5;

const state = {
  token: new URLSearchParams(location.hash.replace(/^#/, "")).get("token") || "",
  points: [], // {t, vms: {name: VmPoint}}
  colour: new Map(), // VM name -> colour, in order of first appearance
  policies: [],
  policyDirty: false,
  snapshot: null,
  lastSeq: 0, // the last change record shown (ChangeRecord.seq)
};

const $ = (sel) => document.querySelector(sel);

function el(tag, attrs, children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "text") e.textContent = v;
    else if (k === "class") e.className = v;
    else e.setAttribute(k, v);
  }
  for (const c of children || []) e.append(c);
  return e;
}

function colourOf(name) {
  if (!state.colour.has(name)) state.colour.set(name, COLOURS[state.colour.size % COLOURS.length]);
  return state.colour.get(name);
}

function fmt(x, digits) {
  if (x === null || x === undefined || !Number.isFinite(x)) return "–";
  return x.toFixed(digits);
}

// ---- Controls ----------------------------------------------------------------------------

// "Last change": its outcome, what it was, who asked and when. `change` is a ChangeRecord
// ({seq, unix_ms, by, what, error}) from the daemon, or one this page makes for a request the
// daemon refused before recording it.
function showChange(change) {
  const r = $("#last-result");
  const ok = !change.error;
  const when = change.unix_ms ? " at " + new Date(change.unix_ms).toLocaleTimeString() : "";
  r.replaceChildren(
    el("span", { class: "outcome", text: ok ? "ok" : "refused: " + change.error }),
    el("span", { class: "what", text: change.what }),
    el("span", { class: "by", text: "by " + change.by + when }),
  );
  r.className = "result " + (ok ? "ok" : "err");
}

// Shows the daemon's record `change` unless one as recent is shown already.
function showRecord(change) {
  if (!change || change.seq <= state.lastSeq) return;
  state.lastSeq = change.seq;
  showChange(change);
}

// POSTs `body` to `path`; `what` names the change for a refusal. Returns whether it was done.
async function post(path, body, what) {
  const refused = (error) => showChange({ what, by: "this page", error, unix_ms: Date.now() });
  try {
    const resp = await fetch(path, {
      method: "POST",
      headers: { "Content-Type": "application/json", "X-Vgpu-Token": state.token },
      body: JSON.stringify(body),
      cache: "no-store",
    });
    let answer = null;
    try { answer = await resp.json(); } catch (_) { /* not JSON: reported below */ }
    if (resp.ok && answer && answer.ok) {
      if (answer.change) {
        state.lastSeq = Math.max(state.lastSeq, answer.change.seq);
        showChange(answer.change);
      }
      return true;
    }
    refused((answer && answer.error) || ("HTTP " + resp.status));
  } catch (e) {
    refused("request failed: " + e.message);
  }
  return false;
}

function policyKey(config) {
  return JSON.stringify(config);
}

async function loadPolicies() {
  try {
    const resp = await fetch("/api/policies", { cache: "no-store" });
    state.policies = await resp.json();
  } catch (e) {
    showChange({ what: "load the policy list", by: "this page", error: e.message });
    return;
  }
  const select = $("#policy-select");
  select.replaceChildren(...state.policies.map((p, i) => el("option", { value: String(i), text: p.label })));
  select.addEventListener("change", () => { state.policyDirty = true; });
  if (state.snapshot) showPolicy(state.snapshot);
}

async function applyPolicy() {
  const choice = state.policies[Number($("#policy-select").value)];
  if (!choice) return;
  if (await post("/api/policy", choice.config, "set-policy " + choice.label)) state.policyDirty = false;
}

// Sends the inputs of a VM row that were edited, as `vgpuctl set` assignments: the daemon
// parses and checks them as it does vgpuctl's, and a refusal shows its words. Inputs left
// alone are not sent (a shared reserve or an unset field stays as it is).
async function applyParams(row) {
  const edited = [...row.querySelectorAll("[data-param].dirty")];
  const set = edited.map((i) => i.dataset.param + "=" + i.value.trim());
  const what = "set " + row.dataset.vm + " " + set.join(" ");
  if (set.length === 0) {
    showChange({ what: "set " + row.dataset.vm, by: "this page", error: "no field edited" });
    return;
  }
  if (await post("/api/params", { vm: row.dataset.vm, set }, what)) {
    for (const input of edited) input.classList.remove("dirty");
  }
}

// ---- The snapshot: header, policy and table ----------------------------------------------

function showPolicy(s) {
  // The simulated engine runs only groups the devices hand to the daemon: shown once it has.
  const engine = s.engine_busy_pct > 0
    ? " · simulated engine " + fmt(s.engine_busy_pct, 0) + " % busy (last " + fmt(s.engine_window_s, 0) + " s)"
    : "";
  $("#policy-now").replaceChildren("running ", el("b", { text: s.policy_name }), engine);
  $("#policy-name").textContent = s.policy_name;
  const rows = s.policy_table.map((p) => el("tr", {}, [
    el("th", { text: p.name }),
    el("td", { class: "value", text: p.value }),
    el("td", { class: "about", text: p.about }),
  ]));
  if (rows.length === 0) rows.push(el("tr", {}, [el("td", { colspan: "3", class: "about", text: "no parameters" })]));
  $("#policy-params tbody").replaceChildren(...rows);
  if (state.policyDirty || state.policies.length === 0) return;
  const select = $("#policy-select");
  const key = policyKey(s.policy);
  let index = state.policies.findIndex((p) => policyKey(p.config) === key);
  if (index < 0) {
    // A configuration with parameters of its own: offered as it is.
    state.policies.push({ label: s.policy_name + " (current settings)", config: s.policy });
    index = state.policies.length - 1;
    select.append(el("option", { value: String(index), text: state.policies[index].label }));
  }
  select.value = String(index);
}

function paramInput(name, value, kind) {
  if (kind === "sched") {
    const select = el("select", { "data-param": "sched", "aria-label": "sched" },
      ["", "prt", "ht"].map((v) => el("option", { value: v, text: v || "default" })));
    select.value = value || "";
    select.addEventListener("change", () => select.classList.add("dirty"));
    return select;
  }
  const input = el("input", { "data-param": name, "aria-label": name, class: name });
  input.value = value === null || value === undefined ? "" : String(value);
  input.addEventListener("input", () => input.classList.add("dirty"));
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter") applyParams(input.closest("tr"));
  });
  return input;
}

function newRow(vm) {
  const row = el("tr", { "data-vm": vm.name });
  const swatch = el("i");
  swatch.style.background = colourOf(vm.name);
  const apply = el("button", { type: "button", "data-action": "apply", text: "Apply" });
  const focus = el("button", { type: "button", "data-action": "focus", text: "Focus" });
  apply.addEventListener("click", () => applyParams(row));
  focus.addEventListener("click", () => post("/api/focus", { vm: row.dataset.vm }, "focus " + row.dataset.vm));
  const cell = (cls, children) => el("td", { class: cls }, children);
  row.append(
    cell("name", [swatch, vm.name, el("small", { class: "state" })]),
    cell("num share", []),
    cell("num fps", []),
    cell("num latency", []),
    cell("num queue", []),
    cell("num memory", []),
    cell("num budget", []),
    cell("", [paramInput("priority", vm.params.priority)]),
    cell("", [paramInput("weight", vm.params.weight)]),
    cell("", [paramInput("target_fps", vm.params.target_fps)]),
    cell("", [paramInput("sched", vm.params.sched, "sched")]),
    cell("", [paramInput("reserve", reserveText(vm.params.reserve))]),
    cell("", [paramInput("slo", usText(vm.params.slo))]),
    cell("effective", []),
    cell("actions", [apply, focus]),
  );
  return row;
}

// Nanoseconds as vgpuctl set takes them: µs.
function usText(ns) {
  return ns === null || ns === undefined ? "" : String(ns / 1000);
}

// A reserve as vgpuctl set takes it: C_us/T_us/pe|ae.
function reserveText(r) {
  return r ? usText(r.c) + "/" + usText(r.t) + "/" + r.enforcement : "";
}

// The row's inputs as the daemon has them.
function paramValue(vm, name) {
  if (name === "reserve") return reserveText(vm.params.reserve);
  if (name === "slo") return usText(vm.params.slo);
  const v = vm.params[name];
  return v === null || v === undefined ? "" : String(v);
}

function effectiveText(vm) {
  const p = vm.effective || vm.params;
  const parts = ["prio " + p.priority, "weight " + p.weight];
  if (p.sched) parts.push(p.sched);
  if (p.reserve) {
    const r = p.reserve;
    parts.push("reserve " + fmt(r.c / 1e6, 1) + "/" + fmt(r.t / 1e6, 1) + " ms " + r.enforcement +
      (r.shared ? " (" + r.shared + ")" : ""));
  }
  if (p.slo !== null && p.slo !== undefined) parts.push("slo " + fmt(p.slo / 1e6, 1) + " ms/s");
  if (p.target_fps !== null && p.target_fps !== undefined) parts.push(p.target_fps + " fps");
  return parts.join(", ");
}

function updateRow(row, vm) {
  const set = (cls, text) => { row.querySelector("td." + cls).textContent = text; };
  const stateText = row.querySelector("td.name .state");
  stateText.textContent = vm.connected ? "connected" : "away";
  stateText.className = "state " + (vm.connected ? "state-on" : "state-off");
  set("share", fmt(vm.share_pct, 1));
  set("fps", fmt(vm.fps, 1));
  set("latency", fmt(vm.latency_p50_ms, 2) + " / " + fmt(vm.latency_p99_ms, 2));
  set("queue", String(vm.queue_depth));
  const mib = (bytes) => fmt(bytes / 1048576, 0);
  set("memory", vm.memory_limit_bytes === null || vm.memory_limit_bytes === undefined ? "–"
    : mib(vm.memory_used_bytes) + " / " + mib(vm.memory_limit_bytes));
  set("budget", vm.budget ? fmt(vm.budget.remaining_ms, 2) + " / " + fmt(vm.budget.capacity_ms, 2) : "–");
  set("effective", effectiveText(vm));
  // Inputs follow the daemon unless the user is editing them.
  for (const input of row.querySelectorAll("[data-param]")) {
    if (input.classList.contains("dirty") || input === document.activeElement) continue;
    input.value = paramValue(vm, input.dataset.param);
  }
  row.querySelector("[data-action=focus]").disabled = !state.token || !vm.connected;
  row.querySelector("[data-action=apply]").disabled = !state.token;
  for (const input of row.querySelectorAll("[data-param]")) input.disabled = !state.token;
}

function showTable(s) {
  const body = $("#vms tbody");
  const rows = new Map([...body.querySelectorAll("tr[data-vm]")].map((r) => [r.dataset.vm, r]));
  const ordered = [];
  for (const vm of s.vms) {
    const row = rows.get(vm.name) || newRow(vm);
    rows.delete(vm.name);
    updateRow(row, vm);
    ordered.push(row);
  }
  for (const gone of rows.values()) gone.remove();
  ordered.forEach((row, i) => {
    if (body.children[i] !== row) body.insertBefore(row, body.children[i] || null);
  });
}

// ---- Charts --------------------------------------------------------------------------------

// Each chart's value axis covers [lo, hi] and grows to the data unless `fixed`; `mean` draws
// each point as the mean of the VM's values over that many seconds before it.
const CHARTS = [
  { id: "chart-share", legend: "share", series: [["share_pct", []]], lo: 0, hi: 100, fixed: true },
  { id: "chart-fps", legend: "fps", series: [["fps", []]], lo: 0 },
  { id: "chart-latency", legend: "latency", series: [["latency_p50_ms", []], ["latency_p99_ms", [6, 4]]], lo: 0 },
  { id: "chart-queue", legend: "queue", series: [["queue_depth", []]], lo: 0, integer: true },
  { id: "chart-budget", legend: "budget", series: [["budget_pct", []]], lo: 0, hi: 100, mean: BUDGET_MEAN_S },
];

// The values of `key` for VM `name` at each of `points` (null where absent), as the mean of
// the last `mean` seconds when `mean` is set.
function seriesValues(points, name, key, mean) {
  const raw = points.map((p) => {
    const v = p.vms[name] ? p.vms[name][key] : null;
    return v === null || v === undefined || !Number.isFinite(v) ? null : v;
  });
  if (!mean) return raw;
  return raw.map((v, i) => {
    if (v === null) return null;
    let sum = 0;
    let n = 0;
    for (let j = i; j >= 0 && points[j].t > points[i].t - mean; j--) {
      if (raw[j] !== null) { sum += raw[j]; n++; }
    }
    return sum / n;
  });
}

// Round numbers for an axis covering lo to hi: about `count` steps of 1, 2 or 5 times 10^k,
// the axis widened to whole steps so that both ends are labelled.
function ticks(lo, hi, count, integer) {
  const span = hi - lo || 1;
  let step = Math.pow(10, Math.floor(Math.log10(span / count)));
  for (const m of [1, 2, 5, 10]) {
    if (span / (step * m) <= count) { step *= m; break; }
  }
  if (integer) step = Math.max(1, Math.round(step));
  const first = Math.floor(lo / step + 1e-9);
  const last = Math.max(first + 1, Math.ceil(hi / step - 1e-9));
  const values = [];
  for (let k = first; k <= last; k++) values.push(k * step);
  return { step, values, lo: first * step, hi: last * step };
}

function sizeCanvas(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const w = Math.max(1, Math.round(canvas.clientWidth * ratio));
  const h = Math.max(1, Math.round(canvas.clientHeight * ratio));
  if (canvas.width !== w || canvas.height !== h) {
    canvas.width = w;
    canvas.height = h;
  }
  return ratio;
}

// The time axis: the seconds it spans (the history there is, between MIN_SPAN_S and
// WINDOW_S) and its tick step.
function timeAxis(now) {
  const first = state.points.length ? state.points[0].t : now;
  const span = Math.min(WINDOW_S, Math.max(MIN_SPAN_S, Math.ceil((now - first) / 60) * 60));
  return { span, step: span <= 60 ? 10 : span <= 180 ? 30 : 60 };
}

function tickLabel(s) {
  if (s === 0) return "now";
  return s % 60 === 0 ? "-" + s / 60 + " min" : "-" + s + " s";
}

function drawChart(chart, names, now) {
  const canvas = document.getElementById(chart.id);
  const ratio = sizeCanvas(canvas);
  const ctx = canvas.getContext("2d");
  const W = canvas.width / ratio;
  const H = canvas.height / ratio;
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, W, H);
  const pad = { left: 56, right: 12, top: 10, bottom: 30 };
  const pw = W - pad.left - pad.right;
  const ph = H - pad.top - pad.bottom;
  const axis = timeAxis(now);
  const t0 = now - axis.span;
  const visible = state.points.filter((p) => p.t >= t0);
  const series = new Map(); // "name key" -> values at the visible points
  for (const name of names) {
    for (const [key] of chart.series) series.set(name + " " + key, seriesValues(visible, name, key, chart.mean));
  }

  let lo = chart.lo !== undefined ? chart.lo : Infinity;
  let hi = chart.hi !== undefined ? chart.hi : -Infinity;
  if (!chart.fixed) {
    for (const values of series.values()) {
      for (const x of values) {
        if (x === null) continue;
        lo = Math.min(lo, x);
        hi = Math.max(hi, x);
      }
    }
  }
  if (!Number.isFinite(lo)) lo = 0;
  if (!Number.isFinite(hi) || hi <= lo) hi = lo + (chart.integer ? 4 : 1);
  const yt = ticks(lo, hi, 4, chart.integer);
  lo = yt.lo;
  hi = yt.hi;
  const X = (t) => pad.left + ((t - t0) / axis.span) * pw;
  const Y = (v) => pad.top + ph - ((v - lo) / (hi - lo)) * ph;

  const styles = getComputedStyle(document.documentElement);
  const grid = styles.getPropertyValue("--line").trim() || "#2a3340";
  const muted = styles.getPropertyValue("--muted").trim() || "#8d98a8";
  ctx.font = "12px system-ui, sans-serif";
  ctx.lineWidth = 1;
  ctx.strokeStyle = grid;
  ctx.fillStyle = muted;
  ctx.setLineDash([]);

  // Y grid and labels, with the unit on the axis.
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  const digits = yt.step >= 1 ? 0 : Math.min(3, Math.ceil(-Math.log10(yt.step)));
  for (const v of yt.values) {
    const y = Math.round(Y(v)) + 0.5;
    ctx.beginPath();
    ctx.moveTo(pad.left, y);
    ctx.lineTo(W - pad.right, y);
    ctx.stroke();
    ctx.fillText(v.toFixed(digits), pad.left - 6, y);
  }
  ctx.save();
  ctx.translate(12, pad.top + ph / 2);
  ctx.rotate(-Math.PI / 2);
  ctx.textAlign = "center";
  ctx.fillText(canvas.dataset.unit || "", 0, 0);
  ctx.restore();

  // Time axis: a tick a step, "now" at the right.
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  for (let s = 0; s <= axis.span; s += axis.step) {
    const x = Math.round(X(now - s)) + 0.5;
    ctx.beginPath();
    ctx.moveTo(x, pad.top + ph);
    ctx.lineTo(x, pad.top + ph + 4);
    ctx.stroke();
    ctx.fillText(tickLabel(s), Math.min(x, W - pad.right - 14), pad.top + ph + 8);
  }
  ctx.beginPath();
  ctx.moveTo(pad.left, pad.top + ph + 0.5);
  ctx.lineTo(W - pad.right, pad.top + ph + 0.5);
  ctx.stroke();

  // One line per VM (and per series: latency has p50 and p99); gaps where a value is absent.
  ctx.save();
  ctx.beginPath();
  ctx.rect(pad.left, pad.top - 2, pw, ph + 4);
  ctx.clip();
  ctx.lineWidth = 2;
  ctx.lineJoin = "round";
  for (const name of names) {
    ctx.strokeStyle = colourOf(name);
    for (const [key, dash] of chart.series) {
      ctx.setLineDash(dash);
      ctx.beginPath();
      let open = false;
      const values = series.get(name + " " + key);
      for (const [i, p] of visible.entries()) {
        const v = values[i];
        if (v === null) {
          open = false;
          continue;
        }
        const x = X(p.t);
        const y = Y(v);
        if (open) ctx.lineTo(x, y);
        else ctx.moveTo(x, y);
        open = true;
      }
      ctx.stroke();
    }
  }
  ctx.restore();
}

function drawLegends(names) {
  for (const chart of CHARTS) {
    const legend = document.querySelector('[data-legend="' + chart.legend + '"]');
    const items = names.map((name) => {
      const swatch = el("i");
      swatch.style.background = colourOf(name);
      return el("span", {}, [swatch, name]);
    });
    legend.replaceChildren(...items);
  }
}

function drawAll() {
  if (state.points.length === 0) return;
  const now = state.points[state.points.length - 1].t;
  const names = state.snapshot ? state.snapshot.vms.map((v) => v.name) : [];
  drawLegends(names);
  for (const chart of CHARTS) drawChart(chart, names, now);
}

function addPoint(point) {
  const vms = {};
  for (const v of point.vms) vms[v.name] = v;
  const last = state.points[state.points.length - 1];
  if (last && point.t <= last.t) return;
  state.points.push({ t: point.t, vms });
  const oldest = point.t - WINDOW_S - 5;
  while (state.points.length && state.points[0].t < oldest) state.points.shift();
}

// ---- The event stream ------------------------------------------------------------------------

function setStatus(live) {
  const s = $("#status");
  s.textContent = live ? "live" : "reconnecting";
  s.className = "status " + (live ? "live" : "down");
}

function connect() {
  const events = new EventSource("/events");
  events.onopen = () => setStatus(true);
  events.onerror = () => setStatus(events.readyState === EventSource.OPEN);
  events.addEventListener("history", (e) => {
    state.points = [];
    for (const p of JSON.parse(e.data)) addPoint(p);
    drawAll();
  });
  events.addEventListener("snapshot", (e) => {
    const s = JSON.parse(e.data);
    state.snapshot = s;
    setStatus(true);
    addPoint({ t: s.t, vms: s.vms });
    showRecord(s.last_change);
    showPolicy(s);
    showTable(s);
    drawAll();
  });
}

function start() {
  if (!state.token) {
    const notice = $("#notice");
    notice.textContent = "Read-only: this address has no token. Open the URL that `vgpuctl dashboard` " +
      "prints to change the policy or parameters.";
    notice.hidden = false;
    $("#policy-apply").disabled = true;
    $("#policy-select").disabled = true;
  }
  $("#policy-apply").addEventListener("click", applyPolicy);
  window.addEventListener("resize", drawAll);
  loadPolicies();
  connect();
}

start();
