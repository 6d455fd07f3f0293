"""How fast this fellow runs a decoder layer: a short calibration on the device it computes on, for the planner.

A synthetic Llama-style decoder layer (attention with its four projections, a gated MLP of 8/3 the width) is timed at
two hidden sizes, for one decode step (one token over a short KV cache) and for a 256-token prefill chunk (a prompt's chunk). The
leader fits a line through the two points (fixed cost per layer + cost per weight byte) and scales it by a model's
layer sizes (swarm.leader.planner). It runs in a worker thread when the fellow starts, takes well under a few seconds,
and is cached in the fellow's data dir keyed by the hardware it ran on, so a restart does not redo it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

log = logging.getLogger(__name__)

VERSION = 2  # bump when what is measured changes: older cached results are then measured again
HIDDEN_SIZES = (256, 768)
PREFILL_TOKENS = 256  # one chunk, as a stage takes a prompt (SWARM_SERVE_PREFILL_CHUNK's default); scaled to 1,000
KV_TOKENS = 64  # the decode step's cache


def hardware_key(device: str, hardware_wire: dict) -> str:
    """What the calibration depends on: the device it ran on, the CPU count and the GPUs' names (not their free
    memory, which moves all the time)."""
    gpus = [g.get("name") for g in hardware_wire.get("gpus") or [] if isinstance(g, dict)]
    text = json.dumps({"v": VERSION, "device": device, "cpu_cores": hardware_wire.get("cpu_cores"), "gpus": gpus},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def compute_device(setting: str) -> str:
    """The torch device a stage on this fellow computes on, as SWARM_DEVICE says (auto: the first GPU if any)."""
    import torch

    if setting == "cpu":
        return "cpu"
    if setting.startswith("cuda"):
        return setting if torch.cuda.is_available() else "cpu"
    return "cuda:0" if torch.cuda.is_available() else "cpu"


def _layer(hidden: int, device: str, dtype):
    import torch

    inter = hidden * 8 // 3
    g = torch.Generator().manual_seed(0)

    def w(rows, cols):
        return (torch.randn(rows, cols, generator=g) / cols ** 0.5).to(device=device, dtype=dtype)

    return {"q": w(hidden, hidden), "k": w(hidden, hidden), "v": w(hidden, hidden), "o": w(hidden, hidden),
            "gate": w(inter, hidden), "up": w(inter, hidden), "down": w(hidden, inter)}


def _forward(layer: dict, x, past_k, past_v, heads: int):
    import torch
    import torch.nn.functional as F

    tokens, hidden = x.shape
    h = F.rms_norm(x, (hidden,))
    q = (h @ layer["q"].T).view(tokens, heads, -1).transpose(0, 1)
    k = (h @ layer["k"].T).view(tokens, heads, -1).transpose(0, 1)
    v = (h @ layer["v"].T).view(tokens, heads, -1).transpose(0, 1)
    if past_k is not None:
        k, v = torch.cat([past_k, k], 1), torch.cat([past_v, v], 1)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=past_k is None)
    x = x + attn.transpose(0, 1).reshape(tokens, hidden) @ layer["o"].T
    h = F.rms_norm(x, (hidden,))
    return x + (F.silu(h @ layer["gate"].T) * (h @ layer["up"].T)) @ layer["down"].T


def _best(fn, sync, repeats: int, budget_s: float) -> float:
    """The fastest of ``repeats`` runs (seconds), after warm-ups; fewer runs once ``budget_s`` is spent. (The first
    calls of a new shape are far slower on CPU -- oneDNN picks its kernels -- so they do not count.)"""
    for _ in range(3):
        fn()
    sync()
    best = float("inf")
    start = time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return best


def measure(device: str = "cpu", threads: int | None = None) -> dict:
    """Time one synthetic decoder layer at each of HIDDEN_SIZES on ``device``: a list of points, each with the
    layer's weight bytes, a decode step's ms and a PREFILL_TOKENS-token prefill chunk's ms."""
    import torch

    dtype = torch.float32 if device == "cpu" else torch.float16
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    sync = (lambda: torch.cuda.synchronize(device)) if device.startswith("cuda") else (lambda: None)
    points = []
    try:
        with torch.inference_mode():
            for hidden in HIDDEN_SIZES:
                layer = _layer(hidden, device, dtype)
                heads = hidden // 64
                g = torch.Generator().manual_seed(1)
                one = torch.randn(1, hidden, generator=g).to(device=device, dtype=dtype)
                past = torch.randn(heads, KV_TOKENS, 64, generator=g).to(device=device, dtype=dtype)
                chunk = torch.randn(PREFILL_TOKENS, hidden, generator=g).to(device=device, dtype=dtype)
                decode = _best(lambda: _forward(layer, one, past, past, heads), sync, 30, 0.5)
                prefill = _best(lambda: _forward(layer, chunk, None, None, heads), sync, 5, 0.5)
                weight_bytes = sum(t.numel() for t in layer.values()) * torch.finfo(dtype).bits // 8
                points.append({"hidden": hidden, "weight_bytes": weight_bytes, "decode_ms": round(decode * 1e3, 4),
                               "prefill_ms": round(prefill * 1e3, 3)})
    finally:
        torch.set_num_threads(old_threads)
    return {"version": VERSION, "device": device, "dtype": str(dtype).removeprefix("torch."),
            "prefill_tokens": PREFILL_TOKENS, "points": points}


def cached_or_measure(data_dir: Path, device: str, hardware_wire: dict, threads: int | None = None) -> dict | None:
    """The calibration for this hardware: from ``data_dir``/calibration.json when it was measured on the same
    hardware, else measured now and written there. None when torch cannot run it (logged)."""
    path = Path(data_dir) / "calibration.json"
    key = hardware_key(device, hardware_wire)
    try:
        cached = json.loads(path.read_text())
        if cached.get("key") == key and isinstance(cached.get("calibration"), dict):
            return cached["calibration"]
    except (OSError, ValueError, AttributeError):
        pass
    try:
        t0 = time.perf_counter()
        result = measure(device, threads)
        log.info("calibrated a decoder layer on %s in %.1f s: %s", device, time.perf_counter() - t0,
                 ", ".join(f"hidden {p['hidden']}: decode {p['decode_ms']:.2f} ms, {PREFILL_TOKENS}-token prefill "
                           f"{p['prefill_ms']:.0f} ms" for p in result["points"]))
    except Exception as exc:  # noqa: BLE001 -- a planner without this fellow's speed is better than no fellow
        log.warning("could not calibrate this fellow's speed on %s (%s): the planner will not count it", device, exc)
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key, "calibration": result}))
    except OSError as exc:
        log.info("could not cache the calibration in %s: %s", path, exc)
    return result
