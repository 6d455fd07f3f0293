"""UDP hole punching between two fellows behind NATs: a sans-IO session and a trio driver.

Both fellows learn from the leader the other's candidate addresses (LAN and reflexive, see
:mod:`swarm.mesh.rendezvous`), a shared secret for this punch, and a common start time. From that time each sends
authenticated probes to every candidate — the first ones opening its own NAT's mapping, so that the peer's probes
get in — and answers every valid probe with an ack. As in ICE (RFC 8445 §7.2.5.2.1) a check only succeeds when the
ack comes back *from the address the probe went to*, which proves both directions of that address pair.

Fellow "a" is the controlling side (RFC 8445 §6.1.3.1): on its first successful check it locks onto that address
and sends a few "confirm" packets there; fellow "b" locks onto the address the first valid confirm came from. Both
then agree on one pair of addresses even when several work (same LAN and hairpin, say) — the QUIC layer on top
accepts datagrams from one address only.

Packets (47 bytes, big-endian)::

    b"SWPN" | version u8 = 1 | kind u8 (1 probe, 2 ack, 3 confirm) | sender role u8 (b"a"/b"b")
            | nonce 12 bytes | echo 12 bytes | tag 16 bytes

``echo`` is zero in a probe, the probe's nonce in an ack, the ack's nonce in a confirm. ``tag`` is
HMAC-SHA256(secret, everything before the tag)[:16], so a stranger who lacks the leader-issued secret can neither
forge a packet nor make us lock onto its address; a replayed packet fails the echo check at the wrong address.
Packets with our own role (our probe reflected back by a hairpinning NAT) are ignored.

A valid probe from an address that is not a candidate is taken as a *peer-reflexive* candidate (RFC 8445 §7.3.1.3)
unless ``peer_reflexive=False``: a Linux masquerading NAT picks a new external port for the peer when our first
probe left a conntrack entry on its old one, and then the peer's packets come from an address nobody announced.

Schedule, after Tailscale's disco and libp2p's DCUtR: a round of probes to every candidate at the start time, then a
round every 50–100 ms (jitter keeps two fellows from sending in lock-step into each other's still-closed NATs) for
3 s, then rounds at doubling gaps up to 1 s until the timeout. Optionally the first rounds go out with a small IP
TTL (HyperDHT's trick): they open our own NAT's mapping but die before the far NAT, so that NAT does not see an
unsolicited packet that it might answer with a port change or an ICMP error. The TTL that does so depends on the
path; :mod:`swarm.mesh.nat_trace` learns it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import random
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import trio

from swarm.errors import ProtocolError, TunnelError
from swarm.mesh.udp import Address, normalize_address, receive_datagram, socket_address

log = logging.getLogger(__name__)

MAGIC = b"SWPN"
VERSION = 1
PROBE, ACK, CONFIRM = 1, 2, 3
_KIND_NAMES = {PROBE: "probe", ACK: "ack", CONFIRM: "confirm"}
NONCE_SIZE = 12
TAG_SIZE = 16  # 128-bit truncated HMAC (RFC 2104 §5 allows truncation to half the hash and not below 80 bits)
_HEAD = struct.Struct(">4sBBc12s12s")
PACKET_SIZE = _HEAD.size + TAG_SIZE
_NO_ECHO = bytes(NONCE_SIZE)

DEFAULT_TIMEOUT_S = 8.0
# Tailscale's disco pings every 5 s once a path is up but probes much faster while a path is being found; DCUtR
# (libp2p) sends its hole-punch burst at ~10 ms spacing. 50–100 ms keeps about 10 probes per candidate per second.
FAST_GAP_S = (0.05, 0.10)
FAST_PHASE_S = 3.0
SLOW_FIRST_GAP_S = 0.2
SLOW_MAX_GAP_S = 1.0
LOW_TTL_ROUNDS = 2
# Copies of the confirm, spaced so one lost packet (or a burst loss) does not leave "b" waiting.
CONFIRM_COPIES = 3
CONFIRM_GAP_S = 0.02
# Bounds on state a flood of valid-looking traffic could grow: nonces remembered, peer-reflexive addresses added.
_MAX_REMEMBERED = 2048
_MAX_PEER_REFLEXIVE = 8


class PunchFailed(TunnelError):
    """Hole punching found no direct UDP path to the peer; use the relay."""


@dataclass(frozen=True)
class Send:
    """A datagram the session wants sent: ``data`` to ``addr``, with IP TTL ``ttl`` (None: the socket's default)."""

    addr: Address
    data: bytes
    ttl: int | None = None


def make_packet(secret: bytes, kind: int, role: str, nonce: bytes, echo: bytes = _NO_ECHO) -> bytes:
    body = _HEAD.pack(MAGIC, VERSION, kind, role.encode(), nonce, echo)
    return body + hmac.new(secret, body, hashlib.sha256).digest()[:TAG_SIZE]


def parse_packet(secret: bytes, data: bytes) -> tuple[int, str, bytes, bytes] | None:
    """(kind, sender role, nonce, echo) of an authentic packet, else None; never raises on garbage."""
    if len(data) != PACKET_SIZE or data[:4] != MAGIC:
        return None
    magic, version, kind, role, nonce, echo = _HEAD.unpack_from(data)
    if version != VERSION or kind not in _KIND_NAMES or role not in (b"a", b"b"):
        return None
    body = data[: _HEAD.size]
    if not hmac.compare_digest(hmac.new(secret, body, hashlib.sha256).digest()[:TAG_SIZE], data[_HEAD.size :]):
        return None
    return kind, role.decode(), nonce, echo


class PunchSession:
    """The state of one hole punch, without I/O: feed it the time and datagrams, send what it returns.

    Call :meth:`on_timer` at :meth:`next_deadline` (and any time after a datagram), :meth:`on_datagram` for every
    datagram that arrives. Stop when :attr:`done` (then :attr:`locked` is the peer's address) or :attr:`failed`.
    """

    def __init__(
        self,
        candidates: Iterable[Address],
        secret: bytes,
        role: str,
        start_at: float,
        timeout: float = DEFAULT_TIMEOUT_S,
        low_ttl: int | None = None,
        *,
        peer_reflexive: bool = True,
        low_ttl_rounds: int = LOW_TTL_ROUNDS,
        ttl_note: str = "",
        rng: random.Random | None = None,
    ):
        # What the leader's punch_start said (swarm.control_links.PunchStart): a malformed one is its protocol error.
        if role not in ("a", "b"):
            raise ProtocolError(f'role must be "a" or "b", not {role!r}')
        if not secret:
            raise ProtocolError("a punch needs the secret the leader issued for it")
        try:
            self.candidates: list[Address] = list(dict.fromkeys(normalize_address(c) for c in candidates))
        except (ValueError, TypeError) as exc:
            raise ProtocolError(f"a candidate address of the peer is malformed: {exc}") from None
        if not self.candidates:
            raise ProtocolError("a punch needs at least one candidate address of the peer")
        self.peer_reflexive_candidates: list[Address] = []
        self.secret = secret
        self.role = role
        self.peer_role = "b" if role == "a" else "a"
        self.start_at = start_at
        self.give_up_at = start_at + timeout
        self.timeout = timeout
        self.low_ttl = low_ttl
        self.low_ttl_rounds = low_ttl_rounds if low_ttl is not None else 0
        self.ttl_note = ttl_note  # how the low TTL was chosen, for the failure message
        self.peer_reflexive = peer_reflexive
        self._rng = rng or random.Random()
        self._round = 0
        self._next_round_at = start_at
        self._slow_gap = SLOW_FIRST_GAP_S
        # nonce -> address it was sent to: probes ("a" checks acks against them), acks ("b" checks confirms).
        self._probes_sent: OrderedDict[bytes, Address] = OrderedDict()
        self._acks_sent: OrderedDict[bytes, Address] = OrderedDict()
        self.locked: Address | None = None
        self._confirm_echo = b""
        self._confirms_left = 0
        self._next_confirm_at = float("inf")
        self.done = False
        self.failed = False
        # What happened, for the failure message.
        self.probes_sent = 0
        self.heard_from: set[Address] = set()  # valid packets of any kind came from here
        self.acked_by: set[Address] = set()  # our checks succeeded here

    # --- inputs ----------------------------------------------------------------------------------------------------

    def next_deadline(self) -> float:
        """When :meth:`on_timer` must be called next."""
        if self.done or self.failed:
            return float("inf")
        if self.locked is not None:
            return self._next_confirm_at
        return min(self._next_round_at, self.give_up_at)

    def on_timer(self, now: float) -> list[Send]:
        out: list[Send] = []
        if self.done or self.failed:
            return out
        if self.locked is not None:  # "a" sending its confirms
            while self._confirms_left and now >= self._next_confirm_at:
                out.append(Send(self.locked, self._packet(CONFIRM, echo=self._confirm_echo)))
                self._confirms_left -= 1
                self._next_confirm_at += CONFIRM_GAP_S
            if not self._confirms_left:
                self.done = True
                self._next_confirm_at = float("inf")
            return out
        if now >= self.give_up_at:
            self.failed = True
            return out
        if now >= self._next_round_at:
            ttl = self.low_ttl if self._round < self.low_ttl_rounds else None
            for addr in self.candidates + self.peer_reflexive_candidates:
                out.append(self._probe(addr, ttl))
            self._round += 1
            self._next_round_at = now + self._gap(now)
        return out

    def on_datagram(self, data: bytes, addr: Address, now: float) -> list[Send]:
        """Handle one datagram from ``addr`` (normalized (host, port)); returns what to send in reply."""
        if self.done or self.failed:
            return []
        known = addr in self.candidates or addr in self.peer_reflexive_candidates
        if not known and not self.peer_reflexive:
            log.debug("punch: ignored a datagram from %s, which is not a candidate", addr)
            return []
        packet = parse_packet(self.secret, data)
        if packet is None:
            log.debug("punch: ignored %d bytes from %s: not a punch packet of this hop (bad tag?)", len(data), addr)
            return []
        kind, role, nonce, echo = packet
        if role != self.peer_role:
            log.debug("punch: ignored our own %s reflected back from %s", _KIND_NAMES[kind], addr)
            return []
        out: list[Send] = []
        if kind == PROBE:
            if not known:
                if len(self.peer_reflexive_candidates) >= _MAX_PEER_REFLEXIVE:
                    return []
                log.debug("punch: %s is a peer-reflexive candidate (the peer's NAT mapped it anew)", addr)
                self.peer_reflexive_candidates.append(addr)
            self.heard_from.add(addr)
            ack_nonce = os.urandom(NONCE_SIZE)
            _remember(self._acks_sent, ack_nonce, addr)
            out.append(Send(addr, self._packet(ACK, nonce=ack_nonce, echo=nonce)))
            if self.role == "a" and self.locked is None:
                # A triggered check (RFC 8445 §7.3.1.4): the path from the peer is open now, so test ours at once
                # instead of waiting for the next round.
                out.append(self._probe(addr, None))
        elif kind == ACK:
            if self._probes_sent.get(echo) != addr:
                log.debug("punch: ignored an ack from %s that answers no probe we sent there", addr)
                return out
            self.heard_from.add(addr)
            self.acked_by.add(addr)
            if self.role == "a" and self.locked is None:
                self.locked = addr
                self._confirm_echo = nonce
                self._confirms_left = CONFIRM_COPIES
                self._next_confirm_at = now
                out.extend(self.on_timer(now))
        elif kind == CONFIRM:
            if self.role != "b":
                return out
            if self._acks_sent.get(echo) != addr:
                log.debug("punch: ignored a confirm from %s that answers no ack we sent there", addr)
                return out
            self.heard_from.add(addr)
            self.locked = addr
            self.done = True
        return out

    # --- outputs ---------------------------------------------------------------------------------------------------

    def failure_message(self) -> str:
        tried = ", ".join(f"{h}:{p}" for h, p in self.candidates + self.peer_reflexive_candidates)
        note = f": {self.ttl_note}" if self.ttl_note else ""
        ttl = (f" (the first {self.low_ttl_rounds} rounds with IP TTL {self.low_ttl}{note})"
               if self.low_ttl_rounds else "")
        if not self.heard_from:
            heard = "heard nothing from the peer: its NAT or firewall drops our packets, or it never started"
        elif not self.acked_by:
            heard = (
                "heard the peer's probes from " + ", ".join(f"{h}:{p}" for h, p in sorted(self.heard_from))
                + " but it never answered ours: the path works in one direction only"
            )
        else:
            heard = "the peer answered our probes but never confirmed a path (its confirm packets were lost)"
        return (
            f"no direct UDP path to the peer after {self.timeout:g} s: sent {self.probes_sent} probes to {tried}"
            f"{ttl}; {heard}. The hop will use the leader's relay."
        )

    def _gap(self, now: float) -> float:
        if now - self.start_at < FAST_PHASE_S:
            return self._rng.uniform(*FAST_GAP_S)
        gap = self._slow_gap
        self._slow_gap = min(SLOW_MAX_GAP_S, self._slow_gap * 2)
        return gap

    def _probe(self, addr: Address, ttl: int | None) -> Send:
        nonce = os.urandom(NONCE_SIZE)
        _remember(self._probes_sent, nonce, addr)
        self.probes_sent += 1
        return Send(addr, self._packet(PROBE, nonce=nonce), ttl)

    def _packet(self, kind: int, *, nonce: bytes | None = None, echo: bytes = _NO_ECHO) -> bytes:
        return make_packet(self.secret, kind, self.role, nonce or os.urandom(NONCE_SIZE), echo)


def _remember(table: OrderedDict, key: bytes, value: Address) -> None:
    table[key] = value
    while len(table) > _MAX_REMEMBERED:
        table.popitem(last=False)


# --- trio driver -----------------------------------------------------------------------------------------------------


async def punch(
    sock,
    candidates: Iterable[Address],
    secret: bytes,
    role: str,
    start_at: float,
    timeout: float = DEFAULT_TIMEOUT_S,
    low_ttl: int | None = None,
    *,
    peer_reflexive: bool = True,
    low_ttl_rounds: int = LOW_TTL_ROUNDS,
    ttl_note: str = "",
    on_other: Callable[[bytes, Address], None] | None = None,
) -> Address:
    """Punch a hole to the peer from the bound UDP socket ``sock``; returns the peer's (host, port) to use.

    ``start_at`` is a :func:`trio.current_time` value (the leader's common start time turned into local clock);
    ``role`` is "a" on one fellow and "b" on the other. Datagrams that are not punch packets (a late rendezvous
    answer, say) go to ``on_other(data, addr)``. Raises :class:`PunchFailed` when no path is found within
    ``timeout`` seconds of ``start_at``.
    """
    session = PunchSession(candidates, secret, role, start_at, timeout, low_ttl, peer_reflexive=peer_reflexive,
                           low_ttl_rounds=low_ttl_rounds, ttl_note=ttl_note)
    await trio.sleep_until(start_at)
    while True:
        for send in session.on_timer(trio.current_time()):
            await _send(sock, send)
        if session.done:
            assert session.locked is not None
            log.debug("punch: locked onto %s:%s as %s", *session.locked, role)
            return session.locked
        if session.failed:
            raise PunchFailed(session.failure_message())
        with trio.move_on_at(session.next_deadline()):
            data, raw_addr = await receive_datagram(sock, 2048, "punch")
            addr = normalize_address(raw_addr)
            if data[:4] != MAGIC:
                if on_other is not None:
                    on_other(data, addr)
                else:
                    log.debug("punch: ignored %d bytes from %s: not a punch packet", len(data), addr)
                continue
            for send in session.on_datagram(data, addr, trio.current_time()):
                await _send(sock, send)


async def _send(sock, send: Send) -> None:
    target = socket_address(sock, send.addr)
    try:
        if send.ttl is None:
            await sock.sendto(send.data, target)
            return
        level, option = _ttl_option(sock)
        default = sock.getsockopt(level, option)
        sock.setsockopt(level, option, send.ttl)
        try:
            await sock.sendto(send.data, target)
        finally:
            sock.setsockopt(level, option, default)
    except OSError as exc:
        # An unreachable candidate (no route to a LAN address from another network) must not end the punch.
        log.debug("punch: could not send to %s:%s: %s", *send.addr, exc)


def _ttl_option(sock) -> tuple[int, int]:
    if sock.family == trio.socket.AF_INET6:
        return trio.socket.IPPROTO_IPV6, trio.socket.IPV6_UNICAST_HOPS
    return trio.socket.IPPROTO_IP, trio.socket.IP_TTL


__all__ = ["PunchFailed", "PunchSession", "Send", "punch", "make_packet", "parse_packet", "MAGIC"]
