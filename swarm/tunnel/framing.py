"""Length-prefixed frames on a byte stream, sans-IO: bytes in, whole frames out (in the style of h11).

A frame on the wire is a 4-byte big-endian length, then that many bytes. It is how Noise frames travel on a TCP
stream (:class:`~swarm.tunnel.channel.StreamFrameTransport`) and on a QUIC stream (:mod:`swarm.mesh.quic`); the
relay carries one frame per websocket message instead and needs no prefix. Both stream paths use this one decoder,
so the size limit and the error a stranger gets are the same everywhere.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

from swarm.errors import ProtocolError
from swarm.tunnel.noise import MAX_FRAME

LENGTH = struct.Struct(">I")
# A Noise frame is at most 65535 bytes; the margin lets a future header grow without breaking old peers' limit,
# while a garbage length prefix (e.g. an HTTP client on the port: b"GET " = 1.2 GB) is refused at once.
MAX_WIRE_FRAME = MAX_FRAME + 1024


def encode_frame(data: bytes) -> bytes:
    """``data`` with its length prefix, ready to write; ProtocolError (our bug, not the peer's) if it is too big.

    Header and body come back as one string, so a caller writes them with one call: one syscall, and no window in
    which another sender's data could land between a header and its body.
    """
    if len(data) > MAX_WIRE_FRAME:
        raise ProtocolError(f"a frame of {len(data)} bytes is larger than the {MAX_WIRE_FRAME} allowed")
    return LENGTH.pack(len(data)) + data


class FrameDecoder:
    """Collects stream bytes (:meth:`feed`) and hands out whole frames (:meth:`next_frame`, or iterate).

    The decoder keeps what it was fed until a frame is complete, so a caller that is cancelled between a read and
    ``next_frame`` loses nothing. A length prefix over ``max_frame`` raises ProtocolError as soon as its 4 bytes
    are in, before any body is buffered, and again on every later call: the stream cannot be resynchronised.
    """

    def __init__(self, max_frame: int = MAX_WIRE_FRAME):
        self.max_frame = max_frame
        self._buffer = bytearray()

    def feed(self, data: bytes | bytearray) -> None:
        """Append bytes received from the stream (any amount, split anywhere)."""
        self._buffer += data

    @property
    def buffered(self) -> int:
        """Bytes held that do not yet make a whole frame; non-zero at end of stream means a frame was cut off."""
        return len(self._buffer)

    def next_frame(self) -> bytes | None:
        """The next whole frame, or None until more bytes are fed."""
        buffer = self._buffer
        if len(buffer) < LENGTH.size:
            return None
        (length,) = LENGTH.unpack_from(buffer)
        if length > self.max_frame:
            raise ProtocolError(
                f"the peer announced a frame of {length} bytes, at most {self.max_frame} are allowed; "
                "it is not a swarm peer"
            )
        end = LENGTH.size + length
        if len(buffer) < end:
            return None
        frame = bytes(buffer[LENGTH.size : end])
        del buffer[:end]  # bytearray deletes from the front in O(1) amortized
        return frame

    def __iter__(self) -> Iterator[bytes]:
        """Every whole frame buffered now, in order."""
        while (frame := self.next_frame()) is not None:
            yield frame


__all__ = ["FrameDecoder", "encode_frame", "LENGTH", "MAX_WIRE_FRAME"]
