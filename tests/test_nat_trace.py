"""The path trace that picks the punch's low IP TTL: which routers are ours, which TTL follows, parsing the kernel's
error-queue messages, and a trace on loopback (no router: nothing learned, the socket left as it was)."""

from __future__ import annotations

import socket
import struct

import pytest
import trio

from swarm.mesh import nat_trace
from swarm.mesh.nat_trace import choose, is_ours, parse_error, probe_packet

TOKEN = b"t" * 8


def test_private_shared_and_our_public_address_are_ours():
    for addr in ("192.168.1.1", "10.0.0.1", "172.16.5.1", "100.64.0.1", "169.254.1.1", "fe80::1", "::ffff:10.1.1.1"):
        assert is_ours(addr), addr
    for addr in ("203.0.113.1", "198.51.100.1", "8.8.8.8", "172.32.0.1", "100.128.0.1", "2001:db8::1"):
        assert not is_ours(addr), addr
    assert is_ours("203.0.113.9", reflexive_ip="203.0.113.9")  # our outermost NAT answering from its WAN side


@pytest.mark.parametrize("routers, complete, want", [
    ({1: "192.168.1.1", 2: "203.0.113.1"}, False, 2),  # one home NAT: die at the first internet router
    ({1: "192.168.3.1", 2: "100.64.0.1", 3: "203.0.113.17"}, False, 3),  # behind a carrier-grade NAT too
    ({1: "192.168.1.1", 2: "10.20.0.1", 3: "203.0.113.1", 4: "198.51.100.1"}, False, 3),  # a private ISP hop
    ({1: "198.51.100.1"}, False, 1),  # no NAT at all: any TTL leaves "ours"
    ({1: "192.168.1.1", 3: "203.0.113.1"}, False, None),  # hop 2 not heard yet: wait
    ({1: "192.168.1.1", 3: "203.0.113.1"}, True, 2),  # at the end: the first hop not proven ours
    ({1: "192.168.1.1"}, True, 2),  # the internet's routers rate-limited their answers
    ({1: "192.168.1.1", 2: "203.0.113.9"}, True, 3),  # hop 2 is our NAT's public address (reflexive below)
    ({}, True, None),  # nobody answered: not learned
])
def test_the_low_ttl_is_the_first_router_past_ours(routers, complete, want):
    assert choose(routers, "203.0.113.9", complete) == want


def _error(ttl: int, router: str, icmp_type: int = 11, token: bytes = TOKEN, family=socket.AF_INET):
    if family == socket.AF_INET:
        origin, level, kind = 2, socket.IPPROTO_IP, 11
        offender = struct.pack("=HH4s8x", socket.AF_INET, 0, socket.inet_pton(socket.AF_INET, router))
    else:
        origin, level, kind = 3, socket.IPPROTO_IPV6, 25
        offender = struct.pack("=HHI16sI", socket.AF_INET6, 0, 0, socket.inet_pton(socket.AF_INET6, router), 0)
    blob = struct.pack("=IBBBBII", 113, origin, icmp_type, 0, 0, 0, 0) + offender
    return probe_packet(ttl, token), [(level, kind, blob)]


def test_error_queue_messages_name_the_ttl_and_the_router():
    assert parse_error(*_error(2, "203.0.113.1"), TOKEN) == (2, "203.0.113.1")
    assert parse_error(*_error(3, "2001:db8::1", icmp_type=3, family=socket.AF_INET6), TOKEN) == (3, "2001:db8::1")
    assert parse_error(*_error(2, "203.0.113.1", icmp_type=3), TOKEN) is None  # unreachable, not time exceeded
    assert parse_error(*_error(2, "203.0.113.1", token=b"x" * 8), TOKEN) is None  # another trace's probe
    data, anc = _error(2, "203.0.113.1")
    assert parse_error(data, [(anc[0][0], anc[0][1], anc[0][2][:10])], TOKEN) is None  # truncated: ignored
    assert parse_error(b"garbage", anc, TOKEN) is None


async def test_a_trace_without_routers_learns_nothing_and_leaves_the_socket_as_it_was():
    server = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM)
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM)
    with server, sock:
        await server.bind(("127.0.0.1", 0))
        await sock.bind(("127.0.0.1", 0))
        ttl = sock.getsockopt(socket.IPPROTO_IP, socket.IP_TTL)
        result = await nat_trace.trace(sock, server.getsockname(), timeout=0.2)
        assert result.low_ttl is None and result.routers == {}
        assert "no router answered" in result.how or "does not report" in result.how
        assert sock.getsockopt(socket.IPPROTO_IP, socket.IP_TTL) == ttl
        if nat_trace.supported():
            assert sock.getsockopt(socket.IPPROTO_IP, 11) == 0  # IP_RECVERR off again
            # Every probe reached the server (loopback has no router): TTL 1..MAX_TTL, in order.
            got = []
            with trio.move_on_after(1):
                while len(got) < nat_trace.MAX_TTL:
                    data, _ = await server.recvfrom(64)
                    got.append(data[4])
            assert got == list(range(1, nat_trace.MAX_TTL + 1))
        # The socket still works for the punch that follows.
        await sock.sendto(b"hello", server.getsockname())
        assert (await server.recvfrom(64))[0] == b"hello"
