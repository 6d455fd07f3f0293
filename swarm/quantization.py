"""Quantization kinds of a load, as facts the leader, the fellow and the stage share: their names, what a quantized
weight holds in memory, and what a machine needs to run each kind -- asked of the installed packages without
importing torch. The stage's modules that hold and compute quantized weights are in swarm.stage.quantize."""

from __future__ import annotations

import importlib.util
from typing import Any

from swarm.errors import BadRequest

KINDS = ("none", "int8", "nf4", "int4-fast")
INT4_GROUP = 32  # weights per scale/offset on CPU: the smallest group torchao's int4 offers, the best perplexity

# Bytes a quantized weight takes, scales included, for placement and the KV budget (what swarm.stage.quantize's modules
# hold): CPU int8: 1 byte + a bfloat16 scale per row; CPU int4: half a byte + a bfloat16 scale and offset per 32
# weights; CUDA nf4: half a byte + bitsandbytes' absmax per 64 weights (double-quantized to ~0.127 bits); CUDA int4
# (torchao): half a byte + a bfloat16 scale and zero per 128 weights.
_BYTES_PER_WEIGHT = {
    ("cpu", "int8"): 1.0, ("cpu", "nf4"): 0.5 + 4 / INT4_GROUP, ("cpu", "int4-fast"): 0.5 + 4 / INT4_GROUP,
    ("cuda", "int8"): 1.0, ("cuda", "nf4"): 0.5 + 0.127 / 8, ("cuda", "int4-fast"): 0.5 + 4 / 128,
}


def check_kind(kind: Any) -> str:
    """``kind`` when it is a quantization this product knows; BadRequest naming the choices otherwise."""
    if kind is None:
        return "none"
    if not isinstance(kind, str) or kind not in KINDS:
        raise BadRequest(f"quantization must be one of {', '.join(KINDS)}; got {kind!r}.", "invalid_quantization")
    return kind


# int8 also holds a scale per output row: bfloat16 on CPU, float32 in bitsandbytes' LLM.int8 (its SCB).
_BYTES_PER_ROW = {("cpu", "int8"): 2, ("cuda", "int8"): 4}


def bytes_per_weight(kind: str, device_type: str, row: int | None = None) -> float | None:
    """What one weight of a quantized linear layer holds in memory (None: unquantized); with ``row`` (the weights of
    an output row, a layer's in_features: give the shortest for an upper bound), its share of the row's scale too."""
    device = "cuda" if device_type != "cpu" else "cpu"
    per_weight = _BYTES_PER_WEIGHT.get((device, kind))
    if per_weight is None or not row:
        return per_weight
    return per_weight + _BYTES_PER_ROW.get((device, kind), 0) / row


# --- what a machine can run (reported in the fellow's hardware, cheap: no torch import) ------------------------------


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _torch_version() -> tuple[int, int]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor, *_ = version("torch").split(".")
        return int(major), int(minor)
    except (PackageNotFoundError, ValueError):
        return (0, 0)


def kinds_on(device_type: str) -> list[str]:
    """The quantization kinds this machine can serve on ``device_type`` ("cpu" or "cuda")."""
    kinds = ["none"]
    if device_type == "cpu":
        # _weight_int8pack_mm has run on CPU since torch 2.3, _weight_int4pack_mm_for_cpu since 2.6.
        if _torch_version() >= (2, 6):
            kinds += ["int8", "nf4", "int4-fast"]
        return kinds
    if _installed("bitsandbytes"):
        kinds += ["int8", "nf4", "int4-fast"]  # int4-fast is plain nf4 without torchao
    elif _installed("torchao"):
        kinds += ["int4-fast"]
    return kinds


def needs(kind: str, device_type: str) -> str:
    """What a machine needs to serve ``kind`` on ``device_type``, in words for a refusal."""
    if device_type == "cpu":
        return "torch 2.6 or newer (its CPU int8/int4 kernels): pip install -U torch in the fellow's environment"
    if kind == "int4-fast":
        return "torchao or bitsandbytes: pip install torchao (or bitsandbytes) in the fellow's environment"
    return "bitsandbytes: pip install bitsandbytes in the fellow's environment"


def cuda_path(kind: str) -> str:
    """Which library serves ``kind`` on this machine's CUDA cards: "bitsandbytes", "torchao" or "none"."""
    if kind == "none":
        return "none"
    if kind == "int4-fast" and _installed("torchao"):
        return "torchao"
    return "bitsandbytes"
