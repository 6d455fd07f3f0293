"""The leader survives hypercorn's close race: a frame sent while the connection shuts its write side is dropped,
not raised out of ``serve`` (which ended every chat and fellow link with it; CI met it when a fellow updated)."""

from __future__ import annotations

import trio
from hypercorn.events import Closed, RawData
from hypercorn.trio.tcp_server import TCPServer

from swarm.leader.api.hypercorn_close import guard_close_race

ROUNDS = 60  # trio orders a batch of ready tasks at random: each order comes up in a few rounds


class _Protocol:
    def __init__(self):
        self.events = []

    async def handle(self, event) -> None:
        self.events.append(event)


async def _race(send) -> str:
    """hypercorn's _close (send_eof, outside the send lock) and a frame's send at once, on a real socket pair:
    'busy' (raised), 'closed' (the send came after, and hypercorn handled it) or 'dropped' (the guard's case)."""
    a, b = trio.socket.socketpair()
    stream, peer = trio.SocketStream(a), trio.SocketStream(b)
    server = TCPServer.__new__(TCPServer)  # only what protocol_send uses: the stream, its send lock, the protocol
    server.stream, server.send_lock, server.protocol = stream, trio.Lock(), _Protocol()
    outcome = []

    async def frame():
        try:
            await send(server, RawData(data=b"frame"))
        except trio.BusyResourceError:
            outcome.append("busy")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream.send_eof)
        nursery.start_soon(frame)
    assert await peer.receive_some(100) == b""  # nothing half-sent after the EOF
    await stream.aclose()
    await peer.aclose()
    if outcome:
        return outcome[0]
    return "closed" if any(isinstance(e, Closed) for e in server.protocol.events) else "dropped"


def test_the_race_raises_without_the_guard_and_not_with_it():
    original = getattr(TCPServer.protocol_send, "__wrapped__", TCPServer.protocol_send)
    unguarded = {trio.run(_race, original) for _ in range(ROUNDS)}
    assert "busy" in unguarded, unguarded  # hypercorn's own code raises out of the connection's task
    guard_close_race()
    guard_close_race()  # idempotent: one wrapper
    assert TCPServer.protocol_send.__wrapped__ is original
    guarded = {trio.run(_race, TCPServer.protocol_send) for _ in range(ROUNDS)}
    assert "busy" not in guarded and "dropped" in guarded, guarded
