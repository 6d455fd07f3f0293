"""Recomputing a pass of another fellow's stage, for the leader's spot checks (swarm.leader.serving.verify).

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


def recompute(stage, rid: str, passes: list[list[int]], inputs, prompt_len: int, claimed: int | None,
              keep: bool) -> dict:
    """Run ``passes`` ([pos, n] each, contiguous) of ``inputs`` through ``stage`` (a StageModel) as request ``rid``:
    from position 0 on a fresh cache, else on from where the last check of the request left its cache (``keep``: a
    replayed copy of the request, so that each check computes only the passes since the last). The last pass's
    output as a wire map: {"hidden"} or, on the last stage, {"token", "gap", "scale"}."""
    if not passes or any(a[0] + a[1] != b[0] for a, b in zip(passes, passes[1:])):
        raise ModelError("a check's passes must follow each other without gaps")
    start = passes[0][0]
    if start == 0:
        stage.new_request(rid)
    elif not stage.has_request(rid) or stage.cached_length(rid) != start:
        stage.drop(rid)
        raise ModelError(f"this checker did not replay the request up to position {start}")
    total = passes[-1][0] + passes[-1][1] - start
    if stage.spec.is_first:
        if not isinstance(inputs, list) or len(inputs) != total:
            raise ModelError(f"a check of stage 0 needs {total} token ids")
        x = torch.tensor([inputs], dtype=torch.long)
    else:
        x = wire.tensor_from_wire(inputs)
        if x.dim() != 3 or x.shape[1] != total:
            raise ModelError(f"a check needs {total} rows of hidden states, got shape {list(x.shape)}")
    try:
        out = None
        for i, (pos, n) in enumerate(passes):
            last = i == len(passes) - 1
            chunk = x[:, pos - start : pos - start + n]
            kwargs = {"input_ids": chunk} if stage.spec.is_first else {"hidden": chunk}
            out = stage.forward(rid, pos, want_logits=last, alone=pos >= prompt_len, **kwargs)
    except BaseException:
        stage.drop(rid)
        raise
    if not keep:
        stage.drop(rid)
    assert out is not None  # the last pass asked for its output
    if not stage.spec.is_last:
        return {"hidden": wire.tensor_to_wire(out)}
    logits = out.float()
    top = int(torch.argmax(logits))
    valid = isinstance(claimed, int) and 0 <= claimed < logits.shape[0]
    gap = float(logits[top] - logits[claimed]) if valid else float("inf")
    return {"token": top, "gap": gap, "scale": float(logits.abs().max())}

