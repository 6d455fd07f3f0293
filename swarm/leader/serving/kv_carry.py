"""A KV handover at a drain or a re-layout, on the leader: the running requests' KV goes over to the new ring, so that
at the switch each stage computes only the tokens after their last whole block, plus one step, instead of prefilling
every request's prompt and streamed tokens again (~80 % of a drain's pause before, and a re-layout's whole pause:
bench/RESULTS.md).

Before the switch, while the old ring still streams (swarm.leader.serving.drain, swarm.leader.serving.relayout):

  1. every stage of the old ring keeps each running request's first full blocks -- rows every stage has computed:
     all but the latest token's -- in its prefix cache, under the names the prefix cache gives a prompt's blocks
     (swarm.leader.serving.prefix_index.block_names of the prompt and the tokens streamed so far);
  2. a stage of the new ring whose fellow holds an old stage of its layers (the same stage; or one narrowed to a part
     of its layers at the switch, which keeps its blocks sliced) keeps what it has. Every other new stage -- a
     drain's taker, a stage a re-layout loaded beside the ring -- takes each of its layers from the old stage that
     held it (a decoder layer's keys and values do not depend on the split): each such old stage exports the range
     of its layers the new stages need, once (KvKeep.export_layers), the leader cuts each new stage's pieces out and
     puts them together in layer order, and the new stage imports them (swarm.stage.kv_handover checks them against
     its own cache layers). A fellow of the old ring whose stage extends at the switch (swarm.stage.resplit) keeps
     its own layers' blocks and imports only the rows of the layers it lacks, held with the parts loaded beside its
     stage until the splice joins them in layer order. The rows go over the leader's control links, encrypted as
     every link;
  3. the prefix cache's index carries its epoch across the switch (PrefixCaches.carry with the new ring's fellows):
     the stages that stay keep their blocks through the relink, the index keeps only the blocks every stage of the
     new ring holds, and each resent request's plan reuses its own.

Anything that does not answer in HANDOVER_WAIT_S, or fails, leaves the switch as it was without this: the index starts
anew and the new ring prefills the requests whole. A block only some old stages exported is left out whole. A block
that some stage lacks anyway fails its request on that stage, and the request is sent again with a new index
(PrefixCaches.failed): slower, never wrong.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from typing import Any

import trio

from swarm import handover_messages as hm
from swarm.leader.serving.prefix_index import block_names

log = logging.getLogger(__name__)

Answer = hm.KvKept | hm.KvImported

# How long the stages get to keep and hand over the blocks; the old ring streams on meanwhile, so waiting costs the
# drain time, not the reply. A few blocks of the built-in model take milliseconds; an older fellow, which does not
# know these messages, never answers.
HANDOVER_WAIT_S = 5.0


class KvCarry:
    """The leader's KV handovers: what each fellow answered, by handover id."""

    def __init__(self, serving: Any):
        self.serving = serving
        self._waiting: dict[tuple[str, int], tuple[trio.Event, list[Answer]]] = {}

    def on_message(self, conn: Any, message: Answer) -> None:
        """A fellow's KvKept or KvImported."""
        box = self._waiting.get((message.handover, conn.id))
        if box is not None and not box[0].is_set():
            box[1].append(message)
            if not (isinstance(message, hm.KvKept) and message.more):  # an export's last part
                box[0].set()

    async def _ask(self, conn: Any, message: hm.KvKeep | hm.KvImport, into: dict[int, Answer]) -> None:
        event, reply = trio.Event(), list[Answer]()
        key = (message.handover, conn.id)
        self._waiting[key] = (event, reply)
        try:
            conn.post(message)
            await event.wait()
            last = reply[-1]
            into[conn.id] = dataclasses.replace(last, blocks=hm.join_blocks(
                [b for r in reply if isinstance(r, hm.KvKept) for b in r.blocks])) \
                if isinstance(last, hm.KvKept) else last
        finally:
            self._waiting.pop(key, None)

    async def prepare(self, model: Any, slot: Any, taker: Any, leaving: Any) -> int:
        """A drain: hand the running requests' blocks of ``model`` over before stage ``slot`` moves from ``leaving`` to
        ``taker`` (:meth:`hand_over`, the new ring being the old one with the taker in the stage's place)."""
        after = [dataclasses.replace(stage.plan, fellow_id=taker.id, fellow_name=taker.name) if stage is slot
                 else stage.plan for stage in model.stages]
        return await self.hand_over(model, after)

    async def hand_over(self, model: Any, after: list[Any]) -> int:
        """Hand the running requests' blocks of ``model`` over to the ring ``after`` (its stages' plans) before the
        switch to it, while the old ring streams on; the prefix cache's index then carries them across the switch.
        A stage of ``after`` whose fellow holds an old stage of its layers (the same, or one narrowed to a part of
        them at the switch) keeps what it has; one whose fellow holds an old stage of some of them (it extends that
        at the switch) keeps those and imports the others' rows; any other imports its layers' rows from the old
        stages that hold them. -> the blocks carried (0: none, the new ring prefills as before)."""
        serving = self.serving
        serving.prefix.carried.pop(model.name, None)  # an earlier switch's that did not happen
        index = serving.prefix.indexes.get(model.name)
        before = [(stage.plan, serving.online.get(stage.plan.fellow_id)) for stage in model.stages]
        new = [(plan, serving.online.get(plan.fellow_id)) for plan in after]
        if index is None or model.ring_id is None or not serving.prefix.ring_takes_plans(model, serving.online) \
                or not all(conn is not None and getattr(conn, "prefix_cache", False) for _, conn in new):
            return 0
        block = index.block
        wanted: dict[str, list[bytes]] = {}
        for request in serving.book.of_model(model.name):
            if request.tokens and request.rid in serving.book.by_rid:
                # rows every stage has computed: the prompt's and the reply's but the latest token's
                count = (len(request.prompt) + len(request.tokens) - 1) // block
                if count:
                    wanted[request.rid] = block_names(request.prompt + request.tokens, block, count)
        if not wanted or any(conn is None for _, conn in before):
            return 0
        layout = ([(p.first_layer, p.end_layer) for p, _ in before], [p.fellow_id for p, _ in before],
                  [(p.first_layer, p.end_layer, p.fellow_id) for p, _ in new])
        pieces, extends = sources(*layout), extending(*layout)
        spans = export_spans(pieces)
        handover, epoch = uuid.uuid4().hex, index.epoch
        kept: dict[int, Answer] = {}
        imported: dict[int, Answer] = {}
        began = trio.current_time()
        with trio.move_on_after(HANDOVER_WAIT_S):
            async with trio.open_nursery() as nursery:
                for i, (plan, conn) in enumerate(before):
                    span = spans.get(i)
                    local = [span[0] - plan.first_layer, span[1] - plan.first_layer] if span is not None else []
                    nursery.start_soon(self._ask, conn, hm.KvKeep(
                        model.name, model.ring_id, handover, epoch, block,
                        [[rid, names] for rid, names in wanted.items()], export=span is not None,
                        export_layers=[] if local == [0, plan.end_layer - plan.first_layer] else local), kept)
            exports = {i: kept.get(conn.id) for i, (_, conn) in enumerate(before)}
            async with trio.open_nursery() as nursery:
                for j, (plan, conn) in enumerate(new):
                    # a fellow from before would take an extending stage's rows as its serving stage's: not asked
                    if j in pieces and (j not in extends or getattr(conn, "kv_extension", False)):
                        blocks = assemble(pieces[j], spans, exports)
                        if blocks:  # an extending stage's are held with its parts until they are spliced in
                            nursery.start_soon(self._ask, conn, hm.KvImport(
                                model.name, handover, epoch, blocks,
                                [plan.first_layer, plan.end_layer] if j in extends else []), imported)
        # an extending stage holds a block when its old stage kept it and it imported the rows of the layers it lacks
        held: list[set[bytes]] = []
        for j, (_, conn) in enumerate(new):
            has = set((imported if j in pieces else kept).get(conn.id, _NONE).names)
            held.append(has & set(kept.get(conn.id, _NONE).names) if j in extends else has)
        carried: list[bytes] = []
        for names in wanted.values():
            for name in names:  # a request reuses its blocks from the first on: the run every stage holds
                if not all(name in h for h in held):
                    break
                carried.append(name)
        fellows = ", ".join(conn.name for j, (_, conn) in enumerate(new) if j in pieces) or "the ring"
        if serving.prefix.indexes.get(model.name) is index:
            # what the stages kept for this and the index does not hold nor carries goes with its next plan, whether
            # the switch comes or not, as other blocks no stage needs (PrefixIndex.orphans)
            sure = set(carried) | set(index.blocks)
            index.orphans += [name for name in dict.fromkeys(n for names in wanted.values() for n in names)
                              if name not in sure]
        if not carried or serving.prefix.indexes.get(model.name) is not index:
            why = [r.message for r in (*kept.values(), *imported.values()) if r.message]
            log.info("no KV of %s handed over to %s: the new ring prefills its requests (%s)", model.name, fellows,
                     "; ".join(why) or f"no answer within {HANDOVER_WAIT_S:.0f} s")
            return 0
        serving.prefix.carry(model.name, epoch, carried, tuple(plan.fellow_id for plan in after))
        log.info("%d KV blocks of %s handed over to %s in %.0f ms", len(carried), model.name, fellows,
                 1000 * (trio.current_time() - began))
        return len(carried)


_NONE = hm.KvImported("", "")  # no answer: nothing held

# One piece of a new stage's layers: (old stage, first layer, end layer), in layer numbers of the model.
Piece = tuple[int, int, int]


def sources(old: list[tuple[int, int]], old_fellows: list[int], new: list[tuple[int, int, int]]) \
        -> dict[int, list[Piece]]:
    """Where each stage of the new ring (``new``: first layer, end layer, fellow) takes its layers' rows from: new
    stage -> its pieces in layer order, each the part of an old stage (``old``: first, end; ``old_fellows``) it
    overlaps. A new stage whose fellow holds an old stage of all its layers (the same stage, or one narrowed to a
    part of its layers at the switch) keeps what it has and is not in the answer; one whose fellow holds an old stage
    of some of them (:func:`extending`: it extends that stage at the switch) keeps those and takes only the others."""
    out: dict[int, list[Piece]] = {}
    for j, (first, end, fellow) in enumerate(new):
        own = next(((a, b) for (a, b), f in zip(old, old_fellows) if f == fellow and a < end and first < b), None)
        if own is not None and own[0] <= first and end <= own[1]:
            continue
        lacking = [(first, end)] if own is None else [r for r in ((first, own[0]), (own[1], end)) if r[0] < r[1]]
        out[j] = [(i, max(lo, a), min(hi, b)) for lo, hi in lacking for i, (a, b) in enumerate(old)
                  if a < hi and lo < b]
    return out


def extending(old: list[tuple[int, int]], old_fellows: list[int], new: list[tuple[int, int, int]]) -> set[int]:
    """The stages of the new ring (as :func:`sources` takes them) whose fellow holds an old stage of some of their
    layers but not all: it extends that stage in place at the switch (swarm.stage.resplit)."""
    return {j for j, (first, end, fellow) in enumerate(new)
            if any(f == fellow and a < end and first < b and not (a <= first and end <= b)
                   for (a, b), f in zip(old, old_fellows))}


def export_spans(pieces: dict[int, list[Piece]]) -> dict[int, tuple[int, int]]:
    """The layers each old stage exports: from the first to the end of the pieces taken from it (model layers)."""
    spans: dict[int, tuple[int, int]] = {}
    for parts in pieces.values():
        for i, first, end in parts:
            a, b = spans.get(i, (first, end))
            spans[i] = (min(a, first), max(b, end))
    return spans


def assemble(parts: list[Piece], spans: dict[int, tuple[int, int]], exports: dict[int, Any]) -> list[dict]:
    """A new stage's blocks (swarm.stage.kv_handover.import_blocks's maps): each block's layers from its pieces, in
    layer order. Only the blocks every piece has, whole: a block some old stage did not export, or exported with
    another layer count (a fellow from before exports all its layers), is left out."""
    found: list[dict[bytes, list]] = []
    for i, first, end in parts:
        export = exports.get(i)
        span = spans[i]
        rows = {b["name"]: b["layers"] for b in (export.blocks if isinstance(export, hm.KvKept) else ())
                if isinstance(b, dict) and isinstance(b.get("layers"), list) and len(b["layers"]) == span[1] - span[0]}
        found.append({name: layers[first - span[0]:end - span[0]] for name, layers in rows.items()})
    return [{"name": name, "layers": layers} for name, layers in hm.join_layers(found).items()]
