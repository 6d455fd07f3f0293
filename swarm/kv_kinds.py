"""How stages hold their requests' keys and values (``--kv-cache``), as facts the leader, the fellow and the stage
share: the kinds' names and the bytes each element takes, for placement and admission. The cache layers that hold
them are in swarm.stage.kv_cache.

- ``auto`` (the default): the stage's compute dtype, what transformers' DynamicCache holds -- float32 on CPU, the
  checkpoint's half precision on a GPU.
- ``f32``, ``f16``: that float width, whatever the compute dtype (keys and values are widened back to it to attend).
- ``q8``: 8-bit integers with one float16 scale per group of Q8_GROUP elements along a head's dimension --
  llama.cpp's q8_0 layout (32 int8 values + one fp16 scale per block): 1.0625 bytes an element, about half of f16.
"""

from __future__ import annotations

from typing import Any

from swarm.errors import BadRequest

KV_KINDS = ("auto", "f32", "f16", "q8")
Q8_GROUP = 32  # llama.cpp's q8_0 block (ggml-common.h, QK8_0): one fp16 scale per 32 values
_BYTES = {"f32": 4.0, "f16": 2.0, "q8": 1.0 + 2.0 / Q8_GROUP}


def check_kv_kind(kind: Any) -> str:
    """``kind`` when it is a KV cache kind this product knows (None: ``auto``); BadRequest naming the choices
    otherwise."""
    if kind is None:
        return "auto"
    if not isinstance(kind, str) or kind not in KV_KINDS:
        raise BadRequest(f"kv_cache must be one of {', '.join(KV_KINDS)}; got {kind!r}. Leave it out for the "
                         "stages' compute dtype, or use q8 to hold the KV cache at about half of f16.",
                         "invalid_kv_cache")
    return kind


def kv_element_bytes(kind: str, compute_bytes: int) -> float:
    """Bytes one key or value element takes at ``kind`` on a stage computing in ``compute_bytes`` per element."""
    return float(compute_bytes) if kind == "auto" else _BYTES[kind]
