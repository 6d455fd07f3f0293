"""Incoming ring links: the previous stage reaches this fellow's stages over a direct TCP connection to the serving
port (SWARM_SERVE_PORT), through the leader's relay, or over a hole-punched tunnel (direct_links.py). Whatever the
path, the peer must prove the key the leader announced for the hop, and what arrives is handed to the stage in the
hop's order (swarm.mesh.sequencing), so a hop may change path between two messages.
"""

from __future__ import annotations

import functools
import logging

import trio
import trio_websocket

from swarm import wire
from swarm.control_messages import HopIn
from swarm.errors import SwarmError, TunnelError, first_leaf
from swarm.fellow.link_probe import PREFIX as PROBE_PREFIX
from swarm.mesh import sequencing
from swarm.mesh.hop import SILENT_S
from swarm.mesh.paths import accept_relay
from swarm.tunnel.channel import NoiseChannel, StreamFrameTransport, close_quietly

log = logging.getLogger(__name__)

RELAY_RETRY_S = 1.0  # after the relay listener's connection drops (a leader restart, a Wi-Fi blip)



class IncomingLinks:
    def __init__(self, fellow):
        self.fellow = fellow
        self.serve_port: int | None = None
        self._resequencers: dict[str, sequencing.Resequencer] = {}

    async def start_listener(self, nursery: trio.Nursery) -> None:
        port, host = self.fellow.settings.serve_port, self.fellow.settings.serve_host or None
        serve = functools.partial(trio.serve_tcp, self._on_direct_connection, host=host)
        try:
            listeners = await nursery.start(serve, port)
        except OSError as exc:
            log.warning("SWARM_SERVE_PORT %s is taken (%s); listening on a free port instead", port, exc)
            listeners = await nursery.start(serve, 0)
        self.serve_port = listeners[0].socket.getsockname()[1]

    def forget_hop(self, hop_id: str) -> None:
        self._resequencers.pop(hop_id, None)

    def _expects(self, key: bytes) -> bool:
        return any(s.hop_in is not None and s.hop_in.peer_key == key for s in self.fellow.stages.values()) or \
            self.fellow.link_probes.allows(key)  # a fellow of the pool measuring its link to this one

    def stage_for_hop(self, hop_id: str, key: bytes):
        """The stage that receives on ``hop_id`` from the fellow with ``key`` (None: no such hop)."""
        for stage in self.fellow.stages.values():
            if stage.hop_in is not None and stage.hop_in.hop_id == hop_id and stage.hop_in.peer_key == key:
                return stage
        return None

    async def pump(self, channel: NoiseChannel, stage, hop_id: str) -> None:
        """Ring messages of one incoming path, handed to the stage in the hop's order. A path that goes silent
        (the sender pings every KEEPALIVE_S) is closed after SILENT_S: the previous stage's fellow is gone or the
        path broke, and the leader will rebuild the ring or the sender will take another path."""
        order = self._resequencers.setdefault(hop_id, sequencing.Resequencer())
        ring_id, driver = stage.ring_id, stage.driver
        try:
            while True:
                with trio.fail_after(SILENT_S):
                    frame = await channel.receive()
                flag, _ = sequencing.kind(frame)
                if flag == sequencing.PING:
                    await channel.send(sequencing.pong(frame))
                    continue
                for payload in order.push(frame):
                    await driver.deliver(wire.decode_message(payload), ring_id)
        except trio.TooSlowError:
            log.info("incoming link of %s went silent for %.0f s; closing it", stage.model, SILENT_S)
        except (TunnelError, SwarmError, OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.info("incoming link of %s closed: %s", stage.model, exc)
        finally:
            await close_quietly(channel)

    async def _on_direct_connection(self, stream: trio.SocketStream) -> None:
        transport = StreamFrameTransport(stream)
        try:
            channel = await NoiseChannel.accept(transport, self.fellow.private, self._expects)
        except (SwarmError, OSError, trio.BrokenResourceError) as exc:
            log.info("refused a direct ring connection: %s", exc)  # the channel closed the transport
            return
        hop_id = channel.handshake_payload.decode(errors="replace")
        if hop_id.startswith(PROBE_PREFIX) and self.fellow.link_probes.allows(channel.remote_static):
            await self.fellow.link_probes.echo(channel)  # swarm.fellow.link_probe
            return
        stage = self.stage_for_hop(hop_id, channel.remote_static)
        if stage is None:
            log.info("refused a direct ring connection for an unknown hop")
            await channel.aclose()
            return
        await self.pump(channel, stage, hop_id)

    async def relay_listener(self, stage, hop_in: HopIn) -> None:
        """Keep one listener waiting on this stage's relay channel, for whenever the previous stage uses it."""
        while True:
            try:
                try:
                    async with trio.open_nursery() as nursery:
                        channel = await accept_relay(
                            nursery, self.fellow.leader_url, hop_in.hop_id, self.fellow.credential,
                            self.fellow.private, lambda key: key == hop_in.peer_key,
                        )
                        await self.pump(channel, stage, hop_in.hop_id)
                        nursery.cancel_scope.cancel()
                except BaseExceptionGroup as group:
                    raise first_leaf(group) from None
            except (SwarmError, OSError, trio_websocket.HandshakeError, trio_websocket.ConnectionClosed) as exc:
                log.info("relay listener for %s: %s", stage.model, exc)
                await trio.sleep(RELAY_RETRY_S)
