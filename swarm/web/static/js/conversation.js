// The open conversation: composer, sending and streaming, Stop, edit / regenerate / retry, and saving it on the
// leader after each reply. The address names the open chat (#chat=<id>).
import { get, post, patch, del, ApiError } from "./api.js";
import { h, icon } from "./dom.js";
import { askText, confirmAction, announce, showError } from "./ui.js";
import { state, selectedApiToken, emit, on } from "./state.js";
import { ensureLoaded, modelStatus } from "./models.js";
import { streamCompletion } from "./stream.js";
import { Transcript, openingLines } from "./transcript.js";
import { splitReasoning } from "./markdown.js";

const SUGGESTIONS = [
  ["Explain a concept", "Explain how a transformer model generates text, in simple terms."],
  ["Write some code", "Write a Python function that checks whether a string is a palindrome."],
  ["Summarize", "Summarize the main causes of the French Revolution in five bullet points."],
  ["Brainstorm", "Give me five names for a cozy coffee shop by the sea."],
];

const conv = { id: null, title: "New chat", model: null, messages: [] };
let streaming = null; // {controller, rid, stopped, reply}
let editIndex = null;
let savedDraft = "";
let saveChain = Promise.resolve();

const $ = (id) => document.getElementById(id);
let transcript;

export function currentChatId() { return conv.id; }

// --- the chat bar and the empty state ---------------------------------------------------------------------------

function renderBar() {
  $("chat-title").textContent = conv.title || "New chat";
  $("rename-chat").hidden = !conv.id;
  $("delete-chat").hidden = !conv.id;
  document.title = `${conv.id ? conv.title : "Inference"} · swarm`;
}

function setSaveState(kind, reason) {
  const el = $("save-state");
  el.className = `save-state ${kind === "saved" ? "ok" : kind === "error" ? "bad" : ""}`;
  el.textContent = kind === "saved" ? "Saved" : kind === "saving" ? "Saving…" : kind === "error" ? `Not saved: ${reason}` : "";
}

let emptyKey = "";

export function renderEmpty() {
  const empty = $("empty-chat");
  empty.hidden = conv.messages.length > 0;
  if (empty.hidden) { emptyKey = ""; return; }
  const ready = modelStatus() === "ready";
  const key = `${ready}|${state.modelId}|${state.models.length}`;
  if (key === emptyKey) return;
  emptyKey = key;
  const buttons = SUGGESTIONS.map(([title, prompt]) => h("button", {
    class: "suggestion", type: "button", disabled: !ready || undefined,
    onclick: () => { const box = $("composer-input"); box.value = prompt; autosize(); box.focus(); },
  }, h("strong", {}, title), h("span", {}, prompt)));
  const noModels = !state.models.length;
  empty.replaceChildren(...[
    h("h2", {}, "What can I help with?"),
    h("p", {}, noModels ? "There are no models in this pool yet: import or train one first."
      : `Chatting with ${state.modelId || "no model"}. Pick a suggestion to start from, or write your own.`),
    h("div", { class: "suggestions" }, buttons),
    ready ? null : h("p", { class: "suggest-note" },
      noModels ? "Suggestions need a model." : "Suggestions are off until the model is loaded — press Load, or just send a message and it loads first."),
  ].filter(Boolean));
}

// --- composer -----------------------------------------------------------------------------------------------------

function autosize() {
  const box = $("composer-input");
  box.style.height = "auto";
  box.style.height = `${Math.min(box.scrollHeight, 240)}px`;
}

function setStreaming(on) {
  $("send-button").hidden = on;
  $("stop-button").hidden = !on;
}

function startEdit(index) {
  if (streaming) return;
  if (editIndex === null) savedDraft = $("composer-input").value;
  editIndex = index;
  $("composer-input").value = conv.messages[index].content;
  $("editing-note").hidden = false;
  autosize();
  $("composer-input").focus();
}

function cancelEdit() {
  if (editIndex === null) return;
  editIndex = null;
  $("composer-input").value = savedDraft;
  $("editing-note").hidden = true;
  autosize();
}

async function submit() {
  const box = $("composer-input");
  const text = box.value.trim();
  if (!text || streaming) return;
  if (!state.modelId) { showError("There is no model to chat with yet."); return; }
  if (editIndex !== null) {
    conv.messages = conv.messages.slice(0, editIndex); // the edited message and everything after it go
    editIndex = null;
    $("editing-note").hidden = true;
    transcript.renderAll(conv.messages);
  }
  box.value = "";
  autosize();
  const message = { role: "user", content: text, at: Date.now() / 1000 };
  conv.messages.push(message);
  transcript.append(message);
  renderEmpty();
  await generate();
}

// --- generation ---------------------------------------------------------------------------------------------------

function history(messages) {
  // What the model sees: plain roles and text, no failed replies and no reasoning.
  return messages
    .filter((m) => !(m.role === "assistant" && (m.error || !splitReasoning(m.content).answer)))
    .map((m) => ({ role: m.role, content: m.role === "assistant" ? splitReasoning(m.content).answer : m.content }));
}

async function generate() {
  const model = state.modelId;
  const reply = { role: "assistant", content: "", reasoning: "", model, pending: true, at: Date.now() / 1000 };
  const messages = history(conv.messages);
  conv.messages.push(reply);
  conv.model = model;
  transcript.append(reply);
  transcript.scrollToBottom(true);
  const run = { controller: new AbortController(), rid: null, stopped: false, reply };
  streaming = run;
  setStreaming(true);
  const body = {
    model, messages,
    max_tokens: state.settings.maxTokens,
    chat_template_kwargs: { enable_thinking: state.settings.reasoning },
  };
  // Only what the user set: the leader fills in the model's own sampling defaults (Qwen3 wants 0.6, say).
  if (state.settings.temperature !== null && state.settings.temperature !== undefined) body.temperature = state.settings.temperature;
  try {
    for (let attempt = 0; ; attempt++) {
      if (modelStatus() !== "ready") {
        reply.status = modelStatus() === "recovering" ? "A fellow dropped out — the model is recovering…"
          : attempt ? "The model was not loaded — loading it again…" : "Loading the model…";
        transcript.update(reply, false);
        await ensureLoaded(run.controller.signal);
        reply.status = null;
        transcript.update(reply, false);
      }
      try {
        const result = await streamCompletion(body, {
          apiToken: selectedApiToken(), signal: run.controller.signal,
          onStart: (rid) => { run.rid = rid; if (run.stopped) cancelOnLeader(run); },
          onDelta: ({ content, reasoning }) => {
            reply.content += content;
            reply.reasoning += reasoning;
            transcript.schedule(reply);
          },
        });
        reply.stats = result.stats;
        if (result.timing) reply.timing = result.timing; // saved with the message: a reopened chat shows the same line
        reply.finish_reason = result.finishReason;
        if (run.stopped) reply.stopped = true;
        break;
      } catch (err) {
        // A model a fellow dropped without saying so: load it again and send once more, by itself.
        if (err instanceof ApiError && err.code === "model_not_loaded" && attempt === 0 && !run.stopped) {
          const m = state.models.find((x) => x.id === model);
          if (m) m.status = "not_loaded";
          continue;
        }
        throw err;
      }
    }
  } catch (err) {
    if (run.stopped || err.name === "AbortError") {
      reply.stopped = true;
    } else {
      reply.error = err.message || String(err);
    }
  } finally {
    if (!reply.reasoning) delete reply.reasoning;
    delete reply.pending;
    delete reply.status;
    streaming = null;
    setStreaming(false);
    transcript.update(reply, true);
    transcript.markLatest();
    if (reply.error) announce(`The reply failed: ${reply.error}`);
    else announce(openingLines(reply) || "The reply is empty.");
    await save();
  }
}

async function cancelOnLeader(run) {
  // Aborting the fetch alone may never reach the fellows (hypercorn does not always report a disconnect).
  try { await post(`/api/v1/requests/${encodeURIComponent(run.rid)}/cancel`, {}); } catch { /* the stream ends anyway */ }
}

async function stop() {
  const run = streaming;
  if (!run || run.stopped) return;
  run.stopped = true;
  if (run.rid) await cancelOnLeader(run);
  run.controller.abort();
}

function regenerate(message) {
  if (streaming) return;
  const index = conv.messages.indexOf(message);
  if (index < 0) return;
  conv.messages.splice(index, 1);
  transcript.element(message)?.remove();
  transcript.messages = conv.messages;
  generate();
}

// --- saving -------------------------------------------------------------------------------------------------------

function stored(messages) {
  return messages.map(({ pending, status, reasoningOpen, ...rest }) => rest);
}

function save() {
  const snapshot = { model: conv.model, messages: stored(conv.messages) };
  const target = conv;
  setSaveState("saving");
  saveChain = saveChain.then(async () => {
    try {
      let chat;
      if (!target.id) {
        chat = await post("/api/v1/chats", snapshot);
        target.id = chat.id;
        if (conv === target) history_replace(chat.id);
      } else {
        chat = await patch(`/api/v1/chats/${encodeURIComponent(target.id)}`, snapshot);
      }
      target.title = chat.title;
      if (conv === target) { renderBar(); setSaveState("saved"); }
      emit("chats-changed");
    } catch (err) {
      if (conv === target) setSaveState("error", err.message);
    }
  });
  return saveChain;
}

function history_replace(id) {
  window.history.replaceState(null, "", `#chat=${encodeURIComponent(id)}`);
}

// --- opening, renaming, deleting ------------------------------------------------------------------------------------

export function newChat({ push = true } = {}) {
  if (streaming) stop();
  cancelEdit();
  Object.assign(conv, { id: null, title: "New chat", model: null, messages: [] });
  transcript.renderAll(conv.messages);
  renderBar();
  setSaveState("");
  renderEmpty();
  if (push && location.hash) window.history.pushState(null, "", location.pathname);
  emit("chat-opened", null);
  $("composer-input").focus();
}

export async function openChat(id) {
  if (streaming) stop();
  cancelEdit();
  try {
    const chat = await get(`/api/v1/chats/${encodeURIComponent(id)}`);
    Object.assign(conv, { id: chat.id, title: chat.title, model: chat.model, messages: chat.messages || [] });
    transcript.renderAll(conv.messages);
    renderBar();
    setSaveState("saved");
    renderEmpty();
    emit("chat-opened", chat.id);
  } catch (err) {
    newChat({ push: false });
    window.history.replaceState(null, "", location.pathname);
    showError(err.status === 404 ? "That chat does not exist, or it is not yours: chats are private to their owner."
      : `The chat could not be opened: ${err.message}`);
  }
}

export async function renameChat(id, currentTitle) {
  const title = await askText("Rename chat", "Title", currentTitle, "Rename");
  if (title === undefined) return;
  try {
    const chat = await patch(`/api/v1/chats/${encodeURIComponent(id)}`, { title });
    if (conv.id === id) { conv.title = chat.title; renderBar(); }
    emit("chats-changed");
  } catch (err) { showError(`The chat was not renamed: ${err.message}`); }
}

export async function deleteChat(id, title) {
  const ok = await confirmAction("Delete chat?", `“${title}” will be deleted for good. This cannot be undone.`);
  if (!ok) return;
  try {
    await del(`/api/v1/chats/${encodeURIComponent(id)}`);
    if (conv.id === id) newChat();
    emit("chats-changed");
  } catch (err) { showError(`The chat was not deleted: ${err.message}`); }
}

function chatFromHash() {
  const m = /^#chat=(.+)$/.exec(location.hash);
  return m ? decodeURIComponent(m[1]) : null;
}

export function initConversation() {
  transcript = new Transcript({
    onEdit: startEdit, onRegenerate: regenerate, onRetry: regenerate,
  });
  const box = $("composer-input");
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); submit(); });
  box.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); submit(); }
    else if (e.key === "Escape" && editIndex !== null) { e.preventDefault(); cancelEdit(); }
  });
  box.addEventListener("input", autosize);
  $("stop-button").addEventListener("click", stop);
  $("cancel-edit").addEventListener("click", cancelEdit);
  $("new-chat").replaceChildren(icon("plus"), h("span", { class: "label" }, "New chat"));
  $("new-chat").addEventListener("click", () => newChat());
  $("rename-chat").append(icon("pencil"));
  $("delete-chat").append(icon("bin"));
  $("rename-chat").addEventListener("click", () => conv.id && renameChat(conv.id, conv.title));
  $("delete-chat").addEventListener("click", () => conv.id && deleteChat(conv.id, conv.title));
  window.addEventListener("hashchange", () => {
    const id = chatFromHash();
    if (id && id !== conv.id) openChat(id);
    else if (!id && conv.id) newChat({ push: false });
  });
  on("models", renderEmpty);
  const id = chatFromHash();
  if (id) openChat(id);
  else newChat({ push: false });
}
