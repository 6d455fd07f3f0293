"""Trio glue for the Noise tunnel: frames over a byte stream, and an encrypted channel over frames.

The crypto and framing rules live in :mod:`swarm.tunnel.noise` and :mod:`swarm.tunnel.framing` (sans-IO); this
module only moves their bytes.
A :class:`FrameTransport` is anything that carries whole frames in order — a TCP stream with length prefixes here,
the leader's relay or a QUIC stream in :mod:`swarm.mesh` — so :class:`NoiseChannel` works unchanged on every path.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar, runtime_checkable

import trio

from swarm.errors import HandshakeFailed, LinkClosed, ProtocolError, SwarmError, TunnelError
from swarm.tunnel.framing import MAX_WIRE_FRAME, FrameDecoder, encode_frame  # MAX_WIRE_FRAME: re-exported
from swarm.tunnel.noise import NoiseSession

# Bytes asked of the stream per read: up to four frames per wakeup when data is waiting. On loopback (2-core EPYC VM)
# 64 KiB and 256 KiB reads measured the same, ~340 MB/s, bound by the cipher; 1 MiB reads were no faster.
_READ_SIZE = 256 * 1024

HANDSHAKE_TIMEOUT = 10.0  # seconds; a peer across two home NATs and a relay answers in well under 1 s.


# Closing a link politely (a websocket close handshake) is shielded from cancellation but bounded: a peer that is
# gone must not hold up a shutdown.
CLEANUP_S = 2.0

# What sending or receiving on a link raises when the link broke under it (whichever path it runs over).
LINK_ERRORS = (TunnelError, OSError, trio.BrokenResourceError, trio.ClosedResourceError)

_T = TypeVar("_T")


async def close_quietly(link) -> None:
    """Close a channel or transport even while cancelled, for at most CLEANUP_S; a failure to close is dropped:
    the link is broken or gone, and whatever made us close it is the error worth reporting."""
    with trio.move_on_after(CLEANUP_S, shield=True):
        try:
            await link.aclose()
        except Exception:  # the link is broken or gone: what made us close it is the error worth reporting
            pass


async def send_last(channel, frame: bytes) -> None:
    """Send a session's last frame (a reply before closing), for at most CLEANUP_S; a link that broke under it is
    dropped: the peer is gone, and nothing is left to tell it."""
    with trio.move_on_after(CLEANUP_S):
        try:
            await channel.send(frame)
        except SwarmError:  # the peer is gone: nothing is left to tell it
            pass


@runtime_checkable
class FrameTransport(Protocol):
    """Carries whole frames, in order and reliably; what a NoiseChannel runs over."""

    async def send_frame(self, data: bytes) -> None: ...

    async def receive_frame(self) -> bytes:
        """The next frame; raises LinkClosed when the other end has closed."""
        ...

    async def aclose(self) -> None: ...


class StreamFrameTransport:
    """Frames over a trio byte stream (TCP): each frame is a 4-byte big-endian length, then the frame."""

    def __init__(self, stream: trio.abc.Stream):
        self.stream = stream
        self._decoder = FrameDecoder()  # kept between calls so a cancelled receive_frame loses nothing

    async def send_frame(self, data: bytes) -> None:
        wire = encode_frame(data)
        try:
            await self.stream.send_all(wire)
        except trio.BrokenResourceError as exc:
            raise LinkClosed("the other end closed the link while we were sending") from exc

    async def receive_frame(self) -> bytes:
        while (frame := self._decoder.next_frame()) is None:
            try:
                data = await self.stream.receive_some(_READ_SIZE)
            except trio.BrokenResourceError as exc:
                raise LinkClosed("the link broke (connection reset)") from exc
            if not data:
                if self._decoder.buffered:
                    raise LinkClosed("the other end closed the link in the middle of a frame")
                raise LinkClosed("the other end closed the link")
            self._decoder.feed(data)
        return frame

    async def aclose(self) -> None:
        await self.stream.aclose()


class NoiseChannel:
    """An encrypted, authenticated message channel: whole messages of any size (up to 256 MiB) in order.

    ``send`` may be called from several tasks at once; ``receive`` from one task at a time.
    """

    def __init__(self, transport: FrameTransport, session: NoiseSession):
        self.transport = transport
        self.session = session
        # Frames of two messages must not interleave, and frames must go out in nonce order: encrypt and send
        # under one lock. StrictFIFOLock keeps senders' order fair.
        self._send_lock = trio.StrictFIFOLock()
        self._send_broken = False
        self._receiving = False

    # --- opening -----------------------------------------------------------------------------------------------

    @classmethod
    async def connect(
        cls,
        transport: FrameTransport,
        local_private: bytes,
        remote_public: bytes,
        payload: bytes = b"",
        *,
        timeout: float = HANDSHAKE_TIMEOUT,
    ) -> NoiseChannel:
        """Open a channel as the initiator, to a peer whose key ``remote_public`` is pinned.

        The channel owns ``transport`` from the call on: on any failure (a malformed key included) the transport
        is closed and HandshakeFailed (or PeerRejected) is raised, so a caller needs no cleanup of its own.
        """

        async def handshake() -> NoiseSession:
            session = NoiseSession.initiator(local_private, remote_public)
            await transport.send_frame(session.start(payload))
            session.receive_handshake(await transport.receive_frame())
            return session

        return cls(transport, await cls._run_handshake(transport, handshake, timeout))

    @classmethod
    async def accept(
        cls,
        transport: FrameTransport,
        local_private: bytes,
        allow: Callable[[bytes], bool] | None,
        *,
        timeout: float = HANDSHAKE_TIMEOUT,
    ) -> NoiseChannel:
        """Open a channel as the responder; ``allow(key)`` says whether the leader vouched for the peer's key.

        As with :meth:`connect`, the transport is closed on any failure (so the peer sees the refusal at once)
        and the error is raised.
        """

        async def handshake() -> NoiseSession:
            session = NoiseSession.responder(local_private, allow)
            reply = session.receive_handshake(await transport.receive_frame())
            await transport.send_frame(reply)
            return session

        return cls(transport, await cls._run_handshake(transport, handshake, timeout))

    @staticmethod
    async def _run_handshake(
        transport: FrameTransport, handshake: Callable[[], Awaitable[_T]], timeout: float
    ) -> _T:
        try:
            try:
                with trio.fail_after(timeout):
                    return await handshake()
            except trio.TooSlowError:
                raise HandshakeFailed(
                    f"the peer did not complete the handshake within {timeout:g} s; it may be down or unreachable"
                ) from None
            except LinkClosed as exc:
                raise HandshakeFailed(
                    "the peer closed the link during the handshake: it may not know our key (ask the leader to "
                    "vouch for this fellow) or may have a different key than the leader gave us"
                ) from exc
            except ProtocolError as exc:
                raise HandshakeFailed(f"the peer broke the handshake: {exc}") from exc
        except BaseException:
            await close_quietly(transport)
            raise

    # --- use ---------------------------------------------------------------------------------------------------

    @property
    def remote_static(self) -> bytes:
        """The peer's static public key (pinned, or learnt and allowed during the handshake)."""
        return self.session.remote_static

    @property
    def handshake_payload(self) -> bytes:
        """What the initiator sent with its first handshake message (b"" on the initiator's side)."""
        return self.session.handshake_payload

    @property
    def max_message_size(self) -> int:
        """The largest message :meth:`receive` accepts; a longer one breaks the link (ProtocolError)."""
        return self.session.max_message_size

    @max_message_size.setter
    def max_message_size(self, size: int) -> None:
        self.session.max_message_size = size

    async def send(self, message: bytes) -> None:
        async with self._send_lock:
            if self._send_broken:
                raise TunnelError("an earlier send on this link was interrupted; open a new link")
            frames = self.session.encrypt(message)
            # Once encrypted, the nonces are spent: if we stop half way (cancelled, or the link broke) the peer's
            # next frame would be out of step or glued onto a half message, so the link is unusable afterwards.
            self._send_broken = True
            for frame in frames:
                await self.transport.send_frame(frame)
            self._send_broken = False

    async def receive(self) -> bytes:
        """The next whole message; LinkClosed at end of stream, FrameCorrupted if a frame fails authentication."""
        if self._receiving:
            raise trio.BusyResourceError("another task is already receiving on this NoiseChannel")
        self._receiving = True
        try:
            while True:
                # Cancel-safe: a frame is either still in the transport's buffer or already decrypted into the
                # session; there is no checkpoint between receiving a frame and decrypting it.
                message = self.session.decrypt(await self.transport.receive_frame())
                if message is not None:
                    return message
        finally:
            self._receiving = False

    async def aclose(self) -> None:
        await self.transport.aclose()

    async def __aenter__(self) -> NoiseChannel:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()


__all__ = [
    "FrameTransport",
    "StreamFrameTransport",
    "NoiseChannel",
    "close_quietly",
    "LINK_ERRORS",
    "CLEANUP_S",
    "HANDSHAKE_TIMEOUT",
    "MAX_WIRE_FRAME",
]
