// One streamed chat completion: POST /v1/chat/completions with stream: true, read the SSE chunks, time them.
import { chatHeaders, errorOf, ApiError } from "./api.js";

/**
 * Stream a reply. `onStart(rid)` gets the leader's request id (for Stop), `onDelta({content, reasoning})` each piece.
 * Resolves to {finishReason, usage, stats}; rejects with ApiError (status/code from the leader) or AbortError.
 */
export async function streamCompletion(body, { apiToken, signal, onStart, onDelta }) {
  const started = performance.now();
  const response = await fetch("/v1/chat/completions", {
    method: "POST", headers: chatHeaders(apiToken), credentials: "same-origin", signal,
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
  });
  if (!response.ok) throw await errorOf(response);
  onStart?.(response.headers.get("x-swarm-request-id"));

  let firstAt = null;
  let lastAt = null;
  let pieces = 0;
  let finishReason = null;
  let usage = null;
  let timing = null; // swarm.timing, in the last chunk: where each token's time went on the fellows
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";

  const handle = (data) => {
    if (data === "[DONE]") return true;
    let chunk;
    try { chunk = JSON.parse(data); } catch { return false; }
    if (chunk.error) throw new ApiError(chunk.error.message || "the reply failed", 502, chunk.error.code);
    if (chunk.usage) usage = chunk.usage;
    if (chunk.swarm?.timing) timing = chunk.swarm.timing;
    const choice = chunk.choices?.[0];
    if (!choice) return false;
    const delta = choice.delta || {};
    const reasoning = delta.reasoning_content ?? delta.reasoning ?? ""; // llama.cpp/DeepSeek, and vLLM's newer name
    const content = delta.content ?? "";
    if (content || reasoning) {
      const now = performance.now();
      if (firstAt === null) firstAt = now;
      lastAt = now;
      pieces += 1;
      onDelta({ content, reasoning });
    }
    if (choice.finish_reason) finishReason = choice.finish_reason;
    return false;
  };

  let done = false;
  while (!done) {
    const { value, done: ended } = await reader.read();
    if (ended) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while (!done && (cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
      const data = event.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (data) done = handle(data);
    }
  }
  if (done) reader.cancel().catch(() => {});
  const endedAt = performance.now();
  return { finishReason, usage, timing, stats: speedStats({ started, firstAt, lastAt: lastAt ?? endedAt, endedAt, pieces, usage }) };
}

/** Tokens per second after the first token, token count, time to first token. A reply that arrived in one burst
 * (a buffering proxy) is rated over the whole request instead. */
export function speedStats({ started, firstAt, lastAt, endedAt, pieces, usage }) {
  const tokens = usage?.completion_tokens ?? pieces;
  if (firstAt === null || !tokens) return { tokens: tokens || 0, ttft_ms: null, tps: null };
  const steady = lastAt - firstAt;
  const burst = steady < 50 || pieces < 3;
  const tps = burst ? tokens / Math.max((endedAt - started) / 1000, 1e-3) : (tokens - 1) / (steady / 1000);
  return { tokens, ttft_ms: Math.round(firstAt - started), tps: Math.round(tps * 10) / 10, burst };
}

/** The speed line under a reply: the browser's figures, then (when the fellows measured it) where each token's time
 * went -- `stage 0 4 ms/token · link 152 ms · stage 1 5 ms`, or `compute 12 ms/token` on one fellow. */
export function speedLine(stats, timing) {
  if (!stats || !stats.tokens) return "";
  const parts = [];
  if (stats.tps !== null && stats.tps !== undefined) parts.push(`${stats.tps.toFixed(1)} tokens/s`);
  parts.push(`${stats.tokens} token${stats.tokens === 1 ? "" : "s"}`);
  if (stats.ttft_ms !== null && stats.ttft_ms !== undefined) parts.push(`${(stats.ttft_ms / 1000).toFixed(2)} s to first token`);
  // the prefix cache's hit: prompt tokens the stages did not compute again
  if (timing?.cached_tokens) parts.push(`${timing.cached_tokens} prompt tokens cached`);
  return parts.concat(splitParts(timing)).join(" · ");
}

// Whole milliseconds as in the seed (`stage 0 4 ms/token`); a tenth below 1 ms (a fast GPU stage).
const ms = (value) => (value >= 1 ? String(Math.round(value)) : value.toFixed(1));

/** swarm.timing's split of a token's time, as the speed line shows it ([] when the fellows did not report it). */
export function splitParts(timing) {
  const stages = (timing?.split === "fellows" && Array.isArray(timing.stages)) ? timing.stages : [];
  if (!stages.length || stages.some((s) => typeof s.compute_ms_per_token !== "number")) return [];
  if (stages.length === 1) return [`compute ${ms(stages[0].compute_ms_per_token)} ms/token`];
  const parts = [`stage ${stages[0].stage} ${ms(stages[0].compute_ms_per_token)} ms/token`];
  if (typeof timing.link_ms_per_token === "number") parts.push(`link ${ms(timing.link_ms_per_token)} ms`);
  for (const s of stages.slice(1)) parts.push(`stage ${s.stage} ${ms(s.compute_ms_per_token)} ms`);
  return parts;
}
