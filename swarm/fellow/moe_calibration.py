"""What a mixture-of-experts layer costs a fellow: the router, the dispatch of each routed expert, and an expert's
matrices at each quantization kind this device serves.

A dense layer's calibration (swarm.fellow.calibration) counts a fixed cost and a cost per weight byte, timed in the
device's own dtype. A MoE layer's routing adds, per pass, ``router_ms`` once and ``expert_ms`` per expert computed
(transformers' eager loop as a stage runs it, swarm.stage.moe_experts: find the rows, two matrix calls and the gating,
add the rows back) -- measured on a block of tiny experts (hidden 64) at one row routed to 1 and to 4 experts, so the
matrices' own bytes are next to nothing.

A routed expert is two small matrix calls on one row, whose cost per byte is not a dense layer's: measured on a
2-core VM (bench/moe_decode.py), a plan that counted int8 experts at float32's cost per byte was 2-5x too fast (the
int8 kernel's calls cost about as much as float32's on rows this short, at a quarter of the bytes). So ``kinds``
times one routed expert -- its dispatch and matrices -- at each kind on EXPERT_SHAPES (hidden, expert rows), a
point per shape as (its bytes at that kind, ms); the planner fits a line through them
(swarm.leader.planning.planner.layer_speed).
"""

from __future__ import annotations

from collections.abc import Callable

EXPERTS = 16  # experts of the timed routing block: at most TOP_K of them per row
TOP_K = 4
# The experts timed per kind, (hidden, expert rows, experts in the block): a small model's (the bench's 512 x 256)
# and a larger one's; multiples of the CPU int4 kernel's group (swarm.quantization.INT4_GROUP) along either matrix's
# input. Each run routes a row of its own (ROWS of them in turn), so that, as in a stage's decode, each token's
# experts are others than the last token's and come from memory rather than the core's cache: measured on a 2-core
# VM, one row routed again and again through a block of 32 ran 20-30 % faster than rows in turn.
EXPERT_SHAPES = ((512, 256, 32), (768, 512, 12))
ROWS = 16
# Before each timed run a buffer this large is written, so that the experts' matrices come from memory, not from the
# caches: a stage's model is far larger than a core's cache, and each token reads other experts. Measured on a 2-core
# VM under other work, a stage's int8 expert calls ran 3-10x slower than the same calls timed back to back on a block
# that stayed in cache.
FLUSH_BYTES = 64 << 20
KIND_RUNS = 12
KINDS = ("none", "int8", "int4-fast")  # nf4 on CPU is the int4 kernel too: the planner counts int4-fast for it


def expert_bytes(hidden: int, rows: int, kind: str, device_type: str, element_size: int) -> int:
    """One expert's gate, up and down matrices at ``kind``, counted as the planner counts them
    (swarm.leader.planning.planner.expert_weight_bytes)."""
    from swarm.quantization import bytes_per_weight

    per_weight = bytes_per_weight(kind, device_type, hidden) if kind != "none" else None
    return int(3 * hidden * rows * (per_weight if per_weight is not None else element_size))


def _block(hidden: int, rows: int, experts: int, top_k: int, device: str, dtype):
    import torch
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from swarm.stage.moe_experts import ROUTED, register

    register()
    config = Qwen3MoeConfig(hidden_size=hidden, num_experts=experts, num_experts_per_tok=top_k,
                            moe_intermediate_size=rows)
    config._experts_implementation = ROUTED  # what a stage runs (swarm.stage.slice)
    module = Qwen3MoeSparseMoeBlock(config).to(device=device, dtype=dtype).eval()
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return module


def measure_moe(device: str, dtype, sync: Callable[[], None], typical: Callable[..., float]) -> dict:
    """{"router_ms", "expert_ms", "kinds"}: the routing's fixed cost per layer and pass, its cost per routed expert,
    and per kind the points (expert bytes, ms of one routed expert). ``typical(fn, sync, repeats, budget_s)``:
    swarm.fellow.calibration's timing of a step."""
    import torch

    row = torch.randn(1, 1, 64, device=device, dtype=dtype)
    one, several = _block(64, 32, EXPERTS, 1, device, dtype), _block(64, 32, EXPERTS, TOP_K, device, dtype)
    t_one = typical(lambda: one(row), sync, 30, 0.3)
    t_several = typical(lambda: several(row), sync, 30, 0.3)
    expert = max(t_several - t_one, 0.0) / (TOP_K - 1)
    router = max(t_one - expert, 0.0)
    return {"router_ms": round(router * 1e3, 4), "expert_ms": round(expert * 1e3, 4),
            "kinds": measure_kinds(device, dtype, sync, typical, router)}


def measure_kinds(device: str, dtype, sync: Callable[[], None], typical: Callable[..., float],
                  router_s: float) -> dict[str, list[list[float]]]:
    """Per kind this device serves, [expert bytes, ms] of one routed expert at each of EXPERT_SHAPES: a block of
    experts with one row routed to TOP_K of them (ROWS rows in turn), less its routing, per expert."""
    import torch

    from swarm.quantization import kinds_on
    from swarm.stage.moe_experts import quantize_experts
    from swarm.stage.quantize import quantize_linear

    device_type = "cpu" if device == "cpu" else "cuda"
    served = [k for k in KINDS if k in kinds_on(device_type)]
    out: dict[str, list[list[float]]] = {}
    flush = torch.zeros(FLUSH_BYTES // 4, device=device, dtype=torch.float32)
    for kind in served:
        points = []
        for hidden, rows, experts in EXPERT_SHAPES:
            block = _block(hidden, rows, experts, TOP_K, device, dtype)
            try:
                if kind != "none":
                    quantize_experts(block, quantize_linear, kind)
            except Exception:  # noqa: BLE001 -- a kind this device cannot compute here: the planner falls back
                break
            inputs = torch.randn(ROWS, 1, 1, hidden, device=device, dtype=dtype)
            t = _cold(block, inputs, flush, sync)
            points.append([expert_bytes(hidden, rows, kind, device_type, inputs.element_size()),
                           round(max(t - router_s, 0.0) / TOP_K * 1e3, 4)])
            del block
        if len(points) == len(EXPERT_SHAPES):
            out[kind] = points
    return out


def _cold(block, inputs, flush, sync: Callable[[], None]) -> float:
    """The median seconds of KIND_RUNS calls of ``block``, each on the next of ``inputs``' rows after ``flush`` was
    written (not timed), after two warm-up calls."""
    import statistics
    import time

    for row in inputs[:2]:
        block(row)
    times = []
    for i in range(KIND_RUNS):
        flush.add_(1.0)
        sync()
        t0 = time.perf_counter()
        block(inputs[i % len(inputs)])
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
