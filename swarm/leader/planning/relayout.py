"""Re-layouts (issue 37): the planner's best layout of a serving model over the pool as it is now -- the number of
stages, the split of the layers, which fellows and in which order, at the measured links -- among those that can be
loaded beside the ring that serves.

A re-layout loads the new ring's stages while the old one serves, then switches (swarm.leader.serving.relayout), so
each stage of the new layout must be loadable beside the old ring at once:

- on an idle fellow (no stage or cover of any model), with the stage's memory free -- its free memory already counts
  what it holds;
- or on a fellow of the ring that holds that very stage now (the same layers, first or last alike): it keeps it and
  is only linked anew;
- or on a fellow of the ring whose new stage narrows the one it holds: a sub-range of its layers that needs no part
  it lacks (the embedding only if it stays first, the final norm and head only if it stays last). It keeps its stage
  and, at the switch, drops the layers it no longer needs (swarm.stage.narrow), so it needs no memory beside. Only a
  fellow whose hello says it can ("narrowing") is given one. The common case: a third PC joins a 2-stage ring --
  pc-1 (layers 0-14) and pc-2 (15-29) -- and the 3-stage layout pc-1 0-9, pc-3 10-19, pc-2 20-29 loads only pc-3's
  stage beside the ring ("2 stages -> 3 stages on pc-1, pc-3, pc-2").

- or on a fellow of the ring whose new stage extends the one it holds: it shares layers with it and reaches beyond
  (pc-1 0-14 -> 0-19; 2 stages -> 1 stage on pc-1). It loads only what it lacks beside its stage -- the layers
  before and after the shared ones, the embedding where the new stage is first, the final norm, head and draft model
  where it is last -- and splices them in at the switch (swarm.stage.resplit), so it needs free memory for those and
  the KV cache the stage grows by (:func:`extension_bytes`). Only a fellow whose hello says it can ("extending").

A fellow of the ring cannot load a second stage of the same model that shares no layer with its own: a fellow holds
one stage of a model at a time (swarm.fellow.process keeps them by model). A layout that needs that, or memory a
fellow does not have, is left out, and the proposal says why ("the 1-stage layout on fellow-1 ... is left out:
...").

A model served with a draft model (SWARM_SERVE_DRAFT_MODEL) is placed as a load places it: over several stages its
last stage holds the draft model's weights and KV cache too (swarm.leader.planning.placement.DraftSize), and its
fellow must run draft models; on one stage it has none (a load on one fellow drafts by prompt lookup alone). A layout
whose last fellow has no room for the draft model, or runs a version without draft models, is left out and told.

A pure function over the placement's inputs (swarm.leader.planning.placement), each fellow's calibrated speed and the
measured links (swarm.leader.planning.link_placement), like the link-aware placement's.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Collection, Sequence

from swarm.errors import PlacementError
from swarm.leader.planning.placement import (
    GB,
    DraftSize,
    FellowCapacity,
    ModelSize,
    StagePlan,
    place_in_order,
    stage_weight_bytes,
)
from swarm.leader.planning.planner import Hop, LayerSpeed, hop_round_trips, predict

# Every order of a ring is tried up to this many stages, as link_placement.MAX_ORDERED; beyond, fellow id order.
MAX_ORDERED = 5
# rings predicted at most per model and proposal: each takes ~0.25 ms (30 layers; measured on the shared 2-core VM,
# 1237 rings over 6 fellows in 0.3 s), and proposals are made on the leader's event loop
MAX_RINGS = 2000
MAX_NOTES = 3  # at most this many layouts left out are told, the fastest first


@dataclasses.dataclass(frozen=True)
class Layout:
    plans: list[StagePlan] | None  # the fastest layout loadable beside the ring (None: none)
    ms_per_token: float | None
    left_out: list[str]  # faster layouts that cannot be loaded beside it, and why


def same_stage(a: StagePlan, a_count: int, b: StagePlan, b_count: int) -> bool:
    """Whether two stages hold the same weights: the same layers, both first or not, both last or not."""
    return (a.first_layer, a.end_layer, a.index == 0, a.index == a_count - 1) == \
        (b.first_layer, b.end_layer, b.index == 0, b.index == b_count - 1)


def same_split(a: list[StagePlan], b: list[StagePlan]) -> bool:
    """Whether two rings split the layers alike (a whole-stage move, not a re-layout)."""
    return [(p.first_layer, p.end_layer) for p in a] == [(p.first_layer, p.end_layer) for p in b]


def narrows(plan: StagePlan, count: int, held: StagePlan, held_count: int) -> bool:
    """Whether stage ``plan`` (of a ring of ``count``) is ``held`` (of a ring of ``held_count``) narrowed: a sub-range
    of its layers that needs no part it lacks -- first only if it is first, last only if it is last."""
    return held.first_layer <= plan.first_layer and plan.end_layer <= held.end_layer \
        and (plan.index != 0 or held.index == 0) and (plan.index != count - 1 or held.index == held_count - 1)


def extension_bytes(size: ModelSize, plan: StagePlan, count: int, held: StagePlan, held_count: int) -> int | None:
    """What a fellow holding ``held`` (of a ring of ``held_count``) loads beside it to extend it to ``plan`` (of a
    ring of ``count``; swarm.stage.resplit): the weights of the layers before and after the shared ones -- the first
    range with the embedding where ``plan`` is first, the last with the final norm and head (and the draft model)
    where it is last -- and the KV cache the stage grows by. None when the two share no layer, or ``plan`` needs an end
    no range brings."""
    if max(plan.first_layer, held.first_layer) >= min(plan.end_layer, held.end_layer):
        return None
    is_first, is_last = plan.index == 0, plan.index == count - 1
    need = max(0, plan.kv_bytes - held.kv_bytes)
    if plan.first_layer < held.first_layer:
        need += stage_weight_bytes(size, plan.first_layer, held.first_layer, is_first, False)
    elif is_first and held.index != 0:
        return None
    if plan.end_layer > held.end_layer:
        need += stage_weight_bytes(size, held.end_layer, plan.end_layer, False, is_last) + plan.draft_bytes
    elif is_last and held.index != held_count - 1:
        return None
    return need


def describe(current: list[StagePlan], plans: list[StagePlan]) -> str:
    """'2 stages -> 1 stage on fellow-3', '1 stage -> 3 stages on pc-1, pc-2, pc-3'."""
    def count(n: int) -> str:
        return f"{n} stage" + ("" if n == 1 else "s")
    return f"{count(len(current))} -> {count(len(plans))} on " + ", ".join(p.fellow_name for p in plans)


def why_not_beside(plans: list[StagePlan], current: list[StagePlan], idle: dict[int, FellowCapacity],
                   held_free: dict[int, int], narrowing: Collection[int] = (), size: ModelSize | None = None,
                   extending: Collection[int] = ()) -> str | None:
    """None when every stage of ``plans`` loads beside ``current``'s ring (see the module's rules), else why not, in
    words. ``held_free``: the free memory now of the ring's fellows; ``narrowing``/``extending``: those that can
    narrow / extend their stage in place (the latter counted with ``size``)."""
    held = {p.fellow_id: p for p in current}
    for plan in plans:
        old = held.get(plan.fellow_id)
        what = f"stage {plan.index} (layers {plan.first_layer}-{plan.end_layer - 1}, {plan.need_bytes / GB:.1f} GB)"
        if old is not None:
            if same_stage(plan, len(plans), old, len(current)):
                continue
            if narrows(plan, len(plans), old, len(current)):
                if plan.draft_bytes and not old.draft_bytes:  # a 1-stage ring has no draft model to keep
                    return (f"{plan.fellow_name} would narrow its stage {old.index} to the last stage, which holds "
                            "the draft model, and it has none loaded")
                if plan.fellow_id in narrowing:
                    continue
                return (f"{plan.fellow_name} would narrow its stage {old.index} (layers {old.first_layer}-"
                        f"{old.end_layer - 1}) to layers {plan.first_layer}-{plan.end_layer - 1}, and its swarm "
                        "version cannot: run swarm update on it")
            free = held_free.get(plan.fellow_id, 0)
            need = extension_bytes(size, plan, len(plans), old, len(current)) if size is not None else None
            if need is None:
                return (f"{plan.fellow_name} would load {what} beside its stage {old.index} of the same model, which "
                        "shares no layer with it, and a fellow holds one stage of a model at a time (it may keep, "
                        "narrow or extend it)")
            grown = (f"{plan.fellow_name} would extend its stage {old.index} (layers {old.first_layer}-"
                     f"{old.end_layer - 1}) to layers {plan.first_layer}-{plan.end_layer - 1}")
            if plan.fellow_id not in extending:
                return f"{grown}, and its swarm version cannot: run swarm update on it"
            if plan.draft_bytes and not old.draft_bytes and plan.end_layer <= old.end_layer:
                return f"{grown} as the last stage, which holds the draft model, and it has none loaded"
            if free < need:
                return f"{grown}, loading {need / GB:.1f} GB beside it, and has {free / GB:.1f} GB free"
            continue
        fellow = idle.get(plan.fellow_id)
        if fellow is None:
            return f"{plan.fellow_name} is not idle"
        if fellow.free_bytes < plan.need_bytes:
            return (f"{plan.fellow_name} needs {plan.need_bytes / GB:.1f} GB for {what}, has "
                    f"{fellow.free_bytes / GB:.1f} GB free")
    return None


def best_layout(size: ModelSize, current: list[StagePlan], idle: Sequence[FellowCapacity],
                held_free: dict[int, int], speeds: dict[int, LayerSpeed], hops: dict[tuple[int, int], Hop],
                hidden_bytes: int, context_tokens: int, worth_ms: float, draft: DraftSize | None = None,
                drafts: set[int] | None = None, narrowing: Collection[int] = (),
                extending: Collection[int] = ()) -> Layout:
    """The fastest layout of the model over the pool -- ``current``'s fellows (``held_free``: each one's free memory
    now, what its stage holds apart) and the ``idle`` fellows -- every stage count, set of fellows and order, split
    by free memory as a load splits it, predicted at the measured ``hops``; the fastest that loads beside
    ``current`` is chosen (``narrowing``/``extending``: the ring's fellows that can narrow / extend their stage in
    place). Layouts faster
    than it that cannot be loaded beside are told (those under ``worth_ms`` a token only: the ones worth a
    re-layout). Fellows whose speed is unknown are not counted. ``draft``: the draft model the ring's last stage
    holds (see the module), and ``drafts`` the fellows that run draft models (None: all)."""
    idle_by_id = {f.fellow_id: f for f in idle}
    # the planner's view of the pool: each fellow of the ring with the memory its stage holds counted free
    pool = [FellowCapacity(p.fellow_id, p.fellow_name,
                           held_free.get(p.fellow_id, 0) + p.weight_bytes + p.kv_bytes + p.draft_bytes)
            for p in current] + [f for f in idle if f.fellow_id not in {p.fellow_id for p in current}]
    pool = sorted((f for f in pool if f.fellow_id in speeds), key=lambda f: f.fellow_id)
    rings: list[tuple[float, int, list[StagePlan], str | None]] = []
    budget = MAX_RINGS
    for count in range(1, len(pool) + 1):
        for subset in itertools.combinations(pool, count):
            orders = itertools.permutations(subset) if count <= MAX_ORDERED else [subset]
            for order in orders:
                budget -= 1
                if budget < 0:
                    break
                placed = _placed(size, list(order), context_tokens, draft if count > 1 else None, drafts)
                if placed is None:
                    continue
                plans, held_back = placed
                ms = float(predict(plans, size, speeds, hop_round_trips(plans, hops), hidden_bytes)["ms_per_token"])
                rings.append((ms, len(rings), plans, held_back))
    notes: list[str] = []
    seen: set[str] = set()
    for ms, _, plans, held_back in sorted(rings, key=lambda r: (r[0], len(r[2]), r[1])):
        why = held_back or why_not_beside(plans, current, idle_by_id, held_free, narrowing, size, extending)
        if why is None:
            return Layout(plans, ms, notes)
        text = describe(current, plans)
        if ms <= worth_ms and text not in seen and len(notes) < MAX_NOTES and math.isfinite(ms):
            seen.add(text)
            notes.append(f"the layout {text} ({ms:.0f} ms a token) is left out: {why}")
    return Layout(None, None, notes)


def _placed(size: ModelSize, order: list[FellowCapacity], context_tokens: int, draft: DraftSize | None,
            drafts: set[int] | None) -> tuple[list[StagePlan], str | None] | None:
    """(the ring over ``order``, None) -- its last stage holding ``draft`` where there is one -- or, where it fits
    only without the draft model, (the ring without it, why it cannot hold it: a layout told, never chosen); None
    when it does not fit at all."""
    with_draft = draft is not None and bool(draft.weight_bytes or draft.kv_bytes_per_token)
    if with_draft and (drafts is None or order[-1].fellow_id in drafts):
        try:
            return place_in_order(size, order, context_tokens, draft), None
        except PlacementError:
            pass
    try:
        bare = place_in_order(size, order, context_tokens)
    except PlacementError:
        return None
    if not with_draft or draft is None:
        return bare, None
    last = order[-1]
    if drafts is not None and last.fellow_id not in drafts:
        return bare, f"{last.name} would hold the last stage and runs a version without draft models"
    need = draft.weight_bytes + draft.kv_bytes_per_token * context_tokens
    return bare, (f"{last.name} would hold the last stage and has no room for the draft model beside it "
                  f"({need / GB:.1f} GB with its KV cache at {context_tokens} tokens; {last.free_bytes / GB:.1f} GB "
                  "free)")
