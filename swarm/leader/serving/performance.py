"""How a served model performs, rolled up from finished requests (swarm.store.history.ServedRequest) and what the
fellows report: plain functions over records, so they are tested with made-up ones.

The route (GET /api/v1/models/{id}/performance) and the Performance column show: the speed series, the headline
figures, the pipeline (each stage's fellow, layers and GPUs), the hops, the time per token split into compute and
link, a one-sentence bottleneck, and the last 15 minutes' table.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from swarm.errors import BadRequest
from swarm.store.history import ServedRequest

# range -> (seconds covered, step of the speed series). The seed: "The chart's steps grow with the range (30 seconds
# up to three hours)"; each range keeps 24 to 56 points, enough for a line and few enough to draw every 2 s.
RANGES: dict[str, tuple[float, float]] = {
    "15m": (15 * 60, 30),
    "1h": (3600, 120),
    "6h": (6 * 3600, 900),
    "24h": (86400, 3600),
    "7d": (7 * 86400, 3 * 3600),
}
LIVE_RANGE = "15m"
IDLE_GPU_PERCENT = 30  # below this mean load the cards wait on something else (the network, the other stages)


def parse_range(text: str | None) -> str:
    text = text or LIVE_RANGE
    if text not in RANGES:
        raise BadRequest(f"range {text!r} is not one the performance view keeps; use one of "
                         f"{', '.join(RANGES)}.", "invalid_range")
    return text


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) of ``values``, linear between the closest ranks (numpy's default); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    low, high = math.floor(at), math.ceil(at)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def speed_series(records: Iterable[ServedRequest], now: float, span: float, step: float) -> list[dict]:
    """Tokens per second over ``span`` seconds up to ``now`` in steps of ``step``: per step, the median rate of the
    replies that ended in it (None when none did), how many tokens they generated and how many they were. Steps sit
    on multiples of ``step``, so a point keeps its place from one refresh to the next; the last one is under way."""
    count = max(1, math.ceil(span / step))
    first = (math.floor(now / step) - count + 1) * step
    buckets: list[list[ServedRequest]] = [[] for _ in range(count)]
    for record in records:
        index = math.floor((record.ended_at - first) / step)
        if 0 <= index < count:
            buckets[index].append(record)
    series = []
    for i, bucket in enumerate(buckets):
        rates = [r.tokens_per_s for r in bucket if r.tokens_per_s]
        series.append({"t": first + i * step, "tokens_per_s": _round(statistics.median(rates)) if rates else None,
                       "tokens": sum(r.reply_tokens for r in bucket), "replies": len(bucket)})
    return series


def live_rate(tokens: int, first_token_at: float | None, now: float) -> float | None:
    """A reply streaming now: its tokens per second since its first token."""
    if first_token_at is None or tokens < 2 or now <= first_token_at:
        return None
    return (tokens - 1) / (now - first_token_at)


def speed(records: Sequence[ServedRequest], streaming: Sequence[float]) -> dict:
    """The headline: tokens per second of the replies streaming now (their sum), or between replies the median per
    reply; the median time to the first token; the tokens generated."""
    rates = [r.tokens_per_s for r in records if r.tokens_per_s]
    ttfts = [r.ttft_ms for r in records if r.ttft_ms is not None]
    median = statistics.median(rates) if rates else None
    return {
        "tokens_per_s": _round(sum(streaming)) if streaming else _round(median),
        "streaming": len(streaming),
        "median_tokens_per_s": _round(median),
        "median_ttft_ms": _round(statistics.median(ttfts)) if ttfts else None,
        "tokens": sum(r.reply_tokens for r in records),
    }


def table(records: Sequence[ServedRequest]) -> dict:
    """The last-15-minutes table: replies (failed and cancelled among them), tokens, tokens/s per reply and time to
    first token at the median and the 95th percentile, queue wait, and the mean time between tokens (all decode time
    over all tokens after the first)."""
    rates = [r.tokens_per_s for r in records if r.tokens_per_s]
    ttfts = [r.ttft_ms for r in records if r.ttft_ms is not None]
    queues = [r.queue_ms for r in records if r.queue_ms is not None]
    decode_s = sum(r.decode_s for r in records)
    steps = sum(r.reply_tokens - 1 for r in records if r.decode_s > 0)

    def spread(values: list[float]) -> dict:
        return {"p50": _round(percentile(values, 50)), "p95": _round(percentile(values, 95))}

    return {
        "replies": len(records),
        "failed": sum(r.outcome == "failed" for r in records),
        "cancelled": sum(r.outcome == "cancelled" for r in records),
        "tokens": sum(r.reply_tokens for r in records),
        "tokens_per_s": spread(rates),
        "ttft_ms": spread(ttfts),
        "queue_ms": spread(queues),
        "mean_ms_between_tokens": _round(1000 * decode_s / steps, 2) if steps else None,
    }


# --- the time per token ----------------------------------------------------------------------------------------------


def _num(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _numbers(items, key: str) -> list[float] | None:
    """``item[key]`` of every item, or None when one is missing."""
    if not isinstance(items, list) or not items:
        return None
    values = [_num(item.get(key)) if isinstance(item, dict) else None for item in items]
    numbers = [v for v in values if v is not None]
    return numbers if len(numbers) == len(values) else None


def split_of(timing: dict | None) -> tuple[list[float], list[float]] | None:
    """A reply's split as its fellows measured it (swarm.leader.serving.timing's shape:
    ``stages[].compute_ms_per_token``, ``links[].ms_per_token``, ``split`` "fellows" once every stage reported): each
    stage's compute and each hop's link in ms per token. None when they did not measure it (fellows from before, or a
    reply that never decoded)."""
    if not timing or timing.get("split") != "fellows":
        return None
    stages = _numbers(timing.get("stages"), "compute_ms_per_token")
    links = _numbers(timing.get("links"), "ms_per_token") if timing.get("links") else []
    if stages is None or links is None:
        return None
    return stages, links


def time_split(records: Sequence[ServedRequest], hops: Sequence[dict], stage_names: Sequence[str]) -> dict | None:
    """Where each token's time goes, averaged over the replies (weighted by their tokens): each stage's compute and
    the link, with shares, the prompt's time and the bytes per token. Measured by the fellows when the replies carry
    their split ("fellows"); else estimated from the median rate and the hops' round trips ("round_trips": each
    token crosses every hop once, about half a round trip each). None without a reply to go by."""
    measured = [(r, s) for r in records if (s := split_of(r.timing)) is not None and r.reply_tokens > 0]
    prompt = [p for r in records if r.timing and (p := _num(r.timing.get("prompt_ms"))) is not None]
    bytes_per_token = {"forward": next((h.get("bytes_per_token") for h in hops[:-1] if h.get("bytes_per_token")), None),
                       "back": hops[-1].get("bytes_per_token") if len(hops) > 1 else None}
    for r in reversed(records):  # no hop reported yet: what the last replies' stages counted
        sent = r.timing.get("bytes_per_token") if r.timing else None
        if isinstance(sent, dict):
            for way in ("forward", "back"):
                bytes_per_token[way] = bytes_per_token[way] or _num(sent.get(way))
    n = len(stage_names)
    if measured and all(len(s[0]) == n for _, s in measured):
        weight = sum(r.reply_tokens for r, _ in measured)
        compute = [sum(s[0][i] * r.reply_tokens for r, s in measured) / weight for i in range(n)]
        hop_ms = [sum((s[1][i] if i < len(s[1]) else 0.0) * r.reply_tokens for r, s in measured) / weight
                  for i in range(max(len(s[1]) for _, s in measured))]
        source = "fellows"
    else:
        rates = [r.tokens_per_s for r in records if r.tokens_per_s]
        if not rates:
            return None
        per_token = 1000 / statistics.median(rates)
        rtts = [h["rtt_ms"] for h in hops if _num(h.get("rtt_ms")) is not None]
        link = min(per_token, sum(rtts) / 2) if n > 1 and rtts else 0.0
        compute, hop_ms, source = [per_token - link], ([link] if n > 1 else []), "round_trips"
    parts: list[dict[str, Any]] = []
    for i, ms in enumerate(compute):
        label = "compute" if len(compute) == 1 else f"stage {i}"
        parts.append({"label": label, "kind": "compute", "stage": i if len(compute) > 1 else None,
                      "fellow": stage_names[i] if len(compute) > 1 else None, "ms": ms})
        if i == 0 and hop_ms:  # the seed's order: stage 0, the link (every hop), stage 1...; or compute, link
            parts.append({"label": "link", "kind": "link", "stage": None, "fellow": None, "ms": sum(hop_ms)})
    total = sum(p["ms"] for p in parts)
    for part in parts:
        part["share"] = round(part["ms"] / total, 3) if total > 0 else 0.0
        part["ms"] = round(part["ms"], 2)
    return {"source": source, "replies": len(measured) if source == "fellows" else len(records),
            "ms_per_token": round(total, 2), "parts": parts, "hop_ms": [round(x, 2) for x in hop_ms],
            "prompt_ms": _round(statistics.mean(prompt)) if prompt else None, "bytes_per_token": bytes_per_token}


def bottleneck(split: dict | None, stages: Sequence[dict]) -> str:
    """One sentence: whether the link or compute takes most of each token, which stage's side is slower, and whether
    the GPUs are mostly idle (then the network, not the cards, sets the speed)."""
    if split is None:
        return "No replies in the last 15 minutes: where each token's time goes shows once the model answers."
    parts = split["parts"]
    link = sum(p["share"] for p in parts if p["kind"] == "link")
    compute = [p for p in parts if p["kind"] == "compute"]
    estimated = " (estimated from the round trips)" if split["source"] == "round_trips" else ""
    if link >= 0.5:
        sentence = (f"The link takes most of each token's time ({link:.0%}){estimated}: the fellows wait on the "
                    "network, not on their processors, so a faster connection (or fellows that reach each other "
                    "directly) speeds the model up, and a bigger GPU does not.")
    elif len(compute) > 1:
        slow = max(compute, key=lambda p: p["ms"])
        fast = min(compute, key=lambda p: p["ms"])
        sentence = (f"Compute takes most of each token's time ({1 - link:.0%}); {slow['label']} on {slow['fellow']} "
                    f"is the slower side ({slow['ms']:.1f} ms against {fast['ms']:.1f} ms per token).")
    else:
        where = stages[0]["fellow"] if len(stages) == 1 else "the stages"
        sentence = f"Compute takes most of each token's time ({1 - link:.0%}){estimated}, on {where}."
    loads = [g["load_percent"] for s in stages for g in s.get("gpus", [])
             if g.get("role") == "stage" and _num(g.get("load_percent")) is not None]
    if loads and statistics.mean(loads) < IDLE_GPU_PERCENT:
        sentence += (f" The GPUs running the stages are mostly idle ({statistics.mean(loads):.0f} % busy): the "
                     "network, not the cards, sets the speed.")
    return sentence


# --- the pipeline ----------------------------------------------------------------------------------------------------


def _gpu_indices(devices: Sequence[str] | None) -> list[int]:
    """GPU indices from torch device names ("cuda:1"); plain "cuda" is torch's current device, card 0."""
    out = []
    for name in devices or []:
        if isinstance(name, str) and name.startswith("cuda"):
            index = int(name.split(":", 1)[1]) if ":" in name and name.split(":", 1)[1].isdigit() else 0
            if index not in out:
                out.append(index)
    return out


def pipeline_stage(stage: dict, hardware, placement: dict | None) -> dict:
    """One card of the pipeline: the stage's fellow and layers, then every GPU of that fellow -- the one(s) running
    the stage first, with the memory the model takes there, the others idle for this model -- or its CPU and RAM.

    ``stage`` is ModelServing.describe()'s; ``hardware`` the fellow's last swarm.messages.Hardware (None: offline);
    ``placement`` what its heartbeat says of the stage: {"devices": [...], "bytes": n}."""
    model_bytes = (placement or {}).get("bytes") or stage.get("memory_bytes")
    card = {"index": stage["index"], "fellow": stage["fellow"], "fellow_id": stage["fellow_id"],
            "layers": stage["layers"], "online": hardware is not None, "model_bytes": model_bytes,
            "gpus": [], "cpu": None}
    if hardware is None:
        return card
    devices = (placement or {}).get("devices") or []
    on_cpu = bool(devices) and all(d == "cpu" for d in devices)
    if hardware.gpus and not on_cpu:
        running = _gpu_indices(devices) or [hardware.gpus[0].index]
        for gpu in sorted(hardware.gpus, key=lambda g: (g.index not in running, g.index)):
            role = "stage" if gpu.index in running else "idle"
            card["gpus"].append({
                "index": gpu.index, "name": gpu.name, "role": role,
                "total_bytes": gpu.total_bytes, "used_bytes": max(0, gpu.total_bytes - gpu.free_bytes),
                "model_bytes": model_bytes // len(running) if role == "stage" and model_bytes else None,
                "load_percent": getattr(gpu, "load_percent", None), "power_w": getattr(gpu, "power_w", None),
                "power_limit_w": getattr(gpu, "power_limit_w", None),
                "temperature_c": getattr(gpu, "temperature_c", None)})
    else:
        card["cpu"] = {"cores": hardware.cpu_cores, "load_percent": getattr(hardware, "cpu_load_percent", None),
                       "ram_total_bytes": hardware.ram_total_bytes,
                       "ram_used_bytes": max(0, hardware.ram_total_bytes - hardware.ram_free_bytes)}
    return card


def hop_rate(previous: dict | None, current: dict, now: float) -> dict:
    """A hop's heartbeat stats with when they came and the bytes per second since the previous report."""
    current = {**current, "at": now}
    sent, before = _num(current.get("bytes_sent")), _num((previous or {}).get("bytes_sent"))
    at = _num((previous or {}).get("at"))
    if sent is not None and before is not None and at is not None and now > at and sent >= before:
        current["bytes_per_s"] = round((sent - before) / (now - at), 1)
    else:
        current["bytes_per_s"] = (previous or {}).get("bytes_per_s")
    return current


# --- the whole view --------------------------------------------------------------------------------------------------


async def performance_view(leader, name: str, range_: str) -> dict:
    """GET /api/v1/models/{name}/performance?range=...: everything above for one model, from the leader's state (its
    serving history, its running requests, the fellows' last heartbeats)."""
    import trio

    span, step = RANGES[range_]
    history, serving = leader.history, leader.serving
    now = history.clock()
    records = await history.over(name, span)
    model = serving.models.get(name)
    loop_now = trio.current_time()
    streaming = [rate for r in serving.book.of_model(name)
                 if (rate := live_rate(len(r.tokens), r.first_token_at, loop_now)) is not None]
    stages = model.describe()["stages"] if model is not None else []
    pipeline = []
    for stage in stages:
        conn = serving.hub.online.get(stage["fellow_id"]) if serving.hub is not None else None
        placement = serving.placements.get(stage["fellow_id"], {}).get(name)
        pipeline.append(pipeline_stage(stage, conn.hardware if conn is not None else None,
                                       placement if isinstance(placement, dict) else None))
    hops = model.hops(serving.hop_stats) if model is not None else []
    for i, hop in enumerate(hops):
        hop["direction"] = "back" if i == len(hops) - 1 else "forward"
        hop["bytes_per_s"] = serving.hop_stats.get(model.hop_ids[i], {}).get("bytes_per_s")
    last_15m = records if range_ == LIVE_RANGE else history.in_memory(name, now - RANGES[LIVE_RANGE][0])
    # the seed: the time per token is "averaged over the replies of the last 15 minutes", whatever the range
    split = time_split(last_15m, hops, [s["fellow"] for s in stages]) if stages else None
    for i, hop in enumerate(hops):
        hop["link_ms"] = split["hop_ms"][i] if split and split["source"] == "fellows" and i < len(split["hop_ms"]) \
            else None
    return {
        "id": name, "status": model.status if model is not None else "not_loaded", "range": range_,
        "step_s": step, "now": now,
        "speed": speed(records, streaming),
        "series": speed_series(records, now, span, step),
        "stages": pipeline,
        "hops": hops,
        "time_per_token": split,
        "bottleneck": bottleneck(split, pipeline) if stages else None,
        "last_15m": table(last_15m),
    }
