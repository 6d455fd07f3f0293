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
