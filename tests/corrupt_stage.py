"""A test double of a broken fellow: its stage's hidden states come out slightly wrong (a failing GPU, a bad driver),
looking like any others -- or, on the last stage, the token it draws is off by one. Only tests use it: it wraps the
fellow's compute calls (swarm.fellow.compute.run) for one stage model in this process, so an in-process fellow of
tests/harness.py turns dishonest while the rest stay honest."""

from __future__ import annotations

import contextlib
import dataclasses

from swarm import wire
from swarm.fellow import compute


@contextlib.contextmanager
def corrupting(stage_model, factor: float = 1.05):
    """While inside, every pass of ``stage_model`` hands on its hidden states times ``factor`` (the last stage: each
    token it draws + 1)."""
    original = compute.run

    async def run(fn, *args):
        output = await original(fn, *args)
        if args and args[0] is stage_model and getattr(output, "hidden", None) is not None:
            x = wire.tensor_from_wire(output.hidden) * factor
            output = dataclasses.replace(output, hidden=wire.tensor_to_wire(x))
        elif args and args[0] is stage_model and getattr(output, "tokens", None) is not None:
            output = dataclasses.replace(output, tokens=[t + 1 if isinstance(t, int) else t for t in output.tokens])
        return output

    compute.run = run
    try:
        yield
    finally:
        compute.run = original
