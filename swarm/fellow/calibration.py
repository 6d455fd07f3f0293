"""How fast this fellow runs a stage: a short calibration on the device it computes on, for the planner.

Transformers' own Llama decoder layer (random weights, grouped-query attention, a gated MLP of 8/3 the width), called
as a stage calls it, is timed at two hidden sizes, for one decode step (one token over a short KV cache) and for a
256-token prefill chunk (a prompt's chunk); so is what a decode pass costs besides its layers (the rotary table, the
causal mask, the hidden state's copy for the wire), a first stage's embedding, and a last stage's final norm, head
and greedy pick over a HEAD_VOCAB-token vocabulary. The leader fits a line through the two points (fixed cost per
layer + cost per weight byte; the head's per head byte) and scales it by a model's sizes
(swarm.leader.planning.planner). The decode step is timed through the library's layers and through the lean step
(swarm.stage.lean_decode, which the Llama-shaped families' stages take), each twice: back to back, as a stage
that holds the whole model runs (its next pass starts at once), and in short runs each after the core waited
IDLE_GAP_S, as a stage in a ring of several runs (it waits for the others between its passes; measured on a 2-core
VM, a core that waited runs the next 20-30 ms ~20-40 % slower, and a PC's power saving does the same). Each figure
is the median of its runs. It runs in a process of its own at the lowest priority when the fellow joins
(swarm.fellow.calibration_process: serving never waits for it), takes ~10 s on a 2-core CPU, stops timing once it
spent SWARM_CALIBRATE_CPU_S of CPU (:class:`CpuBudget`), and is cached for the whole machine keyed by the hardware it
ran on (swarm.fellow.calibration_cache), so a restart or another fellow's data dir on the same PC does not redo it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time

from swarm.fellow.calibration_parts import DECODE_STEPS, LAYERS, LayerStack, StageEnds

log = logging.getLogger(__name__)

VERSION = 9  # bump when what is measured changes: older cached results are then measured again
HIDDEN_SIZES = (256, 768)
PREFILL_TOKENS = 256  # one chunk, as a stage takes a prompt (SWARM_SERVE_PREFILL_CHUNK's default); scaled to 1,000
KV_TOKENS = 64  # the decode step's cache
# How long the core waits before each run of the decode step timed "after idle": a stage of a ring waits about as long
# for the other stages' passes and the links (the built-in model's other stage: 25-35 ms on this repository's VM).
IDLE_GAP_S = 0.03
# Decode steps per run timed after idle: 8 layers' worth, about as long as a small model's stage pass (the built-in
# model's 15 layers at hidden 576). A core that waited runs slow for a while after it wakes, not for a fixed share of
# what follows: measured on a 2-core VM, one 4-layer step after 20 ms ran +1.5-2.3 ms slower, two steps +1-5 ms, eight
# (a 32-layer pass) +3-17 ms, so a run as long as DECODE_STEPS' dilutes it to a few percent where a ring's stages paid
# 20-45 %.
IDLE_DECODE_STEPS = 2


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



class CpuBudget:
    """The CPU time (this process's, every thread's) a calibration may spend, SWARM_CALIBRATE_CPU_S: once it is
    spent, each figure still to come is timed from one warm-up and one run -- coarser, but every figure is there and
    the planner can use the fellow. ``until``: the process CPU time it ends at; None: no cap."""

    def __init__(self, until: float | None = None):
        self.until = until

    @classmethod
    def from_now(cls, seconds: float | None) -> CpuBudget:
        return cls(None if seconds is None else time.process_time() + seconds)

    def spent(self) -> bool:
        return self.until is not None and time.process_time() >= self.until


def _typical(fn, sync, repeats: int, budget_s: float, gap_s: float = 0.0, cpu: CpuBudget | None = None) -> float:
    """The median of ``repeats`` runs (seconds), after warm-ups; fewer runs once ``budget_s`` is spent (sleeps
    included) or the calibration's ``cpu`` budget is; with ``gap_s``, each run after the calling thread slept that
    long. (The first calls of a new shape are far slower on CPU -- oneDNN picks its kernels -- so they do not count.)
    The median, not the fastest: on a machine that other work shares, a stage meets the same contention as the typical
    run, and the fastest run is the lucky moment nothing else ran; on an idle machine the two agree."""
    cpu = cpu or CpuBudget()
    for _ in range(1 if cpu.spent() else 3):
        fn()
    sync()
    times = []
    start = time.perf_counter()
    for _ in range(repeats):
        if gap_s:
            time.sleep(gap_s)
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s or cpu.spent():
            break
    return statistics.median(times)


def _point(hidden: int, device: str, dtype, sync, cpu: CpuBudget) -> dict:
    import torch

    stack = LayerStack(hidden, device, dtype)
    ends = StageEnds(hidden, device, dtype)
    cache = stack.new_cache(KV_TOKENS)
    one = stack.states(1)
    chunk = stack.states(PREFILL_TOKENS)
    rotary = stack.pass_ends(one, KV_TOKENS, cache)

    def decode_steps(steps: int = DECODE_STEPS):
        for _ in range(steps):
            stack.run(one, KV_TOKENS, cache, rotary)
            cache.crop(-1)  # the next step sees the same cache (transformers 5: a count to remove)

    lean, at = stack.lean(), torch.tensor([[KV_TOKENS]], device=device)

    def lean_steps(steps: int = DECODE_STEPS):  # its rotary table inside, as a stage's lean step computes it
        for _ in range(steps):
            lean.forward(one, at, [cache])
            cache.crop(-1)

    def prefill_chunk():
        stack.run(chunk, 0, stack.new_cache(0))

    decode = _typical(decode_steps, sync, 30, 1.0, cpu=cpu) / (LAYERS * DECODE_STEPS)
    decode_idle = _typical(lambda: decode_steps(IDLE_DECODE_STEPS), sync, 24, 1.5,
                           gap_s=IDLE_GAP_S, cpu=cpu) / (LAYERS * IDLE_DECODE_STEPS)
    lean_decode = _typical(lean_steps, sync, 30, 1.0, cpu=cpu) / (LAYERS * DECODE_STEPS)
    lean_idle = _typical(lambda: lean_steps(IDLE_DECODE_STEPS), sync, 24, 1.5,
                         gap_s=IDLE_GAP_S, cpu=cpu) / (LAYERS * IDLE_DECODE_STEPS)
    prefill = _typical(prefill_chunk, sync, 5, 0.5, cpu=cpu) / LAYERS
    per_pass = _typical(lambda: stack.pass_ends(one, KV_TOKENS, cache), sync, 30, 0.2, cpu=cpu)
    embed = _typical(ends.embed_step, sync, 30, 0.1, cpu=cpu)
    head = _typical(lambda: ends.head_step(one), sync, 20, 0.5, cpu=cpu)
    return {"hidden": hidden, "weight_bytes": stack.weight_bytes(), "decode_ms": round(decode * 1e3, 4),
            "decode_idle_ms": round(decode_idle * 1e3, 4), "lean_decode_ms": round(lean_decode * 1e3, 4),
            "lean_decode_idle_ms": round(lean_idle * 1e3, 4),
            "prefill_ms": round(prefill * 1e3, 3), "pass_ms": round(per_pass * 1e3, 4),
            "embed_ms": round(embed * 1e3, 4), "head_bytes": ends.head_bytes(), "head_ms": round(head * 1e3, 4)}


def measure(device: str = "cpu", threads: int | None = None, cpu: CpuBudget | None = None) -> dict:
    """Time a stage's parts at each of HIDDEN_SIZES on ``device``: a list of points, each with one layer's weight
    bytes, its decode step's ms (one token over a KV_TOKENS-token cache; ``decode_idle_ms`` after the core waited
    IDLE_GAP_S), the same two through the lean decode step (``lean_decode_ms``, ``lean_decode_idle_ms``), and its
    PREFILL_TOKENS-token prefill chunk's ms; what a decode pass costs besides its layers (``pass_ms``: rotary table,
    causal mask, the copy for the wire); the first stage's embedding (``embed_ms``); and the last stage's final norm,
    head and greedy pick over HEAD_VOCAB tokens (``head_ms`` for a head of ``head_bytes``); and a mixture-of-experts
    layer's routing (``moe``: swarm.fellow.moe_calibration). ``cpu``: the CPU time it may spend (:class:`CpuBudget`)."""
    import torch

    from swarm.fellow.moe_calibration import measure_moe

    dtype = torch.float32 if device == "cpu" else torch.float16
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    sync = (lambda: torch.cuda.synchronize(device)) if device.startswith("cuda") else (lambda: None)
    try:
        with torch.inference_mode():
            points = [_point(hidden, device, dtype, sync, cpu or CpuBudget()) for hidden in HIDDEN_SIZES]
            moe = measure_moe(device, dtype, sync, lambda fn, on, repeats, budget_s: _typical(
                fn, on, repeats, budget_s, cpu=cpu or CpuBudget()))
    finally:
        torch.set_num_threads(old_threads)
    return {"version": VERSION, "device": device, "dtype": str(dtype).removeprefix("torch."),
            "prefill_tokens": PREFILL_TOKENS, "points": points, "moe": moe}
