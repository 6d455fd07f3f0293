// The admin page's Usage (a chart and a table per period, CSV) and Quotas (rows, set, remove) sections.
import { api, get, del } from "./api.js";
import { h, formatWhen } from "./dom.js";
import { showError } from "./ui.js";

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
const LIMITS = ["prompt_tokens_per_minute", "completion_tokens_per_minute", "prompt_tokens_per_day",
  "completion_tokens_per_day", "concurrent_requests"];
const LIMIT_WORDS = {
  prompt_tokens_per_minute: "prompt tokens/min", completion_tokens_per_minute: "completion tokens/min",
  prompt_tokens_per_day: "prompt tokens/day", completion_tokens_per_day: "completion tokens/day",
  concurrent_requests: "at once",
};
const number = (n) => Number(n).toLocaleString();

function svg(tag, attrs, ...children) {
  const el = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) el.setAttribute(key, value);
  el.append(...children);
  return el;
}

function usageQuery(format) {
  const query = new URLSearchParams({ range: $("usage-range").value, by: $("usage-by").value });
  if (format) query.set("format", format);
  return `/api/v1/usage?${query}`;
}

function who(row, by) {
  return by.map((g) => row[g] ?? (g === "user" ? "(no user)" : g === "token" ? "the page or CLI" : "")).join(" · ");
}

// Tokens per period as stacked bars: prompt (light) under completion, one bar per period with any requests.
function drawChart(rows, step) {
  const periods = new Map();
  for (const r of rows) {
    const p = periods.get(r.period_start) || { prompt: 0, completion: 0, requests: 0 };
    p.prompt += r.prompt_tokens; p.completion += r.completion_tokens; p.requests += r.requests;
    periods.set(r.period_start, p);
  }
  const figure = $("usage-chart");
  if (!periods.size) { figure.replaceChildren(h("figcaption", {}, "No requests in this range.")); return; }
  const starts = [...periods.keys()].sort((a, b) => a - b);
  const first = starts[0], last = Math.max(starts[starts.length - 1], first);
  const slots = Math.round((last - first) / step) + 1;
  const top = Math.max(...[...periods.values()].map((p) => p.prompt + p.completion), 1);
  const width = 100 / slots;
  const bars = starts.map((start) => {
    const p = periods.get(start), x = ((start - first) / step) * width;
    const ph = (p.prompt / top) * 100, ch = (p.completion / top) * 100;
    const label = `${new Date(start * 1000).toISOString().slice(0, step === 3600 ? 16 : 10).replace("T", " ")} UTC: ${number(p.requests)} requests, ${number(p.prompt)} prompt and ${number(p.completion)} completion tokens`;
    return svg("g", {}, svg("title", {}, label),
      svg("rect", { class: "prompt", x: x + width * 0.1, width: width * 0.8, y: 100 - ph, height: ph }),
      svg("rect", { class: "completion", x: x + width * 0.1, width: width * 0.8, y: 100 - ph - ch, height: ch }));
  });
  figure.replaceChildren(svg("svg", { viewBox: "0 0 100 100", preserveAspectRatio: "none", role: "img",
    "aria-label": `Tokens per ${step === 3600 ? "hour" : "day"}, at most ${number(top)}` }, ...bars),
  h("figcaption", {}, `Tokens per ${step === 3600 ? "hour" : "day"} (light: prompt, dark: completion); the highest bar is ${number(top)}.`));
}

export async function loadUsage() {
  $("usage-csv").href = usageQuery("csv");
  const data = await get(usageQuery());
  const step = data.step === "hour" ? 3600 : 86400;
  drawChart(data.rows, step);
  const body = $("usage-table").querySelector("tbody");
  const rows = [...data.rows].reverse(); // the latest first
  body.replaceChildren(...(rows.length ? rows.map((r) => h("tr", {},
    h("td", {}, r.period.slice(0, step === 3600 ? 16 : 10).replace("T", " ")), h("td", {}, who(r, data.by)),
    h("td", {}, number(r.requests) + (r.failed ? ` (${r.failed} failed)` : "")),
    h("td", {}, number(r.prompt_tokens)), h("td", {}, number(r.completion_tokens))))
    : [h("tr", {}, h("td", { colspan: "5", class: "muted" }, "No requests in this range."))]));
}

export async function loadQuotas() {
  const { quotas } = await get("/api/v1/quotas");
  const body = $("quotas-table").querySelector("tbody");
  body.replaceChildren(...(quotas.length ? quotas.map((q) => {
    const set = LIMITS.filter((k) => q.limits[k] !== undefined && q.limits[k] !== null);
    const label = `${q.scope === "pool" ? "Pool" : q.scope === "user" ? "User" : "Token"} ${q.name ?? q.id}`;
    return h("tr", {}, h("td", {}, label),
      h("td", {}, set.length ? set.map((k) => `${number(q.limits[k])} ${LIMIT_WORDS[k]}`).join(", ")
        : h("span", { class: "muted" }, "no limits")),
      h("td", {}, formatWhen(q.updated_at)),
      h("td", {}, h("button", {
        class: "btn small", type: "button", "aria-label": `Remove the quota of ${label}`,
        onclick: async () => {
          try { await del(`/api/v1/quotas/${q.scope}/${q.id}`); } catch (err) { showError(err.message); }
          loadQuotas();
        },
      }, "Remove")));
  }) : [h("tr", {}, h("td", { colspan: "4", class: "muted" }, "No quotas: everyone may use the pools as much as the queue allows."))]));
}

export function initUsage() {
  $("usage-range").addEventListener("change", () => loadUsage().catch((err) => showError(err.message)));
  $("usage-by").addEventListener("change", () => loadUsage().catch((err) => showError(err.message)));
  $("quota-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    const limits = {};
    for (const name of LIMITS) {
      const value = $(`quota-${name}`).value.trim();
      if (value !== "") limits[name] = Number(value);
    }
    const scope = $("quota-scope").value, ref = $("quota-ref").value.trim();
    try {
      await api("PUT", `/api/v1/quotas/${scope}/${encodeURIComponent(ref)}`, limits);
      e.target.reset();
      $("quota-scope").value = "user";
    } catch (err) { showError(`The quota was not set: ${err.message}`); }
    loadQuotas();
  });
  return Promise.all([loadUsage(), loadQuotas()]);
}
