"""Reflexive-address discovery: the sans-IO packets (no sockets) and the UDP server and client on loopback."""

from __future__ import annotations

import random

import pytest
import trio

from swarm.errors import ProtocolError
from swarm.mesh import rendezvous
from swarm.mesh.rendezvous import (
    discover_reflexive,
    make_request,
    make_response,
    parse_request,
    parse_response,
    serve_rendezvous,
)

TXID = bytes(range(12))


# --- sans-IO ---------------------------------------------------------------------------------------------------------


def test_request_round_trip():
    for who in (b"", b"fellow-7", bytes(64)):
        assert parse_request(make_request(TXID, who)) == (TXID, who)


@pytest.mark.parametrize("addr", [("203.0.113.7", 40000), ("127.0.0.1", 1), ("2001:db8::1", 65535)])
def test_response_round_trip(addr):
    data = make_response(TXID, addr)
    assert parse_response(data, TXID) == addr
    assert parse_response(data, bytes(12)) is None  # another request's answer
    # The address is masked on the wire, so a NAT helper rewriting its own address in payloads cannot touch it.
    assert rendezvous._plain_ip(addr[0]).packed not in data


def test_ipv4_mapped_address_is_answered_as_ipv4():
    assert parse_response(make_response(TXID, ("::ffff:198.51.100.2", 9)), TXID) == ("198.51.100.2", 9)


def test_limits_on_what_we_build():
    with pytest.raises(ProtocolError):
        make_request(TXID, bytes(65))
    with pytest.raises(ValueError):
        make_request(b"short", b"")


def test_garbage_is_none_never_an_exception():
    rng = random.Random(7)
    good_request = make_request(TXID, b"token")
    good_response = make_response(TXID, ("192.0.2.1", 5))
    samples = [b"", b"SWRV", b"GET / HTTP/1.1\r\n\r\n", good_request + b"x", good_request[:-1], good_response[:-1]]
    samples += [good_request[:n] for n in range(len(good_request))]
    samples += [bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 120))) for _ in range(500)]
    samples += [b"SWRV" + bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 90))) for _ in range(500)]
    for data in samples:
        assert parse_request(data) is None or data.startswith(b"SWRV\x01\x01")
        assert parse_response(data, TXID) is None or data.startswith(b"SWRV\x01\x02")
    # A request is not a response and vice versa.
    assert parse_response(good_request, TXID) is None
    assert parse_request(good_response) is None


# --- trio ------------------------------------------------------------------------------------------------------------


async def udp_socket(host="127.0.0.1"):
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM)
    await sock.bind((host, 0))
    return sock


async def test_reflexive_address_on_loopback_is_the_socket_address(nursery):
    with trio.fail_after(5):
        server = await nursery.start(serve_rendezvous, "127.0.0.1", 0, lambda who: who == b"fellow-1")
        with await udp_socket() as sock:
            assert await discover_reflexive(sock, server, b"fellow-1") == sock.getsockname()
        # Another loopback address works the same (the server sees 127.0.0.2 as the source).
        with await udp_socket("127.0.0.2") as sock:
            assert await discover_reflexive(sock, server, b"fellow-1") == sock.getsockname()


async def test_unknown_token_gets_no_answer(nursery):
    with trio.fail_after(5):
        server = await nursery.start(serve_rendezvous, "127.0.0.1", 0, lambda who: who == b"fellow-1")
        with await udp_socket() as sock:
            start = trio.current_time()
            assert await discover_reflexive(sock, server, b"stranger", timeout=0.3, retries=3) is None
            assert 0.29 <= trio.current_time() - start < 1.0


async def test_a_crashing_allow_check_refuses_without_stopping_the_server(nursery):
    calls = []

    def allow(who):
        calls.append(who)
        if who == b"boom":
            raise RuntimeError("bug in the check")
        return True

    with trio.fail_after(5):
        server = await nursery.start(serve_rendezvous, "127.0.0.1", 0, allow)
        with await udp_socket() as sock:
            assert await discover_reflexive(sock, server, b"boom", timeout=0.2, retries=1) is None
            assert await discover_reflexive(sock, server, b"ok") == sock.getsockname()
    assert calls == [b"boom", b"ok"]


async def test_garbage_does_not_crash_the_server(nursery):
    with trio.fail_after(5):
        server = await nursery.start(serve_rendezvous, "127.0.0.1", 0, lambda who: True)
        with await udp_socket() as attacker:
            rng = random.Random(1)
            for _ in range(300):
                junk = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 1500)))
                await attacker.sendto(junk, server)
            await attacker.sendto(b"SWRV\x01\x01" + bytes(12) + b"\xff", server)  # who length past the end
            await attacker.sendto(make_request(TXID, b"x") + bytes(3000), server)  # oversized, truncated read
            # Nothing comes back for any of it.
            with trio.move_on_after(0.2):
                await attacker.recvfrom(2048)
                pytest.fail("the server answered garbage")
        with await udp_socket() as sock:
            assert await discover_reflexive(sock, server, b"ok") == sock.getsockname()


async def test_other_datagrams_during_discovery_go_to_the_callback(nursery):
    with trio.fail_after(5):
        server = await nursery.start(serve_rendezvous, "127.0.0.1", 0, lambda who: True)
        with await udp_socket() as sock, await udp_socket() as peer:
            # A peer's early punch packet is already waiting when discovery starts.
            await peer.sendto(b"SWPN early punch", sock.getsockname())
            await trio.lowlevel.wait_readable(sock)  # queued on the socket (not read)
            others = []
            found = await discover_reflexive(sock, server, b"ok", on_other=lambda d, a: others.append((d, a)))
            assert found == sock.getsockname()
            assert others == [(b"SWPN early punch", peer.getsockname())]


async def test_retransmits_until_answered(nursery):
    """The first request is lost (nobody listens yet); a retransmission reaches the server once it is up."""
    with trio.fail_after(5):
        placeholder = await udp_socket()
        address = placeholder.getsockname()
        with await udp_socket() as sock:
            async def start_server_late():
                await placeholder.recv(2048)  # the first request arrived where nobody answers: it is lost
                placeholder.close()  # free the port for the server
                await nursery.start(serve_rendezvous, *address, lambda who: True)

            nursery.start_soon(start_server_late)
            assert await discover_reflexive(sock, address, b"ok", timeout=1.5, retries=4) == sock.getsockname()
