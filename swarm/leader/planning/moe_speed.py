"""What a mixture of experts' layers cost the planner (swarm.leader.planning.planner): the bytes a token computes of
each layer (its routed experts, not all of them), one expert's bytes at a load's kind, and the calibration's figures
of a routed expert at that kind (swarm.fellow.moe_calibration)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from swarm.leader.planning.placement import ModelSize

# A kind the calibration does not time, counted at one it does (swarm.fellow.moe_calibration.KINDS): nf4 computes
# through the same int4 kernel as int4-fast on CPU
TIMED_AS = {"nf4": "int4-fast"}


def line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(fixed, per unit) through the smallest and largest point; a measurement the noise made fall (the larger
    one timed faster) or cross below zero is read as proportional to the largest point."""
    (x0, y0), (x1, y1) = min(points), max(points)
    if x1 > x0:
        slope = (y1 - y0) / (x1 - x0)
        fixed = y0 - slope * x0
        if slope > 0 and fixed >= 0:
            return fixed, slope
    return 0.0, y1 / x1 if x1 else 0.0


def expert_line(moe: Any, kind: str) -> dict[str, float]:
    """expert_fixed_ms, expert_per_byte_ms and kind_byte_factor from the calibration's points of ``kind`` ({} where
    it has none). The factor: measured on a 2-core VM, an int8 expert took 0.4-0.5x an unquantized one's time at a
    quarter of its bytes, so a layer's int8 bytes counted at the float line were 2x too fast."""
    kinds = moe.get("kinds") if isinstance(moe, dict) else None
    points = (kinds.get(kind) or kinds.get(TIMED_AS.get(kind, ""))) if isinstance(kinds, dict) else None
    if not isinstance(points, list) or len(points) < 2:
        return {}
    try:
        pairs = [(float(b), float(ms)) for b, ms in points]
    except (TypeError, ValueError):
        return {}
    if any(b <= 0 or ms < 0 or not math.isfinite(ms) for b, ms in pairs):
        return {}
    fixed, per_byte = line(pairs)
    out = {"expert_fixed_ms": fixed, "expert_per_byte_ms": per_byte}
    plain = kinds.get("none") if isinstance(kinds, dict) else None
    if kind != "none" and isinstance(plain, list) and len(plain) == len(pairs):
        try:
            (b_none, t_none), (b_kind, t_kind) = [float(v) for v in plain[-1]], pairs[-1]
        except (TypeError, ValueError):
            return out
        if b_none > 0 and t_none > 0 and t_kind > 0:
            out["kind_byte_factor"] = b_none / b_kind * t_kind / t_none
    return out


def with_active_experts(size: ModelSize, config: dict, weight_bytes: float) -> ModelSize:
    """``size`` with what a token computes of each layer (:func:`active_layer_bytes`) and the experts a pass
    routes to: the planner's speed of a mixture of experts; a dense model's size as it is."""
    experts, top_k = moe_shape(config)
    if not experts:
        return size
    rows = config.get("moe_intermediate_size") or config.get("intermediate_size")
    expert = int(3 * int(config.get("hidden_size") or 0) * int(rows or 0) * weight_bytes)
    return dataclasses.replace(size, compute_bytes=active_layer_bytes(size.layer_bytes, config, weight_bytes),
                               experts=experts, experts_per_token=top_k, expert_bytes=expert)


def moe_shape(config: dict) -> tuple[int, int]:
    """(experts, experts per token) of a mixture of experts' config.json; (0, 0) for a dense model."""
    experts = config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts")
    top_k = config.get("num_experts_per_tok")
    if isinstance(experts, int) and isinstance(top_k, int) and experts > top_k > 0:
        return experts, top_k
    return 0, 0


def active_layer_bytes(layer_bytes: tuple[int, ...], config: dict, weight_bytes: float) -> tuple[int, ...]:
    """What one token computes of each layer of a mixture of experts (``config``: its config.json): the layer less
    its experts the router does not pick (experts - top-k of them, each a gate, an up and a down matrix of hidden x
    expert rows at ``weight_bytes`` a weight); attention, router and shared experts stay. A prompt's tokens each
    compute their own top-k too, so prefill counts the same. A layer smaller than its unpicked experts (a dense
    layer of a model whose first layers are dense, GLM-4.5's) counts whole; a dense model's layers come back as
    they are."""
    experts, top_k = moe_shape(config)
    rows = config.get("moe_intermediate_size") or config.get("intermediate_size")
    hidden = config.get("hidden_size")
    if not (experts and rows and hidden):
        return layer_bytes
    idle = int((experts - top_k) * 3 * int(hidden) * int(rows) * weight_bytes)
    return tuple(b - idle if b > idle else b for b in layer_bytes)


def expert_weight_bytes(manifest: dict, cpu: bool, kind: str) -> float:
    """What one expert weight holds at a load of ``kind`` (swarm.leader.serving.models.model_size counts alike); at
    ``gguf`` on CPU, a weight of the GGUF's main type as the kernels hold it."""
    from swarm.model_format import DTYPE_BYTES
    from swarm.quantization import GGUF_KIND, bytes_per_weight, gguf_weight_bytes

    quantized = bytes_per_weight(kind, "cpu" if cpu else "cuda", manifest.get("hidden_size") or 0)
    if quantized is not None:
        return quantized
    held = gguf_weight_bytes(manifest.get("file_type", "")) if kind == GGUF_KIND and cpu else None
    if held is not None:
        return held
    return 4 if cpu else DTYPE_BYTES.get(manifest.get("dtype", "float32"), 4)
