"""The relay hub: pairs the two ends of a hop on the leader and forwards their frames verbatim.

Only ciphertext passes: the fellows run a Noise session with each other's pinned keys inside the relay channel, so
the leader forwards frames it cannot read or alter undetected. A channel exists only for the two fellows the leader
placed on either end of a hop; each end proves who it is with its node credential.
"""

from __future__ import annotations

import dataclasses
import logging

import trio
from starlette.websockets import WebSocket, WebSocketDisconnect

from swarm.tunnel.channel import CLEANUP_S

log = logging.getLogger(__name__)

# How long the dialer end waits for the listener end to arrive (the listener joins right after its stage loads).
PAIR_TIMEOUT_S = 15.0


@dataclasses.dataclass
class _Waiting:
    ws: WebSocket
    paired: trio.Event
    peer: WebSocket | None = None
    done: trio.Event = dataclasses.field(default_factory=trio.Event)


@dataclasses.dataclass(frozen=True)
class RelayChannel:
    hop_id: str
    dialer_fellow: int
    listener_fellow: int


class RelayHub:
    def __init__(self) -> None:
        self.channels: dict[str, RelayChannel] = {}
        self._waiting: dict[tuple[str, str], _Waiting] = {}
        self.bytes_forwarded = 0

    def open_channel(self, hop_id: str, dialer_fellow: int, listener_fellow: int) -> None:
        self.channels[hop_id] = RelayChannel(hop_id, dialer_fellow, listener_fellow)

    def close_channel(self, hop_id: str) -> None:
        self.channels.pop(hop_id, None)

    def may_join(self, hop_id: str, role: str, fellow_id: int) -> bool:
        channel = self.channels.get(hop_id)
        if channel is None:
            return False
        return fellow_id == (channel.dialer_fellow if role == "dial" else channel.listener_fellow)

    async def join(self, ws: WebSocket, hop_id: str, role: str) -> None:
        """Serve one end until either end closes. ``ws`` is accepted already."""
        other_role = "listen" if role == "dial" else "dial"
        other = self._waiting.pop((hop_id, other_role), None)
        if other is not None:
            other.peer = ws
            other.paired.set()
            try:
                await self._pump(ws, other.ws)
            finally:
                other.done.set()
            return
        me = _Waiting(ws, trio.Event())
        previous = self._waiting.get((hop_id, role))
        if previous is not None:
            await _close(previous.ws)  # a stale end (its fellow reconnected): the new one replaces it
        self._waiting[(hop_id, role)] = me
        try:
            timeout = PAIR_TIMEOUT_S if role == "dial" else float("inf")
            with trio.move_on_after(timeout):
                await me.paired.wait()
            if me.peer is None:
                await _close(ws, 1013)  # try again later: no listener yet
                return
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pump_then_cancel, ws, me.peer, nursery.cancel_scope)
                await me.done.wait()
                nursery.cancel_scope.cancel()
        finally:
            if self._waiting.get((hop_id, role)) is me:
                del self._waiting[(hop_id, role)]

    async def _pump_then_cancel(self, source: WebSocket, sink: WebSocket, scope: trio.CancelScope) -> None:
        await self._pump(source, sink)
        scope.cancel()

    async def _pump(self, source: WebSocket, sink: WebSocket) -> None:
        try:
            while True:
                message = await source.receive()
                if message["type"] == "websocket.disconnect":
                    break
                data = message.get("bytes")
                if data is None:
                    break
                self.bytes_forwarded += len(data)
                await sink.send_bytes(data)
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass
        finally:
            await _close(sink)
            await _close(source)


async def _close(ws: WebSocket, code: int = 1000) -> None:
    with trio.move_on_after(CLEANUP_S, shield=True):
        try:
            await ws.close(code)
        except (RuntimeError, OSError):
            pass
