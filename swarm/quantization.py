"""Quantization kinds of a load, as facts the leader, the fellow and the stage share: their names, what a quantized
weight holds in memory, and what a machine needs to run each kind -- asked of the installed packages without
importing torch. The stage's modules that hold and compute quantized weights are in swarm.stage.quantize."""

from __future__ import annotations

import importlib.util
from typing import Any

from swarm.errors import BadRequest

KINDS = ("none", "int8", "nf4", "int4-fast", "gguf")
# gguf: a GGUF model's linear layers computed on the file's own quantized blocks (swarm.stage.gguf_linear); the
# default kind of a model imported from a .gguf file, refused for one without kept blocks (check_model_kind)
GGUF_KIND = "gguf"
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


def default_kind(manifest: dict | None) -> str:
    """The kind a model loads at when none is asked: ``gguf`` for a model that keeps a GGUF's blocks (its manifest's
    storage), ``none`` otherwise."""
    return GGUF_KIND if manifest and manifest.get("storage") == "gguf" else "none"


def check_model_kind(kind: str, manifest: dict | None, name: str) -> str:
    """``kind`` when model ``name`` can load at it; BadRequest saying why not and what to do otherwise."""
    kind = check_kind(kind)
    if kind == GGUF_KIND and default_kind(manifest) != GGUF_KIND:
        raise BadRequest(f"quantization gguf computes on a GGUF file's own quantized blocks, and model {name} has none "
                         "(it was imported from a safetensors folder, or before imports kept a GGUF's blocks). Load it "
                         "at none, int8, nf4 or int4-fast, or import its .gguf file again.", "invalid_quantization")
    return kind


# What a stage at gguf holds per byte of a layer's stored blocks (swarm.stage.gguf_linear), by GGUF type: Q4_0 and
# Q4_1 repack to half a byte a weight plus a float16 scale and offset per 32 (0.625 bytes: Q4_1's own size, Q4_0's 18
# bytes a block of 32 become 20); Q4_K to a float32 scale and offset per 32 (0.75 bytes against 144 / 256 = 0.5625);
# the 8-bit group kernel's types (swarm.stage.gguf_q8) to their levels -- a byte a weight for Q8_0, nibbles and
# high-bit planes for the 5- and 6-bit types (5/8 and 6/8 of a byte; rows are padded to 64 inputs, which the
# models' widths already are) -- and scales per 32 as exact as the file's: fp16 d (and m) for Q8_0, Q5_0 and Q5_1
# (those three at their file's size), int8 sub-scales plus an fp16 multiplier per 8 for Q5_K and Q6_K (Q6_K's per
# 16): 1.0625 bytes for Q8_0, 0.6875 for Q5_0, 0.75 for Q5_1, 0.703 for Q5_K (file 0.6875), 0.828 for Q6_K (0.820).
GGUF_HELD_PER_STORED = {"Q4_0": 20 / 18, "Q4_1": 1.0, "Q4_K": 0.75 / 0.5625, "Q8_0": 1.0, "Q5_0": 1.0, "Q5_1": 1.0,
                        "Q5_K": (0.625 + 2 * 1.25 / 32) / (176 / 256), "Q6_K": (0.75 + 2 * 1.25 / 32) / (210 / 256)}
# The types llama.cpp's mixes put in a layer (Q4_K_M: Q4_K with some Q6_K, and Q5_0/Q8_0 where rows do not fit 256):
# a layer of a mix counts at its most expensive type, an upper bound.
_GGUF_MIXES = {"Q4_K": ("Q4_K", "Q5_0", "Q6_K", "Q8_0"), "Q5_K": ("Q5_K", "Q5_0", "Q6_K", "Q8_0"),
               "Q6_K": ("Q6_K", "Q8_0"), "Q3_K": (), "Q2_K": ()}


# gpt-oss's MXFP4 files (llama.cpp's MOSTLY_MXFP4_MOE): the experts MXFP4 (17 bytes a block of 32, held at Q5_0's
# 0.6875 bytes a weight by swarm.stage.gguf_q8), the rest BF16 (and F32 norms and biases), which widens to float32
_MXFP4_FILES = frozenset({"MXFP4", "MXFP4_MOE"})
_MXFP4_STORED, _MXFP4_HELD = 17 / 32, 0.6875


def gguf_layer_bytes(file_type: str, stored: int, params: int, types: dict[str, int] | None = None) -> int:
    """What a layer file of ``stored`` bytes holding ``params`` weight values takes in a stage at ``gguf`` on CPU
    (swarm.stage.gguf_linear). ``types``: its weight values by GGUF type, as the import counted them (the manifest's):
    each type at what a kernel's layout holds a weight of it (GGUF_HELD_PER_WEIGHT), every other type -- F32, F16,
    BF16, and the types no kernel takes (Q2_K, Q3_K, IQ*) -- widened to float32, 4 bytes a weight. Without them (a
    manifest written before), the file's type as llama.cpp names it (manifest file_type: Q4_1, Q4_K_M) decides, an
    upper bound for a mix; an MXFP4 file's layer is then split into its MXFP4 weights and its 16-bit ones from its
    bytes and weights (two equations, two unknowns): those at 0.6875 bytes, these at 4 (its F32 counted as 16-bit,
    which overcounts a file whose matrices are F32)."""
    if types:
        return int(sum(GGUF_HELD_PER_WEIGHT.get(t.upper(), 4) * n for t, n in types.items()))
    name = file_type.upper()
    family = name.rsplit("_", 1)[0] if name.endswith(("_S", "_M", "_L", "_XS")) else name
    if family in _MXFP4_FILES and stored and params:
        wide = min(params, max(0.0, (stored - _MXFP4_STORED * params) / (2 - _MXFP4_STORED)))
        return int(_MXFP4_HELD * (params - wide) + 4 * wide)
    mix = _GGUF_MIXES.get(family, (family,))
    ratios = [GGUF_HELD_PER_STORED.get(t) for t in mix]
    if not stored or not ratios or None in ratios:
        return params * 4
    return int(stored * max(r for r in ratios if r is not None))


# What a stage at gguf holds per weight of each type a kernel takes (the figures above): a MoE layer's routed
# experts' bytes a weight, for the planner's speed (swarm.leader.planning.moe_speed)
GGUF_HELD_PER_WEIGHT = {"Q4_0": 0.625, "Q4_1": 0.625, "Q4_K": 0.75, "Q8_0": 1.0625, "Q5_0": 0.6875, "Q5_1": 0.75,
                        "Q5_K": 0.625 + 2 * 1.25 / 32, "Q6_K": 0.75 + 2 * 1.25 / 32, "MXFP4": _MXFP4_HELD,
                        "MXFP4_MOE": _MXFP4_HELD}


def gguf_weight_bytes(file_type: str) -> float | None:
    """What a weight of a GGUF of ``file_type`` (Q4_0, Q4_K_M) holds at ``gguf`` on CPU, at the file's main type (a
    mix's: Q4_K for Q4_K_M); None where no kernel takes it (it widens to float32)."""
    name = file_type.upper()
    return GGUF_HELD_PER_WEIGHT.get(name.rsplit("_", 1)[0] if name.endswith(("_S", "_M", "_L", "_XS")) else name)


def gguf_head_bytes(file_type: str, stored: int, params: int) -> int:
    """What a head built on an embedding's blocks of ``stored`` bytes takes at ``gguf`` on CPU: llama.cpp's files keep
    the embedding at a type of their own (Q8_0 in a Q4_1 file, Q6_K in a Q4_K_M one), so it counts at the most a
    kernel's layout holds per stored byte -- or at float32 for a file whose layers have no kernel either."""
    name = file_type.upper()
    if name in _MXFP4_FILES or gguf_layer_bytes(file_type, stored, params) == params * 4:  # gpt-oss's head: BF16
        return params * 4
    return int(stored * max(GGUF_HELD_PER_STORED.values()))


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
        return [*kinds, GGUF_KIND]  # swarm's own kernel, or the blocks' float values where it cannot be built
    if _installed("bitsandbytes"):
        kinds += ["int8", "nf4", "int4-fast"]  # int4-fast is plain nf4 without torchao
    elif _installed("torchao"):
        kinds += ["int4-fast"]
    return [*kinds, GGUF_KIND]  # on CUDA each layer's blocks widen to the card's dtype at load


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
