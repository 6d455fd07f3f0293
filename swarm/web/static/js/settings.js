// The Settings column: the selected model's facts, stages and load progress; generation settings; the API section.
import { get, post } from "./api.js";
import { h, icon, copyText, formatBytes, store } from "./dom.js";
import { state, selectedModel, saveSetting, selectedApiToken, on } from "./state.js";
import { refreshModels } from "./models.js";
import { askText, showOnce, showError } from "./ui.js";
import { FACES, LANGUAGES, examples } from "./api_examples.js";

const PHASES = [["download", "Download"], ["extract", "Extract"], ["load", "Load into memory"]];
const STATUS_TEXT = { ready: "Ready", loading: "Loading", recovering: "Recovering", not_loaded: "Not loaded", failed: "Load failed" };
let panel;
let modelBox;
let apiBox;
let exampleTab = store.get("exampleTab", "curl");
let exampleFace = store.get("exampleFace", "chat");

function stageLine(stage) {
  const [first, end] = stage.layers || [0, 0];
  return `Stage ${stage.index}: ${stage.fellow} · L${first}-${end - 1} · ${formatBytes(stage.memory_bytes)}`;
}

/** "int8 · 3.6x smaller" for a quantized load, "gguf (the file's own blocks) · ..." at gguf, "None (full precision)"
 * otherwise. */
function compression(model) {
  if (!model.quantization || model.quantization === "none") return model.num_stages ? "None (full precision)" : "—";
  if (model.quantization === "gguf") {
    return `gguf (the file's own blocks) · ${Number(model.compression || 1).toFixed(1)}x smaller than float32`;
  }
  return `${model.quantization} · ${Number(model.compression || 1).toFixed(1)}x smaller`;
}

// The planner's prediction per model id (GET /api/v1/models/{id}/plan): {at, text, error}; asked again after PLAN_TTL_MS.
const plans = new Map();
const PLAN_TTL_MS = 30000;

/** "about 21 tokens/s, first token of a 1,000-token prompt in 1.4 s over 2 stages; ...", or why there is none. */
function planFact(model) {
  const known = plans.get(model.id);
  const dd = h("dd", { id: "model-plan", class: known?.error ? "muted" : "" },
    known?.text || known?.error || "Predicting…");
  if (!known || Date.now() - known.at > PLAN_TTL_MS) {
    plans.set(model.id, { at: Date.now(), text: known?.text, error: known?.error });
    get(`/api/v1/models/${encodeURIComponent(model.id)}/plan`).then(
      (plan) => plans.set(model.id, { at: Date.now(), text: plan.text }),
      (err) => plans.set(model.id, { at: Date.now(), error: err.message || String(err) }),
    ).then(() => {
      const shown = document.getElementById("model-plan");
      const now = plans.get(model.id);
      if (shown && selectedModel()?.id === model.id) {
        shown.textContent = now.text || now.error;
        shown.className = now.error ? "muted" : "";
      }
    });
  }
  return dd;
}

function renderModel() {
  const model = selectedModel();
  if (!model) {
    modelBox.replaceChildren(h("p", { class: "muted" }, "No model in this pool yet. Import one with `swarm model import`, or train one."));
    return;
  }
  const facts = h("dl", { class: "facts" },
    h("dt", {}, "Model"), h("dd", { class: "mono" }, model.id),
    h("dt", {}, "Architecture"), h("dd", {}, model.architecture || "—"),
    h("dt", {}, "Layers"), h("dd", {}, model.num_layers ?? "—"),
    h("dt", {}, "Stages"), h("dd", {}, model.num_stages ? String(model.num_stages) : "—"),
    h("dt", {}, "Precision"), h("dd", {}, model.dtype || "—"),
    h("dt", {}, "Compression"), h("dd", { id: "model-compression" }, compression(model)),
    h("dt", {}, "Memory"), h("dd", {}, `≈ ${formatBytes(model.weight_bytes || model.total_bytes)}`),
    h("dt", {}, "Status"), h("dd", {}, STATUS_TEXT[model.status] || model.status),
    h("dt", {}, "Planned speed"), planFact(model));
  const parts = [facts];
  if (model.stages?.length) {
    parts.push(h("ul", { class: "stage-lines", "aria-label": "Stages" }, model.stages.map((s) => h("li", {}, stageLine(s)))));
  }
  if (model.status === "loading" && model.progress) {
    const fraction = Math.round((model.progress.fraction || 0) * 100);
    const phases = new Set((model.progress.stages || []).map((s) => s.phase));
    parts.push(h("div", { class: "load-progress" },
      h("div", { class: "progress", role: "progressbar", "aria-label": "Load progress", "aria-valuemin": "0",
        "aria-valuemax": "100", "aria-valuenow": String(fraction) }, h("div", { style: `width:${fraction}%` })),
      h("div", { class: "phases" }, PHASES.map(([key, label], i) => [
        i ? h("span", { "aria-hidden": "true" }, "→") : null, h("span", { class: phases.has(key) ? "on" : "" }, label)]),
        h("span", { style: "margin-left:auto" }, `${fraction}%`)),
      h("ul", { class: "stage-lines" }, (model.progress.stages || []).map((s) =>
        h("li", {}, `Stage ${s.index}: ${s.fellow} · ${s.phase}${s.phase !== "ready" && s.fraction ? ` ${Math.round(s.fraction * 100)}%` : ""}`)))));
  }
  if (model.status === "failed" && model.error) parts.push(h("p", { class: "notice bad" }, model.error));
  modelBox.replaceChildren(...parts);
}

function generation() {
  const shown = state.settings.temperature ?? 0.7;
  const temp = h("input", { type: "range", min: "0", max: "2", step: "0.05", value: String(shown), "aria-label": "Temperature" });
  const tempNum = h("input", { type: "number", min: "0", max: "2", step: "0.05", value: String(shown), "aria-label": "Temperature value" });
  const note = h("span", { class: "muted", id: "temperature-note" });
  const reset = h("button", { class: "btn small", type: "button", id: "temperature-default" }, "Model default");
  const showNote = () => {
    const own = state.settings.temperature === null || state.settings.temperature === undefined;
    note.textContent = own ? "the model's own default" : "";
    reset.hidden = own;
  };
  const setTemp = (v) => {
    const value = Math.min(2, Math.max(0, Number(v) || 0));
    temp.value = tempNum.value = String(value);
    saveSetting("temperature", value);
    showNote();
    renderApi();
  };
  temp.addEventListener("input", () => setTemp(temp.value));
  tempNum.addEventListener("change", () => setTemp(tempNum.value));
  reset.addEventListener("click", () => {
    saveSetting("temperature", null);
    temp.value = tempNum.value = "0.7";
    showNote();
    renderApi();
  });
  showNote();
  const reasoning = h("input", { type: "checkbox", role: "switch", checked: state.settings.reasoning || undefined, id: "reasoning-switch" });
  reasoning.addEventListener("change", () => saveSetting("reasoning", reasoning.checked));
  const maxTokens = h("input", { type: "number", min: "1", max: "4096", step: "1", value: String(state.settings.maxTokens), id: "max-tokens" });
  maxTokens.addEventListener("change", () => {
    const value = Math.min(4096, Math.max(1, Math.round(Number(maxTokens.value) || 1024)));
    maxTokens.value = String(value);
    saveSetting("maxTokens", value);
    renderApi();
  });
  return h("section", { "aria-labelledby": "gen-title" },
    h("h3", { id: "gen-title" }, "Generation"),
    h("div", { class: "card stack", style: "gap:12px" },
      h("label", { class: "field" }, "Temperature (0 = deterministic)", h("div", { class: "range-row" }, temp, tempNum)),
      h("div", { class: "range-row" }, note, reset),
      h("label", { class: "switch" }, reasoning, h("span", {}, "Reasoning"),
        h("span", { class: "muted", style: "font-size:12.5px" }, "off answers without thinking first")),
      h("label", { class: "field" }, "Max tokens (up to 4096)", maxTokens)));
}

function persistTokens() {
  store.set("apiTokens", state.apiTokens);
  store.set("apiTokenName", state.apiTokenName);
}

async function newToken() {
  const name = await askText("New API token", "Name", "", "Create");
  if (!name) return;
  try {
    const created = await post("/api/v1/tokens", { name });
    state.apiTokens = state.apiTokens.filter((t) => t.name !== name).concat({ name, token: created.token });
    state.apiTokenName = name;
    persistTokens();
    renderApi();
    await showOnce("Your new token", "Copy it now: the leader keeps only its hash, so it is shown this once.", created.token);
  } catch (err) { showError(`The token was not created: ${err.message}`); }
}

function renderApi() {
  const base = exampleFace === "chat" || exampleFace === "responses" ? `${location.origin}/v1` : location.origin;
  const picker = h("select", { "aria-label": "API token", id: "api-token-picker" },
    h("option", { value: "" }, `No token (chat as ${state.me?.user?.name || "you"})`),
    state.apiTokens.map((t) => h("option", { value: t.name, selected: t.name === state.apiTokenName || undefined }, t.name)));
  picker.addEventListener("change", () => { state.apiTokenName = picker.value; persistTokens(); renderApi(); });
  const paste = h("input", { type: "password", placeholder: "Paste an existing token", "aria-label": "Paste a token", autocomplete: "off" });
  const add = h("button", { class: "btn", type: "button", onclick: () => {
    const token = paste.value.trim();
    if (!token) return;
    const name = `pasted ${token.slice(0, 8)}…`;
    state.apiTokens = state.apiTokens.filter((t) => t.name !== name).concat({ name, token });
    state.apiTokenName = name;
    persistTokens();
    renderApi();
  } }, "Add");
  const forget = state.apiTokenName ? h("button", { class: "btn ghost small", type: "button", onclick: () => {
    state.apiTokens = state.apiTokens.filter((t) => t.name !== state.apiTokenName);
    state.apiTokenName = "";
    persistTokens();
    renderApi();
  } }, "Forget this token") : null;
  const code = examples(exampleFace, selectedApiToken() || "YOUR_API_TOKEN", state.modelId || "MODEL", state.settings);
  const pre = h("pre", { class: "example", tabindex: "0", "aria-label": "Example request" }, code[exampleTab]);
  const face = h("select", { "aria-label": "Example API", id: "api-face-picker" },
    FACES.map(([key, label]) => h("option", { value: key, selected: key === exampleFace || undefined }, label)));
  face.addEventListener("change", () => { exampleFace = face.value; store.set("exampleFace", face.value); renderApi(); });
  const tabs = h("div", { class: "tabs", role: "tablist" }, LANGUAGES.map(([key, label]) =>
    h("button", { type: "button", role: "tab", "aria-selected": key === exampleTab ? "true" : "false",
      onclick: () => { exampleTab = key; store.set("exampleTab", key); renderApi(); } }, label)));
  apiBox.replaceChildren(...[
    h("label", { class: "field" }, "Base URL", h("div", { class: "row" },
      h("input", { type: "text", readonly: true, value: base, "aria-label": "Base URL", class: "mono" }),
      h("button", { class: "btn", type: "button", "aria-label": "Copy base URL", onclick: (e) => copyText(base, e.currentTarget) }, "Copy"))),
    h("label", { class: "field" }, "Token", h("div", { class: "row" }, picker,
      h("button", { class: "btn", type: "button", onclick: newToken }, icon("plus"), "New token"))),
    h("div", { class: "row" }, paste, add), forget,
    h("p", { class: "muted", style: "margin:0;font-size:12.5px" }, "Tokens are kept only in this browser. The selected one is used for the chat and filled into the examples; chats are always saved with your session."),
    h("label", { class: "field" }, "Example request", face),
    h("div", {}, tabs, pre),
    h("div", { class: "row" }, h("button", { class: "btn small", type: "button", onclick: (e) => copyText(code[exampleTab], e.currentTarget) }, "Copy example")),
  ].filter(Boolean));
}

export function initSettings() {
  panel = document.getElementById("panel-settings");
  modelBox = h("div", { class: "card", id: "model-facts" });
  apiBox = h("div", { class: "card stack" });
  panel.replaceChildren(
    h("section", { "aria-labelledby": "model-title" },
      h("div", { class: "panel-head" }, h("h3", { id: "model-title", style: "margin:0" }, "Model"),
        h("button", { class: "btn small ghost", type: "button", onclick: refreshModels }, icon("refresh"), "Refresh list")),
      modelBox),
    generation(),
    h("section", { "aria-labelledby": "api-title" }, h("h3", { id: "api-title" }, "API"), apiBox),
  );
  on("models", renderModel);
  on("model", () => { renderModel(); renderApi(); });
  renderModel();
  renderApi();
}
