"""The ``gguf`` kind for a mixture-of-experts layer: each expert's matrices computed on the file's own blocks.

A MoE GGUF holds a layer's experts as 3-D tensors, [experts, rows, columns] (llama.cpp's ffn_gate_exps, ffn_up_exps
and ffn_down_exps): expert e's matrix is rows e*rows .. (e+1)*rows of the tensor's blocks, whole rows of blocks, so
each expert's matrix is taken apart exactly. The import keeps these tensors as the file has them, the gate and up
experts apart (swarm.store.gguf_source); a stage at ``gguf`` builds one :func:`swarm.stage.gguf_linear.gguf_linear`
per expert and matrix on those rows -- the gate and up rows of an expert stacked into one matrix where both have
the same type, which is exact and the gate_up_proj transformers computes -- and computes them in swarm's experts loop
(swarm.stage.moe_experts.experts_loop): only the routed experts' matrices are read for a token, and a batch reads
each hit expert once for all its rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from swarm.errors import ModelError
from swarm.stage.gguf_linear import GGUFBlocks, gguf_linear
from swarm.stage.moe_experts import LinearExperts, fused_experts

# the experts' matrices a stage at gguf computes on blocks, as transformers' experts modules name them
EXPERT_MATRICES = ("gate_up_proj", "up_proj", "down_proj")


def is_expert_weight(layer: nn.Module, key: str) -> bool:
    """Whether state-dict name ``key`` is a fused expert matrix of ``layer`` that :class:`GGUFExperts` computes
    (experts of another layout -- transposed, biased, normed: gpt-oss -- are not)."""
    path, _, leaf = key.rpartition(".")
    if leaf not in EXPERT_MATRICES:
        return False
    try:
        module = layer.get_submodule(path)
    except AttributeError:
        return False
    return fused_experts(module) and not _other_layout(module)


def _other_layout(module: Any) -> bool:
    return bool(getattr(module, "is_transposed", False) or getattr(module, "has_bias", False)
                or getattr(module, "has_post_expert_norm", False))


class _Joined(nn.Module):
    """One expert's matrix whose parts have different types: each part on its own layer, outputs side by side."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def expert_linear(parts: list[GGUFBlocks], expert: int, device: Any, dtype: torch.dtype) -> nn.Module:
    """Expert ``expert``'s matrix made of ``parts`` (in order, stacked along the rows) as a gguf_linear."""
    def rows(part: GGUFBlocks) -> torch.Tensor:
        n = part.shape[0]
        return part.blocks[expert * n : (expert + 1) * n]

    first = parts[0]
    if all(p.ggml_type == first.ggml_type and p.blocks.shape[1] == first.blocks.shape[1] for p in parts):
        stacked = torch.cat([rows(p) for p in parts]) if len(parts) > 1 else rows(first).contiguous()
        return gguf_linear(stacked, first.ggml_type, (sum(p.shape[0] for p in parts), first.shape[1]), None,
                           device, dtype)
    return _Joined([gguf_linear(rows(p).contiguous(), p.ggml_type, p.shape, None, device, dtype) for p in parts])


class GGUFExperts(LinearExperts):
    """An experts module whose experts' matrices are gguf_linear layers on the file's blocks, one per expert and
    matrix, computed routed-only and grouped by expert (see the module doc)."""

    def __init__(self, experts: Any, matrices: dict[str, list[GGUFBlocks]], device: Any = "cpu",
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_experts = int(experts.num_experts)
        self.has_gate = bool(getattr(experts, "has_gate", True))
        up_name = "gate_up_proj" if self.has_gate else "up_proj"
        if sorted(matrices) != sorted((up_name, "down_proj")):
            raise ModelError(f"{type(experts).__name__} takes {up_name} and down_proj; the file holds "
                             f"{', '.join(sorted(matrices)) or 'none'} for it")
        for name, parts in matrices.items():
            if any(p.experts != self.num_experts for p in parts):
                raise ModelError(f"{name} holds {[p.experts for p in parts]} experts where the config says "
                                 f"{self.num_experts}")
        self.up = nn.ModuleList(expert_linear(matrices[up_name], e, device, dtype) for e in range(self.num_experts))
        self.down = nn.ModuleList(expert_linear(matrices["down_proj"], e, device, dtype)
                                  for e in range(self.num_experts))
        self.act_fn = experts.act_fn
        for name in (up_name, "down_proj"):  # the library's module for its gating, its matrices let go
            if hasattr(experts, name):
                delattr(experts, name)
        self._library = (experts,)  # a tuple: not registered, its (now empty) parameters are not the stage's
        self.kinds = sorted({p.ggml_type for parts in matrices.values() for p in parts})

    def extra_repr(self) -> str:
        return f"{self.num_experts} experts, {'/'.join(self.kinds)} blocks"


def place_experts(layer: nn.Module, kept: dict[str, GGUFBlocks], device: Any = "cpu",
                  dtype: torch.dtype = torch.float32) -> None:
    """Replace each experts module of ``layer`` (on the meta device) whose matrices are in ``kept`` (state-dict names,
    a joined matrix's parts under their own names: swarm.stage.weights) by its :class:`GGUFExperts`, taking those
    entries out of ``kept``."""
    by_module: dict[str, dict[str, list[tuple[int, GGUFBlocks]]]] = {}
    for key in [k for k, v in kept.items() if v.experts]:
        blocks = kept.pop(key)
        path, _, leaf = (blocks.into or key).rpartition(".")
        by_module.setdefault(path, {}).setdefault(leaf, []).append((blocks.part, blocks))
    for path, matrices in by_module.items():
        parent_name, _, name = path.rpartition(".")
        parent = layer.get_submodule(parent_name)
        ordered = {leaf: [b for _, b in sorted(parts, key=lambda p: p[0])] for leaf, parts in matrices.items()}
        setattr(parent, name, GGUFExperts(getattr(parent, name), ordered, device, dtype))
