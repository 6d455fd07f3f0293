"""The fellow's side of direct links: open a hole-punched, QUIC-carried, Noise-encrypted tunnel for a hop.

The leader coordinates (swarm.leader.fleet.direct_links): it asks both ends of a hop for their UDP candidates, then
tells both to punch at the same moment. The sending end ("a") becomes the QUIC client and moves its OutgoingHop onto the
tunnel between two messages; the receiving end ("b") accepts and feeds what arrives into the stage like any other path.
One UDP socket per attempt carries the rendezvous probe, the punch and the QUIC connection, so the NAT mapping the
leader saw is the one the peer punches to.
"""

from __future__ import annotations

import functools
import logging
from urllib.parse import urlsplit

import trio

from swarm.control_links import PunchCandidates, PunchPrepare, PunchResult, PunchStart
from swarm.errors import SwarmError, first_leaf
from swarm.fellow.net import outbound_ip
from swarm.mesh import hole_punch, quic
from swarm.mesh.punch_plan import Learned, Plan, next_attempt, plan_punch
from swarm.tunnel.channel import NoiseChannel

log = logging.getLogger(__name__)


class DirectLinkAgent:
    def __init__(self, fellow):
        self.fellow = fellow
        self.sockets: dict[str, trio.socket.SocketType] = {}
        self.plans: dict[str, Plan] = {}
        self.learned: dict[str, Learned] = {}  # per hop, kept across attempts

    def _close(self, hop_id: str) -> None:
        self.plans.pop(hop_id, None)
        sock = self.sockets.pop(hop_id, None)
        if sock is not None:
            sock.close()

    async def prepare(self, message: PunchPrepare) -> None:
        """Open this end's UDP socket for the hop, learn its public address, tell the leader the candidates."""
        hop_id, role = message.hop_id, message.role
        stage = self.fellow.stages.get(message.model)
        reply = functools.partial(PunchCandidates, message.model, hop_id, role)
        if stage is None:
            await self.fellow.send_to_leader(reply(skip="not loaded"))
            return
        if role == "a":
            hop = stage.driver.out_hop
            if hop is not None:
                try:
                    await hop.ensure_open()
                except SwarmError as exc:
                    log.info("hop %s cannot open any path yet: %s", hop_id, exc)
            if hop is None or hop.path in ("direct", "tunnel"):
                await self.fellow.send_to_leader(reply(skip=hop.path if hop else "no hop"))
                return
        self._close(hop_id)
        sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM)
        await sock.bind(("0.0.0.0", 0))
        self.sockets[hop_id] = sock
        server = (urlsplit(self.fellow.leader_url).hostname, message.rendezvous_port)
        try:
            plan = await plan_punch(sock, server, message.who.encode(), outbound_ip(self.fellow.leader_url),
                                    self.learned.setdefault(hop_id, Learned()))
        except (SwarmError, OSError) as exc:  # the leader's token or address was refused: no punch this time
            self._close(hop_id)
            await self.fellow.send_to_leader(reply(skip=f"cannot prepare: {exc}"))
            return
        self.plans[hop_id] = plan
        log.info("hop %s: punching with IP TTL %d for the first %d rounds (%s)", hop_id, plan.low_ttl,
                 plan.low_ttl_rounds, plan.note)
        await self.fellow.send_to_leader(reply(candidates=[list(c) for c in plan.candidates],
                                               reflexive=plan.reflexive is not None))

    async def start(self, message: PunchStart) -> None:
        hop_id, role = message.hop_id, message.role
        sock = self.sockets.get(hop_id)
        plan = self.plans.pop(hop_id, None)
        stage = self.fellow.stages.get(message.model)
        result = functools.partial(PunchResult, message.model, hop_id, role)
        if sock is None or stage is None or plan is None:
            await self.fellow.send_to_leader(result(False, "not prepared"))
            return
        start_at = trio.current_time() + message.start_in_s
        learned = self.learned.setdefault(hop_id, Learned())
        try:
            try:
                peer = await hole_punch.punch(sock, [tuple(c) for c in message.peer_candidates], message.secret,
                                              role, start_at, low_ttl=plan.low_ttl, low_ttl_rounds=plan.low_ttl_rounds,
                                              ttl_note=plan.note)
                if role == "a":
                    await self._dial(stage, sock, peer, hop_id)
                else:
                    await self._accept(stage, sock, peer, hop_id)
            except BaseExceptionGroup as group:
                raise first_leaf(group) from None
        except (SwarmError, OSError) as exc:
            why = str(exc)
            if isinstance(exc, hole_punch.PunchFailed):
                why += next_attempt(learned)
            log.info("no tunnel for hop %s: %s", hop_id, why)
            self._close(hop_id)
            await self.fellow.send_to_leader(result(False, why))
            return
        self.learned.pop(hop_id, None)  # a hop that punched starts afresh if it ever needs to again
        self.sockets.pop(hop_id, None)  # the QUIC driver owns it now
        await self.fellow.send_to_leader(result(True, peer=list(peer)))

    async def _dial(self, stage, sock, peer, hop_id: str) -> None:
        hop = stage.driver.out_hop
        if hop is None or hop.config.hop_id != hop_id or stage.links_nursery is None:
            raise SwarmError("the ring was rebuilt meanwhile: this hop is gone")
        transport = await quic.open_quic_client(sock, peer, stage.links_nursery)
        channel = await NoiseChannel.connect(transport, self.fellow.private, hop.config.peer_public,
                                             payload=hop_id.encode())
        await hop.upgrade(channel, "tunnel")

    async def _accept(self, stage, sock, peer, hop_id: str) -> None:
        if not stage.hop_in or stage.hop_in.hop_id != hop_id or stage.links_nursery is None:
            raise SwarmError("the ring was rebuilt meanwhile: this hop is gone")
        transport = await quic.accept_quic_server(sock, peer, stage.links_nursery)
        expected = stage.hop_in.peer_key
        channel = await NoiseChannel.accept(transport, self.fellow.private, lambda key: key == expected)
        if channel.handshake_payload.decode(errors="replace") != hop_id:
            await channel.aclose()
            raise SwarmError("the tunnel's peer named another hop")
        stage.links_nursery.start_soon(self.fellow.links.pump, channel, stage, hop_id)
