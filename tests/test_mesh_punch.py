"""Hole punching: the sans-IO session fed packets and times (no sockets), and two UDP sockets on loopback."""

from __future__ import annotations

import os
import random

import pytest
import trio

from swarm.errors import TunnelError
from swarm.mesh import hole_punch as punch_mod
from swarm.mesh.hole_punch import (
    ACK,
    CONFIRM,
    PROBE,
    PunchFailed,
    PunchSession,
    make_packet,
    parse_packet,
    punch,
)
from swarm.mesh.udp import normalize_address, receive_datagram

SECRET = b"s" * 32
A_ADDR = ("198.51.100.1", 40001)  # how b sees a
B_ADDR = ("203.0.113.2", 40002)  # how a sees b
DEAD = ("192.0.2.99", 9)


# --- sans-IO ---------------------------------------------------------------------------------------------------------


def test_packets_are_authenticated():
    packet = make_packet(SECRET, PROBE, "a", bytes(12))
    assert parse_packet(SECRET, packet) == (PROBE, "a", bytes(12), bytes(12))
    assert parse_packet(b"another secret", packet) is None
    for i in range(len(packet)):  # any flipped bit is refused
        assert parse_packet(SECRET, packet[:i] + bytes([packet[i] ^ 1]) + packet[i + 1 :]) is None
    rng = random.Random(3)
    for _ in range(300):
        assert parse_packet(SECRET, bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 80)))) is None


def test_schedule():
    start = 100.0
    session = PunchSession([B_ADDR, DEAD], SECRET, "a", start, timeout=8.0, low_ttl=2, rng=random.Random(5))
    rounds = []  # (time, [ttl of each probe])
    now = start - 1.0
    assert session.on_timer(now) == []  # nothing before the start time
    while not session.failed:
        now = session.next_deadline()
        sends = session.on_timer(now)
        if sends:
            assert {s.addr for s in sends} == {B_ADDR, DEAD}
            assert all(parse_packet(SECRET, s.data)[0] == PROBE for s in sends)
            rounds.append((now, [s.ttl for s in sends]))
    times = [t for t, _ in rounds]
    assert times[0] == start
    assert now == start + 8.0  # gives up exactly at the timeout
    # Low TTL on the first two rounds only.
    assert [ttls for _, ttls in rounds[:3]] == [[2, 2], [2, 2], [None, None]]
    gaps = [b - a for a, b in zip(times, times[1:])]
    fast = [g for t, g in zip(times, gaps) if t - start < punch_mod.FAST_PHASE_S]
    slow = [g for t, g in zip(times, gaps) if t - start >= punch_mod.FAST_PHASE_S]
    assert 30 <= len(fast) <= 60 and all(0.05 <= g <= 0.1 for g in fast)
    assert len(set(fast)) > 10  # jittered, not lock-step
    assert slow == sorted(slow) and slow[0] == pytest.approx(0.2) and max(slow) == pytest.approx(1.0)
    message = session.failure_message()
    assert "192.0.2.99:9" in message and "203.0.113.2:40002" in message and "heard nothing" in message
    assert "relay" in message


def exchange(a: PunchSession, b: PunchSession, now: float, lose=lambda send: False) -> None:
    """Deliver a's and b's datagrams to each other (a at A_ADDR, b at B_ADDR) until nothing moves."""
    queue = [("a", s) for s in a.on_timer(now)] + [("b", s) for s in b.on_timer(now)]
    while queue:
        sender, send = queue.pop(0)
        if lose(send):
            continue
        if sender == "a" and send.addr == B_ADDR:
            queue += [("b", s) for s in b.on_datagram(send.data, A_ADDR, now)]
        elif sender == "b" and send.addr == A_ADDR:
            queue += [("a", s) for s in a.on_datagram(send.data, B_ADDR, now)]


def test_pair_agrees_on_one_address_pair():
    a = PunchSession([DEAD, B_ADDR], SECRET, "a", 0.0)
    b = PunchSession([A_ADDR, ("10.0.0.5", 4000)], SECRET, "b", 0.0)
    now = 0.0
    while not (a.done and b.done):
        exchange(a, b, now)
        now = min(a.next_deadline(), b.next_deadline())
        assert now < 1.0 or (a.done and b.done)
    assert a.locked == B_ADDR and b.locked == A_ADDR


def test_lost_first_confirm_is_covered_by_the_copies():
    a = PunchSession([B_ADDR], SECRET, "a", 0.0)
    b = PunchSession([A_ADDR], SECRET, "b", 0.0)
    lost = []

    def lose_first_confirm(send):
        if not lost and parse_packet(SECRET, send.data)[0] == CONFIRM:
            lost.append(send)
            return True
        return False

    now = 0.0
    while not (a.done and b.done):
        exchange(a, b, now, lose_first_confirm)
        now = min(a.next_deadline(), b.next_deadline())
        assert now < 1.0 or (a.done and b.done)
    assert lost and b.locked == A_ADDR


def test_strangers_and_replays_are_ignored():
    a = PunchSession([B_ADDR], SECRET, "a", 0.0, peer_reflexive=False)
    stranger = ("192.0.2.66", 666)
    # Wrong secret, from a candidate address: ignored.
    assert a.on_datagram(make_packet(b"wrong", PROBE, "b", os.urandom(12)), B_ADDR, 0.0) == []
    # Right secret, address not a candidate, peer-reflexive candidates off: ignored.
    assert a.on_datagram(make_packet(SECRET, PROBE, "b", os.urandom(12)), stranger, 0.0) == []
    # Our own role reflected back: ignored.
    assert a.on_datagram(make_packet(SECRET, PROBE, "a", os.urandom(12)), B_ADDR, 0.0) == []
    # An ack that answers no probe of ours: no lock.
    assert a.on_datagram(make_packet(SECRET, ACK, "b", os.urandom(12), os.urandom(12)), B_ADDR, 0.0) == []
    # An ack for a probe we sent to B_ADDR, replayed from another candidate: no lock (the check is symmetric).
    a2 = PunchSession([B_ADDR, DEAD], SECRET, "a", 0.0)
    probe = next(s for s in a2.on_timer(0.0) if s.addr == B_ADDR)
    ack = make_packet(SECRET, ACK, "b", os.urandom(12), parse_packet(SECRET, probe.data)[2])
    a2.on_datagram(ack, DEAD, 0.0)
    assert a2.locked is None
    a2.on_datagram(ack, B_ADDR, 0.0)
    assert a2.locked == B_ADDR
    assert a.locked is None and not a.heard_from


def test_peer_reflexive_candidate_from_a_port_changing_nat():
    """b's NAT gave b a new port: a hears b's authentic probe from an address nobody announced and still locks."""
    b_new = ("203.0.113.2", 50000)
    a = PunchSession([B_ADDR], SECRET, "a", 0.0)
    sends = a.on_datagram(make_packet(SECRET, PROBE, "b", os.urandom(12)), b_new, 0.0)
    assert {s.addr for s in sends} == {b_new}  # an ack and a triggered probe
    probe = next(s for s in sends if parse_packet(SECRET, s.data)[0] == PROBE)
    a.on_datagram(make_packet(SECRET, ACK, "b", os.urandom(12), parse_packet(SECRET, probe.data)[2]), b_new, 0.0)
    assert a.locked == b_new
    assert b_new in a.peer_reflexive_candidates


def test_one_way_path_is_named_in_the_failure():
    a = PunchSession([B_ADDR], SECRET, "a", 0.0, timeout=1.0)
    a.on_timer(0.0)
    a.on_datagram(make_packet(SECRET, PROBE, "b", os.urandom(12)), B_ADDR, 0.1)
    a.on_timer(1.0)
    assert a.failed and "one direction only" in a.failure_message()


# --- trio on loopback ------------------------------------------------------------------------------------------------


async def udp_socket(host="127.0.0.1"):
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM)
    await sock.bind((host, 0))
    return sock


async def punch_pair(sock_a, sock_b, cand_a, cand_b, secret=SECRET, low_ttl=None):
    start = trio.current_time() + 0.05
    results = {}

    async def run(role, sock, candidates):
        results[role] = await punch(sock, candidates, secret, role, start, timeout=3.0, low_ttl=low_ttl)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "a", sock_a, cand_a)
        nursery.start_soon(run, "b", sock_b, cand_b)
    return results["a"], results["b"]


@pytest.mark.parametrize("low_ttl", [None, 2])
async def test_two_sockets_lock_onto_each_other(low_ttl):
    with trio.fail_after(5):
        with await udp_socket() as a, await udp_socket("127.0.0.2") as b, await udp_socket() as closed:
            dead = closed.getsockname()
            closed.close()  # a port nobody listens on: ICMP unreachable, which must not end the punch
            ttl = a.getsockopt(trio.socket.IPPROTO_IP, trio.socket.IP_TTL)
            got_a, got_b = await punch_pair(
                a, b, [("127.0.0.3", 9), dead, b.getsockname()], [dead, a.getsockname()], low_ttl=low_ttl
            )
            assert got_a == b.getsockname() and got_b == a.getsockname()
            # The socket's own TTL is back after the low-TTL rounds: QUIC runs on it next.
            assert a.getsockopt(trio.socket.IPPROTO_IP, trio.socket.IP_TTL) == ttl


async def test_third_party_with_the_wrong_secret_is_ignored(nursery):
    with trio.fail_after(5):
        with await udp_socket() as a, await udp_socket() as b, await udp_socket() as mallory:
            targets = [a.getsockname(), b.getsockname()]

            async def spam():
                # Valid-looking packets under another secret, from an address both sides list as a candidate.
                while True:
                    for kind in (PROBE, ACK, CONFIRM):
                        for target in targets:
                            await mallory.sendto(make_packet(b"guess", kind, "a", os.urandom(12), os.urandom(12)),
                                                 target)
                            await mallory.sendto(make_packet(b"guess", kind, "b", os.urandom(12), os.urandom(12)),
                                                 target)
                    await trio.sleep(0.005)

            nursery.start_soon(spam)
            got_a, got_b = await punch_pair(
                a, b, [mallory.getsockname(), b.getsockname()], [mallory.getsockname(), a.getsockname()]
            )
            assert got_a == b.getsockname() and got_b == a.getsockname()
            # Mallory got nothing but our probes to its (candidate) address: no ack, no confirm.
            kinds = set()
            with trio.move_on_after(0.1):
                while True:
                    data, _ = await mallory.recvfrom(2048)
                    kinds.add(parse_packet(SECRET, data)[0])
            assert kinds <= {PROBE}
            nursery.cancel_scope.cancel()


async def test_punch_fails_clearly_when_the_peer_never_answers(autojump_clock):
    with trio.fail_after(60):
        with await udp_socket() as a, await udp_socket() as silent:
            start = trio.current_time() + 1.0
            with pytest.raises(PunchFailed) as caught:
                await punch(a, [("127.0.0.3", 9), silent.getsockname()], SECRET, "a", start, timeout=8.0,
                            low_ttl=3)
            assert trio.current_time() == pytest.approx(start + 8.0)
            message = str(caught.value)
            assert "127.0.0.3:9" in message and f"127.0.0.1:{silent.getsockname()[1]}" in message
            assert "heard nothing" in message and "TTL 3" in message
            assert isinstance(caught.value, TunnelError)


async def test_non_punch_datagrams_go_to_the_callback():
    with trio.fail_after(5):
        with await udp_socket() as a, await udp_socket() as b, await udp_socket() as other:
            await other.sendto(b"late rendezvous answer", a.getsockname())
            seen = []
            start = trio.current_time() + 0.05
            results = {}

            async def run_a():
                results["a"] = await punch(a, [b.getsockname()], SECRET, "a", start,
                                           on_other=lambda d, addr: seen.append((d, addr)))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run_a)
                results["b"] = await punch(b, [a.getsockname()], SECRET, "b", start)
            assert seen == [(b"late rendezvous answer", other.getsockname())]
            assert results == {"a": b.getsockname(), "b": a.getsockname()}


async def test_read_errors_on_the_socket_are_skipped():
    # An ICMP error from an earlier send surfaces as a failed read (Windows, or a connected socket): punching,
    # rendezvous and QUIC's accept all read through udp.receive_datagram, which skips it.
    class Socket:
        def __init__(self):
            self.results = [ConnectionResetError(10054, "port unreachable"), (b"data", ("127.0.0.1", 5))]

        async def recvfrom(self, size):
            await trio.lowlevel.checkpoint()
            result = self.results.pop(0)
            if isinstance(result, Exception):
                raise result
            return result

    with trio.fail_after(5):
        assert await receive_datagram(Socket(), 2048, "test") == (b"data", ("127.0.0.1", 5))


def test_addresses_compare_as_plain_ip():
    assert normalize_address(("::ffff:192.0.2.1", 7, 0, 0)) == ("192.0.2.1", 7)
    assert normalize_address(("fe80::1%eth0", "8")) == ("fe80::1", 8)
