"""Measuring the links to the fellows this one may be placed next to (issue 37): round-trip time and throughput over
the path a ring hop would take, reported to the leader, whose admin page shows the matrix.

The leader sends ``probe_links`` now and then (swarm.leader.fleet.link_matrix) naming the pool's other fellows: their
keys, and their serving ports where a hop would dial them directly. For each, this fellow opens a Noise session as a hop
does (the peer checks the key the leader announced, the dialer the peer's), sends PINGS small frames and one BULK
frame, each echoed back, and closes: about 2 * (PINGS * PING_BYTES + BULK_BYTES) bytes a pair, some 10 KB a probe.
A peer with no port to dial (or SWARM_PIPELINE_TRANSPORT=relay on the leader) is reported as on the relay, not
measured.
"""

from __future__ import annotations

import logging
import os

import trio

from swarm.errors import SwarmError
from swarm.mesh.paths import dial_direct
from swarm.tunnel.channel import NoiseChannel, close_quietly

log = logging.getLogger(__name__)

PREFIX = "probe:"  # the handshake payload of a probe (a hop's is its hop id)
PINGS = 3
PING_BYTES = 64
BULK_BYTES = 4096
ALLOW_S = 120.0  # how long after a probe_links message its peers may open probes to this fellow
TIMEOUT_S = 5.0  # one peer's whole measurement
FRAMES = PINGS + 1  # what one probe sends, and what its echo answers at most


class LinkProbes:
    def __init__(self, fellow):
        self.fellow = fellow
        self._allowed: dict[bytes, float] = {}  # peer key -> until when it may probe this fellow

    def allows(self, key: bytes) -> bool:
        return self._allowed.get(key, 0.0) > trio.current_time()

    async def run(self, message: dict) -> None:
        """Measure every peer of a ``probe_links`` message, one after another, and report them to the leader."""
        peers = [p for p in message.get("peers", []) if isinstance(p, dict) and isinstance(p.get("key"), bytes)]
        until = trio.current_time() + ALLOW_S
        for peer in peers:
            self._allowed[peer["key"]] = until
        links = []
        for peer in peers:
            links.append({"fellow_id": peer.get("fellow_id"), **await self.measure(peer)})
        if links:
            try:
                await self.fellow.control.send({"t": "link_report", "links": links})
            except SwarmError as exc:  # the control link dropped meanwhile: the next probe reports again
                log.info("could not report link measurements: %s", exc)

    async def measure(self, peer: dict) -> dict:
        direct = peer.get("direct")
        if not (isinstance(direct, list) and len(direct) == 2):
            return {"path": "relay", "rtt_ms": None, "mbps": None, "error": "no serving port to dial"}
        channel: NoiseChannel | None = None
        try:
            with trio.fail_after(TIMEOUT_S):
                start = trio.current_time()
                channel = await dial_direct(str(direct[0]), int(direct[1]), PREFIX + str(peer.get("probe_id", "")),
                                            self.fellow.private, peer["key"], TIMEOUT_S)
                connect = trio.current_time() - start
                rtts = []
                for _ in range(PINGS):
                    rtts.append(await _echoed(channel, os.urandom(PING_BYTES)))
                bulk = await _echoed(channel, os.urandom(BULK_BYTES))
        except (trio.TooSlowError, SwarmError, OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            why = "timed out" if isinstance(exc, trio.TooSlowError) else str(exc) or type(exc).__name__
            return {"path": "relay", "rtt_ms": None, "mbps": None, "error": f"direct link failed: {why}"[:200]}
        finally:
            if channel is not None:
                await close_quietly(channel)
        rtt = min(rtts)
        spent = max(bulk - rtt, 1e-6)  # the bulk frame's extra time over a small one's, both ways
        return {"path": "direct", "rtt_ms": round(rtt * 1000, 2), "mbps": round(2 * BULK_BYTES * 8 / spent / 1e6, 1),
                "connect_ms": round(connect * 1000, 2)}

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
