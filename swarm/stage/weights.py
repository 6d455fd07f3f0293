"""Reading one of an imported model's weight files (swarm.model_format) into torch tensors, one tensor at a time.

A file from a safetensors folder, or from any import before GGUFs kept their blocks, holds float tensors: they are
converted to the compute dtype. A file that keeps a GGUF's tensors (its metadata names them under GGUF_TENSORS_KEY)
holds quantized block bytes and the file's own float tensors: each is dequantized with gguf-py -- the function
transformers' own GGUF loader calls, so the values are the file's, bit for bit -- a slice of rows at a time (gguf's
numpy dequantizers make a few arrays of the slice's size, so the intermediates stay tens of MB whatever the
tensor's size), then given transformers' per-family fix-up (``TENSOR_PROCESSORS``: Llama's q/k row permutation,
Gemma's norm offset) in float32, as ``from_pretrained(gguf_file=...)`` does, and only then converted to the compute
dtype. In float32 a stage so holds exactly what transformers' float32 load of the GGUF holds.

At the ``gguf`` kind the quantized linear weights are not widened: :func:`read_weights_and_blocks` hands them over as
their blocks, which swarm.stage.gguf_linear computes on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from swarm.errors import ModelError
from swarm.gguf_layout import joined_shape, own_processor, place_part, rows_as_filed
from swarm.model_format import GGUF_ARCHITECTURE_KEY, GGUF_FLOAT_TYPES, GGUF_JOIN_DIM, GGUF_TENSORS_KEY, GGUF_TYPES
from swarm.stage.gguf_linear import GGUFBlocks, row_order

# Values dequantized per slice of rows (the importer's bound before blocks were kept: swarm.store.gguf_source).
DEQUANT_SLICE_ELEMENTS = 4 << 20


def read_weights(path: Path, config: Mapping[str, Any], dtype: torch.dtype | None = None,
                 device: str | torch.device = "cpu", what: str = "",
                 keep_float32: re.Pattern | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the weight file at ``path`` (names as in the file), in ``dtype`` (None: float32 for a GGUF's
    tensors, the stored dtype otherwise) on ``device``. ``config``: the model's config.json contents (the GGUF
    fix-ups read the head counts from it). ``what``: the file as messages name it. ``keep_float32``: the names of the
    tensors read in float32 whatever ``dtype`` is (the family's ``_keep_in_fp32_modules_strict``: GLM's router)."""
    return read_weights_and_blocks(path, config, None, dtype, device, what, keep_float32)[0]


def read_weights_and_blocks(path: Path, config: Mapping[str, Any], keep: Callable[[str], bool] | None,
                            dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                            what: str = "", keep_float32: re.Pattern | None = None,
                            ) -> tuple[dict[str, torch.Tensor], dict[str, GGUFBlocks]]:
    """As :func:`read_weights`, but the file's quantized GGUF tensors whose names ``keep`` takes (the ``gguf`` kind's
    linear weights) come back apart, as their blocks (swarm.stage.gguf_linear), never widened: a fix-up that permutes
    their rows (Llama's q and k) is applied to the blocks' rows; one that does more widens them as before."""
    from safetensors import safe_open

    def wanted(key: str, value: torch.Tensor) -> torch.dtype:
        return torch.float32 if keep_float32 is not None and keep_float32.search(key) else dtype or value.dtype

    out: dict[str, torch.Tensor] = {}
    kept_blocks: dict[str, GGUFBlocks] = {}
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            if keep is not None and GGUF_TENSORS_KEY not in meta:
                raise ModelError(f"{what or path} holds no GGUF blocks (its model was imported from a safetensors "
                                 "folder, or before imports kept a GGUF's blocks), so the gguf kind has nothing to "
                                 "compute on; load the model at none, int8, nf4 or int4-fast, or import its .gguf "
                                 "file again")
            kept = json.loads(meta[GGUF_TENSORS_KEY]) if GGUF_TENSORS_KEY in meta else {}
            processor = None
            for key in f.keys():
                info = kept.get(key)
                if info is None:
                    value = f.get_tensor(key)
                    out[key] = value.to(device=device, dtype=wanted(key, value))
                    continue
                if info.get("fixup") and processor is None:
                    processor = _processor(meta.get(GGUF_ARCHITECTURE_KEY, ""), config)
                shape = tuple(info["shape"])
                into = info.get("into", "")
                as_filed = not info.get("fixup") or rows_as_filed(meta.get(GGUF_ARCHITECTURE_KEY, ""), info["name"])
                if keep is not None and len(shape) == 3 and as_filed and keep(into or key):
                    # a MoE layer's experts, [experts, rows, columns], whatever their type: as (experts x rows) rows
                    # of blocks, each expert's rows taken apart by swarm.stage.gguf_experts
                    blocks = f.get_tensor(key).clone()
                    kept_blocks[key] = GGUFBlocks(blocks.reshape(shape[0] * shape[1], -1), info["type"],
                                                  (int(shape[1]), int(shape[2])), experts=int(shape[0]), into=into,
                                                  part=int(info.get("part", 0)), join=info.get("join", ""))
                    continue
                if keep is not None and keep(key) and info["type"] not in GGUF_FLOAT_TYPES and len(shape) == 2:
                    # a copy: the stage must not hold safetensors' map of the file (see dequantize)
                    blocks = f.get_tensor(key).clone()
                    order = row_order(processor, info["name"], blocks.shape[0]) if info.get("fixup") else None
                    if order is not None or not info.get("fixup"):
                        kept_blocks[key] = GGUFBlocks(blocks if order is None else blocks[order].contiguous(),
                                                      info["type"], (int(shape[0]), int(shape[1])))
                        continue
                value = dequantize(f.get_tensor(key), info["type"], shape, f"{key} of {what or path}")
                if info.get("fixup") and processor is not None:
                    # torch.as_tensor: a fix-up may hand back numpy (Qwen2-MoE's shared-expert gate, expand_dims)
                    value = torch.as_tensor(processor.process(weights=value, name=info["name"]).weights).contiguous()
                if into:  # a part: into its place in the joined tensor
                    _put_part(out, kept, key, value.to(device=device, dtype=wanted(into, value)), what or str(path))
                else:
                    out[key] = value.to(device=device, dtype=wanted(key, value))
                del value
    except ModelError:
        raise
    except Exception as exc:  # safetensors and gguf raise many kinds for a damaged file
        raise ModelError(f"cannot read {what or path} ({exc}); fetch it again") from exc
    return out, kept_blocks


def _put_part(out: dict[str, torch.Tensor], kept: Mapping[str, Any], key: str, value: torch.Tensor,
              what: str) -> None:
    """Copy ``value``, the widened part ``key`` of a tensor the GGUF holds in parts (a MoE layer's ffn_gate_exps and
    ffn_up_exps: its experts' gate_up_proj), into its place in that tensor in ``out`` -- joined as transformers' GGUF
    loader joins them (swarm.store.gguf_source) -- allocated at the first part read: a layer holds its joined tensor
    and one widened part at once, never every part and their join."""
    into = kept[key]["into"]
    members = sorted((int(info.get("part", 0)), k) for k, info in kept.items() if info.get("into") == into)
    if [p for p, _ in members] != list(range(len(members))) or len(members) < 2:
        raise ModelError(f"{what} holds parts {[p for p, _ in members]} of {into}; it needs all of them")
    join = kept[key].get("join", "")  # side by side, or interleaved (gpt-oss: swarm.gguf_layout)
    sizes = [int(kept[k]["shape"][GGUF_JOIN_DIM]) for _, k in members]
    joined = out.get(into)
    if joined is None:
        shape = list(value.shape)
        if join:
            shape = list(joined_shape(tuple(value.shape), len(members), join, GGUF_JOIN_DIM))
        else:
            shape[GGUF_JOIN_DIM] = sum(sizes)
        joined = out[into] = torch.empty(shape, dtype=value.dtype, device=value.device)
    place_part(joined, value, [k for _, k in members].index(key), sizes, join, GGUF_JOIN_DIM)


def dequantize(stored: torch.Tensor, gguf_type: str, shape: tuple[int, ...], what: str = "tensor") -> torch.Tensor:
    """The float32 values of a tensor kept as the GGUF had it: ``stored`` is the file's float tensor, or its block
    bytes (rows, bytes per row) for a quantized type; ``shape`` its logical (transformers) shape."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf import dequantize as gguf_dequantize

    if gguf_type not in GGUF_TYPES:
        raise ModelError(f"{what} is stored as the GGUF type {gguf_type}, which this version of swarm does not read; "
                         f"it reads {', '.join(GGUF_TYPES)}. Update swarm on this fellow.")
    if gguf_type in GGUF_FLOAT_TYPES:
        # a copy even where it is float32 already: safetensors hands out tensors over its map of the file, which
        # would keep every page of the file's blocks read here in the stage's memory (measured: 40 MB a stage of the
        # built-in model)
        widened = stored.to(torch.float32, copy=True)
        if tuple(widened.shape) != shape:
            raise ModelError(f"{what} has shape {tuple(widened.shape)} where its metadata says {shape}")
        return widened
    kind = GGMLQuantizationType[gguf_type]
    raw = stored.numpy()
    rows = raw.shape[0]
    numel = 1
    for d in shape:
        numel *= int(d)
    if raw.ndim != 2 or rows == 0 or numel % rows:
        raise ModelError(f"{what}: {tuple(raw.shape)} bytes of {gguf_type} blocks cannot hold a tensor of shape "
                         f"{shape}")
    step = max(1, DEQUANT_SLICE_ELEMENTS // max(1, numel // rows))
    out: torch.Tensor | None = None
    for start in range(0, rows, step):
        values: Any = gguf_dequantize(raw[start : start + step], kind)
        if values.shape != (min(step, rows - start), numel // rows):
            raise ModelError(f"{what}: its {gguf_type} blocks hold {values.shape[-1]} values a row, its shape says "
                             f"{numel // rows}")
        piece = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
        if rows <= step:  # one slice: gguf's own array, not copied
            return piece.view(shape)
        if out is None:
            out = torch.empty(shape, dtype=torch.float32)
        out.view(rows, numel // rows)[start : start + step] = piece
    assert out is not None  # rows > 0
    return out


def _processor(architecture: str, config: Mapping[str, Any]) -> Any:
    """transformers' fix-up of the GGUF's family, as its GGUF loader builds it."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    own = own_processor(architecture)  # a family swarm maps itself (swarm.store.gguf_names)
    if own is not None:
        return own
    return TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=dict(config))
