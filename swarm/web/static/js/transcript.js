// The conversation on screen: one element per message, built once; only the streaming reply is re-rendered.
// Follows the stream while the reader is at the bottom, with a jump-to-latest button otherwise.
import { h, icon, copyText } from "./dom.js";
import { renderMarkdownInto, splitReasoning } from "./markdown.js";
import { speedLine } from "./stream.js";

const views = new WeakMap(); // message object -> {el, body, details, reasoningMd, answer, status, speed, actions}

export class Transcript {
  constructor({ onEdit, onRegenerate, onRetry }) {
    this.scroller = document.getElementById("transcript");
    this.list = document.getElementById("messages");
    this.jump = document.getElementById("jump-latest");
    this.handlers = { onEdit, onRegenerate, onRetry };
    this.messages = [];
    this.follow = true;
    this.frame = 0;
    this.lastRenderMs = 0;
    this.nextRenderAt = 0;
    this.scroller.addEventListener("scroll", () => this.onScroll(), { passive: true });
    this.jump.addEventListener("click", () => this.scrollToBottom(true));
    // Copy buttons inside rendered code blocks (their HTML comes from the markdown renderer).
    this.list.addEventListener("click", (e) => {
      const button = e.target.closest(".copy-code");
      if (button) copyText(button.closest(".code-block").querySelector("code").textContent, button);
    });
  }

  atBottom() {
    const s = this.scroller;
    return s.scrollHeight - s.scrollTop - s.clientHeight < 48;
  }

  onScroll() {
    this.follow = this.atBottom();
    this.jump.hidden = this.follow || !this.messages.length;
  }

  scrollToBottom(force = false) {
    if (force) this.follow = true;
    if (!this.follow) { this.jump.hidden = !this.messages.length; return; }
    this.scroller.scrollTop = this.scroller.scrollHeight;
    this.jump.hidden = true;
  }

  renderAll(messages) {
    this.messages = messages;
    const nodes = messages.map((m, i) => this.build(m, i));
    this.list.replaceChildren(...nodes);
    this.markLatest();
    this.follow = true;
    requestAnimationFrame(() => this.scrollToBottom(true));
  }

  append(message) {
    this.list.append(this.build(message, this.messages.indexOf(message)));
    this.markLatest();
  }

  markLatest() {
    const last = this.messages[this.messages.length - 1];
    for (const m of this.messages) {
      const view = views.get(m);
      if (!view) continue;
      view.el.classList.toggle("latest", m === last);
      if (m.role === "assistant") this.renderActions(m);
    }
  }

  build(message, index) {
    return message.role === "user" ? this.buildUser(message, index) : this.buildAssistant(message);
  }

  buildUser(message) {
    const actions = h("div", { class: "msg-actions" },
      h("button", { class: "btn ghost small", type: "button", "aria-label": "Copy message",
        onclick: (e) => copyText(message.content, e.currentTarget) }, icon("copy"), h("span", { class: "label" }, "Copy")),
      h("button", { class: "btn ghost small", type: "button", "aria-label": "Edit message",
        onclick: () => this.handlers.onEdit(this.messages.indexOf(message)) }, icon("edit"), h("span", { class: "label" }, "Edit")));
    const el = h("article", { class: "msg user", "aria-label": "You said" },
      h("div", { class: "bubble", text: message.content }), actions);
    views.set(message, { el });
    return el;
  }

  buildAssistant(message) {
    const reasoningMd = h("div", { class: "md" });
    const details = h("details", { class: "reasoning", hidden: true },
      h("summary", {}, h("span", { class: "reasoning-label" }, "Reasoning")), reasoningMd);
    details.addEventListener("toggle", () => { message.reasoningOpen = details.open; });
    const answer = h("div", { class: "md answer" });
    const status = h("div", { class: "msg-status", hidden: true });
    const error = h("div", { class: "msg-error", role: "alert", hidden: true });
    const speed = h("div", { class: "speed" });
    const actions = h("div", { class: "msg-actions" });
    const el = h("article", { class: "msg assistant", "aria-label": "Reply" },
      h("div", { class: "bubble" }, details, answer, status, error), speed, actions);
    views.set(message, { el, details, reasoningMd, answer, status, error, speed, actions });
    this.update(message, !message.pending);
    return el;
  }

  renderActions(message) {
    const view = views.get(message);
    if (!view || message.role !== "assistant") return;
    const latest = message === this.messages[this.messages.length - 1];
    const buttons = [];
    if (message.model) buttons.push(h("span", { class: "model-name", title: "The model that wrote this reply" }, message.model));
    if (!message.pending) {
      const { answer } = splitReasoning(message.content);
      if (answer) {
        buttons.push(h("button", { class: "btn ghost small", type: "button", "aria-label": "Copy reply",
          onclick: (e) => copyText(answer, e.currentTarget) }, icon("copy"), h("span", { class: "label" }, "Copy")));
      }
      if (message.error) {
        buttons.push(h("button", { class: "btn ghost small", type: "button", onclick: () => this.handlers.onRetry(message) },
          icon("refresh"), h("span", { class: "label" }, "Retry")));
      } else if (latest) {
        buttons.push(h("button", { class: "btn ghost small", type: "button", onclick: () => this.handlers.onRegenerate(message) },
          icon("refresh"), h("span", { class: "label" }, "Regenerate")));
      }
    }
    view.actions.replaceChildren(...buttons);
  }

  /** Re-render one reply. While streaming, calls are folded into one per animation frame (and spaced out further
   * when a long reply makes the markdown parse itself slow). */
  schedule(message) {
    if (this.frame) return;
    this.frame = requestAnimationFrame(() => {
      this.frame = 0;
      if (performance.now() < this.nextRenderAt) { this.schedule(message); return; }
      this.update(message, false);
    });
  }

  update(message, final) {
    const view = views.get(message);
    if (!view) return;
    const t0 = performance.now();
    const { reasoning: inline, answer, thinking } = splitReasoning(message.content);
    const reasoning = [message.reasoning || "", inline].filter((s) => s.trim()).join("\n\n");
    const reasoningLive = !final && (thinking || (message.reasoning && !answer));
    // An empty Reasoning block (a model that skipped thinking) is hidden.
    view.details.hidden = !reasoning.trim();
    if (reasoning.trim()) {
      renderMarkdownInto(view.reasoningMd, reasoning, final);
      view.details.querySelector(".reasoning-label").textContent = reasoningLive ? "Reasoning…" : "Reasoning";
      if (message.reasoningOpen === undefined) view.details.open = !!reasoningLive;
    }
    renderMarkdownInto(view.answer, answer, final);
    view.answer.classList.toggle("typing", !final && !!message.pending && !message.status);
    view.status.hidden = !message.status;
    if (message.status) view.status.replaceChildren(h("span", { class: "spinner", "aria-hidden": "true" }), message.status);
    view.error.hidden = !message.error;
    if (message.error) view.error.textContent = message.error;
    const line = speedLine(message.stats, message.timing);
    view.speed.textContent = message.stopped ? [line, "stopped"].filter(Boolean).join(" · ") : line;
    if (final) this.renderActions(message);
    const spent = performance.now() - t0;
    this.nextRenderAt = performance.now() + (spent > 8 ? spent * 3 : 0);
    this.scrollToBottom();
  }

  element(message) { return views.get(message)?.el; }
}

/** The first lines of a reply, for screen readers when it completes. */
export function openingLines(message) {
  const { answer } = splitReasoning(message.content);
  const text = answer.replace(/[#*_`>|]/g, " ").replace(/\s+/g, " ").trim();
  return text.length > 280 ? `${text.slice(0, 280)}…` : text;
}
