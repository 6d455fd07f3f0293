"""Quantized linear layers that read the same input (q/k/v, gate/up) computed as one matrix on CPU: each part is
what that layer quantized alone computes, in the layer's own call order and called on its own, and the decoder layer
holds the weights once."""

from __future__ import annotations

import pytest
import torch

from swarm.stage.quantize import (
    FusedPart,
    module_bytes,
    quantize_linear,
    quantize_linears,
)


class _Projections(torch.nn.Module):
    """The q/k/v of a grouped-query attention (k and v narrower than q), with biases as Qwen2 has them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q_proj = torch.nn.Linear(128, 128)
        self.k_proj = torch.nn.Linear(128, 32)
        self.v_proj = torch.nn.Linear(128, 32)
        self.o_proj = torch.nn.Linear(128, 128)
        for p in self.parameters():
            torch.nn.init.normal_(p, std=0.05)


@pytest.mark.parametrize("kind", ["int8", "nf4", "int4-fast"])
def test_fused_parts_compute_what_each_layer_quantized_alone_computes(kind):
    plain = _Projections()
    alone = {name: quantize_linear(getattr(plain, name), kind) for name in ("q_proj", "k_proj", "v_proj")}
    fused = quantize_linears(_Projections(), kind)
    part = FusedPart
    assert all(isinstance(getattr(fused, n), part) for n in ("q_proj", "k_proj", "v_proj"))
    assert not isinstance(fused.o_proj, part)  # o reads the attention's output: a layer of its own
    assert fused.q_proj.fused is fused.k_proj.fused is fused.v_proj.fused
    # the stacked matrix holds each weight once: the same bytes as the three layers alone
    assert module_bytes(fused) == sum(module_bytes(m) for m in alone.values()) + module_bytes(fused.o_proj)

    x = torch.randn(1, 5, 128)
    with torch.inference_mode():
        in_order = [fused.q_proj(x), fused.k_proj(x), fused.v_proj(x)]  # the decoder layer's order: one kernel call
        for name, got in zip(("q_proj", "k_proj", "v_proj"), in_order):
            assert torch.equal(got, alone[name](x)), name
        # on their own, or with another input: each computes the stacked matrix itself, never a stale part
        y = torch.randn(1, 3, 128)
        assert torch.equal(fused.v_proj(y), alone["v_proj"](y))
        assert torch.equal(fused.k_proj(x), alone["k_proj"](x))
        assert torch.equal(fused.k_proj(y), alone["k_proj"](y))


def test_only_cpu_layers_of_one_shape_are_fused():
    from torch import nn

    module = nn.Module()
    module.gate_proj = nn.Linear(64, 96, bias=False)
    module.up_proj = nn.Linear(64, 96, bias=True)  # a bias on one of them only: not one matrix
    quantize_linears(module, "int8")
    assert not isinstance(module.gate_proj, FusedPart) and not isinstance(module.up_proj, FusedPart)
