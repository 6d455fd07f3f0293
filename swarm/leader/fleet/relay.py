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
# A second end for a slot waits this long for the first to leave (a fellow reconnecting closes its old socket
# within milliseconds) before it is refused.
SLOT_GRACE_S = 2.0


@dataclasses.dataclass
class _Waiting:
    ws: WebSocket
    paired: trio.Event
    peer: WebSocket | None = None
    done: trio.Event = dataclasses.field(default_factory=trio.Event)
    gone: bool = False  # its websocket closed while it waited
    left: trio.Event = dataclasses.field(default_factory=trio.Event)  # it no longer holds the slot
    early: list[bytes] = dataclasses.field(default_factory=list)  # what it sent as it was being paired


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
        if previous is not None and not previous.gone:
            # An end that is going away (its fellow reconnected) gets a moment to leave.
            with trio.move_on_after(SLOT_GRACE_S):
                await previous.left.wait()
        previous = self._waiting.get((hop_id, role))
        if previous is not None and not previous.gone:
            # The slot is taken by a live end: a second one (whoever holds a copy of the credential) cannot take
            # it over. A stale end is noticed as its socket closes (the watch below) and frees the slot.
            log.warning("refused a second %s end for relay hop %s: the slot is in use", role, hop_id)
            await _close(ws, 4409)
            return
        self._waiting[(hop_id, role)] = me
        try:
            timeout = PAIR_TIMEOUT_S if role == "dial" else float("inf")
            async with trio.open_nursery() as watching:
                watching.start_soon(self._watch_waiting, me, watching.cancel_scope)
                with trio.move_on_after(timeout):
                    await me.paired.wait()
                watching.cancel_scope.cancel()
            if me.peer is None:
                await _close(ws, 1013)  # try again later: no listener yet (or this end went away)
                return
            for data in me.early:
                await me.peer.send_bytes(data)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pump_then_cancel, ws, me.peer, nursery.cancel_scope)
                await me.done.wait()
                nursery.cancel_scope.cancel()
        finally:
            if self._waiting.get((hop_id, role)) is me:
                del self._waiting[(hop_id, role)]
            me.left.set()

    @staticmethod
    async def _watch_waiting(me: _Waiting, scope: trio.CancelScope) -> None:
        """Notice a waiting end's socket closing, so its slot frees at once. A waiting end sends nothing before it
        is paired; a frame that arrives as it is being paired is kept for the peer."""
        try:
            message = await me.ws.receive()
        except (WebSocketDisconnect, RuntimeError, OSError):
            message = {"type": "websocket.disconnect"}
        if message["type"] == "websocket.disconnect":
            me.gone = True
            scope.cancel()
        elif message.get("bytes") is not None:
            me.early.append(message["bytes"])

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
            # either end went away: the relay ends, the other end closes below
            pass
        finally:
            await _close(sink)
            await _close(source)


async def _close(ws: WebSocket, code: int = 1000) -> None:
    with trio.move_on_after(CLEANUP_S, shield=True):
        try:
            await ws.close(code)
        except (RuntimeError, OSError):  # already closed or broken: nothing left to close
            pass
