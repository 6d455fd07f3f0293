// The admin page's Spot checks card: the share of passes recomputed by another fellow (PUT /api/v1/verification),
// the counts so far, the stages nothing checks (no checker for stage N), suspects, and an alert for each fellow taken out of service with the requests it served.
import { api, get } from "./api.js";
import { h, formatWhen } from "./dom.js";
import { showError } from "./ui.js";

const $ = (id) => document.getElementById(id);

export async function loadVerification() {
  const v = await get("/api/v1/verification");
  $("verify-fraction").value = String(v.fraction);
  $("verify-fraction").disabled = v.forced_by_env;
  $("verify-state").textContent = v.fraction > 0
    ? `${v.checks} passes checked, ${v.failures} outside the tolerance${v.forced_by_env ? " (SWARM_SERVE_VERIFY on the leader)" : ""}`
    : "Spot checks are off";
  // stages nothing checks while checks are on: said, never silently skipped
  const unchecked = (v.unchecked ?? []).map((u) => h("li", { class: "unchecked" }, u.message));
  const suspects = v.suspects.map((s) => h("li", {}, `${s.fellow} is suspect on stage ${s.stage} of ${s.model}: its next pass is checked again`));
  const alerts = v.alerts.slice().reverse().map((a) => h("li", { class: "alert", role: "alert" }, [
    h("strong", {}, `${a.fellow} taken out of service (${formatWhen(a.at)})`), " ", a.message, " ",
    h("details", {}, [h("summary", {}, `Requests served through stage ${a.stage} since its last good check (${a.requests.length})`),
      h("ul", {}, a.requests.map((r) => h("li", {}, `${r.id} — ${r.user ?? "unknown user"}`)))]),
  ]));
  $("verify-alerts").replaceChildren(...unchecked, ...suspects, ...alerts);
}

export function initVerification() {
  $("verify-fraction").addEventListener("change", async (e) => {
    const fraction = Number(e.target.value);
    try { await api("PUT", "/api/v1/verification", { fraction }); } catch (err) { showError(err.message); }
    loadVerification().catch(() => {});
  });
  return loadVerification();
}
