// The saved chats column: most recently used first, grouped by day; search; rename and delete from each row's menu.
import { get } from "./api.js";
import { h, icon, formatWhen } from "./dom.js";
import { on } from "./state.js";
import { newChat, renameChat, deleteChat, currentChatId } from "./conversation.js";

let panel;
let query = "";
let searchTimer = null;
let openMenu = null;
let visible = false;

export function groupName(seconds, now = new Date()) {
  const startOfToday = new Date(now.getFullYear(), now.getMonth(), now.getDate()).getTime();
  const t = seconds * 1000;
  const day = 86400e3;
  if (t >= startOfToday) return "Today";
  if (t >= startOfToday - day) return "Yesterday";
  if (t >= startOfToday - 7 * day) return "Previous 7 days";
  if (t >= startOfToday - 30 * day) return "Previous 30 days";
  return new Date(t).toLocaleDateString([], { month: "long", year: "numeric" });
}

function closeMenu() {
  if (openMenu) { openMenu.remove(); openMenu = null; }
}

function rowMenu(chat, anchor) {
  closeMenu();
  const menu = h("div", { class: "row-menu", role: "menu" },
    h("button", { type: "button", role: "menuitem", onclick: () => { closeMenu(); renameChat(chat.id, chat.title); } }, "Rename"),
    h("button", { type: "button", role: "menuitem", class: "danger", onclick: () => { closeMenu(); deleteChat(chat.id, chat.title); } }, "Delete"));
  menu.addEventListener("keydown", (e) => {
    if (e.key === "Escape") { closeMenu(); anchor.focus(); }
  });
  anchor.closest(".chat-row").append(menu);
  anchor.setAttribute("aria-expanded", "true");
  openMenu = menu;
  menu.querySelector("button").focus();
}

function row(chat) {
  const more = h("button", {
    class: "icon-btn", type: "button", "aria-label": `More actions for ${chat.title}`, "aria-haspopup": "menu",
    "aria-expanded": "false",
    onclick: (e) => { e.stopPropagation(); openMenu && openMenu.parentElement === more.parentElement ? closeMenu() : rowMenu(chat, more); },
  }, icon("more"));
  const count = `${chat.message_count} message${chat.message_count === 1 ? "" : "s"}`;
  const open = h("button", {
    class: "chat-open", type: "button", "aria-current": chat.id === currentChatId() ? "true" : undefined,
    onclick: () => { location.hash = `chat=${encodeURIComponent(chat.id)}`; },
  }, h("span", { class: "t" }, h("span", { class: "title" }, chat.title),
    h("time", { datetime: new Date(chat.updated_at * 1000).toISOString(), title: "Last used" }, formatWhen(chat.updated_at))),
    h("span", { class: "m" }, [chat.model, count].filter(Boolean).join(" · ")));
  return h("li", { class: `chat-row${chat.id === currentChatId() ? " current" : ""}`, dataset: { chatId: chat.id } }, open, more);
}

let latestRequest = 0;

export async function refreshChats() {
  if (!visible) return;
  const list = panel.querySelector(".chat-groups");
  const mine = ++latestRequest;
  let chats;
  try {
    chats = (await get(`/api/v1/chats${query ? `?q=${encodeURIComponent(query)}` : ""}`)).chats;
    if (mine !== latestRequest) return; // a newer search already answered
    closeMenu();
  } catch (err) {
    list.replaceChildren(h("p", { class: "notice bad" }, `The chats could not be read: ${err.message}`));
    return;
  }
  if (!chats.length) {
    list.replaceChildren(h("p", { class: "placeholder" }, query ? `No chat matches “${query}”.` : "No saved chats yet. Every conversation is saved here after each reply."));
    return;
  }
  const groups = new Map();
  for (const chat of chats) {
    const name = groupName(chat.updated_at);
    if (!groups.has(name)) groups.set(name, []);
    groups.get(name).push(chat);
  }
  list.replaceChildren(...[...groups].map(([name, items]) => h("section", { class: "chat-group" },
    h("h3", {}, name), h("ul", { class: "chat-list" }, items.map(row)))));
}

export function initChats() {
  panel = document.getElementById("panel-chats");
  const search = h("input", { type: "search", class: "chat-search", placeholder: "Search chats", "aria-label": "Search chats" });
  search.addEventListener("input", () => {
    clearTimeout(searchTimer);
    searchTimer = setTimeout(() => { query = search.value.trim(); refreshChats(); }, 200);
  });
  panel.replaceChildren(
    h("div", { class: "panel-head" }, h("h2", {}, "Chats"),
      h("button", { class: "btn small", type: "button", onclick: () => newChat() }, icon("plus"), "New chat")),
    search,
    h("div", { class: "chat-groups", "aria-live": "off" }),
  );
  document.addEventListener("click", (e) => { if (openMenu && !openMenu.contains(e.target)) closeMenu(); });
  on("chats-changed", refreshChats);
  on("chat-opened", refreshChats);
  on("column", (name) => { visible = name === "chats"; refreshChats(); });
}
