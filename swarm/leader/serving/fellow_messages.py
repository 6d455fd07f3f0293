"""What the fellows' control links bring to serving: tokens, failures and timings of requests, heartbeats, stage
events, spot checks, leaving, idle unloads and link reports, each handed to the part that deals with it; and
fellows that join or drop out."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

from swarm import control_links as cl
from swarm import control_messages as cm
from swarm import handover_messages as hm
from swarm import messages
from swarm.leader.serving.performance import hop_rate
from swarm.leader.serving.recovery import StageEvent

if TYPE_CHECKING:
    from swarm.leader.serving.serving import Serving

log = logging.getLogger(__name__)


class FellowMessages:
    """Dispatches the fellows' messages to the parts of one leader's serving
    (its :class:`~swarm.leader.serving.serving.Serving`)."""

    def __init__(self, serving: Serving):
        self.serving = serving

    async def on_fellow_message(self, conn, message: Any) -> None:
        """Everything a fellow's control link brings, to its handler by type. Never waits on a client or another
        fellow."""
        handler = self.handlers.get(type(message))
        if handler is None:  # the link's own (Alive, UpdateFailed), or a type this leader does not know
            log.debug("ignoring a %s from %s", getattr(message, "TYPE", None) or type(message).__name__, conn.name)
            return
        await handler(conn, message)

    @property
    def handlers(self) -> dict[type, Callable[[Any, Any], Awaitable[None]]]:
        """What serving does with each message of a fellow, by its type."""
        stage_event, verify, punch = self._stage_event, self._verify, self._punch
        return {
            messages.Tokens: self._tokens, messages.Failed: self._failed, messages.StageTimes: self._stage_times,
            messages.HopLost: self._hop_lost, cm.Heartbeat: self._heartbeat, cm.LoadProgress: stage_event,
            cm.Loaded: stage_event, cm.LoadFailed: stage_event, cm.Linked: stage_event, cm.LinkFailed: stage_event,
            cm.VerifySample: verify, cm.VerifyResult: verify, cm.Leave: self._leave, cm.Unloaded: self._unloaded,
            cl.LinkReport: self._link_report, cl.PunchCandidates: punch, cl.PunchResult: punch, cl.PunchPong: punch,
            hm.KvKept: self._kv_handover, hm.KvImported: self._kv_handover,
        }

    async def _tokens(self, conn, message: messages.Tokens) -> None:
        if self._serves(conn, message.model):
            self.serving.prefix.on_tokens(message)  # first: the requests this ending starts may reuse its blocks
            self.serving.perform(self.serving.book.on_tokens(message))

    async def _failed(self, conn, message: messages.Failed) -> None:
        if self._serves(conn, message.model):
            log.info("request %s failed on stage %s: %s", message.rid, message.stage, message.message)
            self.serving.prefix.failed(message.model, message.rid)
            self.serving.perform(self.serving.book.on_failed(message))

    async def _stage_times(self, conn, message: messages.StageTimes) -> None:
        if self._serves(conn, message.model):
            self.serving.book.on_stage_times(message)

    async def _hop_lost(self, conn, message: messages.HopLost) -> None:
        if self._serves(conn, message.model):
            log.info("a link of %s over the %s broke; re-sending its requests", message.model, message.path)
            self.serving.perform(self.serving.book.on_path_lost(message.model))

    async def _heartbeat(self, conn, message: cm.Heartbeat) -> None:
        # A fellow reports the hops it sends on (hop i leaves stage i), and only those.
        own = {m.hop_ids[s.plan.index] for m in self.serving.models.values() for s in m.stages
               if s.plan.fellow_id == conn.id and s.plan.index < len(m.hop_ids)}
        for hop in message.hops:
            if hop.get("hop_id") in own:
                previous = self.serving.hop_stats.get(hop["hop_id"])
                self.serving.hop_stats[hop["hop_id"]] = hop_rate(previous, hop, trio.current_time())
        self.serving.placements[conn.id] = message.placement

    async def _stage_event(self, conn, message: StageEvent) -> None:
        self.serving.recovery.on_stage_event(conn, message)

    async def _verify(self, conn, message: cm.VerifySample | cm.VerifyResult) -> None:
        self.serving.verifier.on_message(conn, message)

    async def _leave(self, conn, message: cm.Leave) -> None:
        """SIGTERM of the fellow's process: hand its stages over, then it goes."""
        self.serving.start_task(self.serving.drains.on_leave, conn, message)

    async def _unloaded(self, conn, message: cm.Unloaded) -> None:
        if message.reason == "idle":
            await self._idle(conn, message)

    async def _kv_handover(self, conn, message: hm.KvKept | hm.KvImported) -> None:
        self.serving.drains.kv.on_message(conn, message)  # a drain's KV handover (swarm.leader.serving.kv_carry)

    async def _link_report(self, conn, message: cl.LinkReport) -> None:
        self.serving.link_matrix.on_report(conn, message)
        self.serving.rebalance.pool_changed()

    async def _punch(self, conn, message: cl.PunchAnswer) -> None:
        if self.serving.direct_links is not None:
            self.serving.direct_links.on_message(conn, message)

    def _serves(self, conn, model: str) -> bool:
        """Whether ``conn`` serves a stage of ``model``: only those fellows speak for its requests."""
        serving = self.serving.models.get(model)
        return serving is not None and conn.id in serving.fellow_ids

    async def _idle(self, conn, message: cm.Unloaded) -> None:
        serving = self.serving.models.get(message.model)
        if serving is None or serving.load_id != message.load_id or conn.id not in serving.fellow_ids:
            return
        log.info("%s went idle on %s: unloading it from every fellow", serving.name, conn.name)
        await self.serving.loader.unload(serving.name,
                                         reason=f"model {serving.name} was unloaded: nobody used it for a while")
        self.serving.reload_on_request.add(serving.name)

    def on_fellow_joined(self, conn, stages: list) -> list[str]:
        """A fellow (re)connected holding ``stages``: the models whose stage it keeps (it unloads the others).
        What follows from it -- adopting its stages, linking rings -- runs once its welcome has gone out."""
        self.serving.start_task(self._adopt, conn, stages)
        self.serving.link_matrix.fleet_changed()  # its links are measured soon
        self.serving.rebalance.pool_changed()
        return sorted(set(self.serving.recovery.keeps(conn, stages)) | set(self.serving.models_on_fellow(conn.id)))

    async def _adopt(self, conn, stages: list) -> None:
        joined = self.serving.online.get(conn.id)
        if joined is None or joined is not conn:
            return
        self.serving.recovery.adopt(joined, stages)
        self.serving.recovery.fleet_changed()
        if joined.standby and self.serving.verifier.fraction > 0:
            await self.serving.verifier.cover_all()  # spot checks: a standby that joins checks a stage nothing checks

    async def on_fellow_lost(self, conn) -> None:
        self.serving.recovery.fellow_lost(conn)
