"""QUIC over a punched UDP socket on loopback, with the Noise channel on top as the ring would run it."""

from __future__ import annotations

import os
import ssl

import pytest
import trio
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection

from swarm.errors import LinkClosed, ProtocolError
from swarm.mesh.hole_punch import punch
from swarm.mesh.quic import (
    ALPN,
    QuicFrameTransport,
    QuicHandshakeFailed,
    accept_quic_server,
    open_quic_client,
)
from swarm.mesh.quic_config import client_initial_header, quic_configuration
from swarm.tunnel import keys
from swarm.tunnel.channel import MAX_WIRE_FRAME, FrameTransport, NoiseChannel

SIZES = [0, 1, 64 * 1024 + 1, 5 * 1024 * 1024]


def test_both_sides_share_one_configuration():
    client = quic_configuration(is_client=True, idle_timeout=3.0, max_datagram_size=1300)
    server = quic_configuration(is_client=False, idle_timeout=3.0, max_datagram_size=1300)
    for side in (client, server):
        assert side.alpn_protocols == [ALPN] and side.idle_timeout == 3.0 and side.max_datagram_size == 1300
    # QUIC's TLS authenticates nothing here (Noise does): the client skips verification, the server has a cert.
    assert client.is_client and client.verify_mode == ssl.CERT_NONE and client.certificate is None
    assert not server.is_client and server.certificate is not None and server.private_key is not None
    assert quic_configuration(is_client=True, idle_timeout=1.0).max_datagram_size == 1200


def test_a_clients_first_datagram_is_recognised():
    configuration = quic_configuration(is_client=False, idle_timeout=5.0)
    connection = QuicConnection(configuration=quic_configuration(is_client=True, idle_timeout=5.0))
    connection.connect(("127.0.0.1", 9), now=0.0)
    first = connection.datagrams_to_send(now=0.0)[0][0]
    assert client_initial_header(first, configuration) is not None
    assert client_initial_header(first[:1000], configuration) is None  # an Initial is padded to 1200 bytes
    assert client_initial_header(b"SWPN" + bytes(43), configuration) is None  # a late punch packet
    assert client_initial_header(b"", configuration) is None


async def udp_socket(host="127.0.0.1"):
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM)
    await sock.bind((host, 0))
    return sock


async def punched():
    """Two sockets after a punch: (sock_a, b's address as a locked it, sock_b, a's address as b locked it)."""
    sock_a, sock_b = await udp_socket(), await udp_socket("127.0.0.2")
    secret = os.urandom(32)
    start = trio.current_time() + 0.02
    found = {}

    async def run(role, sock, candidates):
        found[role] = await punch(sock, candidates, secret, role, start, timeout=3.0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "a", sock_a, [("127.0.0.3", 9), sock_b.getsockname()])
        nursery.start_soon(run, "b", sock_b, [sock_a.getsockname()])
    return sock_a, found["a"], sock_b, found["b"]


async def quic_pair(nursery, **options) -> tuple[QuicFrameTransport, QuicFrameTransport]:
    """Client (role a) and server (role b) transports over a fresh punched pair of sockets."""
    sock_a, peer_of_a, sock_b, peer_of_b = await punched()
    accepted = {}

    async def accept():
        accepted["server"] = await accept_quic_server(sock_b, peer_of_b, nursery, **options)

    async with trio.open_nursery() as opening:
        opening.start_soon(accept)
        client = await open_quic_client(sock_a, peer_of_a, nursery, **options)
    return client, accepted["server"]


async def noise_pair(client: QuicFrameTransport, server: QuicFrameTransport):
    a_key, b_key = keys.generate_private_key(), keys.generate_private_key()
    channels = {}

    async def accept():
        channels["b"] = await NoiseChannel.accept(server, b_key, lambda key: key == keys.public_key(a_key))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(accept)
        channels["a"] = await NoiseChannel.connect(client, a_key, keys.public_key(b_key), payload=b"hop-1")
    assert channels["b"].handshake_payload == b"hop-1"
    return channels["a"], channels["b"]


async def test_noise_over_quic_round_trips_every_size(nursery):
    with trio.fail_after(30):
        client, server = await quic_pair(nursery)
        assert isinstance(client, FrameTransport)
        a, b = await noise_pair(client, server)
        for size in SIZES:
            message = os.urandom(size)
            await a.send(message)
            assert await b.receive() == message
            await b.send(message[::-1])
            assert await a.receive() == message[::-1]
        await a.aclose()
        await b.aclose()


async def test_concurrent_senders_in_both_directions(nursery):
    with trio.fail_after(30):
        client, server = await quic_pair(nursery)
        a, b = await noise_pair(client, server)
        sizes = [0, 1, 1000, 70_000, 300_000]
        outgoing = {
            side: [f"{side}{task}-{i}:".encode() + os.urandom(sizes[(task + i) % len(sizes)])
                   for task in range(4) for i in range(5)]
            for side in "ab"
        }
        received = {"a": [], "b": []}

        async def sender(channel, messages):
            for message in messages:
                await channel.send(message)

        async def receiver(channel, into, count):
            for _ in range(count):
                into.append(await channel.receive())

        async with trio.open_nursery() as inner:
            for side, channel in (("a", a), ("b", b)):
                for task in range(4):
                    inner.start_soon(sender, channel, outgoing[side][task * 5 : task * 5 + 5])
            inner.start_soon(receiver, b, received["b"], 20)
            inner.start_soon(receiver, a, received["a"], 20)
        assert sorted(received["b"]) == sorted(outgoing["a"])
        assert sorted(received["a"]) == sorted(outgoing["b"])
        # Each sender's own messages arrive in the order it sent them.
        for task in range(4):
            mine = [m for m in received["b"] if m.startswith(f"a{task}-".encode())]
            assert mine == outgoing["a"][task * 5 : task * 5 + 5]
        await a.aclose()
        await b.aclose()


async def stranger_initial(target) -> tuple[trio.socket.SocketType, list[bytes]]:
    """A socket that sends an aioquic client's Initial datagrams to ``target``; returns it and what it sent."""
    stranger = await udp_socket("127.0.0.5")
    connection = QuicConnection(
        configuration=QuicConfiguration(is_client=True, alpn_protocols=[ALPN], verify_mode=ssl.CERT_NONE)
    )
    connection.connect(target, now=trio.current_time())
    datagrams = [data for data, _ in connection.datagrams_to_send(now=trio.current_time())]
    assert datagrams
    for data in datagrams:
        await stranger.sendto(data, target)
    return stranger, datagrams


async def assert_silent(sock, seconds=0.3):
    with trio.move_on_after(seconds):
        data, addr = await sock.recvfrom(65536)
        pytest.fail(f"the stranger got {len(data)} bytes back from {addr}")


async def test_a_stranger_gets_nothing_and_does_not_disturb_the_session(nursery):
    with trio.fail_after(30):
        sock_a, peer_of_a, sock_b, peer_of_b = await punched()
        server_address = sock_b.getsockname()
        accepted = {}

        async def accept():
            accepted["server"] = await accept_quic_server(sock_b, peer_of_b, nursery)

        async with trio.open_nursery() as opening:
            opening.start_soon(accept)
            # While the server waits for its peer, a stranger's handshake comes first: it is not the one accepted.
            early, _ = await stranger_initial(server_address)
            await trio.sleep(0.05)
            client = await open_quic_client(sock_a, peer_of_a, nursery)
        server = accepted["server"]
        assert server.peer == peer_of_b
        await assert_silent(early)

        a, b = await noise_pair(client, server)
        # A stranger during the session (again, and replaying its Initial many times): still nothing back.
        late, datagrams = await stranger_initial(server_address)
        for _ in range(20):
            await late.sendto(datagrams[0], server_address)
            await late.sendto(os.urandom(1200), server_address)
        await assert_silent(late)
        for size in (1, 100_000):
            await a.send(b"x" * size)
            assert await b.receive() == b"x" * size
        early.close()
        late.close()
        await a.aclose()


async def test_closing_one_side_gives_link_closed_on_the_other(nursery):
    with trio.fail_after(10):
        client, server = await quic_pair(nursery)
        a, b = await noise_pair(client, server)
        await a.send(b"last words")
        start = trio.current_time()
        await a.aclose()
        assert await b.receive() == b"last words"
        with pytest.raises(LinkClosed, match="other end closed"):
            await b.receive()
        assert trio.current_time() - start < 1.0
        with pytest.raises(LinkClosed):
            await a.send(b"after close")
        with pytest.raises(LinkClosed):
            await server.send_frame(b"after close")


async def test_silence_gives_link_closed_within_the_idle_timeout(nursery):
    with trio.fail_after(15):
        client, server = await quic_pair(nursery, idle_timeout=1.0)
        a, b = await noise_pair(client, server)
        # The client's PC vanishes: its driver stops without a word (no CONNECTION_CLOSE).
        client._driver_scope.cancel()
        await trio.sleep(0)
        start = trio.current_time()
        with pytest.raises(LinkClosed, match="silent"):
            await b.receive()
        assert 0.9 <= trio.current_time() - start < 2.0
        with pytest.raises(LinkClosed):
            await a.send(b"x")


async def test_keepalive_holds_an_idle_link_open(nursery):
    with trio.fail_after(15):
        client, server = await quic_pair(nursery, idle_timeout=1.0)
        a, b = await noise_pair(client, server)
        await trio.sleep(2.5)  # idle for 2.5 idle timeouts: PINGs every 1/3 s keep it up
        await a.send(b"still there?")
        assert await b.receive() == b"still there?"
        await a.aclose()


async def test_frame_size_limits(nursery):
    with trio.fail_after(10):
        client, server = await quic_pair(nursery)
        with pytest.raises(ProtocolError):
            await client.send_frame(bytes(MAX_WIRE_FRAME + 1))
        await client.send_frame(bytes(MAX_WIRE_FRAME))
        assert await server.receive_frame() == bytes(MAX_WIRE_FRAME)
        # A peer announcing a frame past the limit is refused, not buffered.
        client._conn.send_stream_data(0, (MAX_WIRE_FRAME + 1).to_bytes(4, "big"))
        client._flush()
        with pytest.raises(ProtocolError, match="not a swarm peer"):
            await server.receive_frame()
        await client.aclose()


async def test_handshake_timeout_when_nobody_answers():
    with trio.fail_after(10):
        silent, sock, server = await udp_socket(), await udp_socket(), await udp_socket()
        async with trio.open_nursery() as nursery:
            with pytest.raises(QuicHandshakeFailed, match="no answer"):
                await open_quic_client(sock, silent.getsockname(), nursery, handshake_timeout=0.5)
            with pytest.raises(QuicHandshakeFailed, match="no QUIC connection"):
                await accept_quic_server(server, silent.getsockname(), nursery, handshake_timeout=0.3)
        # The link owned the sockets: both are closed, and no driver task is left in the nursery.
        assert sock.fileno() == -1 and server.fileno() == -1
        silent.close()


async def test_cancelled_open_leaves_no_driver_behind():
    with trio.fail_after(10):
        silent, sock = await udp_socket(), await udp_socket()
        async with trio.open_nursery() as nursery:
            with trio.move_on_after(0.3):
                await open_quic_client(sock, silent.getsockname(), nursery)
        assert sock.fileno() == -1
        silent.close()
