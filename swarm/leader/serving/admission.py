"""How many requests a served model takes at once, as a plain function over its placement.

Each stage budgets its KV caches from the memory left after its weights. A model over several stages keeps up to
REQUESTS_PER_STAGE requests per stage in flight (the ring is a pipeline: while one stage works on one group of
requests, the others work on other groups), sized for a typical conversation of SWARM_SERVE_TYPICAL_TOKENS; where
the caches cannot hold that many, the number is lowered instead of refusing the load. The pool's token budget --
what the smallest stage's caches hold -- bounds what may run at once, and a conversation longer than the whole pool
is refused. Placement guarantees room for at least one conversation of SWARM_SERVE_CONTEXT_TOKENS.
"""

from __future__ import annotations

import dataclasses

from swarm.leader.planning.placement import OVERHEAD_BYTES, StagePlan

REQUESTS_PER_STAGE = 4  # the seed's number: "keeps up to four requests per stage in flight"


@dataclasses.dataclass(frozen=True)
class Budget:
    max_requests: int  # requests in flight at once
    tokens: int  # KV tokens every stage can hold at once: the pool's size, prompt and reply together

    def fits(self, running: list[int], need: int) -> bool:
        """Whether a request needing ``need`` tokens may start beside requests holding ``running``."""
        return len(running) < self.max_requests and sum(running) + need <= self.tokens

    def fits_group(self, running: list[int], needs: list[int]) -> bool:
        """Whether a group (sampled choices of one prompt, prefilled once) may start whole beside ``running``. Alone
        on the ring it may pass max_requests -- a pipelining target, not memory -- as long as its caches fit."""
        count = not running or len(running) + len(needs) <= self.max_requests
        return count and sum(running) + sum(needs) <= self.tokens


def budget(plans: list[StagePlan], free_bytes: dict[int, int], kv_bytes_per_token_layer: int, typical_tokens: int,
           context_tokens: int) -> Budget:
    """The budget of a model placed as ``plans`` on fellows with ``free_bytes`` free (before the load)."""
    tokens = None
    for plan in plans:
        # the last stage's draft model (SWARM_SERVE_DRAFT_MODEL) keeps a cache of every conversation too
        per_token = kv_bytes_per_token_layer * (plan.end_layer - plan.first_layer) + plan.draft_kv_per_token
        room = free_bytes.get(plan.fellow_id, 0) - plan.weight_bytes - OVERHEAD_BYTES - plan.draft_bytes
        fits = room // per_token if per_token > 0 else 1 << 30
        tokens = fits if tokens is None else min(tokens, fits)
    tokens = max(int(tokens or 0), context_tokens)  # placement made sure one full context fits
    slots = REQUESTS_PER_STAGE * len(plans)
    return Budget(max(1, min(slots, tokens // max(1, typical_tokens))), tokens)
