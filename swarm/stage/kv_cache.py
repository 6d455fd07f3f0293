"""The KV caches a stage keeps per request, at the kind its load asked for (swarm.kv_kinds): transformers'
DynamicCache as it is (``auto``, or the float width the stage computes in), or one whose full-attention layers hold
their keys and values packed -- another float width, or q8: int8 values with a float16 scale per group of
Q8_GROUP elements of a head's dimension, as llama.cpp's q8_0 blocks.

A packed layer is a DynamicLayer to the library's attention: ``update`` stores the new rows packed and returns every
cached row unpacked in the compute dtype -- the new rows too, so a row attends to its own key as it is stored, as
later rows will see it. Sliding-window layers stay as the library keeps them: they hold a window, not the context.
The stage's own decode paths (swarm.stage.lean_decode, swarm.stage.compiled_decode) write into a plain layer's
tensors in place; they take only plain caches (:func:`is_packed` says which are not), and packed ones go through the
library's layers."""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from swarm.kv_kinds import Q8_GROUP

_FLOATS = {"f32": torch.float32, "f16": torch.float16}


class PackedLayer(DynamicLayer):
    """A full-attention layer's keys and values, held packed (:meth:`pack`) and unpacked to attend."""

    is_croppable = True

    def __init__(self) -> None:
        super().__init__()
        self.length = 0
        self.packed_keys: tuple[torch.Tensor, ...] = ()
        self.packed_values: tuple[torch.Tensor, ...] = ()
        self.dtype = torch.float32

    def pack(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def unpack(self, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        raise NotImplementedError

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.packed_keys = _append(self.packed_keys, self.pack(key_states))
        self.packed_values = _append(self.packed_values, self.pack(value_states))
        self.length += key_states.shape[-2]
        keys, values = self.unpack(self.packed_keys), self.unpack(self.packed_values)
        return keys, values

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of tokens to remove")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        keep = max(self.length + tokens_to_remove, 0)
        self.packed_keys = tuple(p[..., :keep, :] for p in self.packed_keys)
        self.packed_values = tuple(p[..., :keep, :] for p in self.packed_values)
        self.length = keep

    def reset(self) -> None:
        self.packed_keys = self.packed_values = ()
        self.length = 0
        super().reset()

    def rows(self, start: int, end: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Copies of rows [start, end) of the packed keys and values, as they are packed (the prefix cache)."""
        return (tuple(p[..., start:end, :].clone() for p in self.packed_keys),
                tuple(p[..., start:end, :].clone() for p in self.packed_values))

    def extend(self, keys: tuple[torch.Tensor, ...], values: tuple[torch.Tensor, ...], dtype: torch.dtype) -> None:
        """Append packed rows (:meth:`rows` of a layer of the same kind), unpacked to ``dtype`` when attended."""
        if not self.is_initialized:
            self.device, self.dtype, self.is_initialized = keys[0].device, dtype, True
        self.packed_keys = _append(self.packed_keys, keys)
        self.packed_values = _append(self.packed_values, values)
        self.length += keys[0].shape[-2]

    def held_bytes(self) -> int:
        """What this layer's packed keys and values take in memory."""
        return sum(p.numel() * p.element_size() for p in (*self.packed_keys, *self.packed_values))


class FloatLayer(PackedLayer):
    """Keys and values held at another float width than the compute dtype (f16 on a float32 CPU stage)."""

    def __init__(self, held: torch.dtype) -> None:
        super().__init__()
        self.held = held

    def pack(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x.to(self.held),)

    def unpack(self, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return parts[0].to(self.dtype)


class Q8Layer(PackedLayer):
    """Keys and values as int8 with a float16 scale per group of a head's dimension (q8_0's symmetric rounding:
    scale = max |x| / 127, value = round(x / scale))."""

    def pack(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return quantize_q8(x)

    def unpack(self, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return dequantize_q8(parts[0], parts[1], self.dtype)


def _group(dim: int) -> int:
    """Elements per scale for a head dimension of ``dim``: Q8_GROUP, or the largest divisor of dim it has in common."""
    return math.gcd(dim, Q8_GROUP)


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values shaped as ``x``, float16 scales (..., dim / group)) of ``x`` (..., dim)."""
    dim = x.shape[-1]
    groups = x.float().reshape(*x.shape[:-1], dim // _group(dim), _group(dim))
    scale = (groups.abs().amax(dim=-1, keepdim=True) / 127.0).to(torch.float16)
    # divide by the scale as it is stored (fp16), so values and scale agree; a group of zeros keeps scale 0
    safe = scale.float().clamp_min(torch.finfo(torch.float16).tiny)
    values = torch.round(groups / safe).clamp_(-127, 127).to(torch.int8)
    return values.reshape(x.shape), scale.squeeze(-1)


def dequantize_q8(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    dim = values.shape[-1]
    groups = values.reshape(*values.shape[:-1], dim // _group(dim), _group(dim)).float()
    return (groups * scale.float().unsqueeze(-1)).reshape(values.shape).to(dtype)


def _append(held: tuple[torch.Tensor, ...], new: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    if not held:
        return tuple(p.contiguous() for p in new)
    return tuple(torch.cat([a, b], dim=-2) for a, b in zip(held, new))


class PackedCache(DynamicCache):
    """A DynamicCache whose full-attention layers are packed (:class:`PackedLayer`); ``kind`` names how."""

    kind = "auto"


def new_cache(config: Any, kind: str = "auto", dtype: torch.dtype = torch.float32) -> DynamicCache:
    """An empty cache for one request on a stage computing in ``dtype``, holding keys and values at ``kind``
    (swarm.kv_kinds.KV_KINDS): the library's DynamicCache where that is the compute dtype's."""
    if kind == "auto" or _FLOATS.get(kind) == dtype:
        return DynamicCache(config=config)
    cache = PackedCache(config=config)
    cache.kind = kind
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:  # full attention; sliding layers keep only their window as they are
            cache.layers[i] = Q8Layer() if kind == "q8" else FloatLayer(_FLOATS[kind])
    return cache


def is_packed(cache: Any) -> bool:
    """Whether ``cache`` (a request's, or a batched pass's swarm.stage.ragged.RaggedCache) holds packed layers, which
    the stage's in-place decode paths do not write."""
    if isinstance(cache, PackedCache):
        return True
    return any(isinstance(c, PackedCache) for c in getattr(cache, "caches", ()))


def held_bytes(cache: DynamicCache) -> int:
    """Bytes a request's cache holds in memory, packed layers as packed."""
    total = 0
    for layer in cache.layers:
        if isinstance(layer, PackedLayer):
            total += layer.held_bytes()
        else:
            for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(tensor, torch.Tensor):
                    total += tensor.numel() * tensor.element_size()
    return total
