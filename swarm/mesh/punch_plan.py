"""How one end of a hop punches: the candidates it announces, the low IP TTL of its first probes, and what failed
attempts of the hop taught it (used by the fellow's side of Direct links and by the network lab).

The first probes go out with a small IP TTL: enough to leave every NAT of ours, too little to reach the far NAT and
make it remap (see :mod:`swarm.mesh.hole_punch`). The TTL is traced per attempt (:mod:`swarm.mesh.nat_trace`);
where it cannot be, it is guessed and the guess raised after a failure. After a failure the low-TTL phase also lasts
longer, in case the two ends did not start together.
"""

from __future__ import annotations

import dataclasses

import trio

from swarm.mesh import hole_punch, nat_trace, rendezvous

MAX_LOW_TTL_ROUNDS = 6


@dataclasses.dataclass
class Learned:
    """What the earlier attempts of one hop taught this end."""

    failures: int = 0


@dataclasses.dataclass(frozen=True)
class Plan:
    """How this end punches: candidates to announce, and the low-TTL phase of its probes."""

    candidates: list[list]
    reflexive: tuple[str, int] | None
    low_ttl: int
    low_ttl_rounds: int
    note: str


async def plan_punch(sock, server: tuple[str, int], who: bytes, lan_ip: str, learned: Learned) -> Plan:
    """From the bound UDP socket ``sock``: its public address (rendezvous with ``server``), the TTL that leaves this
    end's NATs (traced), and what earlier failures of the hop (``learned``) change. Used by the fellow and the lab."""
    port = sock.getsockname()[1]
    candidates = [[lan_ip, port]]
    asked = trio.current_time()
    public = await rendezvous.discover_reflexive(sock, server, who)
    # Every router on the way answers a trace sooner than the leader answered that: wait twice as long at most.
    wait = min(nat_trace.TRACE_TIMEOUT_S, max(0.1, 2 * (trio.current_time() - asked)))
    if public is not None and list(public) not in candidates:
        candidates.append(list(public))
    server_addr = await rendezvous.resolve(sock, server)
    trace = await nat_trace.trace(sock, server_addr, public[0] if public else None, timeout=wait)
    if trace.low_ttl is not None:
        low_ttl, note = trace.low_ttl, trace.how
    else:
        low_ttl = nat_trace.FALLBACK_TTL + min(learned.failures, 1)
        note = f"guessed, since the path could not be traced ({trace.how})"
    rounds = min(MAX_LOW_TTL_ROUNDS, hole_punch.LOW_TTL_ROUNDS * (1 + learned.failures))
    return Plan(candidates, public, low_ttl, rounds, note)


def next_attempt(learned: Learned) -> str:
    """Record a failed punch and say what the next attempt does differently, and what the user can do."""
    learned.failures += 1
    rounds = min(MAX_LOW_TTL_ROUNDS, hole_punch.LOW_TTL_ROUNDS * (1 + learned.failures))
    return (f" The next attempt traces the path again and sends {rounds} low-TTL rounds, in case the two ends did "
            "not start together; if it keeps failing, one of the NATs changes the port per destination or drops "
            "UDP (Direct links need one that keeps a port per socket: 'endpoint-independent mapping').")


__all__ = ["MAX_LOW_TTL_ROUNDS", "Learned", "Plan", "next_attempt", "plan_punch"]
