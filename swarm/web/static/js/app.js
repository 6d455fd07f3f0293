// The inference page: who is signed in, which pool, which right-hand column is open; then the parts start.
import { get, post, setCsrf } from "./api.js";
import { h, icon, store } from "./dom.js";
import { state, emit } from "./state.js";
import { initModels } from "./models.js";
import { initConversation } from "./conversation.js";
import { initChats } from "./chats.js";
import { initSettings } from "./settings.js";
import { initPerformance } from "./performance.js";

const COLUMNS = { chats: "Chats", performance: "Performance", settings: "Settings" };

function setColumn(name, { scroll = false } = {}) {
  const workspace = document.getElementById("workspace");
  const column = document.getElementById("side-column");
  for (const key of Object.keys(COLUMNS)) {
    document.getElementById(`panel-${key}`).hidden = key !== name;
    document.querySelector(`[data-column="${key}"]`).setAttribute("aria-pressed", String(key === name));
  }
  column.hidden = !name;
  workspace.classList.toggle("no-column", !name);
  store.set("column", name);
  emit("column", name);
  // Under 900 px the column sits below the chat: opening it scrolls there.
  if (scroll && name && matchMedia("(max-width: 899px)").matches) column.scrollIntoView({ behavior: "smooth", block: "start" });
}

function initColumns() {
  for (const [key, label] of Object.entries(COLUMNS)) {
    const button = document.querySelector(`[data-column="${key}"]`);
    button.replaceChildren(icon(key), h("span", { class: "label" }, label));
    button.addEventListener("click", () => {
      const open = button.getAttribute("aria-pressed") === "true";
      setColumn(open ? "" : key, { scroll: !open });
    });
  }
  setColumn(store.get("column", "chats"));
}

function initUserMenu() {
  const button = document.getElementById("user-button");
  const menu = document.getElementById("user-menu");
  button.append(icon("user"));
  const items = [h("div", { class: "who" }, `Signed in as ${state.me.user.name}`)];
  if (state.me.user.is_admin) items.push(h("a", { href: "/admin", role: "menuitem" }, "Admin"));
  items.push(h("button", { type: "button", role: "menuitem", onclick: async () => {
    try { await post("/api/v1/auth/logout", {}); } finally { location.href = "/login"; }
  } }, "Sign out"));
  menu.replaceChildren(...items);
  const toggle = (open) => { menu.hidden = !open; button.setAttribute("aria-expanded", String(open)); };
  button.addEventListener("click", (e) => { e.stopPropagation(); toggle(menu.hidden); });
  document.addEventListener("click", (e) => { if (!menu.contains(e.target)) toggle(false); });
  menu.addEventListener("keydown", (e) => { if (e.key === "Escape") { toggle(false); button.focus(); } });
}

// The pool the page is scoped to: /pools/{owner}/{pool}/inference names one, /inference is all the user's pools.
function poolFromPath() {
  const m = /^\/pools\/([^/]+)\/([^/]+)\/inference/.exec(location.pathname);
  return m ? { owner: decodeURIComponent(m[1]), name: decodeURIComponent(m[2]) } : null;
}

function poolContext(pool) {
  return pool ? `${pool.owner} / ${pool.name}` : "All your pools";
}

// With more than one pool, a picker beside the context opens another pool's page (or all of them).
async function initPoolPicker() {
  const { pools } = await get("/api/v1/pools");
  const select = document.getElementById("pool-picker");
  if (pools.length < 2) return;
  select.replaceChildren(
    h("option", { value: "/inference", selected: !state.pool || undefined }, "All your pools"),
    ...pools.map((p) => h("option", { value: p.path, selected: p.name === state.pool || undefined }, p.name)));
  select.hidden = false;
  select.addEventListener("change", () => { location.href = select.value + location.hash; });
}

function trackTopbarHeight() {
  // Under 900 px the chat is sized to the window below the header, whose height changes as it wraps.
  const topbar = document.querySelector(".topbar");
  const set = () => document.documentElement.style.setProperty("--topbar-h", `${topbar.offsetHeight}px`);
  new ResizeObserver(set).observe(topbar);
  set();
}

async function main() {
  trackTopbarHeight();
  state.me = await get("/api/v1/me");
  setCsrf(state.me.csrf);
  const pool = poolFromPath();
  state.pool = pool ? pool.name : null;
  document.getElementById("pool-context").textContent = poolContext(pool);
  initPoolPicker().catch(() => {}); // the page works without it
  initUserMenu();
  initPerformance();
  initSettings();
  initChats();
  initConversation();
  initColumns();
  await initModels();
}

main().catch((err) => {
  if (err?.status === 401) return; // on the way to the sign-in page
  const box = document.getElementById("page-error");
  box.textContent = `The page could not start: ${err.message || err}`;
  box.hidden = false;
});
