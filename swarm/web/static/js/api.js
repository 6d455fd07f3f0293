// Talking to the leader: session cookie + CSRF header for the browser, errors turned into readable messages.

let csrf = null;

export class ApiError extends Error {
  constructor(message, status, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export function setCsrf(token) { csrf = token; }

export async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  let code = null;
  try {
    const body = await response.json();
    if (body && body.error) {
      message = body.error.message || message;
      code = body.error.code || body.error.type || null;
    }
  } catch { /* not JSON */ }
  return new ApiError(message, response.status, code);
}

export async function api(method, path, body, { signal } = {}) {
  const headers = { accept: "application/json" };
  if (body !== undefined) headers["content-type"] = "application/json";
  if (method !== "GET" && csrf) headers["x-csrf-token"] = csrf;
  let response;
  try {
    response = await fetch(path, {
      method, headers, signal, credentials: "same-origin",
      body: body === undefined ? undefined : JSON.stringify(body),
    });
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError("the leader cannot be reached; check the connection and try again.", 0, "network");
  }
  if (response.status === 401 && path === "/api/v1/me") {
    location.href = `/login?next=${encodeURIComponent(location.pathname + location.hash)}`;
    throw new ApiError("signed out", 401, "unauthorized");
  }
  if (!response.ok) throw await errorOf(response);
  return response.status === 204 ? null : response.json();
}

export const get = (path, opts) => api("GET", path, undefined, opts);
export const post = (path, body = {}, opts) => api("POST", path, body, opts);
export const patch = (path, body, opts) => api("PATCH", path, body, opts);
export const del = (path, opts) => api("DELETE", path, undefined, opts);

export function chatHeaders(apiToken) {
  // The model API goes with the token picked under Settings > API, else as the signed-in user (cookie + CSRF).
  const headers = { "content-type": "application/json", accept: "text/event-stream" };
  if (apiToken) headers.authorization = `Bearer ${apiToken}`;
  else if (csrf) headers["x-csrf-token"] = csrf;
  return headers;
}
