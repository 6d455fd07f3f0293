"""One hop of the ring, seen from the stage that sends on it: choose a path, keep it, fall back when it breaks.

``auto`` tries the direct TCP link first (a LAN needs nothing else) and takes the leader's relay when the direct
link cannot be opened in DIRECT_CONNECT_TIMEOUT_S or breaks; once the direct link has failed, the hop stays on the
relay until it is set up again. ``direct`` and ``relay`` force one path.
"""

from __future__ import annotations

import dataclasses
import logging

import trio

from swarm.errors import LinkClosed, SwarmError, TunnelError
from swarm.mesh import paths
from swarm.tunnel.channel import CLEANUP_S, NoiseChannel

log = logging.getLogger(__name__)


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
        credential: str,
        local_private: bytes,
        connect_timeout: float = paths.DIRECT_CONNECT_TIMEOUT_S,
    ):
        self.config = config
        self._nursery = nursery
        self._leader_url = leader_url
        self._credential = credential
        self._private = local_private
        self._connect_timeout = connect_timeout
        self._channel: NoiseChannel | None = None
        self._lock = trio.Lock()
        self.direct_failed = config.transport == "relay" or config.direct is None
        self.path: str | None = None  # "direct" or "relay" once open

    async def _open(self) -> NoiseChannel:
        cfg = self.config
        if not self.direct_failed:
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
            self._nursery, self._leader_url, cfg.hop_id, self._credential, self._private, cfg.peer_public
        )
        self.path = "relay"
        return channel

    async def send(self, message: bytes) -> None:
        """Send one ring message; raises LinkClosed/TunnelError when the path breaks (the caller fails the request)."""
        async with self._lock:
            if self._channel is None:
                self._channel = await self._open()
                self._nursery.start_soon(self._watch, self._channel)
            try:
                await self._channel.send(message)
            except (TunnelError, OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                broken, self._channel = self._channel, None
                if self.path == "direct":
                    self.direct_failed = True  # the next request goes over the relay
                with trio.move_on_after(CLEANUP_S, shield=True):
                    await _quiet_close(broken)
                raise LinkClosed(f"the link to {self.config.peer_name} over the {self.path} broke: {exc}") from None

    async def _watch(self, channel: NoiseChannel) -> None:
        """Nothing comes back on an outgoing hop: a read that ends means the peer closed or the path broke, so the
        next send opens a fresh path instead of writing into a dead socket."""
        try:
            while True:
                await channel.receive()
        except (SwarmError, OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        if self._channel is channel:
            self._channel = None
            log.info("the %s link to %s closed", self.path, self.config.peer_name)
            await _quiet_close(channel)

    async def aclose(self) -> None:
        if self._channel is not None:
            channel, self._channel = self._channel, None
            await _quiet_close(channel)


async def _quiet_close(channel: NoiseChannel) -> None:
    try:
        await channel.aclose()
    except Exception:  # closing a broken link: nothing left to report
        pass
