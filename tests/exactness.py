"""Comparing a reply with transformers' generate, with the near-tie rule.

Re-prefilling tokens that were decoded one by one (a failover), or computing several rows at once (batched decode),
sums floats in another order: the reply may then leave generate's, but only where generate's own choice was a
near-tie. ``check_reply`` asserts exactly that: identical, or a first difference at a step whose top two logits in
the reference lie within ``tol``.
"""

from __future__ import annotations

import torch


def reference(model, prompt: list[int], max_new_tokens: int, eos: list[int] | None = None):
    """(tokens, margins): generate's greedy reply and, per step, its top-1 minus top-2 logit."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             eos_token_id=eos, pad_token_id=eos[0] if eos else 0)
    tokens = out.sequences[0, len(prompt):].tolist()
    margins = []
    for logits in out.logits:
        top = torch.topk(logits[0].float(), 2).values
        margins.append(float(top[0] - top[1]))
    return tokens, margins


def check_reply(got: list[int], want: list[int], margins: list[float], tol: float = 1e-3) -> str:
    """"identical", or "near-tie at N" when the first difference is allowed; AssertionError otherwise."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            assert margins[i] < tol, (f"the reply leaves generate's at token {i} ({a} != {b}) where the reference's "
                                      f"top two logits are {margins[i]:.5f} apart, not a near-tie")
            return f"near-tie at {i}"
    assert len(got) == len(want), f"the reply has {len(got)} tokens, generate's {len(want)}"
    return "identical"
