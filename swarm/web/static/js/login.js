// The sign-in page: name and password, then back to where the user was going (or their pool's inference page).
const form = document.getElementById("signin");
const error = document.getElementById("signin-error");
const params = new URLSearchParams(location.search);

function fail(message) {
  error.textContent = message;
  error.hidden = false;
}

if (params.get("expired")) fail("That sign-in link has expired or was already used. Sign in with your password, or ask for a new link.");

function target(home) {
  const next = params.get("next") || "";
  return next.startsWith("/") && !next.startsWith("//") ? next : home || "/";
}

// Already signed in: straight on.
fetch("/api/v1/me", { credentials: "same-origin" }).then(async (r) => {
  if (r.ok && !params.get("expired")) location.replace(target((await r.json()).home));
}).catch(() => {});

form.addEventListener("submit", async (e) => {
  e.preventDefault();
  error.hidden = true;
  const button = document.getElementById("signin-button");
  button.disabled = true;
  try {
    const response = await fetch("/api/v1/auth/login", {
      method: "POST", credentials: "same-origin", headers: { "content-type": "application/json" },
      body: JSON.stringify({ name: document.getElementById("name").value.trim(), password: document.getElementById("password").value }),
    });
    if (!response.ok) {
      let message = "The name or password is wrong.";
      try { message = (await response.json()).error.message || message; } catch { /* keep the default */ }
      fail(message);
      return;
    }
    const me = await (await fetch("/api/v1/me", { credentials: "same-origin" })).json();
    location.href = target(me.home);
  } catch {
    fail("The leader cannot be reached; check the connection and try again.");
  } finally {
    button.disabled = false;
  }
});
