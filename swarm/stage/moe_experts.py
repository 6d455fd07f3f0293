"""The experts of a mixture-of-experts layer, computed routed-only and grouped by expert.

transformers' MoE layers hold each kind of expert matrix fused over the experts (``gate_up_proj``: experts x rows x
columns) and dispatch their forward by ``config._experts_implementation``. Its ``eager`` forward loops over the
experts the router hit in the pass and computes all the rows routed to each at once -- but indexes the fused tensor
with a tensor, which gathers a copy of the expert's matrices on every pass (measured here: 4.2 ms for 4 experts of
a 512-wide layer against 1.5 ms for their 8 matrix products). ``grouped_mm``, what ``from_pretrained`` picks, hands
the kernel every expert's tensor; ``batched_mm`` gathers a copy per routed row.

A stage runs :func:`routed_forward` instead (registered in transformers' experts interface as :data:`ROUTED`,
swarm.stage.slice sets it): the same loop, in the same order and with the same operations, each expert taken as a
view of its slice -- a decode step reads only its top-k experts' matrices, and a batch of requests (or a prompt
chunk) reads each hit expert once for all its rows. tests/test_moe_compute.py counts the slices read per pass.

A quantized load (swarm.stage.quantize) turns each expert's matrices into linear layers of the kind --
:class:`QuantizedExperts` -- computed in the same loop, so a quantized stage and the quantized one-process reference
(swarm.stage.quantize.quantize_model) compute the same numbers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from swarm.errors import ModelError

ROUTED = "swarm_routed"  # the experts implementation a stage sets on its config


def routed_forward(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' eager experts loop with each expert's matrices as views (see the module doc). Experts of
    another layout (transposed, with biases or a norm after each expert: gpt-oss) keep the family's own forward."""
    if (getattr(self, "is_transposed", False) or getattr(self, "has_bias", False) or not getattr(self, "has_gate", True)
            or getattr(self, "has_post_expert_norm", False)):
        return type(self).forward.__wrapped__(self, hidden_states, top_k_index, top_k_weights)

    def expert_out(expert: int, rows: torch.Tensor) -> torch.Tensor:
        projected = self._apply_gate(nn.functional.linear(rows, self.gate_up_proj[expert]))
        return nn.functional.linear(projected, self.down_proj[expert])

    return experts_loop(hidden_states, top_k_index, top_k_weights, self.num_experts, expert_out)


def experts_loop(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 num_experts: int, expert_out: Any) -> torch.Tensor:
    """The sum over the rows' routed experts of ``expert_out(expert, rows)`` times the rows' routing weights, each
    expert computed once for all its rows, in expert order, added up as transformers' loop adds them. One row (a
    decode step) takes its experts straight from the router's pick -- no masks, no gather, no scatter: measured
    here they were half of a step's expert time -- and adds them in the same order, so the sum is the same."""
    final = torch.zeros_like(hidden_states)
    if hidden_states.shape[0] == 1:
        picked = top_k_index[0].tolist()
        for slot in sorted(range(len(picked)), key=picked.__getitem__):
            out = expert_out(picked[slot], hidden_states) * top_k_weights[:, slot, None]
            final.add_(out.to(final.dtype))
        return final
    for expert, token_idx, top_k_pos in route(top_k_index, num_experts):
        out = expert_out(expert, hidden_states[token_idx]) * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, out.to(final.dtype))
    return final


def register() -> None:
    """Make :data:`ROUTED` an experts implementation transformers' MoE layers dispatch to."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if ROUTED not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(ROUTED, routed_forward)


def fused_experts(module: Any) -> bool:
    """Whether ``module`` is a transformers experts module holding its matrices fused over the experts."""
    down = getattr(module, "down_proj", None)
    return isinstance(down, torch.Tensor) and down.dim() == 3 and hasattr(module, "num_experts")


def route(top_k_index: torch.Tensor, num_experts: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(expert, rows routed to it, their top-k slot) for each expert hit, in expert order -- as transformers' eager
    loop finds them (one_hot, then the rows where each expert's mask is set)."""
    with torch.no_grad():
        mask = nn.functional.one_hot(top_k_index, num_classes=num_experts).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    out = []
    for expert in hit[:, 0].tolist():
        top_k_pos, token_idx = torch.where(mask[expert])
        out.append((expert, token_idx, top_k_pos))
    return out


class LinearExperts(nn.Module):
    """Experts held as a linear module per expert and matrix -- ``up`` (gate and up joined, or up alone) and ``down``
    -- computed for the routed rows only, through the family's own gating: the library's experts module, kept in
    ``_library`` with its matrices let go (gpt-oss clamps and interleaves). Subclasses build ``up`` and ``down``."""

    num_experts: int
    has_gate: bool
    up: nn.ModuleList
    down: nn.ModuleList
    act_fn: Any
    _library: tuple[Any]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        def expert_out(expert: int, rows: torch.Tensor) -> torch.Tensor:
            projected = self.up[expert](rows)
            projected = self._library[0]._apply_gate(projected) if self.has_gate else self.act_fn(projected)
            return self.down[expert](projected)

        return experts_loop(hidden_states, top_k_index, top_k_weights, self.num_experts, expert_out)


class QuantizedExperts(LinearExperts):
    """An experts module whose experts' matrices are ``kind`` linear layers (one per expert and kind of matrix: the
    fused gate-and-up rows stay one matrix, computed in one kernel call), computed routed-only, grouped by expert."""

    def __init__(self, experts: Any, quantize_linear: Any, kind: str):
        super().__init__()
        if getattr(experts, "has_post_expert_norm", False):
            raise ModelError(f"{type(experts).__name__} has a norm after each expert, which quantized loads do not "
                             "compute; load this model with quantization none")
        self.num_experts = int(experts.num_experts)
        self.has_gate = bool(getattr(experts, "has_gate", True))
        transposed = bool(getattr(experts, "is_transposed", False))
        up_name = "gate_up_proj" if self.has_gate else "up_proj"
        self.up = nn.ModuleList(_linears(experts, up_name, transposed, quantize_linear, kind))
        self.down = nn.ModuleList(_linears(experts, "down_proj", transposed, quantize_linear, kind))
        self.act_fn = experts.act_fn
        # the family's own gating (gpt-oss clamps and interleaves): the library's module, its matrices let go
        for name in (up_name, "down_proj", f"{up_name}_bias", "down_proj_bias"):
            if hasattr(experts, name):
                delattr(experts, name)
        self._library = (experts,)  # a tuple: not registered, its (now empty) parameters are not the stage's
        self.kind = kind

    def extra_repr(self) -> str:
        return f"{self.num_experts} experts, {self.kind}"


def _linears(experts: Any, name: str, transposed: bool, quantize_linear: Any, kind: str) -> list[nn.Module]:
    """Each expert's slice of the fused tensor ``name`` as a quantized linear layer (its bias from ``name_bias``)."""
    fused = getattr(experts, name)
    biases = getattr(experts, f"{name}_bias", None)
    out = []
    for expert in range(fused.shape[0]):
        weight = fused[expert].detach()
        weight = weight.t() if transposed else weight  # transposed: (in, out)
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=biases is not None, device="meta")
        linear.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        if biases is not None:
            linear.bias = nn.Parameter(biases[expert].detach().clone(), requires_grad=False)
        out.append(quantize_linear(linear, kind))
    return out


def quantize_experts(module: Any, quantize_linear: Any, kind: str) -> None:
    """Replace every fused experts module under ``module`` by its :class:`QuantizedExperts`."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if fused_experts(child):
                setattr(parent, name, QuantizedExperts(child, quantize_linear, kind))
