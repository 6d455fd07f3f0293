"""The UDP socket facts shared by rendezvous, hole punching and QUIC: how addresses compare, and reading datagrams.

One fellow socket goes through all three (discover its public address, punch, then carry QUIC), and each must agree
on which address a datagram came from: a dual-stack socket reports ``::ffff:192.0.2.1`` where the leader announced
``192.0.2.1``, so every comparison goes through :func:`normalize_address`.
"""

from __future__ import annotations

import ipaddress
import logging

import trio

log = logging.getLogger(__name__)

Address = tuple[str, int]


def plain_ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The address as an IP object, an IPv4-mapped IPv6 address (a dual-stack socket's view) as plain IPv4."""
    ip = ipaddress.ip_address(host.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def normalize_address(addr) -> Address:
    """(host, port) as this package compares addresses: canonical text, IPv4-mapped IPv6 as IPv4, no flow/scope."""
    return str(plain_ip(addr[0])), int(addr[1])


def socket_address(sock, addr: Address):
    """``addr`` in the form ``sock.sendto`` wants: IPv4 on an IPv6 (dual-stack) socket becomes IPv4-mapped."""
    if sock.family == trio.socket.AF_INET6 and ipaddress.ip_address(addr[0]).version == 4:
        return (f"::ffff:{addr[0]}", addr[1])
    return (addr[0], addr[1])


async def receive_datagram(sock, size: int, what: str):
    """The next (data, address as the socket gives it) on the trio UDP socket ``sock``; read errors are skipped.

    A read can fail with an ICMP error that an earlier send provoked (Windows reports a port-unreachable as
    WSAECONNRESET, a connected socket does so everywhere): one unreachable address must not end the socket's use.
    ``what`` names the caller in the debug log.
    """
    while True:
        try:
            return await sock.recvfrom(size)
        except OSError as exc:
            log.debug("%s: read error ignored: %s", what, exc)


__all__ = ["Address", "plain_ip", "normalize_address", "socket_address", "receive_datagram"]
