// What the page knows, shared by its parts, and a tiny event bus between them.
import { store } from "./dom.js";

export const state = {
  me: null, // {user: {id, name, is_admin}, csrf, home}
  pool: null, // the pool the page is scoped to (its name), null: all the user's pools
  models: [], // GET /api/v1/models (?pool=)
  modelId: store.get("model", null),
  settings: {
    temperature: store.get("temperature", null), // null: the model's own default (the leader fills it in)
    reasoning: store.get("reasoning", true),
    maxTokens: store.get("maxTokens", 1024),
  },
  apiTokens: store.get("apiTokens", []), // [{name, token}] kept only in this browser
  apiTokenName: store.get("apiTokenName", ""), // "" = no token: chat as the signed-in user
};

export function selectedModel() {
  return state.models.find((m) => m.id === state.modelId) || null;
}

export function selectedApiToken() {
  return state.apiTokens.find((t) => t.name === state.apiTokenName)?.token || null;
}

export function saveSetting(key, value) {
  state.settings[key] = value;
  store.set(key, value);
}

const bus = new EventTarget();
export function emit(name, detail) { bus.dispatchEvent(new CustomEvent(name, { detail })); }
export function on(name, fn) { bus.addEventListener(name, (e) => fn(e.detail)); }
