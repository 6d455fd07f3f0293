"""Measuring the links to the fellows this one may be placed next to (issue 37): round-trip time and throughput over
the path a ring hop would take, reported to the leader, whose admin page shows the matrix.

The leader sends ``probe_links`` now and then (swarm.leader.fleet.link_matrix) naming the pool's other fellows: their
keys, their serving ports where a hop would dial them directly, and a relay channel opened for the probe. For each,
this fellow opens a Noise session over the path a hop would take -- the direct link first, the leader's relay when
there is no port to dial, the dial fails, or SWARM_PIPELINE_TRANSPORT=relay -- (the peer checks the key the leader
announced, the dialer the peer's), sends PINGS small frames and one BULK frame, each echoed back, and closes: about
2 * (PINGS * PING_BYTES + BULK_BYTES) bytes a pair, some 10 KB a probe, whichever the path.
The same message names the relay channels this fellow listens on for its peers' probes (``listen``). A hop that
serves over a hole-punched tunnel reports its own round-trip times (swarm.leader.fleet.link_matrix.hops), which win
over a probe's: a probe does not punch a tunnel of its own, which would cost a rendezvous per pair.
"""

from __future__ import annotations

import logging
import os

import trio
import trio_websocket

from swarm.control_links import LinkFigures, LinkReport, ProbeLinks, ProbePeer
from swarm.errors import SwarmError
from swarm.mesh.paths import accept_relay, dial_direct, dial_relay
from swarm.tunnel.channel import NoiseChannel, close_quietly

log = logging.getLogger(__name__)

PREFIX = "probe:"  # the handshake payload of a probe (a hop's is its hop id)
PINGS = 3
PING_BYTES = 64
BULK_BYTES = 4096
ALLOW_S = 120.0  # how long after a probe_links message its peers may open probes to this fellow
TIMEOUT_S = 5.0  # one peer's whole measurement
FRAMES = PINGS + 1  # what one probe sends, and what its echo answers at most
FAILURES = (SwarmError, OSError, trio.BrokenResourceError, trio.ClosedResourceError, trio_websocket.HandshakeError,
            trio_websocket.ConnectionClosed)


class LinkProbes:
    def __init__(self, fellow):
        self.fellow = fellow
        self._allowed: dict[bytes, float] = {}  # peer key -> until when it may probe this fellow

    def allows(self, key: bytes) -> bool:
        return self._allowed.get(key, 0.0) > trio.current_time()

    async def run(self, message: ProbeLinks) -> None:
        """Measure every peer of a ``probe_links`` message, one after another, and report them to the leader."""
        peers = message.peers
        until = trio.current_time() + ALLOW_S
        for peer in peers:
            self._allowed[peer.key] = until
        nursery = self.fellow.nursery
        listens = message.listen
        # A peer measures its peers one after another, each direct then over the relay: this fellow's relay ends
        # wait that long (a probe that went direct leaves them idle), then free their slots on the leader.
        wait_s = min(ALLOW_S, 2 * TIMEOUT_S * (len(listens) + 1))
        for listen in listens if nursery is not None else []:
            nursery.start_soon(self.echo_relay, listen.hop_id, listen.key, wait_s)
        links = []
        for peer in peers:
            links.append(LinkFigures(fellow_id=peer.fellow_id, **await self.measure(peer)))
        if links:
            try:
                await self.fellow.control.send(LinkReport(links))
            except SwarmError as exc:  # the control link dropped meanwhile: the next probe reports again
                log.info("could not report link measurements: %s", exc)

    async def measure(self, peer: ProbePeer) -> dict:
        """The figures of one peer over the direct link, else over the relay (saying why not direct)."""
        direct = peer.direct
        why = "no serving port to dial"
        if isinstance(direct, list) and len(direct) == 2:
            host, port = str(direct[0]), int(direct[1])
            figures, why = await self._measure_over("direct", lambda: dial_direct(
                host, port, PREFIX + peer.probe_id, self.fellow.private, peer.key, TIMEOUT_S))
            if figures is not None:
                return figures
            why = f"direct link failed: {why}"
        relay = peer.relay
        if not isinstance(relay, str) or not relay:
            return {"path": "relay", "rtt_ms": None, "mbps": None, "error": why[:200]}
        async with trio.open_nursery() as nursery:  # the relay websocket's own tasks
            figures, relay_why = await self._measure_over("relay", lambda: dial_relay(
                nursery, self.fellow.leader_url, relay, self.fellow.credential or "", self.fellow.private,
                peer.key))
            nursery.cancel_scope.cancel()
        if figures is None:
            return {"path": "relay", "rtt_ms": None, "mbps": None, "error": f"{why}; relay failed: {relay_why}"[:200]}
        return {**figures, "note": why[:200]}

    async def _measure_over(self, path: str, dial) -> tuple[dict | None, str]:
        """(figures, "") over the channel ``dial()`` opens, or (None, why it failed)."""
        channel: NoiseChannel | None = None
        try:
            with trio.fail_after(TIMEOUT_S):
                start = trio.current_time()
                channel = await dial()
                connect = trio.current_time() - start
                rtts = []
                for _ in range(PINGS):
                    rtts.append(await _echoed(channel, os.urandom(PING_BYTES)))
                bulk = await _echoed(channel, os.urandom(BULK_BYTES))
        except (trio.TooSlowError, *FAILURES) as exc:
            return None, "timed out" if isinstance(exc, trio.TooSlowError) else str(exc) or type(exc).__name__
        finally:
            if channel is not None:
                await close_quietly(channel)
        rtt = min(rtts)
        spent = max(bulk - rtt, 1e-6)  # the bulk frame's extra time over a small one's, both ways
        return {"path": path, "rtt_ms": round(rtt * 1000, 2), "mbps": round(2 * BULK_BYTES * 8 / spent / 1e6, 1),
                "connect_ms": round(connect * 1000, 2)}, ""

    async def echo_relay(self, hop_id: str, key: bytes, wait_s: float) -> None:
        """Wait (``wait_s`` at most) on the relay channel ``hop_id`` for the peer with ``key`` to probe, then echo."""
        with trio.move_on_after(wait_s):
            try:
                async with trio.open_nursery() as nursery:
                    channel = await accept_relay(nursery, self.fellow.leader_url, hop_id, self.fellow.credential or "",
                                                 self.fellow.private, lambda k: k == key)
                    await self.echo(channel)
                    nursery.cancel_scope.cancel()
            except* FAILURES as group:
                log.info("link probe over the relay %s: %s", hop_id, group.exceptions[0])

    async def echo(self, channel: NoiseChannel) -> None:
        """The probed end: send each frame back, FRAMES at most, then close."""
        try:
            with trio.fail_after(TIMEOUT_S):
                for _ in range(FRAMES):
                    await channel.send(await channel.receive())
        except (trio.TooSlowError, SwarmError, OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the prober measures (or times out) the probe and reports it; this end has nothing to tell
        finally:
            await close_quietly(channel)


async def _echoed(channel: NoiseChannel, payload: bytes) -> float:
    """Seconds for ``payload`` to come back."""
    start = trio.current_time()
    await channel.send(payload)
    back = await channel.receive()
    if back != payload:
        raise SwarmError("the probed fellow echoed something else")
    return trio.current_time() - start
