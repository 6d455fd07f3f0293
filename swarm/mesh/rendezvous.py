"""Reflexive-address discovery over UDP: a fellow asks the leader "what address do my packets come from?".

A minimal STUN (RFC 8489): the fellow sends a request from the very UDP socket it will later punch and run QUIC on,
so the public (reflexive) address the leader reports is the NAT mapping of *that* socket. The leader answers only
requests whose opaque ``who`` token it accepts (a fellow's credential or a per-hop ticket), so the port is not an
open reflector for the internet.

Wire format (all big-endian), magic first so stray traffic is dropped on the first four bytes:

    request:  b"SWRV" | version u8 = 1 | type u8 = 1 | txid 12 bytes | who length u8 | who (0..64 bytes)
    response: b"SWRV" | version u8 = 1 | type u8 = 2 | txid 12 bytes | family u8 (4 or 6) | port ^ mask u16
              | address ^ mask (4 or 16 bytes)

The address in a response is XOR-ed with ``magic + txid`` (as STUN's XOR-MAPPED-ADDRESS does): some NATs' "helper"
modules rewrite any 4 bytes that look like their public address inside UDP payloads, which would hide the very
answer we asked for.

The sans-IO half (``make_*``/``parse_*``) never raises on input from the network: anything malformed is ``None``.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import struct
from collections.abc import Callable

import trio

# normalize_address and socket_address live in swarm.mesh.udp (punching and QUIC use them too) and stay importable
# from here, as they were.
from swarm.errors import ProtocolError
from swarm.mesh.udp import Address, normalize_address, receive_datagram, socket_address
from swarm.mesh.udp import plain_ip as _plain_ip

log = logging.getLogger(__name__)

MAGIC = b"SWRV"
VERSION = 1
TYPE_REQUEST = 1
TYPE_RESPONSE = 2
TXID_SIZE = 12  # as STUN's transaction id (RFC 8489 §5): 96 random bits, never guessed by a blind spoofer
MAX_WHO = 64

_HEAD = struct.Struct(">4sBB12s")
# The largest datagram either side reads: a request is at most 83 bytes and a response 39; reading more than that
# only costs memory, reading less would silently truncate an oversized (hence invalid) datagram, which we drop anyway.
_RECV_SIZE = 2048

# RFC 8489 §6.2.1 starts retransmissions at 500 ms; discover_reflexive spreads its ``timeout`` over ``retries``
# sends with doubling gaps instead, so a caller sets one overall budget.
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_RETRIES = 3


# --- sans-IO ---------------------------------------------------------------------------------------------------------


def make_request(txid: bytes, who: bytes) -> bytes:
    """A binding request with transaction id ``txid`` (12 bytes) and the leader-checked token ``who``."""
    if len(txid) != TXID_SIZE:
        raise ValueError(f"a transaction id has {TXID_SIZE} bytes, got {len(txid)}")  # our own bug: a builtin's
    if len(who) > MAX_WHO:  # the token is the leader's (swarm.control_links.PunchPrepare.who)
        raise ProtocolError(f"a rendezvous token has at most {MAX_WHO} bytes, got {len(who)}")
    return _HEAD.pack(MAGIC, VERSION, TYPE_REQUEST, txid) + bytes([len(who)]) + who


def parse_request(data: bytes) -> tuple[bytes, bytes] | None:
    """(txid, who) of a well-formed request, else None."""
    head = _parse_head(data, TYPE_REQUEST)
    if head is None or len(data) < _HEAD.size + 1:
        return None
    length = data[_HEAD.size]
    if length > MAX_WHO or len(data) != _HEAD.size + 1 + length:
        return None
    return head, bytes(data[_HEAD.size + 1 :])


def make_response(txid: bytes, addr: Address) -> bytes:
    """The answer to request ``txid``: the address (host, port) its datagram came from."""
    if len(txid) != TXID_SIZE:
        raise ValueError(f"a transaction id has {TXID_SIZE} bytes, got {len(txid)}")
    ip = _plain_ip(addr[0])
    packed = ip.packed
    mask = MAGIC + txid
    port = addr[1] ^ int.from_bytes(mask[:2], "big")
    return (
        _HEAD.pack(MAGIC, VERSION, TYPE_RESPONSE, txid)
        + struct.pack(">BH", ip.version, port)
        + bytes(b ^ m for b, m in zip(packed, mask))
    )


def parse_response(data: bytes, txid: bytes) -> Address | None:
    """(host, port) from a well-formed response to request ``txid``, else None."""
    got = _parse_head(data, TYPE_RESPONSE)
    if got is None or got != txid or len(data) < _HEAD.size + 3:
        return None
    family, port = struct.unpack_from(">BH", data, _HEAD.size)
    size = {4: 4, 6: 16}.get(family)
    body = data[_HEAD.size + 3 :]
    if size is None or len(body) != size:
        return None
    mask = MAGIC + txid
    raw = bytes(b ^ m for b, m in zip(body, mask))
    host = str(ipaddress.IPv4Address(raw) if family == 4 else ipaddress.IPv6Address(raw))
    return host, port ^ int.from_bytes(mask[:2], "big")


def _parse_head(data: bytes, kind: int) -> bytes | None:
    if len(data) < _HEAD.size or data[:4] != MAGIC:
        return None
    magic, version, got_kind, txid = _HEAD.unpack_from(data)
    if version != VERSION or got_kind != kind:
        return None
    return txid


# --- trio glue -------------------------------------------------------------------------------------------------------


async def serve_rendezvous(
    host: str,
    port: int,
    allow: Callable[[bytes], bool],
    *,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Answer rendezvous requests on UDP ``host:port`` until cancelled; ``task_status.started`` gets (host, port).

    A request whose ``who`` token ``allow`` refuses gets no answer at all: a scanner learns nothing, and the port
    cannot be used to reflect traffic at a third party. Work per datagram is bounded (one parse of at most 2 KiB,
    one ``allow`` call, one small reply).
    """
    family = trio.socket.AF_INET6 if ":" in host else trio.socket.AF_INET
    sock = trio.socket.socket(family, trio.socket.SOCK_DGRAM)
    with sock:
        await sock.bind((host, port))
        bound = sock.getsockname()
        task_status.started((bound[0], bound[1]))
        while True:
            data, addr = await receive_datagram(sock, _RECV_SIZE, "rendezvous")
            request = parse_request(data)
            if request is None:
                log.debug("rendezvous: ignored %d bytes from %s: not a request", len(data), addr[:2])
                continue
            txid, who = request
            try:
                allowed = allow(who)
            except Exception:  # a bug in the check must not kill the server; it counts as a refusal
                log.exception("rendezvous: the allow check failed; request refused")
                allowed = False
            if not allowed:
                log.debug("rendezvous: refused a request from %s: unknown token", addr[:2])
                continue
            try:
                await sock.sendto(make_response(txid, normalize_address(addr)), addr)
            except OSError as exc:
                log.debug("rendezvous: could not answer %s: %s", addr[:2], exc)


async def discover_reflexive(
    sock,
    server: Address,
    who: bytes,
    timeout: float = DEFAULT_TIMEOUT_S,
    retries: int = DEFAULT_RETRIES,
    *,
    on_other: Callable[[bytes, Address], None] | None = None,
) -> Address | None:
    """The public (host, port) of the bound UDP socket ``sock`` as the rendezvous ``server`` sees it, or None.

    The request is sent ``retries`` times with doubling gaps that together fill ``timeout`` seconds (3 tries in 2 s:
    at 0, 0.29 and 0.86 s, giving up at 2 s). Every other datagram that arrives meanwhile — a peer's early punch
    packet, say — goes to ``on_other(data, (host, port))`` instead of being lost; without ``on_other`` it is dropped.
    None means the server did not answer: it is down, refused our token, or UDP is blocked on this network.
    """
    if retries < 1:
        raise ValueError("retries must be at least 1")
    server_addr = await resolve(sock, server)
    txid = os.urandom(TXID_SIZE)
    request = make_request(txid, who)
    # Gaps g, 2g, 4g, ... summing to ``timeout``.
    unit = timeout / (2**retries - 1)
    deadline = trio.current_time() + timeout
    for attempt in range(retries):
        try:
            await sock.sendto(request, socket_address(sock, server_addr))
        except OSError as exc:
            log.debug("rendezvous: could not send to %s: %s", server_addr, exc)
        wait_until = min(deadline, trio.current_time() + unit * 2**attempt)
        with trio.move_on_at(wait_until):
            while True:
                data, addr = await receive_datagram(sock, _RECV_SIZE, "rendezvous")
                source = normalize_address(addr)
                if source == server_addr:
                    found = parse_response(data, txid)
                    if found is not None:
                        return found
                if on_other is not None:
                    on_other(data, source)
                else:
                    log.debug("rendezvous: dropped %d bytes from %s while discovering", len(data), source)
    return None


async def resolve(sock, server: Address) -> Address:
    """``server`` with its host as a numeric address of the socket's family (names are looked up once)."""
    try:
        return normalize_address(server)
    except ValueError:  # a host name, not a numeric address: looked up below
        pass
    infos = await trio.socket.getaddrinfo(server[0], server[1], sock.family, trio.socket.SOCK_DGRAM)
    if not infos:
        raise OSError(f"no address found for the rendezvous server {server[0]}")
    return normalize_address(infos[0][4])


__all__ = [
    "MAGIC",
    "make_request",
    "parse_request",
    "make_response",
    "parse_response",
    "normalize_address",
    "socket_address",
    "serve_rendezvous",
    "discover_reflexive",
    "resolve",
]
