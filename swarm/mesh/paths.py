"""The two paths between ring neighbours today: a direct TCP link and the leader's relay.

Both carry the same Noise session (swarm.tunnel) with keys pinned by the leader, so a path only moves ciphertext:
the relay forwards frames it cannot read, and a listener refuses any key the leader did not announce for the hop.
The dialer names the hop in the handshake payload so one listening port serves every hop of a fellow.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable

import trio
import trio_websocket

from swarm.errors import LinkClosed, TunnelError
from swarm.mesh.websocket import WebSocketFrameTransport, ws_url
from swarm.tunnel.channel import HANDSHAKE_TIMEOUT, NoiseChannel, StreamFrameTransport
from swarm.tunnel.tls import context_for

log = logging.getLogger(__name__)

# A hop that cannot open within this time falls back to the relay. On a LAN a TCP connect plus the Noise handshake
# takes about a millisecond; seconds mean a filtered port, whose SYNs are dropped rather than refused.
DIRECT_CONNECT_TIMEOUT_S = 3.0
HANDSHAKE_TIMEOUT_S = HANDSHAKE_TIMEOUT  # the tunnel's own default; the name is kept for old imports


async def dial_direct(
    host: str, port: int, hop_id: str, local_private: bytes, peer_public: bytes, timeout: float
) -> NoiseChannel:
    """Open a TCP connection to the next stage's serving port and authenticate it by its pinned key."""
    with trio.fail_after(timeout):
        # One token per frame wants no Nagle delay: trio's SocketStream turns on TCP_NODELAY itself.
        stream = await trio.open_tcp_stream(host, port)
    # NoiseChannel owns the transport from here on, as in dial_relay and accept_relay: a failed handshake closes it.
    transport = StreamFrameTransport(stream)
    return await NoiseChannel.connect(transport, local_private, peer_public, payload=hop_id.encode())


async def open_relay(
    nursery: trio.Nursery,
    leader_url: str,
    hop_id: str,
    role: str,
    credential: str,
    ssl_context: ssl.SSLContext | None = None,
) -> WebSocketFrameTransport:
    """Join one end of a relay channel on the leader; the leader pairs the dialer with the listener."""
    url = ws_url(leader_url, f"/relay/{hop_id}?role={role}")
    ssl_context = ssl_context or context_for(leader_url)  # the leader's pinned certificate (swarm.tunnel.tls)
    # The websocket's reader task runs in a nursery of its own: a refusal it raises there (the leader answering 403
    # for a hop of an old ring) ends this channel, never the stage's nursery and with it the fellow.
    own, connected = await nursery.start(_websocket_nursery, url)
    try:
        ws = await trio_websocket.connect_websocket_url(
            own,
            url,
            ssl_context=ssl_context,
            extra_headers=[(b"authorization", f"Bearer {credential}".encode())],
            max_message_size=1 << 20,
        )
    except (OSError, trio_websocket.HandshakeError) as exc:
        raise LinkClosed(f"could not reach the leader's relay at {url}: {exc}") from None
    finally:
        connected.set()
    return WebSocketFrameTransport(ws)


async def _websocket_nursery(url: str, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """A nursery for one websocket's background tasks, open until the connect is done and its tasks have ended."""
    connected = trio.Event()
    try:
        async with trio.open_nursery() as own:
            task_status.started((own, connected))
            await connected.wait()
    except* (OSError, trio_websocket.HandshakeError, trio_websocket.ConnectionClosed) as group:
        log.info("the relay channel at %s ended: %s", url, group.exceptions[0])


async def dial_relay(
    nursery: trio.Nursery,
    leader_url: str,
    hop_id: str,
    credential: str,
    local_private: bytes,
    peer_public: bytes,
) -> NoiseChannel:
    """Dial the next stage through the leader's relay and authenticate it by its pinned key."""
    transport = await open_relay(nursery, leader_url, hop_id, "dial", credential)
    return await NoiseChannel.connect(transport, local_private, peer_public, payload=hop_id.encode())


async def accept_relay(
    nursery: trio.Nursery,
    leader_url: str,
    hop_id: str,
    credential: str,
    local_private: bytes,
    allow: Callable[[bytes], bool],
) -> NoiseChannel:
    """Wait on the listener end of a relay channel until the previous stage dials it."""
    transport = await open_relay(nursery, leader_url, hop_id, "listen", credential)
    # No timeout: the listener waits as long as it takes for the dialer to come.
    return await NoiseChannel.accept(transport, local_private, allow, timeout=float("inf"))


__all__ = ["dial_direct", "dial_relay", "accept_relay", "TunnelError", "DIRECT_CONNECT_TIMEOUT_S"]
