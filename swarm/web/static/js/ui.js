// Page-wide bits: the error banner, the screen-reader announcer, and the dialogs (ask a name, confirm, show once).
import { h, copyText } from "./dom.js";

export function showError(message) {
  const box = document.getElementById("page-error");
  box.replaceChildren(
    h("span", { text: message }),
    h("button", { class: "btn small ghost", type: "button", style: "margin-left:8px", "aria-label": "Dismiss",
      onclick: () => { box.hidden = true; } }, "Dismiss"),
  );
  box.hidden = false;
}

export function clearError() { document.getElementById("page-error").hidden = true; }

export function announce(text) {
  const region = document.getElementById("announcer");
  region.textContent = "";
  setTimeout(() => { region.textContent = text; }, 50);
}

function openDialog(build) {
  const dialog = document.getElementById("dialog");
  return new Promise((resolve) => {
    const close = (value) => { dialog.close(); resolve(value); };
    dialog.replaceChildren(...build(close));
    dialog.onclose = () => resolve(undefined);
    dialog.showModal();
    const first = dialog.querySelector("input, [data-autofocus]");
    if (first) { first.focus(); if (first.select) first.select(); }
  });
}

export function askText(title, label, initial = "", confirmLabel = "Save") {
  return openDialog((close) => {
    const input = h("input", { type: "text", value: initial, "aria-label": label, maxlength: "200" });
    const form = h("form", { method: "dialog", onsubmit: (e) => { e.preventDefault(); close(input.value); } },
      h("h2", { text: title }),
      h("label", { class: "field" }, label, input),
      h("div", { class: "dialog-actions" },
        h("button", { class: "btn", type: "button", onclick: () => close(undefined) }, "Cancel"),
        h("button", { class: "btn primary", type: "submit" }, confirmLabel)));
    return [form];
  });
}

export function confirmAction(title, message, confirmLabel = "Delete") {
  return openDialog((close) => [
    h("h2", { text: title }),
    h("p", { text: message }),
    h("div", { class: "dialog-actions" },
      h("button", { class: "btn", type: "button", "data-autofocus": true, onclick: () => close(false) }, "Cancel"),
      h("button", { class: "btn danger solid", type: "button", onclick: () => close(true) }, confirmLabel)),
  ]).then((v) => v === true);
}

export function showOnce(title, message, secret) {
  return openDialog((close) => {
    const copy = h("button", { class: "btn", type: "button", onclick: (e) => copyText(secret, e.currentTarget) }, "Copy");
    return [
      h("h2", { text: title }),
      h("p", { text: message }),
      h("div", { class: "card token-once", text: secret }),
      h("div", { class: "dialog-actions" }, copy,
        h("button", { class: "btn primary", type: "button", "data-autofocus": true, onclick: () => close(true) }, "Done")),
    ];
  });
}
