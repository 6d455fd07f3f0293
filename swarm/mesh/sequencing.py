"""Per-hop message order across path changes (sans-IO).

A hop may move from one path to another between two messages (relay -> tunnel when a hole punch succeeds): the last
messages on the old path and the first on the new one can then arrive in either order. Every ring message on a hop
carries a sequence number, and the receiver hands them on strictly in order.

When a path *broke* (rather than was replaced), what was in flight on it may be lost for good; the sender then starts
the new path with RESET, telling the receiver to expect the sequence from there on instead of waiting for the lost
ones (the leader re-sends a request that lost a message; see swarm.leader.serving.serving).

Header: 1 byte flags + 8 bytes big-endian sequence number. Pings and pongs (round-trip time, keepalive) carry a
timestamp instead and are never sequenced.
"""

from __future__ import annotations

import struct

from swarm.errors import ProtocolError

DATA, RESET, PING, PONG = 0, 1, 2, 3
_HEADER = struct.Struct(">BQ")
MAX_REORDER = 4096  # messages held back waiting for an earlier one: far more than a path switch leaves in flight


class Sequencer:
    """The sending side: numbers the messages of one hop."""

    def __init__(self) -> None:
        self.next_seq = 0

    def wrap(self, payload: bytes, reset: bool = False) -> bytes:
        frame = _HEADER.pack(RESET if reset else DATA, self.next_seq) + payload
        self.next_seq += 1
        return frame


def ping(stamp_us: int) -> bytes:
    return _HEADER.pack(PING, stamp_us)


def pong(ping_frame: bytes) -> bytes:
    return _HEADER.pack(PONG, _HEADER.unpack_from(ping_frame)[1])


def kind(frame: bytes) -> tuple[int, int]:
    """-> (flag, sequence or timestamp)."""
    if len(frame) < _HEADER.size:
        raise ProtocolError("a hop frame is shorter than its header")
    flag, value = _HEADER.unpack_from(frame)
    if flag not in (DATA, RESET, PING, PONG):
        raise ProtocolError(f"unknown hop frame flag {flag}")
    return flag, value


class Resequencer:
    """The receiving side: payloads out in sequence order, whichever path they came over."""

    def __init__(self) -> None:
        self.expected = 0
        self._held: dict[int, bytes] = {}

    def push(self, frame: bytes) -> list[bytes]:
        flag, seq = kind(frame)
        if flag not in (DATA, RESET):
            raise ProtocolError("pings and pongs are not sequenced")
        payload = frame[_HEADER.size :]
        if flag == RESET:
            # Whatever was lost before `seq` is gone; anything held from before it is stale.
            self._held = {s: p for s, p in self._held.items() if s > seq}
            self.expected = seq
        if seq < self.expected:
            return []  # a duplicate from the old path
        self._held[seq] = payload
        if len(self._held) > MAX_REORDER:
            raise ProtocolError(f"more than {MAX_REORDER} messages arrived ahead of a missing one")
        ready = []
        while self.expected in self._held:
            ready.append(self._held.pop(self.expected))
            self.expected += 1
        return ready
