"""How many routers a fellow's own NATs span: the IP TTL that leaves them all and dies before the far NAT.

Hole punching sends its first probes with a small IP TTL (see :mod:`swarm.mesh.hole_punch`): they must get past every
NAT of our own (a home router, a carrier-grade NAT in front of it) so that those open their mappings, and die at the
first router beyond, before they can reach the peer's NAT and make it remap its port. A fixed TTL fits one
topology only (3 reaches the far NAT when a single router lies between two homes), so it is learned, as traceroute
does: the socket that will punch sends one datagram per TTL 1..:data:`MAX_TTL` towards the leader's rendezvous port
(reaching the leader is harmless) and reads the ICMP time-exceeded errors they provoke from its error queue
(``IP_RECVERR``, Linux). Each names the router that dropped the probe. Routers with private (RFC 1918), shared
(RFC 6598, carrier-grade NAT), link-local or loopback addresses, and the router answering from our own public
(reflexive) address, are ours; the TTL to use is that of the first router outside them.

Where the error queue does not exist (Windows, macOS) or no router answers, the caller falls back to a guess
(:data:`FALLBACK_TTL`, one home NAT) and may raise it on a later attempt.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import socket
import struct
import sys

import trio

from swarm.errors import counted
from swarm.mesh.udp import Address, plain_ip, socket_address

log = logging.getLogger(__name__)

MAGIC = b"SWTR"
MAX_TTL = 8  # a carrier-grade NAT behind two home routers is 3 hops deep; 8 leaves room for ISP routers
TRACE_TIMEOUT_S = 1.0  # the farthest answer we wait for is the first public router's, one short round trip away
FALLBACK_TTL = 2  # leaves one home NAT and dies at the next router: the commonest case when nothing can be learned

_IP_RECVERR = getattr(socket, "IP_RECVERR", 11)
_IPV6_RECVERR = getattr(socket, "IPV6_RECVERR", 25)
_SO_EE_ORIGIN_ICMP, _SO_EE_ORIGIN_ICMP6 = 2, 3
_ICMP_TIME_EXCEEDED, _ICMP6_TIME_EXCEEDED = 11, 3
_EE = struct.Struct("=IBBBBII")  # struct sock_extended_err
_OURS = [ipaddress.ip_network(n) for n in (
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",  # RFC 1918
    "100.64.0.0/10",  # RFC 6598: carrier-grade NAT
    "169.254.0.0/16", "127.0.0.0/8", "0.0.0.0/8",
    "fc00::/7", "fe80::/10", "::1/128",
)]


@dataclasses.dataclass(frozen=True)
class Trace:
    """What a trace found: ``low_ttl`` to use (None: not learned), the routers that answered (TTL -> address),
    and ``how`` in words for the log and a failure message."""

    low_ttl: int | None
    routers: dict[int, str]
    how: str


def supported() -> bool:
    """Whether this system reports ICMP errors on a UDP socket's error queue (Linux)."""
    return sys.platform.startswith("linux") and hasattr(socket, "MSG_ERRQUEUE")


def is_ours(address: str, reflexive_ip: str | None = None) -> bool:
    """Whether a router at ``address`` is inside our own NATs: a private/shared/link-local address, or our public
    one."""
    ip = plain_ip(address)
    if reflexive_ip is not None and ip == plain_ip(reflexive_ip):
        return True
    return any(ip.version == net.version and ip in net for net in _OURS)


def probe_packet(ttl: int, token: bytes) -> bytes:
    """The datagram sent with IP TTL ``ttl``: it comes back inside the ICMP error, so the answer names its TTL."""
    return MAGIC + bytes([ttl]) + token


def parse_error(data: bytes, ancdata, token: bytes) -> tuple[int, str] | None:
    """(TTL of our probe, router address) from one message of the error queue, when it is a time-exceeded answer
    to a probe of this trace (``token``); else None. Never raises on what the kernel handed us."""
    if len(data) != len(MAGIC) + 1 + len(token) or data[:4] != MAGIC or data[5:] != token:
        return None
    for level, kind, blob in ancdata:
        if (level, kind) not in ((socket.IPPROTO_IP, _IP_RECVERR), (socket.IPPROTO_IPV6, _IPV6_RECVERR)):
            continue
        if len(blob) < _EE.size + 8:
            continue
        _errno, origin, icmp_type, _code, _pad, _info, _data = _EE.unpack_from(blob)
        if (origin, icmp_type) not in ((_SO_EE_ORIGIN_ICMP, _ICMP_TIME_EXCEEDED),
                                       (_SO_EE_ORIGIN_ICMP6, _ICMP6_TIME_EXCEEDED)):
            continue
        family = struct.unpack_from("=H", blob, _EE.size)[0]
        try:
            if family == socket.AF_INET:
                router = socket.inet_ntop(socket.AF_INET, blob[_EE.size + 4:_EE.size + 8])
            elif family == socket.AF_INET6 and len(blob) >= _EE.size + 24:
                router = socket.inet_ntop(socket.AF_INET6, blob[_EE.size + 8:_EE.size + 24])
            else:
                continue
            return data[4], str(plain_ip(router))
        except (OSError, ValueError):
            continue
    return None


def choose(routers: dict[int, str], reflexive_ip: str | None, complete: bool) -> int | None:
    """The low TTL from the routers that answered so far (TTL -> address); None while (or when) it is not known.

    Our NATs are the routers with our addresses below the first one outside them; the TTL is one more than the
    farthest of ours. Before the trace ends (``complete`` False) the answer is final only once every TTL below the
    first outside router has answered; at the end, silent hops below it are assumed ours only when a router of ours
    answered beyond them (the probes then never pass a router we did not see answer as ours).
    """
    outside = [ttl for ttl, addr in sorted(routers.items()) if not is_ours(addr, reflexive_ip)]
    first_outside = outside[0] if outside else None
    ours = [ttl for ttl, addr in routers.items() if is_ours(addr, reflexive_ip)
            and (first_outside is None or ttl < first_outside)]
    if first_outside is not None and all(t in routers for t in range(1, first_outside)):
        return first_outside
    if not complete:
        return None
    if ours:
        return max(ours) + 1
    return None


async def trace(sock, server: Address, reflexive_ip: str | None = None, timeout: float = TRACE_TIMEOUT_S,
                max_ttl: int = MAX_TTL) -> Trace:
    """Learn the low TTL of the bound UDP socket ``sock`` by probing towards ``server`` (see the module's text).

    Leaves the socket as it was (error reporting off again, its queue emptied). Datagrams that arrive meanwhile are
    dropped: call this before the peer can be sending (the punch starts after it).
    """
    if not supported():
        return Trace(None, {}, "this system does not report ICMP errors to programs")
    v6 = sock.family == socket.AF_INET6
    options = [(socket.IPPROTO_IP, _IP_RECVERR)] + ([(socket.IPPROTO_IPV6, _IPV6_RECVERR)] if v6 else [])
    ttl_option = (socket.IPPROTO_IPV6, socket.IPV6_UNICAST_HOPS) if v6 else (socket.IPPROTO_IP, socket.IP_TTL)
    token = os.urandom(8)
    routers: dict[int, str] = {}
    target = socket_address(sock, server)
    try:
        for level, option in options:
            sock.setsockopt(level, option, 1)
        default_ttl = sock.getsockopt(*ttl_option)
        try:
            for ttl in range(1, max_ttl + 1):
                sock.setsockopt(*ttl_option, ttl)
                await _send(sock, probe_packet(ttl, token), target)
        finally:
            sock.setsockopt(*ttl_option, default_ttl)
        # The same descriptor, not a duplicate (epoll would keep watching a closed duplicate): detached after.
        raw = socket.socket(fileno=sock.fileno())
        try:
            with trio.move_on_after(timeout):
                await _read_errors(sock, raw, token, routers, reflexive_ip)
        finally:
            raw.detach()
    finally:
        for level, option in options:  # turning it off also empties the error queue (Linux)
            sock.setsockopt(level, option, 0)
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)  # and reading it clears a pending error
    low_ttl = choose(routers, reflexive_ip, complete=True)
    path = ", ".join(f"{ttl}: {addr}" for ttl, addr in sorted(routers.items())) or "no router answered"
    if low_ttl is None:
        return Trace(None, routers, f"not learned ({path})")
    return Trace(low_ttl, routers,
                 f"traced: the first router past this fellow's NATs is {counted(low_ttl, 'hop')} away ({path})")


async def _read_errors(sock, raw: socket.socket, token: bytes, routers: dict[int, str], reflexive_ip) -> None:
        while choose(routers, reflexive_ip, complete=False) is None:
            await trio.lowlevel.wait_readable(sock)
            try:
                data, ancdata, _flags, _addr = raw.recvmsg(64, 1024, socket.MSG_ERRQUEUE)
            except BlockingIOError:
                _drop_one(raw)  # a plain datagram is what woke us: it cannot wait (see the docstring)
                continue
            except OSError as exc:
                log.debug("trace: reading the error queue: %s", exc)
                continue
            found = parse_error(data, ancdata, token)
            if found is not None:
                routers.setdefault(*found)


async def _send(sock, data: bytes, target) -> None:
    # With IP_RECVERR on, the error an earlier probe provoked is reported by the next send, which then sends
    # nothing (EHOSTUNREACH for a time-exceeded): that error is taken off the socket, so send again.
    for attempt in range(4):
        try:
            await sock.sendto(data, target)
            return
        except OSError as exc:
            log.debug("trace: send %d of a probe: %s", attempt + 1, exc)


def _drop_one(raw: socket.socket) -> None:
    try:
        raw.recvfrom(2048)
    except OSError:  # nothing after all, or a pending ICMP error reported on the plain read
        pass


__all__ = ["FALLBACK_TTL", "Trace", "choose", "is_ours", "parse_error", "probe_packet", "supported", "trace"]
