"""One hop of the ring, seen from the stage that sends on it: choose a path, keep it, fall back when it breaks, and
move to a better path between two messages.

``auto`` tries the direct TCP link first (a LAN needs nothing else) and takes the leader's relay when the direct
link cannot be opened in DIRECT_CONNECT_TIMEOUT_S or breaks; once the direct link has failed, the hop stays on the
relay until a better path is offered (``upgrade``: a hole-punched tunnel). ``direct`` and ``relay`` force one path.

Every message is numbered (swarm.mesh.sequencing) so that the receiver keeps the order across a path change. Pings
every KEEPALIVE_S measure the round trip and keep NAT mappings and the relay's websocket alive.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import statistics
import time
from collections.abc import Awaitable, Callable

import trio

from swarm.errors import LinkClosed, SwarmError
from swarm.mesh import paths, sequencing
from swarm.tunnel.channel import LINK_ERRORS, NoiseChannel, close_quietly

log = logging.getLogger(__name__)

# Under the ~30 s UDP mapping timeout of common home routers (Linux conntrack's udp timeout is 30 s; RFC 4787
# REQ-5 asks for at least 2 minutes, many routers do less), and well under idle timeouts of proxies in front of the
# leader (60 s is common).
KEEPALIVE_S = 1.0
# A path with no pong for this long is dead (a fellow lost power, a cable was pulled): noticed within seconds, so the
# leader can rebuild the ring long before a user gives up on the reply.
SILENT_S = 4 * KEEPALIVE_S
# A hop's round trip is the least of its latest pongs: a pong waits for both peers' event loops as well as the wire,
# and on a busy machine one of them is often late (loopback read 15 ms on a busy 2-core VM from the latest pong alone).
# The least of half a minute's is the wire's figure placement weighs (swarm.leader.planning.link_placement).
RTT_WINDOW = 30
# How long the old path stays open after an upgrade, so what is still on its way there arrives.
DRAIN_S = 2.0


class RoundTrips:
    """A hop's latest RTT_WINDOW round trips, in seconds; its figure is the least of them (see RTT_WINDOW)."""

    def __init__(self) -> None:
        self._latest: collections.deque[float] = collections.deque(maxlen=RTT_WINDOW)

    def add(self, seconds: float) -> None:
        self._latest.append(seconds)

    @property
    def least(self) -> float | None:
        return min(self._latest) if self._latest else None


@dataclasses.dataclass(frozen=True)
class HopConfig:
    hop_id: str  # names the hop on the leader's relay and in the Noise handshake payload
    peer_public: bytes  # the next stage's fellow key, as the leader vouched for it
    peer_name: str
    direct: tuple[str, int] | None  # the next stage's serving address, when it has one
    transport: str = "auto"  # auto | direct | relay


class OutgoingHop:
    """Sends ring messages to the next stage over the best path that works."""

    def __init__(
        self,
        config: HopConfig,
        *,
        nursery: trio.Nursery,
        leader_url: str,
        credential,
        local_private: bytes,
        connect_timeout: float = paths.DIRECT_CONNECT_TIMEOUT_S,
    ):
        self.config = config
        self._nursery = nursery
        self._leader_url = leader_url
        # The node credential for the relay: a callable, since a fellow gets a fresh one each time it reconnects.
        self._credential = credential if callable(credential) else (lambda: credential)
        self._private = local_private
        self._connect_timeout = connect_timeout
        self._channel: NoiseChannel | None = None
        self._lock = trio.Lock()
        self._sequencer = sequencing.Sequencer()
        self._reset_next = True  # the first message on a fresh path after a break tells the receiver to resync
        self.direct_failed = config.transport == "relay" or config.direct is None
        self.path: str | None = None  # "direct", "tunnel" or "relay" once open
        self.round_trips = RoundTrips()
        self.bytes_sent = 0
        self.messages_sent = 0
        self._recent_sizes: collections.deque[int] = collections.deque(maxlen=64)
        # Called (async) when the path in use breaks under it: what was in flight on it may be lost.
        self.on_lost: Callable[[OutgoingHop], Awaitable[None]] | None = None
        self.closed = False

    async def _open(self) -> NoiseChannel:
        cfg = self.config
        if not self.direct_failed:
            assert cfg.direct is not None  # direct_failed is set where there is none
            host, port = cfg.direct
            try:
                channel = await paths.dial_direct(
                    host, port, cfg.hop_id, self._private, cfg.peer_public, self._connect_timeout
                )
                self.path = "direct"
                return channel
            except (OSError, trio.TooSlowError, SwarmError) as exc:
                self.direct_failed = True
                if cfg.transport == "direct":
                    raise LinkClosed(
                        f"the direct link to {cfg.peer_name} at {host}:{port} failed ({exc}); "
                        f"SWARM_PIPELINE_TRANSPORT=direct forbids the relay."
                    ) from None
                log.info("direct link to %s at %s:%s failed (%s); using the relay", cfg.peer_name, host, port, exc)
        channel = await paths.dial_relay(
            self._nursery, self._leader_url, cfg.hop_id, self._credential(), self._private, cfg.peer_public
        )
        self.path = "relay"
        return channel

    def _adopt(self, channel: NoiseChannel) -> None:
        self._channel = channel
        self._nursery.start_soon(self._watch, channel)
        self._nursery.start_soon(self._keepalive, channel)

    async def ensure_open(self) -> None:
        """Open a path now (after a load), so the first reply does not wait for it and the leader knows the path."""
        async with self._lock:
            if self._channel is None:
                self._adopt(await self._open())

    async def send(self, message: bytes) -> None:
        """Send one ring message; raises LinkClosed/TunnelError when the path breaks (the caller fails the request)."""
        if self.closed:
            raise LinkClosed(f"the hop to {self.config.peer_name} is closed")
        async with self._lock:
            if self._channel is None:
                self._adopt(await self._open())
            assert self._channel is not None  # adopted above
            frame = self._sequencer.wrap(message, reset=self._reset_next)
            try:
                await self._channel.send(frame)
                self._reset_next = False
                self.bytes_sent += len(frame)
                self.messages_sent += 1
                self._recent_sizes.append(len(frame))
            except LINK_ERRORS as exc:
                broken, self._channel = self._channel, None
                self._reset_next = True
                if self.path == "direct":
                    self.direct_failed = True  # the next request goes over the relay
                await close_quietly(broken)
                raise LinkClosed(f"the link to {self.config.peer_name} over the {self.path} broke: {exc}") from None

    async def upgrade(self, channel: NoiseChannel, path: str) -> None:
        """Move the hop onto ``channel`` between two messages; the old path drains, then closes."""
        async with self._lock:
            old, self.path = self._channel, path
            self._adopt(channel)
            log.info("hop %s to %s moved to the %s", self.config.hop_id, self.config.peer_name, path)
        if old is not None:
            self._nursery.start_soon(_close_later, old)

    async def _keepalive(self, channel: NoiseChannel) -> None:
        while self._channel is channel:
            try:
                await channel.send(sequencing.ping(int(time.monotonic() * 1e6)))
            except LINK_ERRORS:
                return  # the watcher sees the same failure and drops the path
            await trio.sleep(KEEPALIVE_S)

    async def _watch(self, channel: NoiseChannel) -> None:
        """Only pongs come back on an outgoing hop: a read that ends means the peer closed or the path broke, so the
        next send opens a fresh path instead of writing into a dead socket."""
        try:
            while True:
                with trio.fail_after(SILENT_S):
                    frame = await channel.receive()
                flag, stamp = sequencing.kind(frame)
                if flag == sequencing.PONG:
                    self.round_trips.add(max(0.0, time.monotonic() - stamp / 1e6))
        except trio.TooSlowError:
            log.info("the %s link to %s went silent for %.0f s", self.path, self.config.peer_name, SILENT_S)
        except (SwarmError, *LINK_ERRORS):  # SwarmError: a malformed pong too
            pass
        lost = self._channel is channel
        if lost:
            self._channel = None
            self._reset_next = True
            if self.path == "tunnel":
                self.direct_failed = True  # fall back to the relay, not to a direct port that did not work
            log.info("the %s link to %s closed", self.path, self.config.peer_name)
        await close_quietly(channel)
        if lost and self.on_lost is not None:
            await self.on_lost(self)

    @property
    def rtt_s(self) -> float | None:
        return self.round_trips.least

    def stats(self) -> dict:
        return {"hop_id": self.config.hop_id, "peer": self.config.peer_name, "transport": self.path,
                "rtt_ms": round(rtt * 1000, 3) if (rtt := self.rtt_s) is not None else None,
                "bytes_sent": self.bytes_sent, "messages_sent": self.messages_sent,
                # A decode step sends one message per token on every hop; the median skips prompt chunks.
                "bytes_per_token": int(statistics.median(self._recent_sizes)) if self._recent_sizes else None}

    async def aclose(self) -> None:
        self.closed = True
        if self._channel is not None:
            channel, self._channel = self._channel, None
            await close_quietly(channel)


async def _close_later(channel: NoiseChannel) -> None:
    await trio.sleep(DRAIN_S)
    await close_quietly(channel)
