// The admin page: users, pools, fellows (hardware, state, standby), join tokens, usage and quotas (admin_usage.js),
// the Direct links, Hot cover, Auto-load and Evict idle models switches, and spot checks (admin_verify.js).
import { api, get, post, del, setCsrf } from "./api.js";
import { h, formatWhen } from "./dom.js";
import { confirmAction, showOnce, showError } from "./ui.js";
import { initUsage, loadUsage } from "./admin_usage.js";
import { initVerification, loadVerification } from "./admin_verify.js";

const $ = (id) => document.getElementById(id);
let me;

function rows(tableId, items, cells, empty) {
  const body = $(tableId).querySelector("tbody");
  const columns = $(tableId).querySelectorAll("th").length;
  body.replaceChildren(...(items.length ? items.map((item) => h("tr", {}, cells(item).map((c) => h("td", {}, c))))
    : [h("tr", {}, h("td", { colspan: String(columns), class: "muted" }, empty))]));
}

async function loadUsers() {
  const { users } = await get("/api/v1/users");
  rows("users-table", users, (u) => [
    u.name, u.is_admin ? "Admin" : "User", formatWhen(u.created_at),
    u.id === me.user.id ? h("span", { class: "muted" }, "you") : h("button", {
      class: "btn small danger", type: "button", "aria-label": `Delete user ${u.name}`,
      onclick: async () => {
        if (!await confirmAction(`Delete ${u.name}?`, "Their chats and tokens are deleted too. This cannot be undone.")) return;
        try { await del(`/api/v1/users/${u.id}`); } catch (err) { showError(err.message); }
        loadUsers();
      },
    }, "Delete"),
  ], "No users.");
}

function membersCell(pool, users) {
  const path = `/api/v1/pools/${encodeURIComponent(pool.name)}/members`;
  const change = async (method, url, body) => {
    try { await api(method, url, body); } catch (err) { showError(err.message); }
    loadPools();
  };
  const others = users.filter((u) => !pool.members.some((m) => m.id === u.id));
  const add = h("select", { "aria-label": `Add a member to pool ${pool.name}` },
    [h("option", { value: "" }, "Add…"), ...others.map((u) => h("option", { value: u.name }, u.name))]);
  add.addEventListener("change", () => { if (add.value) change("POST", path, { user: add.value }); });
  return h("div", { class: "members" }, [
    ...pool.members.map((m) => h("span", { class: "member" }, [m.name, h("button", {
      class: "btn small", type: "button", "aria-label": `Remove ${m.name} from pool ${pool.name}`,
      onclick: () => change("DELETE", `${path}/${encodeURIComponent(m.name)}`),
    }, "×")])),
    ...(others.length ? [add] : []),
  ]);
}

async function loadPools() {
  const [{ pools }, { users }] = await Promise.all([get("/api/v1/pools"), get("/api/v1/users")]);
  rows("pools-table", pools, (p) => [
    h("a", { href: p.path }, p.name), membersCell(p, users),
    p.fellows.map((f) => f.name).join(", ") || h("span", { class: "muted" }, "—"),
    p.models.join(", ") || h("span", { class: "muted" }, "—"),
    formatWhen(p.created_at),
    p.name === "default" ? "" : h("button", {
      class: "btn small danger", type: "button", "aria-label": `Delete pool ${p.name}`,
      onclick: async () => {
        if (!await confirmAction(`Delete pool ${p.name}?`, "Its join tokens and memberships go with it. A pool that still has fellows or models is not deleted.")) return;
        try { await del(`/api/v1/pools/${encodeURIComponent(p.name)}`); } catch (err) { showError(err.message); }
        loadPools();
      },
    }, "Delete"),
  ], "No pools.");
  const picker = $("join-pool");
  const chosen = picker.value || "default";
  picker.replaceChildren(...pools.map((p) => h("option", { value: p.name, selected: p.name === chosen || undefined }, p.name)));
}

function versionCell(f, leader) {
  if (!f.version) return h("span", { class: "muted" }, "—");
  const text = `${f.version} (protocol ${f.protocol})`;
  if (!f.outdated) return text;
  const why = f.protocol !== leader.protocol ? `needs protocol ${leader.protocol}: it gets no stage until updated`
    : `the leader runs ${leader.version}`;
  return h("span", { class: "version-outdated", title: f.update_error || why }, [text, h("br"), h("small", {}, f.update_error ? `update failed: ${f.update_error}` : why)]);
}

async function updateOutdated() {
  try {
    const { updating, manual, version } = await post("/api/v1/fellows/update", {});
    const lines = [];
    if (updating.length) lines.push(`${updating.join(", ")} ${updating.length === 1 ? "installs" : "install"} swarm ${version} from this leader and restart${updating.length === 1 ? "s" : ""}.`);
    for (const m of manual) lines.push(m.message);
    $("fellows-outdated").replaceChildren(lines.join(" ") || "No fellow online needs an update.");
  } catch (err) { showError(err.message); }
  setTimeout(() => loadFellows().catch(() => {}), 3000);
}

async function loadFellows() {
  const { fellows, leader } = await get("/api/v1/fellows");
  const outdated = fellows.filter((f) => f.state === "online" && f.outdated);
  const notice = $("fellows-outdated");
  notice.hidden = !outdated.length;
  if (outdated.length) {
    notice.replaceChildren(
      `${outdated.map((f) => f.name).join(", ")} ${outdated.length === 1 ? "runs" : "run"} another version than this leader (swarm ${leader.version}, protocol ${leader.protocol}). `,
      h("button", { class: "btn small", type: "button", onclick: updateOutdated }, "Update outdated fellows"),
    );
  }
  rows("fellows-table", fellows, (f) => [
    f.name,
    h("span", { class: f.state === "online" ? "state-online" : "state-offline" }, f.state === "online" ? "Online" : "Offline"),
    f.hardware_text ? [f.hardware_text, ...(f.checks ? [h("br"), h("small", { class: "muted" }, f.checks.text)] : [])]
      : h("span", { class: "muted" }, f.state === "online" ? "—" : "unknown while offline"),
    versionCell(f, leader),
    (f.stages || []).length ? (f.stages || []).map((s) => (typeof s === "string" ? s : `${s.model ?? ""} stage ${s.index ?? s.stage ?? ""}`)).join(", ") : "—",
    h("label", { class: "switch" }, [
      h("input", {
        type: "checkbox", role: "switch", "aria-label": `${f.name} is a standby`, checked: f.standby,
        onchange: async (e) => {
          try { await api("PUT", `/api/v1/fellows/${f.id}`, { standby: e.target.checked }); } catch (err) { showError(err.message); }
          loadFellows();
        },
      }),
      h("span", {}, f.standby ? "Standby" : "—"),
    ]),
    [...(f.state === "online" ? [drainButton(f), " "] : []), h("button", {
      class: "btn small danger", type: "button", "aria-label": `Remove fellow ${f.name}`,
      onclick: async () => {
        if (!await confirmAction(`Remove ${f.name}?`, "Its link ends now and its key is refused from then on; its stages move to other fellows. To join again it needs a new key and a new join token.")) return;
        try { await del(`/api/v1/fellows/${f.id}`); } catch (err) { showError(err.message); }
        loadFellows();
      },
    }, "Remove")],
  ], "No fellow has joined yet: create a join token and run swarm join on a PC.");
}

// Drain: the fellow hands its stages to a hot cover, a standby or an idle fellow with room -- replies go on without
// a pause -- then leaves (as `swarm leave` on it). Refused when nobody can take a stage; then it may leave anyway.
function drainButton(f) {
  return h("button", {
    class: "btn small", type: "button", "aria-label": `Drain fellow ${f.name}`,
    onclick: async () => {
      if (!await confirmAction(`Drain ${f.name}?`, "Its stages move to other fellows while replies go on, then it leaves the pool (its process stops).")) return;
      try {
        await api("POST", `/api/v1/fellows/${f.id}/drain`, { force: false });
      } catch (err) {
        if (!await confirmAction(`${f.name} cannot hand everything over`, `${err.message} Leave anyway?`)) { loadFellows(); return; }
        try { await api("POST", `/api/v1/fellows/${f.id}/drain`, { force: true }); } catch (again) { showError(again.message); }
      }
      loadFellows();
    },
  }, "Drain");
}

async function loadJoinTokens() {
  const { join_tokens: tokens } = await get("/api/v1/join-tokens");
  const now = Date.now() / 1000;
  const state = (t) => t.revoked ? "revoked" : (t.expires_at && t.expires_at <= now) ? "expired"
    : t.uses_left === 0 ? "used" : t.uses_left == null ? "active" : `active, ${t.uses_left} of ${t.uses} left`;
  rows("join-table", tokens, (t) => [
    h("span", { class: "mono" }, `${t.prefix}…`), t.pool || "—", formatWhen(t.created_at),
    t.expires_at ? formatWhen(t.expires_at) : "never", state(t),
    state(t).startsWith("active") ? h("button", {
      class: "btn small danger", type: "button", "aria-label": `Revoke join token ${t.prefix}`,
      onclick: async () => {
        try { await del(`/api/v1/join-tokens/${t.id}`); } catch (err) { showError(err.message); }
        loadJoinTokens();
      },
    }, "Revoke") : "",
  ], "No join tokens.");
}

async function loadDirectLinks() {
  const { enabled } = await get("/api/v1/settings/direct-links");
  $("direct-links").checked = enabled;
  $("direct-links-state").textContent = enabled ? "Direct links are on" : "Direct links are off";
}

async function loadHotCover() {
  const { enabled, forced_by_env: forced } = await get("/api/v1/settings/hot-cover");
  $("hot-cover").checked = enabled;
  $("hot-cover").disabled = forced;
  $("hot-cover-state").textContent = enabled ? (forced ? "Hot cover is on (SWARM_SERVE_HOT_COVER=1 on the leader)" : "Hot cover is on") : "Hot cover is off";
}

function linkText(link) {
  if (!link) return "";
  if (link.rtt_ms == null) return link.error ? `${link.path}: ${link.error}` : link.path;
  return `${link.rtt_ms} ms, ${link.mbps} Mbit/s (${link.path})`;
}

async function loadLinks() {
  const { fellows, links } = await get("/api/v1/links");
  const byPair = new Map(links.map((l) => [`${l.from_id}>${l.to_id}`, l]));
  $("links-table").querySelector("thead").replaceChildren(h("tr", {}, [h("th", {}, "From \\ to"), ...fellows.map((f) => h("th", {}, f.name))]));
  rows("links-table", fellows.length > 1 ? fellows : [], (from) => [
    h("strong", {}, from.name),
    ...fellows.map((to) => (to.id === from.id || to.pool_id !== from.pool_id ? "—" : linkText(byPair.get(`${from.id}>${to.id}`)) || "not measured yet")),
  ], "Links are measured between two or more fellows of a pool.");
}

async function loadMoves() {
  const { mode, proposals, left_out: leftOut = {} } = await get("/api/v1/rebalance");
  if (mode === "auto") $("moves-mode").textContent = "Moves and re-layouts the planner predicts at least 1.3x faster are applied as they are found (SWARM_SERVE_REBALANCE=auto).";
  const notes = (lines) => (lines && lines.length ? h("div", { class: "muted" }, lines.join("; ")) : "");
  const shown = [...proposals, ...Object.entries(leftOut).map(([model, lines]) => ({ model, text: `${model}: nothing to propose`, left_out: lines, none: true }))];
  rows("moves-table", shown, (p) => [h("div", {}, [p.text, notes(p.left_out)]), p.none ? "" : h("button", {
    class: "btn small", type: "button", "aria-label": `Apply the ${p.kind === "relayout" ? "re-layout" : "move"} of ${p.model}`,
    onclick: async () => {
      try { await post("/api/v1/rebalance", { model: p.model }); } catch (err) { showError(`It was not applied: ${err.message}`); }
      loadMoves();
    },
  }, "Apply")], mode === "off" ? "Live moves are off (SWARM_SERVE_REBALANCE=off)." : "No faster placement to propose now.");
}

async function loadModelSwitches() {
  const { auto_load: autoLoad, evict_idle: evict } = await get("/api/v1/settings/models");
  $("auto-load").checked = autoLoad;
  $("auto-load-state").textContent = autoLoad ? "Auto-load is on" : "Auto-load is off";
  $("evict-idle").checked = evict;
  $("evict-idle-state").textContent = evict ? "Evict idle models is on" : "Evict idle models is off";
}

async function main() {
  me = await get("/api/v1/me");
  setCsrf(me.csrf);
  $("back-link").href = me.home;
  $("password-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    try {
      const { csrf } = await post("/api/v1/me/password", { current_password: $("current-password").value, new_password: $("new-password").value });
      e.target.reset();
      $("password-state").textContent = "Password changed. Your other browsers are signed out.";
      if (csrf) setCsrf(csrf);
    } catch (err) { showError(`The password was not changed: ${err.message}`); }
  });
  if (!me.user.is_admin) {
    $("admin-main").replaceChildren(h("p", { class: "notice warn" }, "This page is for admins. Ask an admin of this leader to make you one."));
    return;
  }
  $("user-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    try {
      await post("/api/v1/users", { name: $("new-user-name").value.trim(), password: $("new-user-password").value, is_admin: $("new-user-admin").checked });
      e.target.reset();
      loadUsers();
      loadPools(); // a new user starts in the default pool
    } catch (err) { showError(`The user was not added: ${err.message}`); }
  });
  $("pool-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    try {
      await post("/api/v1/pools", { name: $("new-pool-name").value.trim() });
      e.target.reset();
      loadPools();
    } catch (err) { showError(`The pool was not created: ${err.message}`); }
  });
  $("new-join-token").addEventListener("click", async () => {
    try {
      const uses = Number($("join-uses").value) || 1;
      const pool = $("join-pool").value || "default";
      const { token } = await post("/api/v1/join-tokens", { uses, ttl_s: Number($("join-ttl").value), pool });
      const install = `curl -fsSL "${location.origin}/install.sh?token=${token}" | sh`;
      await showOnce("New join token", `Run this on ${uses === 1 ? "the PC" : `up to ${uses} PCs`} that should join pool ${pool} (Linux, macOS): it installs swarm from this leader and starts it as a service. On Windows, in PowerShell: irm "${location.origin}/install.ps1?token=<the same token>" | iex. By hand: swarm join ${location.origin} --token <the token>. The token is shown only now.`, install);
      loadJoinTokens();
    } catch (err) { showError(err.message); }
  });
  $("direct-links").addEventListener("change", async (e) => {
    try { await api("PUT", "/api/v1/settings/direct-links", { enabled: e.target.checked }); } catch (err) { showError(err.message); }
    loadDirectLinks();
  });
  $("hot-cover").addEventListener("change", async (e) => {
    try { await api("PUT", "/api/v1/settings/hot-cover", { enabled: e.target.checked }); } catch (err) { showError(err.message); }
    loadHotCover();
  });
  for (const [id, key] of [["auto-load", "auto_load"], ["evict-idle", "evict_idle"]]) {
    $(id).addEventListener("change", async (e) => {
      try { await api("PUT", "/api/v1/settings/models", { [key]: e.target.checked }); } catch (err) { showError(err.message); }
      loadModelSwitches();
    });
  }
  const results = await Promise.allSettled([loadUsers(), loadPools(), loadFellows(), loadJoinTokens(), loadDirectLinks(), loadHotCover(), loadModelSwitches(), loadLinks(), loadMoves(), initUsage(), initVerification()]);
  const failed = results.find((r) => r.status === "rejected");
  if (failed) showError(failed.reason.message);
  setInterval(() => loadFellows().catch(() => {}), 5000);
  setInterval(() => loadLinks().catch(() => {}), 15_000);
  setInterval(() => loadMoves().catch(() => {}), 15_000);
  setInterval(() => loadVerification().catch(() => {}), 15_000);
  setInterval(() => loadUsage().catch(() => {}), 60_000);
}

main().catch((err) => { if (err?.status !== 401) showError(`The page could not start: ${err.message}`); });
