"""What a mixture-of-experts layer costs a fellow besides its weights: the router and the dispatch of each routed
expert (transformers' eager loop: find the rows, gather them, two matrix calls and the gating, add the rows back).

A dense layer's calibration (swarm.fellow.calibration) counts a fixed cost and a cost per weight byte; a MoE layer's
active weights are counted by the planner (swarm.leader.planning.planner.active_layer_bytes), and this adds what its
routing does per pass: ``router_ms`` once, ``expert_ms`` per expert the pass computes. Measured on a block of tiny
experts (hidden 64, rows 32) at one row routed to 1 and to 4 experts, so the matrices' own bytes are next to nothing;
the stage's own experts loop (swarm.stage.moe_experts). The cost grows in a line with the experts a row takes.
"""

from __future__ import annotations

from collections.abc import Callable

EXPERTS = 16  # experts of the timed block: at most TOP_K of them per row
TOP_K = 4


def measure_moe(device: str, dtype, sync: Callable[[], None], typical: Callable[..., float]) -> dict:
    """{"router_ms", "expert_ms"}: the routing's fixed cost per layer and pass, and its cost per routed expert.
    ``typical(fn, sync, repeats, budget_s)``: swarm.fellow.calibration's timing of a step."""
    import torch
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from swarm.stage.moe_experts import ROUTED, register

    register()

    def block(top_k: int):
        config = Qwen3MoeConfig(hidden_size=64, num_experts=EXPERTS, num_experts_per_tok=top_k,
                                moe_intermediate_size=32)
        config._experts_implementation = ROUTED  # what a stage runs (swarm.stage.slice)
        module = Qwen3MoeSparseMoeBlock(config).to(device=device, dtype=dtype).eval()
        for p in module.parameters():
            torch.nn.init.normal_(p, std=0.02)
        return module

    row = torch.randn(1, 1, 64, device=device, dtype=dtype)
    one, several = block(1), block(TOP_K)
    t_one = typical(lambda: one(row), sync, 30, 0.3)
    t_several = typical(lambda: several(row), sync, 30, 0.3)
    expert = max(t_several - t_one, 0.0) / (TOP_K - 1)
    return {"router_ms": round(max(t_one - expert, 0.0) * 1e3, 4), "expert_ms": round(expert * 1e3, 4)}
