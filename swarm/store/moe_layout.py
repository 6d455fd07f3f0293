"""Mixture-of-experts layers as their decoder layer holds them: checkpoints keep one matrix per expert
(``mlp.experts.3.gate_proj.weight``), transformers 5's MoE layers hold each kind fused over the experts
(``mlp.experts.gate_up_proj``, experts x rows x columns) and convert at load with the family's checkpoint conversion
mapping. An import applies that same mapping (transformers' own renamings and operations, not a copy of them) to
each layer file's tensors, so a stored layer file holds exactly what the family's decoder layer's state_dict expects.

A fused tensor is read (all its experts) only when its layer file is written, one layer at a time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from swarm.errors import ImportFailed
from swarm.gguf_layout import joined_shape, place_part
from swarm.model_format import GGUF_JOIN_DIM


@dataclass(frozen=True)
class FusedTensor:
    """A layer tensor built from several checkpoint tensors by a conversion: ``shape`` and ``read(dtype)`` as a
    source tensor has them; read whole, never in slices."""

    hf_name: str
    shape: tuple[int, ...]
    parts: tuple[tuple[str, tuple[Any, ...]], ...]  # source pattern -> that pattern's tensors in expert order
    operations: tuple[Any, ...]
    source_patterns: tuple[str, ...]
    target_patterns: tuple[str, ...]
    write: None = None
    floating: bool = True

    def read(self, dtype: Any) -> Any:
        values: dict[str, Any] = {p: [t.read(dtype) for t in tensors] for p, tensors in self.parts}
        for op in self.operations:
            values = op.convert(values, list(self.source_patterns), list(self.target_patterns))
        (value,) = values.values()
        return value.to(dtype)


def _mapping(model_type: str) -> list[Any]:
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    return list(get_checkpoint_conversion_mapping(model_type) or [])


def fuse_layer(model_type: str, index: int, group: dict[str, Any]) -> dict[str, Any]:
    """One layer's tensors (names relative to the layer) with the family's conversion mapping applied: renamings,
    then per-expert tensors merged into the fused tensors the decoder layer holds. A group already fused, or of a
    family without a mapping, comes back as it was."""
    from transformers.conversion_mapping import WeightConverter, WeightRenaming

    mapping = _mapping(model_type)
    if not mapping:
        return group
    prefix = f"model.layers.{index}."
    named = {prefix + k: t for k, t in group.items()}
    for rule in mapping:
        if isinstance(rule, WeightRenaming):
            for src, dst in zip(rule.source_patterns, rule.target_patterns, strict=False):
                named = {re.sub(src, dst, k): t for k, t in named.items()}
    for rule in mapping:
        if not isinstance(rule, WeightConverter) or len(rule.target_patterns) != 1:
            continue
        parts: dict[str, list[tuple[int, str]]] = {}
        base = None
        for src in rule.source_patterns:
            regex = re.compile("^(.*)" + re.escape(src.lstrip(".")).replace(r"\*", r"(\d+)") + "$")
            for k in named:
                if m := regex.match(k):
                    base = m.group(1)
                    parts.setdefault(src, []).append((int(m.group(2)), k))
        if not parts:
            continue
        if set(parts) != set(rule.source_patterns) or base is None:
            raise ImportFailed(f"layer {index} has some but not all of {', '.join(rule.source_patterns)}; "
                               "the checkpoint is incomplete")
        counts = {len(v) for v in parts.values()}
        ordered = {src: [k for _, k in sorted(parts[src])] for src in rule.source_patterns}
        if len(counts) != 1 or any([i for i, _ in sorted(v)] != list(range(len(v))) for v in parts.values()):
            raise ImportFailed(f"layer {index}'s experts are not numbered 0..n-1 alike in every kind of matrix; "
                               "the checkpoint is incomplete")
        tensors = {src: tuple(named.pop(k) for k in keys) for src, keys in ordered.items()}
        target = base + rule.target_patterns[0].lstrip(".")
        shape = _fused_shape(rule, tensors)
        named[target] = FusedTensor(target, shape, tuple(tensors.items()), tuple(rule.operations),
                                    tuple(rule.source_patterns), tuple(rule.target_patterns))
    return {k.removeprefix(prefix): t for k, t in named.items()}


def _fused_shape(rule: Any, tensors: dict[str, tuple[Any, ...]]) -> tuple[int, ...]:
    """The fused tensor's shape, found by running the operations on empty tensors of the parts' shapes."""
    import torch

    values: dict[str, Any] = {p: [torch.empty(t.shape, device="meta") for t in ts] for p, ts in tensors.items()}
    for op in rule.operations:
        values = op.convert(values, list(rule.source_patterns), list(rule.target_patterns))
    (value,) = values.values()
    return tuple(int(d) for d in value.shape)


@dataclass(frozen=True)
class JoinedTensor:
    """A transformers tensor a GGUF holds in parts (swarm.store.gguf_source: a MoE layer's ffn_gate_exps and
    ffn_up_exps, its experts' gate_up_proj), read joined along ``dim`` -- as transformers' GGUF loader joins them."""

    hf_name: str
    shape: tuple[int, ...]
    parts: tuple[Any, ...]
    dim: int
    write: None = None
    floating: bool = True
    join: str = ""  # swarm.gguf_layout: side by side along dim, or interleaved (gpt-oss)

    def read(self, dtype: Any) -> Any:
        import torch

        if not self.join:
            return torch.cat([part.read(dtype) for part in self.parts], dim=self.dim)
        out = torch.empty(self.shape, dtype=dtype)
        sizes = [int(part.shape[self.dim]) for part in self.parts]
        for index, part in enumerate(self.parts):
            place_part(out, part.read(dtype), index, sizes, self.join, self.dim)
        return out


def joined_parts(tensors: list[Any]) -> list[Any]:
    """``tensors`` (a GGUF's, swarm.store.gguf_source) with the parts of each joined tensor replaced by one
    :class:`JoinedTensor`, where the first part was; a list without parts comes back as it was."""
    parts: dict[str, list[Any]] = {}
    for tensor in tensors:
        if getattr(tensor, "into", ""):
            parts.setdefault(tensor.into, []).append(tensor)
    out = []
    for tensor in tensors:
        into = getattr(tensor, "into", "")
        if not into:
            out.append(tensor)
            continue
        group = sorted(parts.pop(into, []), key=lambda t: t.part)
        if not group:
            continue  # joined at its first part
        join = getattr(group[0], "join", "")
        shape = list(group[0].shape)
        if join:
            shape = list(joined_shape(tuple(shape), len(group), join, GGUF_JOIN_DIM))
        else:
            shape[GGUF_JOIN_DIM] = sum(t.shape[GGUF_JOIN_DIM] for t in group)
        out.append(JoinedTensor(into, tuple(shape), tuple(group), GGUF_JOIN_DIM, join=join))
    return out


# gpt-oss checkpoints keep their experts in MXFP4: for each fused matrix ``X``, ``X_blocks`` (experts x rows x groups x
# 16 bytes, two 4-bit values a byte) and ``X_scales`` (experts x rows x groups, a power-of-two exponent biased by 127
# per 32 values).
MXFP4_PARTS = ("_blocks", "_scales")


@dataclass(frozen=True)
class Mxfp4Tensor:
    """A fused expert matrix of a safetensors MXFP4 checkpoint, read dequantized by transformers' own MXFP4 conversion
    (``convert_moe_packed_tensors``, what ``from_pretrained`` runs when it dequantizes): ``shape`` and ``read(dtype)``
    as the decoder layer's parameter has them. Every FP4 value times its power of two is exact in bfloat16 (and
    float32), so a checkpoint stored in its own 16-bit dtype loses nothing."""

    hf_name: str
    shape: tuple[int, ...]
    blocks: Any
    scales: Any
    write: None = None
    floating: bool = True

    def read(self, dtype: Any) -> Any:
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        return convert_moe_packed_tensors(self.blocks.read(None), self.scales.read(None), dtype=dtype)


def dequantized_mxfp4(tensors: list[Any]) -> list[Any]:
    """``tensors`` (objects with hf_name, shape, read) with each MXFP4 ``X_blocks`` / ``X_scales`` pair replaced by the
    one dequantized tensor ``X``; a list without such pairs comes back as it was."""
    by_name = {t.hf_name: t for t in tensors}
    out = []
    for tensor in tensors:
        name = tensor.hf_name
        if name.endswith(MXFP4_PARTS[1]) and name.removesuffix(MXFP4_PARTS[1]) + MXFP4_PARTS[0] in by_name:
            continue  # read with its blocks
        if not name.endswith(MXFP4_PARTS[0]):
            out.append(tensor)
            continue
        base = name.removesuffix(MXFP4_PARTS[0])
        scales = by_name.get(base + MXFP4_PARTS[1])
        if scales is None:
            raise ImportFailed(f"{name} has no {base + MXFP4_PARTS[1]} beside it; the MXFP4 checkpoint is incomplete")
        *lead, rows, groups, pair_bytes = tensor.shape
        if tuple(scales.shape) != (*lead, rows, groups):
            raise ImportFailed(f"{name} {tuple(tensor.shape)} and its scales {tuple(scales.shape)} do not match; "
                               "the MXFP4 checkpoint is damaged")
        out.append(Mxfp4Tensor(base, (*lead, groups * pair_bytes * 2, rows), tensor, scales))
    return out


class Float32Tensor:
    """A tensor stored in float32 whatever the model's dtype: one the family keeps in float32 in a 16-bit load
    (``_keep_in_fp32_modules_strict``: GLM-4.5's router weight and score-correction bias), so that a stage holds
    the checkpoint's values, as transformers' from_pretrained does, not their 16-bit rounding."""

    stored_dtype = "float32"
    floating = True
    write = None

    def __init__(self, tensor: Any):
        self.tensor = tensor
        self.hf_name = tensor.hf_name
        self.shape = tensor.shape

    def read(self, dtype: Any) -> Any:
        return self.tensor.read(dtype)


def kept_float32(config: Any, group: dict[str, Any]) -> dict[str, Any]:
    """A layer's tensors (names relative to the layer) with those the family keeps in float32 wrapped to be stored
    so (:class:`Float32Tensor`)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from swarm.model_format import module_names_pattern

    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return group
    pattern = module_names_pattern(list(getattr(model_class, "_keep_in_fp32_modules_strict", None) or []))
    if pattern is None:
        return group
    return {k: Float32Tensor(t) if pattern.search(k) else t for k, t in group.items()}
