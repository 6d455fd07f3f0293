"""The ``gguf`` kind for a mixture-of-experts layer: each expert's matrices computed on the file's own blocks.

A MoE GGUF holds a layer's experts as 3-D tensors, [experts, rows, columns] (llama.cpp's ffn_gate_exps, ffn_up_exps
and ffn_down_exps): expert e's matrix is rows e*rows .. (e+1)*rows of the tensor's blocks, whole rows of blocks, so
each expert's matrix is taken apart exactly. The import keeps these tensors as the file has them, the gate and up
experts apart (swarm.store.gguf_source); a stage at ``gguf`` builds one :func:`swarm.stage.gguf_linear.gguf_linear`
per expert and matrix on those rows -- the gate and up rows of an expert stacked into one matrix where both have
the same type, which is exact and the gate_up_proj transformers computes; gpt-oss's gate and up rows interleaved
(gate at even, up at odd outputs, as its ``_apply_gate`` reads them: swarm.gguf_layout), with its biases -- and
computes them in swarm's experts loop
(swarm.stage.moe_experts.experts_loop): only the routed experts' matrices are read for a token, and a batch reads
each hit expert once for all its rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from swarm.errors import ModelError
from swarm.gguf_layout import INTERLEAVE
from swarm.stage.gguf_linear import GGUFBlocks, gguf_linear
from swarm.stage.moe_experts import LinearExperts, fused_experts

# the experts' matrices a stage at gguf computes on blocks, as transformers' experts modules name them
EXPERT_MATRICES = ("gate_up_proj", "up_proj", "down_proj")


def is_expert_weight(layer: nn.Module, key: str) -> bool:
    """Whether state-dict name ``key`` is a fused expert matrix of ``layer`` that :class:`GGUFExperts` computes
    (experts with a norm after each are not; gpt-oss's transposed, biased ones are: the file's rows are (out, in))."""
    path, _, leaf = key.rpartition(".")
    if leaf not in EXPERT_MATRICES:
        return False
    try:
        module = layer.get_submodule(path)
    except AttributeError:
        return False
    return fused_experts(module) and not getattr(module, "has_post_expert_norm", False)


class _Joined(nn.Module):
    """One expert's matrix whose parts have different types: each part on its own layer, outputs side by side."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def expert_linear(parts: list[GGUFBlocks], expert: int, device: Any, dtype: torch.dtype,
                  bias: torch.Tensor | None = None) -> nn.Module:
    """Expert ``expert``'s matrix made of ``parts`` (in order, stacked along the rows, or their rows interleaved
    where the parts say so: gpt-oss) as a gguf_linear, adding ``bias`` (its outputs', in that order) where given."""
    def rows(part: GGUFBlocks) -> torch.Tensor:
        n = part.shape[0]
        return part.blocks[expert * n : (expert + 1) * n]

    first = parts[0]
    if first.join == INTERLEAVE:  # part p's row r is output r x parts + p: a permutation of whole rows of blocks
        if any(p.ggml_type != first.ggml_type or p.blocks.shape[1] != first.blocks.shape[1]
               or p.shape != first.shape for p in parts):
            raise ModelError(f"the interleaved parts of an expert matrix are {[p.ggml_type for p in parts]} of shapes "
                             f"{[p.shape for p in parts]}; they must match: the model file may be damaged, import "
                             "it again")
        interleaved = torch.stack([rows(p) for p in parts], 1).reshape(-1, first.blocks.shape[1])
        return gguf_linear(interleaved, first.ggml_type, (len(parts) * first.shape[0], first.shape[1]), bias,
                           device, dtype)
    if bias is not None:
        raise ModelError("an expert matrix with a bias but not interleaved parts: this is a bug in swarm's loader")
    if all(p.ggml_type == first.ggml_type and p.blocks.shape[1] == first.blocks.shape[1] for p in parts):
        stacked = torch.cat([rows(p) for p in parts]) if len(parts) > 1 else rows(first).contiguous()
        return gguf_linear(stacked, first.ggml_type, (sum(p.shape[0] for p in parts), first.shape[1]), None,
                           device, dtype)
    return _Joined([gguf_linear(rows(p).contiguous(), p.ggml_type, p.shape, None, device, dtype) for p in parts])


class GGUFExperts(LinearExperts):
    """An experts module whose experts' matrices are gguf_linear layers on the file's blocks, one per expert and
    matrix, computed routed-only and grouped by expert (see the module doc)."""

    def __init__(self, experts: Any, matrices: dict[str, list[GGUFBlocks]], device: Any = "cpu",
                 dtype: torch.dtype = torch.float32, biases: dict[str, torch.Tensor] | None = None):
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
        biases = biases or {}
        if getattr(experts, "has_bias", False) and sorted(biases) != sorted((f"{up_name}_bias", "down_proj_bias")):
            raise ModelError(f"{type(experts).__name__} adds biases to its experts' outputs; the file holds "
                             f"{', '.join(sorted(biases)) or 'none'} for it: the model file may be damaged, import it "
                             "again")

        def linears(name: str) -> nn.ModuleList:
            bias = biases.get(f"{name}_bias")
            parts = matrices[name]
            if bias is not None and (bias.dim() != 2 or bias.shape[0] != self.num_experts
                                     or bias.shape[1] != len(parts) * parts[0].shape[0]):
                raise ModelError(f"{name}_bias has shape {tuple(bias.shape)}, which does not fit {name}: the model "
                                 "file may be damaged; import it again")
            if bias is not None and len(parts) == 1:  # one part: joined trivially, so its bias applies as is
                parts = [GGUFBlocks(parts[0].blocks, parts[0].ggml_type, parts[0].shape, parts[0].experts,
                                    join=INTERLEAVE)]
            return nn.ModuleList(expert_linear(parts, e, device, dtype, None if bias is None else bias[e])
                                 for e in range(self.num_experts))

        self.up = linears(up_name)
        self.down = linears("down_proj")
        self.act_fn = getattr(experts, "act_fn", None)  # gpt-oss has none: its _apply_gate gates
        # the library's module for its gating, its matrices (and biases) let go
        for name in (up_name, "down_proj", f"{up_name}_bias", "down_proj_bias"):
            if hasattr(experts, name):
                delattr(experts, name)
        self._library = (experts,)  # a tuple: not registered, its (now empty) parameters are not the stage's
        self.kinds = sorted({p.ggml_type for parts in matrices.values() for p in parts})

    def extra_repr(self) -> str:
        return f"{self.num_experts} experts, {'/'.join(self.kinds)} blocks"


def place_experts(layer: nn.Module, kept: dict[str, GGUFBlocks], device: Any = "cpu",
                  dtype: torch.dtype = torch.float32, tensors: dict[str, torch.Tensor] | None = None) -> None:
    """Replace each experts module of ``layer`` (on the meta device) whose matrices are in ``kept`` (state-dict names,
    a joined matrix's parts under their own names: swarm.stage.weights) by its :class:`GGUFExperts`, taking those
    entries out of ``kept``, and its experts' biases (gpt-oss) out of ``tensors``."""
    by_module: dict[str, dict[str, list[tuple[int, GGUFBlocks]]]] = {}
    for key in [k for k, v in kept.items() if v.experts]:
        blocks = kept.pop(key)
        path, _, leaf = (blocks.into or key).rpartition(".")
        by_module.setdefault(path, {}).setdefault(leaf, []).append((blocks.part, blocks))
    for path, matrices in by_module.items():
        parent_name, _, name = path.rpartition(".")
        parent = layer.get_submodule(parent_name)
        ordered = {leaf: [b for _, b in sorted(parts, key=lambda p: p[0])] for leaf, parts in matrices.items()}
        biases = {leaf: tensors.pop(f"{path}.{leaf}") for leaf in ("gate_up_proj_bias", "down_proj_bias")
                  if tensors is not None and f"{path}.{leaf}" in tensors}
        setattr(parent, name, GGUFExperts(getattr(parent, name), ordered, device, dtype, biases))
