"""A drain's KV handover, on the leader: the running requests' KV goes over to the new ring, so that at the switch
each stage computes only the tokens after their last whole block, plus one step, instead of prefilling every
request's prompt and streamed tokens again (~80 % of the switch's pause before: bench/RESULTS.md, Failover).

Before the switch, while the old ring still streams (swarm.leader.serving.drain):

  1. every stage of the old ring keeps each running request's first full blocks -- rows every stage has computed:
     all but the latest token's -- in its prefix cache, under the names the prefix cache gives a prompt's blocks
     (swarm.leader.serving.prefix_index.block_names of the prompt and the tokens streamed so far);
  2. the leaving stage exports those blocks' rows, which go over the leader's control links (encrypted, as every
     link) to the taker's copy of the stage, which imports them under the same names (swarm.fellow.handover);
  3. the prefix cache's index carries its epoch across the switch (PrefixCaches.carry): the stages that stay keep
     their blocks through the relink, the index keeps only the blocks every stage of the new ring holds, and each
     resent request's plan reuses its own.

Anything that does not answer in HANDOVER_WAIT_S, or fails, leaves the switch as it was without this: the index starts
anew and the new ring prefills the requests whole. A block that some stage lacks anyway fails its request on that
stage, and the request is sent again with a new index (PrefixCaches.failed): slower, never wrong.
"""

from __future__ import annotations

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
            box[0].set()

    async def _ask(self, conn: Any, message: hm.KvKeep | hm.KvImport, into: dict[int, Answer]) -> None:
        event, reply = trio.Event(), list[Answer]()
        key = (message.handover, conn.id)
        self._waiting[key] = (event, reply)
        try:
            conn.post(message)
            await event.wait()
            into[conn.id] = reply[0]
        finally:
            self._waiting.pop(key, None)

    async def prepare(self, model: Any, slot: Any, taker: Any, leaving: Any) -> int:
        """Hand the running requests' blocks of ``model`` over before stage ``slot`` moves from ``leaving`` to
        ``taker``; the prefix cache's index then carries them across the switch. -> the blocks carried (0: none, the
        switch prefills as before)."""
        serving = self.serving
        index = serving.prefix.indexes.get(model.name)
        if index is None or model.ring_id is None or not serving.prefix.ring_takes_plans(model, serving.online) \
                or not getattr(taker, "prefix_cache", False):
            return 0
        block = index.block
        wanted: dict[str, list[bytes]] = {}
        for request in serving.book.of_model(model.name):
            if request.tokens and request.rid in serving.book.by_rid:
                # rows every stage has computed: the prompt's and the reply's but the latest token's
                count = (len(request.prompt) + len(request.tokens) - 1) // block
                if count:
                    wanted[request.rid] = block_names(request.prompt + request.tokens, block, count)
        stages = [(stage, serving.online.get(stage.plan.fellow_id)) for stage in model.stages]
        if not wanted or any(conn is None for _, conn in stages):
            return 0
        handover, epoch = uuid.uuid4().hex, index.epoch
        kept: dict[int, Answer] = {}
        imported: dict[int, Answer] = {}
        began = trio.current_time()
        with trio.move_on_after(HANDOVER_WAIT_S):
            async with trio.open_nursery() as nursery:
                for stage, conn in stages:
                    nursery.start_soon(self._ask, conn, hm.KvKeep(
                        model.name, model.ring_id, handover, epoch, block,
                        [[rid, names] for rid, names in wanted.items()], export=stage is slot), kept)
            exported = kept.get(leaving.id)
            if isinstance(exported, hm.KvKept) and exported.blocks:
                await self._ask(taker, hm.KvImport(model.name, handover, epoch, exported.blocks), imported)
        held = [set(kept[conn.id].names if conn.id in kept else ()) for stage, conn in stages if stage is not slot]
        held.append(set(imported[taker.id].names if taker.id in imported else ()))
        carried: list[bytes] = []
        for names in wanted.values():
            for name in names:  # a request reuses its blocks from the first on: the run every stage holds
                if not all(name in h for h in held):
                    break
                carried.append(name)
        after = tuple(taker.id if stage is slot else stage.plan.fellow_id for stage in model.stages)
        if not carried or serving.prefix.indexes.get(model.name) is not index:
            why = [r.message for r in (*kept.values(), *imported.values()) if r.message]
            log.info("no KV of %s handed over to %s (%s): the new ring prefills its requests", model.name,
                     taker.name, "; ".join(why) or f"no answer within {HANDOVER_WAIT_S:.0f} s")
            return 0
        serving.prefix.carry(model.name, epoch, carried, after)
        log.info("%s handed %d KV blocks of %s to %s in %.0f ms", leaving.name, len(carried), model.name, taker.name,
                 1000 * (trio.current_time() - began))
        return len(carried)
