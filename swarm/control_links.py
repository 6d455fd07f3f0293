"""The control link's messages about the links between fellows (typed records checked on decode, swarm.wire):
measuring them (swarm.leader.fleet.link_matrix, swarm.fellow.link_probe) and punching Direct links through NATs
(swarm.leader.fleet.direct_links, swarm.fellow.direct_links)."""

from __future__ import annotations

import dataclasses
from typing import Any

from swarm.wire import message, record

# --- link probes ------------------------------------------------------------------------------------------------------


@record
class ProbePeer:
    """A peer to measure the link to: directly at ``direct`` ([host, port]), else over the relay channel ``relay``."""

    fellow_id: int
    name: str
    key: bytes
    probe_id: str
    direct: list[Any] | None = None
    relay: str | None = None


@record
class ProbeListen:
    """A relay channel a peer will probe this fellow over: echo what comes from ``key``."""

    hop_id: str
    key: bytes


@message("probe_links")
class ProbeLinks:
    peers: list[ProbePeer] = dataclasses.field(default_factory=list)
    listen: list[ProbeListen] = dataclasses.field(default_factory=list)


@record
class LinkFigures:
    """What a fellow measured of its link to one peer."""

    fellow_id: int
    path: str  # "direct" or "relay"
    rtt_ms: float | None = None
    mbps: float | None = None
    connect_ms: float | None = None
    error: str | None = None  # why nothing was measured
    note: str | None = None  # why not direct


@message("link_report")
class LinkReport:
    links: list[LinkFigures] = dataclasses.field(default_factory=list)


# --- punching a Direct link (``role``: "a" sends on the hop, "b" receives) -------------------------------------------


@message("punch_ping")
class PunchPing:
    hop_id: str
    role: str


@message("punch_pong")
class PunchPong:
    hop_id: str
    role: str


@message("punch_prepare")
class PunchPrepare:
    model: str
    hop_id: str
    role: str
    who: str  # what the fellow names itself by to the leader's rendezvous
    rendezvous_port: int


@message("punch_candidates")
class PunchCandidates:
    model: str
    hop_id: str
    role: str
    skip: str | None = None  # why this hop needs no punch (its path already), or cannot have one
    candidates: list[list[Any]] = dataclasses.field(default_factory=list)  # [host, port] to try
    reflexive: bool = False


@message("punch_start")
class PunchStart:
    model: str
    hop_id: str
    role: str
    secret: bytes
    peer_candidates: list[list[Any]]
    start_in_s: float


@message("punch_result")
class PunchResult:
    model: str
    hop_id: str
    role: str
    ok: bool
    message: str | None = None
    peer: list[Any] | None = None


PunchAnswer = PunchPong | PunchCandidates | PunchResult  # what the fellows answer the leader's punch messages with
