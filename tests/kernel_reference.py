"""What swarm's C kernels compute, written plainly in torch (float64): the references tests/test_int4_kernel.py,
test_q8_kernel.py and test_gguf_kind.py check the kernels (swarm.stage.int4_kernel, swarm.stage.q8_kernel)
against."""

from __future__ import annotations

import torch


def int4_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in float64 with torch: ``x`` (rows, in) quantized per group of 32 as the C file
    quantizes it, against levels ``q`` (out, in) with ``scale`` and ``zero`` per group (out, in / 32). The kernel must
    agree with it to float32 rounding."""
    rows, k = x.shape
    groups = x.float().reshape(rows, k // 32, 32)
    d = groups.abs().amax(-1) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    xq = torch.round(groups * inverse[..., None]).clamp(-127, 127)
    dot = torch.einsum("rgi,ngi->rng", xq.double(), q.double().reshape(q.shape[0], k // 32, 32))
    scale, zero = scale.double(), zero.double()
    return (dot * scale[None] * d.double()[:, None]
            + (zero - 8 * scale)[None] * groups.double().sum(-1)[:, None]).sum(-1)


def q8_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq, d): rows ``x`` (rows, in) quantized per group of 32 as the C file does, xq (rows, in / 32, 32) in
    -127..127 and d (rows, in / 32) with x ~ d xq."""
    rows, k = x.shape
    groups = x.float().reshape(rows, k // 32, 32)
    d = groups.abs().amax(-1) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return torch.round(groups * inverse[..., None]).clamp(-127, 127), d


def q8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
    """What the kernel computes, in float64 with torch: ``x`` (rows, in) quantized per group of 32 as the C file
    quantizes it, against levels ``q`` (out, in) with ``scale`` per half group (out, in / 16) and ``offset`` per group
    (out, in / 32) or None. The kernel must agree with it to float32 rounding."""
    rows, k = x.shape
    xq, d = q8_activations(x)
    halves = xq.double().reshape(rows, k // 16, 16)
    dot = torch.einsum("rhi,nhi->rnh", halves, q.double().reshape(q.shape[0], k // 16, 16))
    d16 = d.double().repeat_interleave(2, -1)
    y = (dot * scale.double()[None] * d16[:, None]).sum(-1)
    if offset is not None:
        y = y + x.double().reshape(rows, k // 32, 32).sum(-1) @ offset.double().T
    return y
