"""A stage this fellow holds: loaded once, then linked into a ring -- and linked again, onto new hops, whenever the
leader rebuilds the ring (a failover, a leader restart) -- until it is unloaded.

Linking gives the stage its hops: the outgoing one to the next stage (swarm.mesh.hop) and the id and key of the
incoming one. Each link is a generation of the ring: linking again drops every request in flight and closes the old
hops, and nothing that arrives on an old hop is read (swarm.fellow.ring drops messages of other generations).
"""

from __future__ import annotations

import logging

import trio

from swarm.control_messages import HopIn, HopOut, Link, Load, Unloaded
from swarm.errors import SwarmError
from swarm.fellow import compute
from swarm.fellow.idle import unload_due
from swarm.fellow.ring import StageDriver
from swarm.mesh.hop import HopConfig, OutgoingHop
from swarm.messages import HopLost

log = logging.getLogger(__name__)

IDLE_CHECK_S = 5.0  # how often a stage looks at its idle time: the unload comes at most this late


class LoadedStage:
    def __init__(self, fellow, message: Load, stage_model):
        spec = message.stage
        self.fellow = fellow
        self.model: str = message.model
        self.load_id: str = message.load_id
        self.index: int = spec.index
        self.num_stages: int = spec.num_stages
        self.first_layer: int = spec.first_layer
        self.end_layer: int = spec.end_layer
        self.cover: bool = message.cover  # a hot cover: loaded and waiting to take over the stage
        self.driver = StageDriver(model=self.model, stage_model=stage_model, send_to_leader=fellow.send_to_leader,
                                  prefill_chunk=fellow.settings.serve_prefill_chunk,
                                  max_batch=fellow.settings.serve_max_batch, threads=fellow.threads_for)
        self.ring_id: str | None = None
        self.hop_in: HopIn | None = None  # the hop this stage receives on: id and the previous stage's key
        self.cancel_scope = trio.CancelScope()  # the whole stage: cancelled on unload
        self.nursery: trio.Nursery | None = None
        self.links_nursery: trio.Nursery | None = None  # this ring generation's hops and tunnels
        self._links_scope: trio.CancelScope | None = None
        self._weight_bytes: int | None = None  # what its weights take (placement()), counted once
        # When the leader said the whole ring is ready (ring_ready); None while the model loads, recovers, or this
        # stage is a cover: the idle clock (swarm.fellow.idle) runs only from then on.
        self.ready_since: float | None = None
        # parts loaded beside the stage for a re-layout (swarm.fellow.extending): (the stage's next layers and whether
        # first and last, the parts), spliced in by the Link that gives it those layers; a KV handover's rows of the
        # layers the stage lacks are held in the parts' prefix stores until then (swarm.fellow.handover)
        self.extension: tuple[tuple[int, int, bool, bool], list] | None = None

    def summary(self) -> dict:
        """What the fellow tells the leader of this stage (in its hello: a restarted leader adopts it)."""
        return {"model": self.model, "load_id": self.load_id, "index": self.index, "num_stages": self.num_stages,
                "first_layer": self.first_layer, "end_layer": self.end_layer, "cover": self.cover}

    def placement(self) -> dict:
        """Where this stage runs, for the leader's Performance view: its devices and the bytes its weights take (with
        the last stage's draft model, SWARM_SERVE_DRAFT_MODEL)."""
        stage_model = self.driver.stage_model
        if self._weight_bytes is None:
            drafter = getattr(stage_model, "drafter", None)
            self._weight_bytes = stage_model.parameter_bytes() + (drafter.parameter_bytes() if drafter else 0)
        beside = sum(p.parameter_bytes() + (p.drafter.parameter_bytes() if p.drafter else 0)
                     for p in self.extension[1]) if self.extension else 0
        devices = sorted({str(d) for d in getattr(stage_model, "layer_devices", None) or [stage_model.device]})
        return {"devices": devices, "bytes": self._weight_bytes + beside}

    def held(self) -> dict:
        """The requests this stage holds state for: in the ring protocol, and KV caches (0 and 0 when idle: a
        request that ended, was cancelled or whose client went away leaves nothing behind)."""
        protocol = self.driver.protocol
        return {"requests": len(protocol.requests) if protocol is not None else 0,
                "caches": len(self.driver.stage_model.requests())}

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with self.cancel_scope:
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                await nursery.start(self.driver.run)
                nursery.start_soon(self._unload_when_idle)  # a cover too: its clock starts once it is linked and ready
                task_status.started()
                try:
                    await trio.sleep_forever()
                finally:
                    self.driver.unlink()

    # --- linking ------------------------------------------------------------------------------------------------

    async def link(self, message: Link) -> None:
        """Join the ring generation ``message.ring_id``: new hops, no requests carried over. A link that gives the
        stage a sub-range of its layers narrows it first (:meth:`narrow`), one that gives it the layers its parts
        loaded beside were for splices them in (:meth:`extend`); ModelError if it names layers or parts the stage
        does not hold (then it stays unlinked)."""
        self.unlink()
        if message.first_layer is not None and message.end_layer is not None:
            layers = (message.first_layer, message.end_layer, message.index == 0,
                      message.index == message.num_stages - 1)
            if self.extension is not None and self.extension[0] == layers:
                await self.extend()
            else:  # a link of another ring keeps the parts: the re-layout that loaded them may still switch
                await self.narrow(*layers)
        self.cover = False
        self.index, self.num_stages = message.index, message.num_stages
        self.ring_id, self.hop_in = message.ring_id, message.hop_in
        self._links_scope = trio.CancelScope()
        assert self.nursery is not None  # set while the fellow runs
        self.links_nursery = await self.nursery.start(self._hold_links, self._links_scope)
        out_hop = self._out_hop(message.hop_out)
        self.driver.relink(self.ring_id, self.index, self.num_stages, out_hop)
        if self.hop_in:
            self.links_nursery.start_soon(self.fellow.links.relay_listener, self, self.hop_in)

    async def narrow(self, first_layer: int, end_layer: int, is_first: bool, is_last: bool) -> None:
        """Keep only layers ``first_layer``..``end_layer - 1`` of the stage (a re-layout's switch: the leader gave
        this fellow a narrower stage of the next ring), freeing the rest; nothing when it holds just those."""
        spec = self.driver.stage_model.spec
        if (first_layer, end_layer, is_first, is_last) == (spec.first_layer, spec.end_layer, spec.is_first,
                                                            spec.is_last):
            return
        # on the compute thread: after a pass of the old ring still computing there, before any of the new one
        freed = await compute.run(self.driver.stage_model.narrow, first_layer, end_layer, is_first, is_last)
        log.info("narrowed stage of %s from layers %d-%d to %d-%d: %.0f MB freed", self.model, self.first_layer,
                 self.end_layer - 1, first_layer, end_layer - 1, freed / 1e6)
        self.first_layer, self.end_layer = first_layer, end_layer
        self._weight_bytes = None  # counted anew: the heartbeat's free memory and placement say what it holds now

    async def extend(self) -> None:
        """Splice the parts loaded beside the stage in (a re-layout's switch: the leader gave this fellow the layers
        they were loaded for), dropping the layers it no longer needs (swarm.stage.resplit)."""
        assert self.extension is not None
        (first_layer, end_layer, is_first, is_last), parts = self.extension
        self.extension = None
        from swarm.stage.resplit import extend

        started = trio.current_time()
        grew = await compute.run(extend, self.driver.stage_model, parts, first_layer, end_layer, is_first, is_last)
        log.info("extended stage of %s from layers %d-%d to %d-%d in %.0f ms: %+.0f MB", self.model,
                 self.first_layer, self.end_layer - 1, first_layer, end_layer - 1,
                 1000 * (trio.current_time() - started), grew / 1e6)
        self.first_layer, self.end_layer = first_layer, end_layer
        self._weight_bytes = None

    def hold_extension(self, layers: tuple[int, int, bool, bool], parts: list) -> None:
        """Hold ``parts`` beside the stage until a link gives it ``layers`` (an earlier extension goes)."""
        self.drop_extension()
        self.extension = (layers, parts)

    def drop_extension(self) -> None:
        """Free the parts loaded beside the stage, if any (the re-layout was given up, or the stage unloads)."""
        extension, self.extension = self.extension, None
        if extension is not None:
            from swarm.fellow.loading import free_memory

            for part in extension[1]:
                free_memory(part)
            log.info("dropped the parts loaded beside the stage of %s", self.model)

    def ring_ready(self, ring_id: str) -> None:
        """Every stage is linked: open the outgoing link now, so the first reply does not wait for it. (Not at link
        time: the next stage may not know this hop yet, and a refused direct link would leave the hop on the relay.)"""
        if ring_id == self.ring_id and self.ring_id is not None:
            self.ready_since = trio.current_time()
        out_hop = self.driver.out_hop
        if ring_id == self.ring_id and out_hop is not None and self.links_nursery is not None:
            self.links_nursery.start_soon(_open_quietly, out_hop)

    def unlink(self) -> None:
        """Leave the current ring: drop every request in flight and close its hops."""
        self.driver.unlink()
        if self._links_scope is not None:
            self._links_scope.cancel()
            self._links_scope = None
        if self.hop_in:
            self.fellow.links.forget_hop(self.hop_in.hop_id)
        self.ring_id = self.hop_in = self.links_nursery = None
        self.ready_since = None

    async def _hold_links(self, scope: trio.CancelScope, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with scope:
            async with trio.open_nursery() as nursery:
                task_status.started(nursery)
                await trio.sleep_forever()

    def _out_hop(self, hop_out: HopOut | None) -> OutgoingHop | None:
        if not hop_out:
            return None
        assert self.links_nursery is not None  # link() opened it first
        fellow = self.fellow
        hop = OutgoingHop(
            HopConfig(
                hop_id=hop_out.hop_id,
                peer_public=hop_out.peer_key,
                peer_name=hop_out.peer_name,
                direct=tuple(hop_out.direct) if hop_out.direct else None,
                transport=hop_out.transport,
            ),
            nursery=self.links_nursery,
            leader_url=fellow.leader_url,
            credential=lambda: fellow.credential,
            local_private=fellow.private,
            connect_timeout=fellow.settings.direct_connect_timeout_s,
        )

        async def lost(hop: OutgoingHop) -> None:
            try:
                await fellow.send_to_leader(HopLost(self.model, hop.config.hop_id, hop.path))
            except SwarmError:  # the link to the leader is down: the heartbeat after it is back reports the hops
                pass

        hop.on_lost = lost
        return hop

    # --- idle unload --------------------------------------------------------------------------------------------

    async def _unload_when_idle(self) -> None:
        """Free the model once it has been ready and unused for SWARM_MODEL_IDLE_UNLOAD_S (swarm.fellow.idle). Every
        stage sees the ring's work (a later stage gets the hidden states of every chat), and the leader tells every
        stage when the ring is ready, so all of a model's stages agree on when it was last used; the leader unloads
        the other stages as soon as one reports it went."""
        limit = self.fellow.settings.model_idle_unload_s
        if limit <= 0:
            return
        while True:
            await trio.sleep(min(IDLE_CHECK_S, limit))
            if not unload_due(trio.current_time(), limit=limit, ready_since=self.ready_since,
                              last_used=self.driver.last_used, busy=self.driver.busy):
                continue
            log.info("unloading %s: unused for %.0f s (SWARM_MODEL_IDLE_UNLOAD_S)", self.model, limit)
            try:
                await self.fellow.send_to_leader(Unloaded(self.model, self.load_id, reason="idle"))
            except SwarmError:  # the leader is out of reach: the heartbeat once it is back says what is held
                pass
            self.fellow.unload(self.model)  # cancels this task too
            return


async def _open_quietly(hop: OutgoingHop) -> None:
    try:
        await hop.ensure_open()
    except SwarmError as exc:
        log.info("the link to %s is not open yet (%s); the first request opens it", hop.config.peer_name, exc)
