"""Recomputing a pass of another fellow's stage, for the leader's spot checks (swarm.leader.verify).

The checked stage sends what went into its layers for the request from position 0 up to the checked pass (token ids
on stage 0, hidden states on the others), cut into the passes it ran, and what came out of the checked pass. The
checker runs the same passes, in the same cuts, through its own copy of the same layers on a throwaway cache, so a
prompt chunk takes the same kernels as on the checked stage, and a decode step the same single-row path. It returns
what the checked pass should have given: hidden states, or on the last stage the token a greedy draw takes and how far
the checked stage's token falls below it in the logits.
"""

from __future__ import annotations

import torch

from swarm import wire
from swarm.errors import ModelError


def recompute(stage, rid: str, passes: list[list[int]], inputs, prompt_len: int, claimed: int | None) -> dict:
    """Run ``passes`` ([pos, n] each, contiguous from 0) of ``inputs`` through ``stage`` (a StageModel) as request
    ``rid``; the last pass's output as a wire map: {"hidden"} or, on the last stage, {"token", "gap", "scale"}."""
    if not passes or passes[0][0] != 0 or any(a[0] + a[1] != b[0] for a, b in zip(passes, passes[1:])):
        raise ModelError("a check's passes must run from position 0 without gaps")
    total = passes[-1][0] + passes[-1][1]
    if stage.spec.is_first:
        if not isinstance(inputs, list) or len(inputs) != total:
            raise ModelError(f"a check of stage 0 needs {total} token ids")
        x = torch.tensor([inputs], dtype=torch.long)
    else:
        x = wire.tensor_from_wire(inputs)
        if x.dim() != 3 or x.shape[1] != total:
            raise ModelError(f"a check needs {total} rows of hidden states, got shape {list(x.shape)}")
    stage.new_request(rid)
    try:
        out = None
        for i, (pos, n) in enumerate(passes):
            last = i == len(passes) - 1
            chunk = x[:, pos : pos + n]
            kwargs = {"input_ids": chunk} if stage.spec.is_first else {"hidden": chunk}
            out = stage.forward(rid, pos, want_logits=last, alone=pos >= prompt_len, **kwargs)
    finally:
        stage.drop(rid)
    assert out is not None  # the last pass asked for its output
    if not stage.spec.is_last:
        return {"hidden": wire.tensor_to_wire(out)}
    logits = out.float()
    top = int(torch.argmax(logits))
    valid = isinstance(claimed, int) and 0 <= claimed < logits.shape[0]
    gap = float(logits[top] - logits[claimed]) if valid else float("inf")
    return {"token": top, "gap": gap, "scale": float(logits.abs().max())}

