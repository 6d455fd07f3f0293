"""Where each stage of a model goes: a pure function over made-up or real inventories.

The leader splits a model's decoder layers into contiguous slices, one per fellow, in proportion to each fellow's free
memory, and refuses a placement a fellow cannot hold with a message that names the stage, the fellow, what it needs
(weights + KV cache) and what it has.
"""

from __future__ import annotations

import dataclasses

from swarm.errors import PlacementError
from swarm.model_format import split_layers

GB = 1e9  # user-facing sizes are decimal gigabytes, like the seed's messages
# Working memory beyond weights and KV cache: activations of a 256-token prefill chunk, the allocator's slack and
# torch's own buffers. Measured on the built-in model on CPU: ~60 MB per stage; rounded up for larger hidden sizes.
OVERHEAD_BYTES = 200_000_000


@dataclasses.dataclass(frozen=True)
class FellowCapacity:
    fellow_id: int
    name: str
    free_bytes: int


@dataclasses.dataclass(frozen=True)
class ModelSize:
    layer_bytes: tuple[int, ...]  # weights of each decoder layer
    embed_bytes: int  # token embedding (stage 0, and the last stage too when the head is tied to it)
    final_bytes: int  # final norm and untied head (last stage)
    tied_embeddings: bool
    kv_bytes_per_token_per_layer: int
    # what a token's pass reads of each layer, where that is less than the layer (a mixture of experts computes only
    # its routed experts): the planner's speed follows it (swarm.leader.planning.planner.active_layer_bytes); None: all
    # of it
    compute_bytes: tuple[int, ...] | None = None
    experts: int = 0  # a mixture of experts: experts per MoE layer, and how many a token is routed to
    experts_per_token: int = 0
    expert_bytes: int = 0  # one routed expert's matrices at the load's kind (the planner times them apart)


@dataclasses.dataclass(frozen=True)
class StagePlan:
    index: int
    fellow_id: int
    fellow_name: str
    first_layer: int
    end_layer: int  # exclusive
    weight_bytes: int
    kv_bytes: int
    # the last stage's draft model (SWARM_SERVE_DRAFT_MODEL): its weights, and its KV cache per token of the
    # conversations it guesses for (counted like the stage's own: its token budget gets smaller)
    draft_bytes: int = 0
    draft_kv_per_token: int = 0

    @property
    def need_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + OVERHEAD_BYTES + self.draft_bytes


@dataclasses.dataclass(frozen=True)
class DraftSize:
    """What a draft model held whole beside the last stage takes: weights, and KV cache bytes per token."""

    weight_bytes: int
    kv_bytes_per_token: int


def stage_weight_bytes(size: ModelSize, first: int, end: int, is_first: bool, is_last: bool) -> int:
    """Weights a stage of layers first..end-1 holds: its layers, the embedding (first stage, and the last when the
    head is tied to it), the final norm and head (last stage)."""
    weight = sum(size.layer_bytes[first:end])
    if is_first or (is_last and size.tied_embeddings):
        weight += size.embed_bytes
    if is_last:
        weight += size.final_bytes
    return weight


# The user's manual: "A single-node model needs its weights plus 1 GB free on one fellow." -- or, where more, its KV
# cache at the served context and working memory (OVERHEAD_BYTES).
ONE_FELLOW_HEADROOM = 1_000_000_000
# Shortest context a placement offers when a full-length conversation does not fit (the least a served context may be,
# as SWARM_SERVE_CONTEXT_TOKENS); offers are rounded down to a multiple of OFFER_STEP tokens above it.
MIN_CONTEXT = 16
OFFER_STEP = 256


def place_on_one(size: ModelSize, fellows: list[FellowCapacity], fellow_id: int | None = None,
                 context_tokens: int = 0) -> list[StagePlan]:
    """The whole model on one fellow -- ``fellow_id``, or the one with most memory free -- with room for one
    conversation of ``context_tokens``."""
    weight = sum(size.layer_bytes) + size.embed_bytes + size.final_bytes
    per_token = size.kv_bytes_per_token_per_layer * len(size.layer_bytes)
    kv = per_token * context_tokens
    need = weight + max(ONE_FELLOW_HEADROOM, kv + OVERHEAD_BYTES)
    if fellow_id is not None:
        chosen = [f for f in fellows if f.fellow_id == fellow_id]
        if not chosen:
            online = ", ".join(f"{f.name} (id {f.fellow_id})" for f in fellows) or "none"
            raise PlacementError(f"fellow {fellow_id} is not online in the pool; online: {online}.")
    else:
        chosen = sorted(fellows, key=lambda f: (-f.free_bytes, f.fellow_id))[:1]
    if chosen and weight + ONE_FELLOW_HEADROOM <= chosen[0].free_bytes < need:
        fellow = chosen[0]
        fits = offer(fellow.free_bytes - weight - OVERHEAD_BYTES, per_token)
        raise PlacementError(
            f"The model needs {need / GB:.1f} GB free on one fellow ({weight / GB:.1f} GB weights + {kv / GB:.1f} GB "
            f"KV cache at {context_tokens} tokens, one full-length conversation), {fellow.name} has "
            f"{fellow.free_bytes / GB:.1f} GB free.{_what_fits(fits)}")
    if not chosen or chosen[0].free_bytes < need:
        states = "; ".join(f"{f.name} has {f.free_bytes / GB:.1f} GB free" for f in (chosen if fellow_id else fellows))
        raise PlacementError(
            f"The model needs {need / GB:.1f} GB free on one fellow: {states or 'no fellow is online'}. Serve it "
            "over several fellows, or free memory on one."
        )
    fellow = chosen[0]
    room = max(0, fellow.free_bytes - weight - OVERHEAD_BYTES)
    return [StagePlan(0, fellow.fellow_id, fellow.name, 0, len(size.layer_bytes), weight,
                      min(room, max(ONE_FELLOW_HEADROOM, kv)))]


def offer(room: int, per_token: int) -> int:
    """The longest context ``room`` bytes of KV cache hold at ``per_token`` bytes a token, rounded down (OFFER_STEP);
    0 when not even MIN_CONTEXT tokens fit."""
    if per_token <= 0:
        return 1 << 30
    fits = max(room, 0) // per_token
    if fits >= OFFER_STEP:
        fits -= fits % OFFER_STEP
    return int(fits) if fits >= MIN_CONTEXT else 0


def _what_fits(fits: int) -> str:
    """The end of a refusal for want of KV room: the context that fits, and the other ways out."""
    if fits:
        return (f" At most {fits} tokens fit: load it with a shorter context (`swarm model-load MODEL --context-tokens "
                f"{fits}`, or context_tokens {fits} on the load call or the page), hold the KV cache at 8 bits "
                "(--kv-cache q8), use more stages, or free memory on the fellows.")
    return " Use more stages, serve on fellows with more free memory, or hold the KV cache at 8 bits (--kv-cache q8)."


def place(
    size: ModelSize,
    fellows: list[FellowCapacity],
    num_stages: int,
    context_tokens: int,
    fellow_id: int | None = None,
    draft: DraftSize | None = None,
) -> list[StagePlan]:
    """Choose ``num_stages`` fellows (most free memory first, then kept in a stable ring order) and their layers.
    ``draft``: the last stage also holds a draft model (only over several stages): its fellow gets fewer layers."""
    if num_stages < 1:
        raise PlacementError("a model needs at least one stage.")
    if num_stages == 1:
        return place_on_one(size, fellows, fellow_id, context_tokens)
    if fellow_id is not None:
        raise PlacementError("--fellow-id picks the fellow of a model served on one PC: use it with --num-stages 1.")
    if len(fellows) < num_stages:
        online = ", ".join(f.name for f in fellows) or "none"
        raise PlacementError(
            f"loading over {num_stages} stages needs {num_stages} fellows online in the pool; "
            f"online: {online}. Start more fellows with `swarm join`, or load with fewer stages."
        )
    chosen = sorted(fellows, key=lambda f: (-f.free_bytes, f.fellow_id))[:num_stages]
    chosen.sort(key=lambda f: f.fellow_id)
    return place_in_order(size, chosen, context_tokens, draft)


def place_in_order(size: ModelSize, chosen: list[FellowCapacity], context_tokens: int,
                   draft: DraftSize | None = None) -> list[StagePlan]:
    """The layers of a ring over ``chosen``, stage 0 first, in proportion to their free memory (the link-aware
    order of swarm.leader.planning.link_placement, or :func:`place`'s); PlacementError when a stage does not fit."""
    num_stages = len(chosen)
    draft = draft or DraftSize(0, 0)
    room = [max(f.free_bytes, 0) for f in chosen]
    room[-1] = max(room[-1] - draft.weight_bytes - draft.kv_bytes_per_token * context_tokens, 0)
    slices = split_layers(len(size.layer_bytes), room)
    plans = []
    for index, (fellow, (first, end)) in enumerate(zip(chosen, slices)):
        last = index == num_stages - 1
        held = draft if last else DraftSize(0, 0)  # only the last stage holds the draft model
        weight = stage_weight_bytes(size, first, end, index == 0, last)
        kv = (size.kv_bytes_per_token_per_layer * (end - first) + held.kv_bytes_per_token) * context_tokens
        plans.append(StagePlan(index, fellow.fellow_id, fellow.name, first, end, weight, kv, held.weight_bytes,
                               held.kv_bytes_per_token))
    short = [(plan, fellow) for plan, fellow in zip(plans, chosen) if plan.need_bytes > fellow.free_bytes]
    if short:
        plan, fellow = short[0]
        # the longest conversation every stage of this split holds: what the refusal offers
        fits = min(offer(f.free_bytes - p.weight_bytes - OVERHEAD_BYTES - p.draft_bytes,
                         size.kv_bytes_per_token_per_layer * (p.end_layer - p.first_layer) + p.draft_kv_per_token)
                   for p, f in zip(plans, chosen))
        kv_full = plan.weight_bytes + OVERHEAD_BYTES + plan.draft_bytes <= fellow.free_bytes
        head = (f"stage {plan.index} on {fellow.name} needs {plan.need_bytes / GB:.1f} GB "
                f"({plan.weight_bytes / GB:.1f} GB weights + {plan.kv_bytes / GB:.1f} GB KV cache at "
                f"{context_tokens} tokens{_with_draft(plan)}), has {fellow.free_bytes / GB:.1f} GB free")
        if kv_full and fits:
            tail = ": not even one conversation of the full context fits." + _what_fits(fits)
        else:
            tail = (". Serve on a fellow with more free memory, use more stages, or load with a shorter context "
                    "(--context-tokens, or SWARM_SERVE_CONTEXT_TOKENS for every model).")
        if plan.draft_bytes:
            tail += " Or unset SWARM_SERVE_DRAFT_MODEL to free its draft model's room."
        raise PlacementError(head + tail)
    return plans


def _with_draft(plan: StagePlan) -> str:
    return f" + {plan.draft_bytes / GB:.1f} GB draft model" if plan.draft_bytes else ""
