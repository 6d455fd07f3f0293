"""The network lab itself (no swarm processes): NAT kinds behave as their names say, nothing gets in, delay is real.

Needs root and network namespaces; skips with the reason otherwise.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

import netlab
from harness import wait_for

_reason = netlab.available()
if _reason:
    pytest.skip(_reason, allow_module_level=True)

pytestmark = pytest.mark.lab

DELAY_MS = netlab.WAN_DELAY_MS


@pytest.fixture(scope="module")
def lab():
    # Two servers on the internet and a home of every kind: ordinary NATs (nat-a, nat-b), fully random (nat-r),
    # UDP blocked (nat-u), behind a carrier's NAT (nat-c behind cgn), a router that answers strangers (nat-p).
    homes = ("nat-a", "nat-b", "nat-r", "nat-u", "nat-c", "nat-p")
    with netlab.world(public=("inet1", "inet2"), homes=homes, delay_ms=DELAY_MS) as lab:
        for node in ("inet1", "inet2"):
            lab.reflector(node, 7000, "tcp")
            lab.reflector(node, 7001, "udp")
        yield lab


def _ip(seen: str | None) -> str | None:
    return None if seen is None else seen.rsplit(":", 1)[0]


def _port(seen: str | None) -> int | None:
    return None if seen is None else int(seen.rsplit(":", 1)[1])


def test_names_are_unique_per_run_and_cleanup_removes_everything():
    with netlab.Lab(delay_ms=0) as one, netlab.Lab(delay_ms=0) as two:
        assert one.tag != two.tag
        one.add_router("home", "masquerade")
        two.add_router("home", "masquerade")
        made = set(one.namespaces) | set(two.namespaces)
        assert len(made) == 4 and made <= set(netlab._lab_namespaces())
    assert not made & set(netlab._lab_namespaces())
    # A failure while building still removes what was made.
    with pytest.raises(RuntimeError):
        with netlab.Lab(delay_ms=0) as broken:
            broken.add_router("x", "masquerade")
            raise RuntimeError("a test failing half-way")
    assert not [ns for ns in netlab._lab_namespaces() if ns.startswith(broken.tag)]


def test_masquerade_tcp_reaches_the_internet_from_the_routers_public_address(lab):
    _, seen = lab.probe("a1", [(lab.address("inet1"), 7000)], proto="tcp")
    assert _ip(seen[0]) == lab.address("nat-a") == lab.public_address("a1")
    assert lab.address("a1").startswith("192.168.")


def test_nothing_behind_a_nat_is_reachable_from_outside(lab):
    server = lab.reflector("b1", 7100, "tcp")
    try:
        _check_nothing_gets_in(lab)
    finally:
        lab.stop(server)


def _check_nothing_gets_in(lab):
    assert lab.tcp_reachable("b2", lab.address("b1"), 7100)  # it listens: its own LAN reaches it
    before = lab.counters("nat-b")
    for outsider in ("inet1", "a1"):
        assert not lab.tcp_reachable(outsider, lab.address("b1"), 7100, timeout=1.0)  # private: no route
        assert not lab.tcp_reachable(outsider, lab.public_address("b1"), 7100, timeout=1.0)  # nothing forwarded
    assert lab.inbound_openings("nat-b") == []
    assert "dnat" not in lab.ruleset("nat-b")
    after = lab.counters("nat-b")
    # The router saw the knocks on its public address and dropped them.
    assert after["local_wan_dropped"][0] > before["local_wan_dropped"][0]


def test_udp_blocked_router_drops_udp_but_passes_tcp(lab):
    target = [(lab.address("inet1"), 7001)]
    _, seen = lab.probe("u1", target, proto="udp", timeout=0.5)
    assert seen == [None]
    assert lab.counters("nat-u")["udp_dropped"][0] >= 3
    _, seen = lab.probe("u1", [(lab.address("inet1"), 7000)], proto="tcp")
    assert _ip(seen[0]) == lab.address("nat-u")
    _, seen = lab.probe("a1", target, proto="udp")  # the same datagram from an ordinary NAT comes back
    assert _ip(seen[0]) == lab.address("nat-a")


def test_fully_random_changes_the_port_per_destination_masquerade_keeps_one_mapping(lab):
    targets = [(lab.address("inet1"), 7001), (lab.address("inet2"), 7001)]
    local, seen = lab.probe("a1", targets, proto="udp", local_port=40001)
    assert None not in seen
    assert {_ip(s) for s in seen} == {lab.address("nat-a")}
    assert _port(seen[0]) == _port(seen[1])  # endpoint-independent: one mapping for one socket
    assert _port(seen[0]) == local == 40001  # Linux keeps the source port when it is free

    local, seen = lab.probe("r1", targets, proto="udp", local_port=40001)
    assert None not in seen
    assert {_ip(s) for s in seen} == {lab.address("nat-r")}
    assert _port(seen[0]) != _port(seen[1])  # a new random port towards each destination
    # The mapping itself is stable for one destination: asking again over the same flow gives the same answer.
    again, seen2 = lab.probe("r1", targets[:1], proto="udp", local_port=40001)
    assert seen2 == seen[:1]


def test_cgnat_host_appears_from_the_carriers_public_address(lab):
    _, seen = lab.probe("c1", [(lab.address("inet1"), 7000)], proto="tcp")
    assert _ip(seen[0]) == lab.address("cgn") == lab.public_address("c1")
    assert lab.address("nat-c").startswith("100.64.")
    _, seen = lab.probe("c1", [(lab.address("inet1"), 7001)], proto="udp")
    assert _ip(seen[0]) == lab.address("cgn")


# One UDP socket on ``port``, driven by the test over stdin so that the packets leave in a known order:
# "send <text>" sends to the peer, "listen" prints every address heard from (what is queued, then whatever comes
# within 1 s of silence) and exits.
_PUNCH = r"""
import socket, sys
port, peer = int(sys.argv[1]), (sys.argv[2], int(sys.argv[3]))
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", port))
print("ready", flush=True)
for line in sys.stdin:
    if line.startswith("send "):
        s.sendto(line[5:].strip().encode(), peer)
        print("sent", flush=True)
        continue
    s.settimeout(1.0)
    seen = set()
    try:
        while True:
            data, src = s.recvfrom(100)
            seen.add(f"{src[0]}:{src[1]}")
    except socket.timeout:
        pass
    print(" ".join(sorted(seen)), flush=True)
    break
"""


def _punch(lab, knocker: str, other: str, port: int) -> tuple[str, str]:
    """Both hosts send from local ``port`` to the other's public address at ``port``: first the knocker's knock,
    which reaches the other's NAT before anything leaves it; then the other's hello; then the knocker's hello, once
    the other's has reached the knocker's NAT. Returns the addresses each one heard from."""
    k_public, o_public = lab.public_address(knocker), lab.public_address(other)
    peers = {knocker: o_public, other: k_public}
    procs = {h: lab.run(h, [sys.executable, "-c", _PUNCH, str(port), peers[h], str(port)], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, text=True) for h in (knocker, other)}

    def say(host: str, line: str) -> str:
        procs[host].stdin.write(line + "\n")
        procs[host].stdin.flush()
        return procs[host].stdout.readline().strip()

    try:
        assert all(p.stdout.readline().strip() == "ready" for p in procs.values())
        # What reaches each NAT from the other side, whatever source port the far NAT chose.
        with lab.capture(lab.hosts[other].router, "wan", f"udp and src host {k_public} and dst port {port}") as at_o, \
                lab.capture(lab.hosts[knocker].router, "wan", f"udp and src host {o_public}") as at_k:
            assert say(knocker, "send knock") == "sent"
            wait_for(lambda: at_o.seen() >= 1, 10, message=f"the knock never reached {other}'s NAT")
            assert say(other, "send hello") == "sent"
            wait_for(lambda: at_k.seen() >= 1, 10, message=f"{other}'s hello never reached {knocker}'s NAT")
            assert say(knocker, "send hello") == "sent"
            wait_for(lambda: at_o.seen() >= 2, 10, message=f"the hello never reached {other}'s NAT")
        return say(knocker, "listen"), say(other, "listen")
    finally:
        for proc in procs.values():
            lab.stop(proc)
            proc.stdin.close()
            proc.stdout.close()


def test_udp_punch_keeps_the_port_unless_the_router_lets_the_first_knock_in(lab):
    # Default routers drop an unsolicited packet to themselves before conntrack confirms it: when the LAN host then
    # sends to the knocker, the NAT keeps its source port and both sides hear each other.
    knocker_got, other_got = _punch(lab, "b1", "a1", 40010)
    assert knocker_got == f"{lab.public_address('a1')}:40010"
    assert other_got == f"{lab.public_address('b1')}:40010"
    # A router with no WAN input filter confirms a conntrack entry for the knock (and answers it with ICMP); the LAN
    # host's own flow to the knocker then clashes with it and is mapped to ANOTHER port, which the knocker's NAT
    # does not expect: nothing gets through either way.
    knocker_got, other_got = _punch(lab, "b1", "p1", 40020)
    assert knocker_got == "" and other_got == ""
    mapped = [line for line in lab.conntrack("nat-p").splitlines()
              if f"src={lab.address('p1')}" in line and "sport=40020" in line]
    assert mapped and "dport=40020 " not in mapped[0].split("src=", 2)[2], mapped


def _min_rtt_ms(lab, node: str, address: str) -> float:
    out = lab.check(node, ["ping", "-c", "4", "-i", "0.2", "-W", "2", address])
    return float(re.search(r"= ([\d.]+)/", out).group(1))


def test_wan_links_add_the_configured_delay(lab):
    one_hop = _min_rtt_ms(lab, "a1", lab.address("inet1"))
    assert one_hop >= 2 * DELAY_MS, lab.delay_backend
    assert one_hop < 2 * DELAY_MS + 30
    two_hops = _min_rtt_ms(lab, "c1", lab.address("inet1"))  # home WAN + carrier WAN
    assert two_hops >= 4 * DELAY_MS
    lan = _min_rtt_ms(lab, "b1", lab.address("b2"))
    assert lan < DELAY_MS


def test_capture_sees_traffic_on_a_routers_wan(lab):
    with lab.capture("nat-a", "wan", "tcp port 7000") as cap:
        _, seen = lab.probe("a1", [(lab.address("inet1"), 7000)], proto="tcp")
    assert seen[0] is not None
    assert cap.count() >= 3  # at least the handshake
    assert cap.contains(seen[0])  # the reflector's reply is plaintext on the wire
    assert all(lab.address("a1") not in line for line in cap.packets())  # only the public address outside


def test_stale_namespaces_of_dead_runs_are_removed():
    import subprocess

    ns = f"{netlab.PREFIX}0-dead-core"  # pid 0: no process ever made this
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        assert ns in netlab.cleanup_stale()
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    assert ns not in netlab._lab_namespaces()


def test_print_grid(capsys):
    text = netlab.print_grid({("masquerade", "masquerade"): "relay", ("lan", "lan"): "direct"})
    assert "relay" in text and "direct" in text and capsys.readouterr().out.strip() == text
