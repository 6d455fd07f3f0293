"""A reliable, congestion-controlled frame link over a hole-punched UDP socket: one QUIC stream, driven by trio.

aioquic's :class:`~aioquic.quic.connection.QuicConnection` is sans-IO; this module is the glue that moves its
datagrams on the socket that :mod:`swarm.mesh.hole_punch` opened through both NATs. QUIC gives us what raw datagrams
lack for a Noise session (ordering, retransmission, congestion control: noiseprotocol's implicit nonces need an ordered
stream). QUIC's own TLS is not what authenticates the fellows — the :class:`~swarm.tunnel.channel.NoiseChannel` run
over :class:`QuicFrameTransport` does, with the keys the leader pinned (see :mod:`swarm.mesh.quic_config`).

Frames travel on one bidirectional stream (id 0, opened by the client) as a 4-byte big-endian length and the frame:
the framing of TCP's :class:`~swarm.tunnel.channel.StreamFrameTransport`, decoded by the same
:class:`~swarm.tunnel.framing.FrameDecoder`. The client starts the stream with the 4-byte preface b"SWQ1" so the
server learns of the stream (aioquic cannot send on a peer's stream it has not seen) and can tell a swarm peer from
anything else that completed a handshake.

One driver task per connection owns the socket: it reads datagrams (only those from the peer's address reach the
connection; a stranger's handshake gets no answer), runs the connection's timer (loss recovery, delayed acks,
pacing, idle timeout), sends keepalive PINGs and flushes what the connection wants sent after every event.
``send_frame`` queues stream data and flushes it at once itself, then moves the driver's timer deadline.
"""

from __future__ import annotations

import logging
import math
import socket

import trio
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import QuicHeader

from swarm.errors import HandshakeFailed, LinkClosed
from swarm.mesh import hole_punch as punch_mod
from swarm.mesh import rendezvous
from swarm.mesh.quic_config import ALPN, DEFAULT_MAX_DATAGRAM_SIZE, client_initial_header, quic_configuration
from swarm.mesh.udp import normalize_address, receive_datagram, socket_address
from swarm.tunnel.channel import CLEANUP_S
from swarm.tunnel.framing import FrameDecoder, encode_frame

log = logging.getLogger(__name__)

STREAM_ID = 0  # the client's first bidirectional stream (RFC 9000 §2.1)
PREFACE = b"SWQ1"

# A path that goes silent (the peer's PC slept, its NAT dropped the mapping) is reported as LinkClosed within this
# many seconds, so the ring can fall back to the relay quickly. aioquic never uses less than 3 PTOs.
DEFAULT_IDLE_TIMEOUT_S = 5.0
# NATs drop idle UDP mappings after as little as 30 s (RFC 4787 REQ-5 asks for at least 2 min, home routers often
# use 30-60 s); a PING every 10 s keeps the mapping, and at most a third of the idle timeout keeps the connection.
KEEPALIVE_MAX_S = 10.0
HANDSHAKE_TIMEOUT_S = 10.0
# aioquic buffers stream data without limit; send_frame waits while more than this is sent but not yet acked, so
# a fast sender cannot queue gigabytes in memory. 1 MiB is aioquic's default stream window: more would only wait
# for flow control credit anyway.
SEND_HIGH_WATER = 1 << 20
_RECV_SIZE = 65536
# Datagrams read per wakeup before flushing and yielding to other tasks.
_READ_BURST = 64


class QuicHandshakeFailed(HandshakeFailed):
    """The QUIC connection over the punched path could not be set up."""


class QuicFrameTransport:
    """Frames over one QUIC stream on a punched UDP socket (a :class:`~swarm.tunnel.channel.FrameTransport`).

    Open it with :func:`open_quic_client` or :func:`accept_quic_server`. ``send_frame`` may be called from several
    tasks; ``receive_frame`` from one at a time. The transport takes the socket over (``sock.detach()``) and closes
    it when the connection ends.

    Datagrams are sent and read with plain non-blocking syscalls, not trio's socket methods: a datagram that does
    not fit in the kernel's buffer is dropped (QUIC's loss recovery resends it, as it would after a drop on the
    way), so sending never waits, and ``send_frame`` pushes its datagrams out at once instead of waking another task.
    On a 2-core VM each task switch saved took ~0.1 ms off a message's round trip.
    """

    def __init__(self, sock, peer: tuple[str, int], connection: QuicConnection, *, is_client: bool,
                 idle_timeout: float, keepalive: float | None = None):
        family, kind = sock.family, sock.type
        self._sockaddr = socket_address(sock, peer)
        self._raw = socket.socket(family, kind, fileno=sock.detach())
        self._raw.setblocking(False)
        self.peer = peer
        self.is_client = is_client
        self._conn = connection
        self._idle_timeout = idle_timeout
        self._keepalive = keepalive if keepalive is not None else min(KEEPALIVE_MAX_S, idle_timeout / 3)
        self._next_ping = trio.current_time() + self._keepalive
        self._ping_uid = 0
        self._decoder = FrameDecoder()
        # The server strips the client's preface off the stream; until it has all of it, the bytes wait here.
        self._preface_seen = is_client
        self._preface = bytearray()
        self._closed: str | None = None  # why the link is closed, once it is
        self._handshake_done = False
        self._ready = trio.Event()  # handshake done (and, on the server, the preface seen); or closed
        self._data_arrived = trio.Event()
        self._drained = trio.Event()
        # The driver's timer task sleeps in this scope; whoever changes the connection's timer moves its deadline.
        self._timer_scope = trio.CancelScope()
        self._driver_scope = trio.CancelScope()
        self._driver_done = trio.Event()
        self.datagrams_dropped = 0  # sends the kernel refused (buffer full); QUIC resent them

    # --- FrameTransport --------------------------------------------------------------------------------------------

    async def send_frame(self, data: bytes) -> None:
        wire = encode_frame(data)
        if self._closed is not None:
            raise LinkClosed(self._closed)
        # One write for header and body: a frame is never split between two senders' data.
        self._conn.send_stream_data(STREAM_ID, wire)
        self._flush()
        await trio.lowlevel.checkpoint()
        while self._closed is None and self._unacked() > SEND_HIGH_WATER:
            if self._drained.is_set():
                self._drained = trio.Event()
            await self._drained.wait()
        if self._closed is not None:
            raise LinkClosed(self._closed)

    async def receive_frame(self) -> bytes:
        while True:
            frame = self._decoder.next_frame()
            if frame is not None:
                await trio.lowlevel.checkpoint()
                return frame
            if self._closed is not None:
                raise LinkClosed(self._closed)
            if self._data_arrived.is_set():
                self._data_arrived = trio.Event()
            await self._data_arrived.wait()

    async def aclose(self) -> None:
        """Close the connection (the peer sees LinkClosed at once) and stop the driver."""
        self._close("this side closed the link")
        with trio.move_on_after(CLEANUP_S, shield=True):
            await self._driver_done.wait()  # the driver sends the CONNECTION_CLOSE, then ends
        self._driver_scope.cancel()
        await trio.lowlevel.checkpoint()

    # --- driver ----------------------------------------------------------------------------------------------------

    async def _run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The driver: a reader task for the socket and a timer task (loss recovery, acks, keepalive, idle)."""
        try:
            with self._driver_scope:
                task_status.started()
                self._flush()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._read_loop)
                    await self._timer_loop()
                    nursery.cancel_scope.cancel()
        finally:
            self._close("the link's driver stopped")
            self._raw.close()
            self._driver_done.set()

    async def _read_loop(self) -> None:
        while True:
            await trio.lowlevel.wait_readable(self._raw)
            now = trio.current_time()
            # Everything waiting, up to a bound, then one flush: acks and replies for a burst go out together.
            for _ in range(_READ_BURST):
                try:
                    data, addr = self._raw.recvfrom(_RECV_SIZE)
                except BlockingIOError:
                    break
                except OSError as exc:  # an ICMP error reported on the socket
                    log.debug("quic: read error ignored: %s", exc)
                    continue
                # The fast test first: parsing the address text costs more than a small packet's decryption.
                if addr[:2] != self._sockaddr[:2] and normalize_address(addr) != self.peer:
                    log.debug("quic: ignored %d bytes from %s, which is not the peer", len(data), addr[:2])
                    continue
                if data[:4] in (punch_mod.MAGIC, rendezvous.MAGIC):
                    continue  # a late copy of the peer's punch confirm
                self._conn.receive_datagram(data, self.peer, now)
            self._process_events()
            self._flush()

    async def _timer_loop(self) -> None:
        conn = self._conn
        while self._closed is None:
            with trio.CancelScope() as self._timer_scope:
                self._rearm()
                await trio.sleep_forever()
            now = trio.current_time()
            timer = conn.get_timer()
            if timer is not None and now >= timer:
                conn.handle_timer(now)
            if now >= self._next_ping:
                if self._handshake_done:
                    self._ping_uid += 1
                    conn.send_ping(self._ping_uid)
                self._next_ping = now + self._keepalive
            self._process_events()
            self._flush()
        # Closed by us, by the peer's FIN or reset, or a wrong preface: tell the peer (a no-op when the connection
        # is already over) and stop; the peer's state for a lost CONNECTION_CLOSE expires with its idle timeout.
        conn.close(reason_phrase="closed")
        self._flush()

    def _flush(self) -> None:
        """Send what the connection wants sent now, and move the timer task's wake-up to the connection's timer."""
        for data, _addr in self._conn.datagrams_to_send(trio.current_time()):
            try:
                self._raw.sendto(data, self._sockaddr)
            except BlockingIOError:
                self.datagrams_dropped += 1
            except OSError as exc:  # e.g. no route for a moment; QUIC's loss recovery resends
                log.debug("quic: send to %s failed: %s", self.peer, exc)
        self._rearm()

    def _rearm(self) -> None:
        if self._closed is not None:
            self._timer_scope.cancel()
            return
        timer = self._conn.get_timer()
        self._timer_scope.deadline = min(timer if timer is not None else math.inf, self._next_ping)

    def _process_events(self) -> None:
        while (event := self._conn.next_event()) is not None:
            if isinstance(event, events.HandshakeCompleted):
                self._handshake_done = True
                if self._preface_seen:
                    self._ready.set()
            elif isinstance(event, events.StreamDataReceived):
                if event.stream_id != STREAM_ID:
                    log.debug("quic: ignored data on stream %d", event.stream_id)
                    continue
                self._on_stream_data(event.data)
                if event.end_stream:
                    self._close("the other end closed the link")
                self._data_arrived.set()
            elif isinstance(event, events.StreamReset):
                if event.stream_id == STREAM_ID:
                    self._close(f"the other end reset the link (error {event.error_code})")
            elif isinstance(event, events.ConnectionTerminated):
                self._close(self._why_terminated(event))
        if self._unacked() <= SEND_HIGH_WATER:
            self._drained.set()

    def _on_stream_data(self, data: bytes) -> None:
        if not self._preface_seen:
            self._preface += data
            if len(self._preface) < len(PREFACE):
                return
            if self._preface[: len(PREFACE)] != PREFACE:
                self._close("the peer is not a swarm fellow (wrong stream preface)")
                return
            data, self._preface = bytes(self._preface[len(PREFACE) :]), bytearray()
            self._preface_seen = True
            if self._handshake_done:
                self._ready.set()
        self._decoder.feed(data)

    def _why_terminated(self, event: events.ConnectionTerminated) -> str:
        if event.reason_phrase == "Idle timeout":
            return (
                f"the direct path went silent for {self._idle_timeout:g} s (idle timeout): "
                "the peer is gone or its NAT dropped the mapping"
            )
        if event.error_code == 0:
            return "the other end closed the link"
        return f"the QUIC connection failed: error {event.error_code:#x} {event.reason_phrase}"

    def _close(self, reason: str) -> None:
        if self._closed is None:
            self._closed = reason
        # Wake everyone who waits on the link: readers, blocked writers, an opener waiting for readiness, and the
        # timer task (which sends the CONNECTION_CLOSE and ends the driver).
        self._data_arrived.set()
        self._drained.set()
        self._ready.set()
        self._timer_scope.cancel()

    def _unacked(self) -> int:
        """Bytes of the stream written but not yet acknowledged (aioquic has no public accessor for it)."""
        stream = self._conn._streams.get(STREAM_ID)
        if stream is None:
            return 0
        return stream.sender._buffer_stop - stream.sender._buffer_start

    async def _wait_ready(self, timeout: float, what: str) -> None:
        """Wait for the handshake (and the preface); on failure or cancellation close the link and the socket."""
        try:
            with trio.move_on_after(timeout):
                await self._ready.wait()
            if self._closed is None and self._ready.is_set():
                return
            reason = self._closed or f"no answer from {self.peer[0]}:{self.peer[1]} within {timeout:g} s"
            raise QuicHandshakeFailed(f"could not {what} over the punched path: {reason}")
        except BaseException:
            await self.aclose()
            raise

    async def start(self, nursery: trio.Nursery, handshake_timeout: float) -> QuicFrameTransport:
        """Start the link's driver in ``nursery`` and wait until the link is up (it is closed if it does not come
        up)."""
        await nursery.start(self._run)
        await self._wait_ready(handshake_timeout, "connect" if self.is_client else "accept")
        return self


# --- opening ---------------------------------------------------------------------------------------------------------


async def open_quic_client(
    sock,
    peer: tuple[str, int],
    nursery: trio.Nursery,
    *,
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S,
    keepalive: float | None = None,
    handshake_timeout: float = HANDSHAKE_TIMEOUT_S,
    max_datagram_size: int = DEFAULT_MAX_DATAGRAM_SIZE,
) -> QuicFrameTransport:
    """Connect to the peer's QUIC server at ``peer`` from the punched socket ``sock``; the driver runs in
    ``nursery``. Raises QuicHandshakeFailed if the connection is not up within ``handshake_timeout`` seconds.

    The socket belongs to the link from now on: it is closed when the link closes, or at once on failure."""
    peer = normalize_address(peer)
    configuration = quic_configuration(is_client=True, idle_timeout=idle_timeout, max_datagram_size=max_datagram_size)
    connection = QuicConnection(configuration=configuration)
    connection.connect(peer, now=trio.current_time())
    connection.send_stream_data(STREAM_ID, PREFACE)
    transport = QuicFrameTransport(sock, peer, connection, is_client=True,
                                   idle_timeout=idle_timeout, keepalive=keepalive)
    return await transport.start(nursery, handshake_timeout)


async def accept_quic_server(
    sock,
    peer: tuple[str, int],
    nursery: trio.Nursery,
    *,
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S,
    keepalive: float | None = None,
    handshake_timeout: float = HANDSHAKE_TIMEOUT_S,
    max_datagram_size: int = DEFAULT_MAX_DATAGRAM_SIZE,
) -> QuicFrameTransport:
    """Wait on the punched socket ``sock`` for the QUIC connection of the client at ``peer`` (datagrams from any
    other address are ignored); the driver runs in ``nursery``. Raises QuicHandshakeFailed if the client's
    connection is not up within ``handshake_timeout`` seconds.

    The socket belongs to the link from now on: it is closed when the link closes, or at once on failure."""
    peer = normalize_address(peer)
    configuration = quic_configuration(is_client=False, idle_timeout=idle_timeout, max_datagram_size=max_datagram_size)
    first, header = await _first_initial(sock, peer, configuration, handshake_timeout)
    connection = QuicConnection(
        configuration=configuration, original_destination_connection_id=header.destination_cid
    )
    connection.receive_datagram(first, peer, now=trio.current_time())
    transport = QuicFrameTransport(sock, peer, connection, is_client=False,
                                   idle_timeout=idle_timeout, keepalive=keepalive)
    return await transport.start(nursery, handshake_timeout)


async def _first_initial(
    sock, peer: tuple[str, int], configuration: QuicConfiguration, timeout: float
) -> tuple[bytes, QuicHeader]:
    """The first datagram from ``peer`` that starts with a QUIC Initial packet of a version we speak.

    The socket is closed if none comes within ``timeout`` seconds (QuicHandshakeFailed), or on cancellation."""
    try:
        with trio.move_on_after(timeout):
            while True:
                data, addr = await receive_datagram(sock, _RECV_SIZE, "quic")
                if normalize_address(addr) != peer:
                    log.debug("quic: ignored %d bytes from %s, which is not the peer", len(data), addr[:2])
                    continue
                header = client_initial_header(data, configuration)
                if header is not None:
                    return data, header
    except BaseException:
        sock.close()
        raise
    sock.close()
    raise QuicHandshakeFailed(
        f"could not accept over the punched path: no QUIC connection from {peer[0]}:{peer[1]} within {timeout:g} s"
    )


__all__ = ["QuicFrameTransport", "QuicHandshakeFailed", "open_quic_client", "accept_quic_server", "ALPN"]
