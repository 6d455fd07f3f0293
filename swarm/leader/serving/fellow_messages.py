"""What the fellows' control links bring to serving: tokens, failures and timings of requests, heartbeats, stage
events, spot checks, leaving, idle unloads and link reports, each handed to the part that deals with it; and
fellows that join or drop out."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import trio

from swarm import messages
from swarm.leader.serving.performance import hop_rate

if TYPE_CHECKING:
    from swarm.leader.serving.serving import Serving

log = logging.getLogger(__name__)


class FellowMessages:
    """Dispatches the fellows' messages to the parts of one leader's serving
    (its :class:`~swarm.leader.serving.serving.Serving`)."""

    def __init__(self, serving: Serving):
        self.serving = serving

    async def on_fellow_message(self, conn, message: Any) -> None:
        """Everything a fellow's control link brings. Never waits on a client or another fellow."""
        if isinstance(message, messages.Tokens):
            if self._serves(conn, message.model):
                self.serving.prefix.on_tokens(message)  # first: the requests this ending starts may reuse its blocks
                self.serving.perform(self.serving.book.on_tokens(message))
        elif isinstance(message, messages.Failed):
            if self._serves(conn, message.model):
                log.info("request %s failed on stage %s: %s", message.rid, message.stage, message.message)
                self.serving.prefix.failed(message.model, message.rid)
                self.serving.perform(self.serving.book.on_failed(message))
        elif isinstance(message, messages.StageTimes):
            if self._serves(conn, message.model):
                self.serving.book.on_stage_times(message)
        elif isinstance(message, messages.HopLost):
            if self._serves(conn, message.model):
                log.info("a link of %s over the %s broke; re-sending its requests", message.model, message.path)
                self.serving.perform(self.serving.book.on_path_lost(message.model))
        elif not isinstance(message, dict):
            log.debug("ignoring a %s from %s", type(message).__name__, conn.name)
        elif message["t"] == "heartbeat":
            # A fellow reports the hops it sends on (hop i leaves stage i), and only those.
            own = {m.hop_ids[s.plan.index] for m in self.serving.models.values() for s in m.stages
                   if s.plan.fellow_id == conn.id and s.plan.index < len(m.hop_ids)}
            hops = message.get("hops")
            for hop in hops if isinstance(hops, list) else []:
                if isinstance(hop, dict) and hop.get("hop_id") in own:
                    previous = self.serving.hop_stats.get(hop["hop_id"])
                    self.serving.hop_stats[hop["hop_id"]] = hop_rate(previous, hop, trio.current_time())
            placement = message.get("placement")
            self.serving.placements[conn.id] = placement if isinstance(placement, dict) else {}
        elif message["t"] in ("load_progress", "loaded", "load_failed", "linked", "link_failed"):
            self.serving.recovery.on_stage_event(conn, message)
        elif message["t"] in ("verify_sample", "verify_result"):
            self.serving.verifier.on_message(conn, message)
        elif message["t"] == "leave":  # SIGTERM of the fellow's process: hand its stages over, then it goes
            self.serving.start_task(self.serving.drains.on_leave, conn, message)
        elif message["t"] in ("kv_kept", "kv_imported"):  # a drain's KV handover (swarm.leader.serving.kv_carry)
            self.serving.drains.kv.on_message(conn, message)
        elif message["t"] == "unloaded" and message.get("reason") == "idle":
            await self._idle(conn, message)
        elif message["t"] == "link_report":
            self.serving.link_matrix.on_report(conn, message)
            self.serving.rebalance.pool_changed()
        elif message["t"] in ("punch_candidates", "punch_result", "punch_pong") \
                and self.serving.direct_links is not None:
            self.serving.direct_links.on_message(conn, message)

    def _serves(self, conn, model: str) -> bool:
        """Whether ``conn`` serves a stage of ``model``: only those fellows speak for its requests."""
        serving = self.serving.models.get(model)
        return serving is not None and conn.id in serving.fellow_ids

    async def _idle(self, conn, message: dict) -> None:
        serving = self.serving.models.get(message.get("model", ""))
        if serving is None or serving.load_id != message.get("load_id") or conn.id not in serving.fellow_ids:
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
