// The Performance column: how the selected model performs across the cluster (GET /api/v1/models/{id}/performance).
// It refreshes every two seconds while it is open and not at all while it is closed; the range is remembered here.
import { get } from "./api.js";
import { h, formatBytes, store } from "./dom.js";
import { state, on } from "./state.js";

const REFRESH_MS = 2000;
const RANGES = ["15m", "1h", "6h", "24h", "7d"];
const RANGE_WORDS = { "15m": "15 minutes", "1h": "hour", "6h": "6 hours", "24h": "24 hours", "7d": "7 days" };
const TRANSPORTS = { direct: "Direct link", tunnel: "Tunnel", relay: "Relay" };
const SVG_NS = "http://www.w3.org/2000/svg";

let open = false;
let timer = null;
let inflight = null;
let range = RANGES.includes(store.get("perfRange", "15m")) ? store.get("perfRange", "15m") : "15m";
let shownModel = null;

const $ = (id) => document.getElementById(id);

// --- formatting --------------------------------------------------------------------------------------------------

function num(value, digits = 1) {
  if (value === null || value === undefined) return "—";
  return Number(value).toLocaleString(undefined, { maximumFractionDigits: digits, minimumFractionDigits: 0 });
}

function ms(value) {
  if (value === null || value === undefined) return "—";
  if (value >= 10000) return `${num(value / 1000, 1)} s`;
  return `${num(value, value < 10 ? 1 : 0)} ms`;
}

function pct(share) { return `${Math.round(share * 100)} %`; }

function stepWords(seconds) {
  if (seconds < 60) return `${seconds}-second`;
  if (seconds < 3600) return `${seconds / 60}-minute`;
  return `${seconds / 3600}-hour`;
}

function svg(tag, attrs = {}, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs)) if (value !== undefined && value !== null) el.setAttribute(key, value);
  for (const child of children) if (child) el.append(child);
  return el;
}

// --- the parts ---------------------------------------------------------------------------------------------------

function chart(data) {
  const points = data.series || [];
  const values = points.map((p) => p.tokens_per_s).filter((v) => v !== null && v !== undefined);
  const peak = values.length ? Math.max(...values) : 0;
  const latest = values.length ? values[values.length - 1] : null;
  const W = 320, H = 110, PAD_L = 30, PAD_B = 16, PAD_T = 8;
  const top = peak > 0 ? peak * 1.15 : 1;
  const x = (i) => PAD_L + (i / Math.max(1, points.length - 1)) * (W - PAD_L - 4);
  const y = (v) => PAD_T + (1 - v / top) * (H - PAD_T - PAD_B);
  const label = values.length
    ? `Tokens per second over the last ${RANGE_WORDS[data.range]} in ${stepWords(data.step_s)} steps: peak ${num(peak)}, latest ${num(latest)}.`
    : `Tokens per second over the last ${RANGE_WORDS[data.range]}: no replies yet.`;
  const box = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": label, class: "perf-chart",
    preserveAspectRatio: "none" });
  box.append(svg("line", { x1: PAD_L, x2: W - 4, y1: H - PAD_B, y2: H - PAD_B, class: "axis" }));
  box.append(svg("line", { x1: PAD_L, x2: W - 4, y1: y(peak || top), y2: y(peak || top), class: "grid" }));
  box.append(svg("text", { x: PAD_L - 4, y: y(peak || top) + 4, "text-anchor": "end", class: "tick" }, document.createTextNode(num(peak || 0, 0))));
  box.append(svg("text", { x: PAD_L - 4, y: H - PAD_B + 4, "text-anchor": "end", class: "tick" }, document.createTextNode("0")));
  box.append(svg("text", { x: PAD_L, y: H - 2, class: "tick" }, document.createTextNode(`−${data.range}`)));
  box.append(svg("text", { x: W - 4, y: H - 2, "text-anchor": "end", class: "tick" }, document.createTextNode("now")));
  // one line per run of steps with replies; a lone step is a dot
  let run = [];
  const flush = () => {
    if (run.length === 1) box.append(svg("circle", { cx: run[0][0], cy: run[0][1], r: 2.5, class: "dot" }));
    if (run.length > 1) {
      const line = run.map(([px, py]) => `${px.toFixed(1)},${py.toFixed(1)}`).join(" ");
      const area = `${run[0][0].toFixed(1)},${H - PAD_B} ${line} ${run[run.length - 1][0].toFixed(1)},${H - PAD_B}`;
      box.append(svg("polygon", { points: area, class: "area" }));
      box.append(svg("polyline", { points: line, class: "line" }));
    }
    run = [];
  };
  points.forEach((p, i) => {
    if (p.tokens_per_s === null || p.tokens_per_s === undefined) flush();
    else run.push([x(i), y(p.tokens_per_s)]);
  });
  flush();
  return box;
}

function bar(fraction, kind, label) {
  const f = Math.max(0, Math.min(1, fraction || 0));
  return h("div", { class: `perf-bar ${kind}`, role: "meter", "aria-label": label, "aria-valuemin": "0",
    "aria-valuemax": "100", "aria-valuenow": String(Math.round(f * 100)) },
  h("div", { style: `width:${(f * 100).toFixed(1)}%` }));
}

function gpuCard(gpu) {
  const busy = gpu.role === "stage";
  const load = gpu.load_percent;
  const extra = [gpu.power_w !== null && gpu.power_w !== undefined ? `${num(gpu.power_w, 0)} W` : null,
    gpu.temperature_c !== null && gpu.temperature_c !== undefined ? `${num(gpu.temperature_c, 0)} °C` : null]
    .filter(Boolean).join(" · ");
  return h("div", { class: `perf-gpu${busy ? "" : " idle"}` },
    h("div", { class: "perf-gpu-head" },
      h("span", { class: "name" }, `GPU ${gpu.index} · ${gpu.name}`),
      h("span", { class: "role" }, busy ? "runs this stage" : "idle for this model")),
    h("div", { class: "perf-meter" }, h("span", {}, "Load"), bar((load || 0) / 100, "load", `GPU ${gpu.index} load`),
      h("span", { class: "v" }, load === null || load === undefined ? "—" : `${num(load, 0)} %`)),
    h("div", { class: "perf-meter" }, h("span", {}, "Memory"),
      bar(gpu.total_bytes ? gpu.used_bytes / gpu.total_bytes : 0, "mem", `GPU ${gpu.index} memory`),
      h("span", { class: "v" }, `${formatBytes(gpu.used_bytes)} / ${formatBytes(gpu.total_bytes)}`)),
    busy && gpu.model_bytes ? h("div", { class: "perf-note" }, `the model takes ${formatBytes(gpu.model_bytes)} here`) : null,
    extra ? h("div", { class: "perf-note" }, extra) : null);
}

function cpuCard(cpu, modelBytes) {
  return h("div", { class: "perf-gpu" },
    h("div", { class: "perf-gpu-head" }, h("span", { class: "name" }, `CPU · ${cpu.cores} cores`),
      h("span", { class: "role" }, "runs this stage (no GPU)")),
    h("div", { class: "perf-meter" }, h("span", {}, "Load"), bar((cpu.load_percent || 0) / 100, "load", "CPU load"),
      h("span", { class: "v" }, cpu.load_percent === null || cpu.load_percent === undefined ? "—" : `${num(cpu.load_percent, 0)} %`)),
    h("div", { class: "perf-meter" }, h("span", {}, "RAM"),
      bar(cpu.ram_total_bytes ? cpu.ram_used_bytes / cpu.ram_total_bytes : 0, "mem", "RAM in use"),
      h("span", { class: "v" }, `${formatBytes(cpu.ram_used_bytes)} / ${formatBytes(cpu.ram_total_bytes)}`)),
    modelBytes ? h("div", { class: "perf-note" }, `the model takes ${formatBytes(modelBytes)} here`) : null);
}

function stageCard(stage) {
  const [first, end] = stage.layers;
  return h("div", { class: "card perf-stage", "data-stage": String(stage.index) },
    h("div", { class: "perf-stage-head" },
      h("strong", {}, `Stage ${stage.index}`),
      h("span", { class: "mono" }, `${stage.fellow} · layers ${first}–${end - 1}`)),
    !stage.online ? h("div", { class: "perf-note bad" }, `${stage.fellow} is offline`) : null,
    ...stage.gpus.map(gpuCard),
    stage.cpu ? cpuCard(stage.cpu, stage.model_bytes) : null);
}

function linkLine(hop, back) {
  const kind = TRANSPORTS[hop.transport] || "Link";
  const facts = [
    hop.bytes_per_token ? `${formatBytes(hop.bytes_per_token)} per token ${back ? "back" : "forward"}` : null,
    hop.bytes_per_s ? `${formatBytes(Math.round(hop.bytes_per_s))}/s` : null,
    hop.link_ms !== null && hop.link_ms !== undefined ? `${ms(hop.link_ms)} a token` : null,
    hop.rtt_ms !== null && hop.rtt_ms !== undefined ? `${ms(hop.rtt_ms)} round trip` : null,
  ].filter(Boolean);
  return h("div", { class: "perf-link", "data-transport": hop.transport || "" },
    h("span", { class: "kind" }, back ? `${kind} back to stage ${hop.to_stage}` : kind),
    h("span", { class: "facts" }, facts.length ? facts.join(" · ") : "no traffic measured yet"));
}

function pipeline(data) {
  const parts = [];
  data.stages.forEach((stage, i) => {
    parts.push(stageCard(stage));
    const hop = data.hops[i];
    if (hop) parts.push(linkLine(hop, i === data.stages.length - 1));
  });
  return parts;
}

// The bar's segments in the ring's order. The API gives one "link" part for all hops (after stage 0) and each hop's
// ms in hop_ms; past 2 stages each hop gets its own segment after the stage it leaves (stage 0, link 0→1, stage 1,
// link 1→2, stage 2, link 2→0), so a slow hop shows where it is.
export function barParts(split) {
  const stages = split.parts.filter((p) => p.kind === "compute");
  const hops = split.hop_ms || [];
  if (stages.length <= 2 || hops.length !== stages.length) return split.parts;
  const total = split.ms_per_token || 0;
  const out = [];
  stages.forEach((stage, i) => {
    out.push(stage);
    const hopMs = hops[i];
    out.push({ label: `link ${i}→${(i + 1) % stages.length}`, kind: "link", stage: null, fellow: null, ms: hopMs,
      share: total > 0 ? hopMs / total : 0 });
  });
  return out;
}

export function timeBar(split, bottleneck) {
  if (!split) return [h("p", { class: "muted perf-bottleneck" }, bottleneck || "No replies in the last 15 minutes.")];
  const parts = barParts(split);
  const legend = parts.map((p, i) => h("li", {},
    h("span", { class: `swatch ${p.kind} k${i}` }), `${p.label} ${ms(p.ms)} (${pct(p.share)})`));
  const facts = [`${ms(split.ms_per_token)} per token`,
    split.prompt_ms !== null && split.prompt_ms !== undefined ? `prompt ${ms(split.prompt_ms)}` : null,
    split.bytes_per_token?.forward ? `${formatBytes(split.bytes_per_token.forward)} forward and ${formatBytes(split.bytes_per_token.back || 0)} back per token` : null]
    .filter(Boolean).join(" · ");
  return [
    h("div", { class: "perf-split", role: "img", "aria-label": parts.map((p) => `${p.label} ${ms(p.ms)}, ${pct(p.share)}`).join("; ") },
      ...parts.map((p, i) => h("div", { class: `${p.kind} k${i}`, style: `flex-grow:${Math.max(p.share, 0.001)}`, title: `${p.label} ${ms(p.ms)}` }))),
    h("ul", { class: "perf-legend" }, ...legend),
    h("p", { class: "perf-note" }, facts),
    split.source === "round_trips"
      ? h("p", { class: "perf-note" }, "Estimated from the hops' round trips: the fellows have not reported their own split yet.")
      : null,
    h("p", { class: "perf-bottleneck" }, bottleneck),
  ];
}

function lastTable(t) {
  const row = (name, value) => h("tr", {}, h("th", { scope: "row" }, name), h("td", {}, value));
  const spread = (s, fmt) => `${fmt(s.p50)} · ${fmt(s.p95)}`;
  return h("table", { class: "perf-table" },
    h("thead", {}, h("tr", {}, h("th", { scope: "col" }, ""), h("th", { scope: "col" }, "last 15 minutes"))),
    h("tbody", {},
      row("Replies", `${t.replies}${t.failed ? ` (${t.failed} failed)` : " (none failed)"}`),
      row("Tokens generated", num(t.tokens, 0)),
      row("Tokens/s per reply (p50 · p95)", spread(t.tokens_per_s, (v) => num(v))),
      row("First token (p50 · p95)", spread(t.ttft_ms, ms)),
      row("Queue wait (p50 · p95)", spread(t.queue_ms, ms)),
      row("Mean time between tokens", ms(t.mean_ms_between_tokens))));
}

function render(data) {
  const speed = data.speed;
  const live = speed.streaming > 0;
  const body = $("perf-body");
  const headline = h("div", { class: "perf-stats" },
    h("div", {}, h("span", { class: "big", id: "perf-rate" }, num(speed.tokens_per_s)),
      h("span", { class: "muted" }, live ? "tokens/s now" : "tokens/s (median per reply)")),
    h("div", {}, h("span", { class: "big" }, ms(speed.median_ttft_ms)), h("span", { class: "muted" }, "median first token")),
    h("div", {}, h("span", { class: "big" }, num(speed.tokens, 0)), h("span", { class: "muted" }, `tokens in ${data.range}`)));
  const stages = data.stages.length
    ? pipeline(data)
    : [h("p", { class: "muted" }, `${data.id} is not loaded: Load it to see its stages.`)];
  body.replaceChildren(
    h("section", { "aria-label": "Speed" }, headline, chart(data)),
    h("section", { "aria-label": "Pipeline" }, h("h3", {}, "Pipeline"), ...stages),
    h("section", { "aria-label": "Time per token" }, h("h3", {}, "Time per token"), ...timeBar(data.time_per_token, data.bottleneck)),
    h("section", { "aria-label": "Last 15 minutes" }, h("h3", {}, "Last 15 minutes"), lastTable(data.last_15m)),
  );
  body.dataset.refreshedAt = String(Date.now());
}

// --- refreshing --------------------------------------------------------------------------------------------------

async function refresh() {
  clearTimeout(timer);
  timer = null;
  if (!open) return;
  const model = state.modelId;
  if (!model) {
    $("perf-body").replaceChildren(h("p", { class: "muted" }, "Pick a model to see how it performs."));
  } else {
    inflight?.abort();
    inflight = new AbortController();
    try {
      const data = await get(`/api/v1/models/${encodeURIComponent(model)}/performance?range=${range}`, { signal: inflight.signal });
      if (open && model === state.modelId) {
        shownModel = model;
        $("perf-error").hidden = true;
        render(data);
      }
    } catch (err) {
      if (err.name === "AbortError") return;
      $("perf-error").textContent = `The performance figures could not be read: ${err.message}`;
      $("perf-error").hidden = false;
    }
  }
  if (open) timer = setTimeout(refresh, REFRESH_MS);
}

function setRange(value) {
  range = value;
  store.set("perfRange", value);
  for (const button of document.querySelectorAll("#perf-range button")) {
    button.setAttribute("aria-checked", String(button.dataset.range === value));
    button.tabIndex = button.dataset.range === value ? 0 : -1;
  }
  refresh();
}

export function initPerformance() {
  const switcher = h("div", { class: "perf-range", id: "perf-range", role: "radiogroup", "aria-label": "Time range" },
    ...RANGES.map((r) => h("button", { type: "button", role: "radio", "data-range": r, onclick: () => setRange(r) }, r)));
  switcher.addEventListener("keydown", (e) => {
    const step = { ArrowRight: 1, ArrowDown: 1, ArrowLeft: -1, ArrowUp: -1 }[e.key];
    if (!step) return;
    e.preventDefault();
    const next = RANGES[(RANGES.indexOf(range) + step + RANGES.length) % RANGES.length];
    setRange(next);
    switcher.querySelector(`[data-range="${next}"]`).focus();
  });
  $("panel-performance").replaceChildren(
    h("div", { class: "panel-head" }, h("h2", {}, "Performance")),
    h("div", { class: "panel-head" }, h("h3", {}, "Speed"), switcher),
    h("div", { class: "notice bad", id: "perf-error", role: "alert", hidden: true }),
    h("div", { id: "perf-body", class: "perf-body" }, h("p", { class: "muted" }, "Loading…")),
  );
  for (const button of switcher.children) {
    button.setAttribute("aria-checked", String(button.dataset.range === range));
    button.tabIndex = button.dataset.range === range ? 0 : -1;
  }
  on("column", (name) => {
    const was = open;
    open = name === "performance";
    if (open && !was) refresh();
    if (!open) { clearTimeout(timer); timer = null; inflight?.abort(); }
  });
  on("models", () => { if (open && state.modelId !== shownModel) refresh(); });
}
