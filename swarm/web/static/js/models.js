// The header's model controls: picker, status pill, Load / Unload; polls the leader while a model changes state.
import { get, post } from "./api.js";
import { h, store } from "./dom.js";
import { state, selectedModel, emit } from "./state.js";
import { showError, clearError } from "./ui.js";

const PILL = {
  ready: "Model ready",
  loading: "Model loading",
  recovering: "Model recovering",
  not_loaded: "Model not loaded",
  failed: "Model load failed",
};
const BUSY = new Set(["loading", "recovering"]);
let pollTimer = null;
let busyAction = false;

const picker = () => document.getElementById("model-picker");
const loadButton = () => document.getElementById("load-button");
const quantizationPicker = () => document.getElementById("quantization-picker");

export function modelStatus() {
  return selectedModel()?.status || "not_loaded";
}

// A model that misses files (a shard from one node) is listed but cannot be picked.
function incomplete(model) {
  return model.complete === false || model.incomplete === true;
}

export async function refreshModels() {
  clearTimeout(pollTimer);
  try {
    const data = await get(state.pool ? `/api/v1/models?pool=${encodeURIComponent(state.pool)}` : "/api/v1/models");
    state.models = data.models || [];
  } catch (err) {
    showError(`The model list could not be read: ${err.message}`);
  }
  const pickable = state.models.filter((m) => !incomplete(m));
  if (!pickable.some((m) => m.id === state.modelId)) {
    state.modelId = (pickable.find((m) => m.status === "ready") || pickable[0])?.id || null;
  }
  renderPicker();
  renderStatus();
  emit("models", state.models);
  // Poll fast while something moves, slowly otherwise: an idle unload or a failover shows without a reload.
  pollTimer = setTimeout(refreshModels, BUSY.has(modelStatus()) ? 1000 : 5000);
}

// Several models may be loaded in a pool at once: the picker says which are ready (or on their way).
const OPTION_STATES = { ready: "ready", loading: "loading", recovering: "recovering" };

function optionText(m) {
  if (incomplete(m)) return `${m.id} (incomplete)`;
  return OPTION_STATES[m.status] ? `${m.id} (${OPTION_STATES[m.status]})` : m.id;
}

function renderPicker() {
  const select = picker();
  const options = state.models.map((m) => h("option", {
    value: m.id, disabled: incomplete(m) || undefined, selected: m.id === state.modelId || undefined,
  }, optionText(m)));
  if (!options.length) options.push(h("option", { value: "", disabled: true, selected: true }, "No models yet"));
  const same = select.options.length === options.length &&
    options.every((o, i) => select.options[i].value === o.value && select.options[i].textContent === o.textContent);
  if (!same) select.replaceChildren(...options);
  select.value = state.modelId || "";
}

function renderStatus() {
  const status = modelStatus();
  const pill = document.getElementById("status-pill");
  const text = state.modelId ? PILL[status] || status : "No model";
  if (pill.textContent !== text) pill.textContent = text; // unchanged text: nothing for screen readers to repeat
  pill.className = `pill ${status}`;
  const button = loadButton();
  const model = selectedModel();
  button.disabled = !model || busyAction || status === "loading";
  if (status === "loading" || (busyAction && status !== "ready")) {
    button.replaceChildren(h("span", { class: "spinner", "aria-hidden": "true" }), "Loading…");
    button.setAttribute("aria-label", "Loading the model");
  } else if (status === "ready" || status === "recovering") {
    button.replaceChildren("Unload");
    button.removeAttribute("aria-label");
  } else {
    button.replaceChildren("Load");
    button.removeAttribute("aria-label");
  }
  button.classList.toggle("primary", status === "not_loaded" || status === "failed");
}

export async function loadModel() {
  const model = selectedModel();
  if (!model) throw new Error("pick a model first.");
  busyAction = true;
  renderStatus();
  try {
    const body = {};
    const quantization = quantizationPicker()?.value;
    if (quantization) body.quantization = quantization;
    const kvCache = document.getElementById("kv-cache-picker")?.value;
    if (kvCache && kvCache !== "auto") body.kv_cache = kvCache;
    const context = Number(document.getElementById("context-input")?.value || 0);
    if (context > 0) body.context_tokens = Math.floor(context);
    await post(`/api/v1/models/${encodeURIComponent(model.id)}/load`, body);
  } finally {
    busyAction = false;
    await refreshModels();
  }
}

/** Load the selected model if needed and wait until it is ready; throws with the leader's reason otherwise. */
export async function ensureLoaded(signal) {
  const id = state.modelId;
  if (modelStatus() === "ready") return;
  if (!BUSY.has(modelStatus())) await loadModel();
  for (;;) {
    if (signal?.aborted) throw new DOMException("stopped", "AbortError");
    const model = await get(`/api/v1/models/${encodeURIComponent(id)}`);
    const index = state.models.findIndex((m) => m.id === id);
    if (index >= 0) state.models[index] = model;
    renderStatus();
    emit("models", state.models);
    if (model.status === "ready") return;
    if (model.status === "failed" || model.status === "not_loaded") {
      throw new Error(model.error || `model ${id} did not load.`);
    }
    await new Promise((r) => setTimeout(r, 700));
  }
}

async function onLoadButton() {
  clearError();
  const model = selectedModel();
  if (!model) return;
  try {
    if (model.status === "ready" || model.status === "recovering") {
      busyAction = true;
      renderStatus();
      try {
        await post(`/api/v1/models/${encodeURIComponent(model.id)}/unload`, {});
      } finally {
        busyAction = false;
      }
      await refreshModels();
    } else {
      await loadModel();
    }
  } catch (err) {
    showError(`Load refused: ${err.message}`);
    await refreshModels();
  }
}

export function initModels() {
  picker().addEventListener("change", () => {
    state.modelId = picker().value;
    store.set("model", state.modelId);
    renderStatus();
    emit("model", state.modelId);
    refreshModels();
  });
  loadButton().addEventListener("click", onLoadButton);
  const quantization = quantizationPicker();
  if (quantization) {
    quantization.value = store.get("quantization", ""); // "": the model's own kind (gguf for a GGUF, else none)
    quantization.addEventListener("change", () => store.set("quantization", quantization.value));
  }
  const kvCache = document.getElementById("kv-cache-picker");
  if (kvCache) {
    kvCache.value = store.get("kvCache", "auto");
    kvCache.addEventListener("change", () => store.set("kvCache", kvCache.value));
  }
  return refreshModels();
}
