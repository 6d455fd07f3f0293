"""Link-aware placement (issue 37): which fellows hold a model's stages, and in which order, by the predicted time per
token -- every stage's compute plus every hop of the ring (stage i -> i+1, and the last stage's token back to stage 0)
at the links' measured round trip and throughput -- not by memory alone.

A pure function over the memory placement's inputs (swarm.leader.planning.placement), each fellow's calibrated speed and
the measured links (swarm.leader.fleet.link_matrix, and the hops of rings already serving). It starts from the
link-blind placement (most free memory, ring in fellow id order) and moves away from it only when the prediction is
clearly better (MIN_GAIN_MS and MIN_GAIN_SHARE: calibration and probes are noisy, and a placement that flips on noise
would move stages for nothing):

- the order of the ring (and, for a load of a given number of stages, which fellows) with the least time per token;
- for a load that lets the leader choose the number of stages, a fellow is left out when the ring is faster without
  it *because of its links*: the gain without it must hold with the measured links and not come from compute alone
  (on a LAN every fellow stays, as before: the seed's pool serves as many chats at once as it has stages), and the
  rest must still hold the model. Each such fellow gets a line saying why ("pc-3 left out: 140 ms to pc-1 ...").

A measured round trip carries the two peers' scheduling noise besides the wire. A hop reports the least of its latest
pongs' round trips (swarm.mesh.hop.RTT_WINDOW), which takes most of it off (the latest pong alone read 15 ms on a busy
2-core VM's loopback); what is left, a LAN's jitter, the choices take off too: they weigh each hop as its round trip
less LAN_NOISE_RTT_MS (never less than a LAN hop's, nor more than measured), so a fellow is never left out, nor a ring
reordered, over a difference a LAN's noise could make. The figures the plan shows are the measured ones.

With no link measured between the candidate fellows, or a fellow of the placement that has not reported its speed
yet, the placement is the link-blind one.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

from swarm.errors import PlacementError, ProtocolError
from swarm.leader.planning.placement import FellowCapacity, ModelSize, StagePlan, place_in_order
from swarm.leader.planning.planner import ASSUMED_RTT_MS, Hop, LayerSpeed, hop_round_trips, layer_speed, predict

# A rearrangement must save at least this much per token, and this share of the link-blind time: a LAN hop is
# 0.5-2 ms (measured on loopback through the relay, planner.ASSUMED_RTT_MS), so LAN noise never moves a stage.
MIN_GAIN_MS = 5.0
MIN_GAIN_SHARE = 0.15
# What of a hop's least measured round trip may still be noise rather than the wire: a LAN's is 0.5-2 ms with a few ms
# of jitter. Not more: between homes 5-30 ms is real, and two such hops a token are what link-aware placement weighs.
LAN_NOISE_RTT_MS = 5.0
# Every order of a ring is tried up to this many stages (5! = 120 predictions; weighing which of 6 fellows to leave
# out tries 6 such rings); beyond, the fellows keep the link-blind order and only leaving one out is weighed.
MAX_ORDERED = 5
MAX_SUBSETS = 5000  # sets of fellows tried for a load of a given number of stages, orders included


@dataclasses.dataclass(frozen=True)
class Arrangement:
    plans: list[StagePlan]
    left_out: list[str]  # why each fellow the link-blind placement had is not in the ring
    ms_per_token: float | None = None  # predicted for ``plans`` (None: link-blind, nothing measured)
    link_blind_ms_per_token: float | None = None


def link_hops(links: dict[tuple[int, int], dict]) -> dict[tuple[int, int], Hop]:
    """The link matrix's measured pairs (swarm.leader.fleet.link_matrix.LinkMatrix.links) as hops: round trip, and the
    throughput the probe saw."""
    out = {}
    for pair, figures in links.items():
        rtt, mbps = figures.get("rtt_ms"), figures.get("mbps")
        if isinstance(rtt, (int, float)) and rtt > 0 and math.isfinite(rtt):
            rate = mbps * 1e6 / 8 if isinstance(mbps, (int, float)) and mbps > 0 else None
            out[pair] = Hop(float(rtt), True, figures.get("path"), rate)
    return out


def fellow_speeds(fellows) -> dict[int, LayerSpeed]:
    """Each fellow's calibrated speed (FellowConn.calibration) where it has reported one it can be read from."""
    speeds = {}
    for fellow in fellows:
        try:
            speeds[fellow.id] = layer_speed(fellow.calibration)
        except (ProtocolError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return speeds


class _Ring:
    """The prediction of rings over sets of fellows, memoised."""

    def __init__(self, size: ModelSize, speeds: dict[int, LayerSpeed], hops: dict[tuple[int, int], Hop],
                 hidden_bytes: int, context_tokens: int):
        self.size, self.speeds, self.hops = size, speeds, hops
        self.judged = {pair: judged_hop(hop) for pair, hop in hops.items()}
        self.hidden_bytes, self.context = hidden_bytes, context_tokens

    def cost(self, plans: list[StagePlan], links: str = "judged") -> float:
        """Time per token over ``links``: "judged" (round trips less their noise: what choices weigh), "measured"
        (what the plan says) or "none" (every hop a LAN's: compute alone)."""
        known = {"judged": self.judged, "measured": self.hops, "none": {}}[links]
        hops = hop_round_trips(plans, known)
        return float(predict(plans, self.size, self.speeds, hops, self.hidden_bytes)["ms_per_token"])

    def best(self, fellows: Sequence[FellowCapacity]) -> tuple[list[StagePlan], float] | None:
        """The fastest order of a ring over ``fellows`` that holds the model, and its time per token; None when
        none fits."""
        ordered = sorted(fellows, key=lambda f: f.fellow_id)
        orders = itertools.permutations(ordered) if len(ordered) <= MAX_ORDERED else [tuple(ordered)]
        found: tuple[list[StagePlan], float] | None = None
        for order in orders:
            try:
                plans = place_in_order(self.size, list(order), self.context)
            except PlacementError:
                continue
            cost = self.cost(plans)
            if found is None or cost < found[1] - 1e-9:
                found = (plans, cost)
        return found


def judged_hop(hop: Hop) -> Hop:
    """``hop`` as the choices weigh it: its round trip less LAN_NOISE_RTT_MS, but not under a LAN hop's
    (planner.ASSUMED_RTT_MS) nor over what was measured -- a jittery LAN's 6 ms counts as a LAN's 2 ms, a far
    fellow's 120 ms as 115 ms."""
    return dataclasses.replace(hop, rtt_ms=max(hop.rtt_ms - LAN_NOISE_RTT_MS, min(hop.rtt_ms, ASSUMED_RTT_MS)))


def clearly_faster(new_ms: float, old_ms: float) -> bool:
    return old_ms - new_ms >= max(MIN_GAIN_MS, MIN_GAIN_SHARE * old_ms)


def arrange(size: ModelSize, capacities: Sequence[FellowCapacity], baseline: list[StagePlan],
            speeds: dict[int, LayerSpeed], hops: dict[tuple[int, int], Hop], hidden_bytes: int, context_tokens: int,
            choose_count: bool) -> Arrangement:
    """The ring to load: ``baseline`` (the link-blind placement over ``capacities``) or a faster one. ``hops``:
    (fellow id, fellow id) -> measured Hop, either way round; ``choose_count``: the load left the number of stages to
    the leader, so a fellow may be left out for its links; else the ring keeps len(baseline) stages."""
    if len(baseline) < 2 and not choose_count:
        return Arrangement(baseline, [])
    candidates = [c for c in capacities if c.fellow_id in speeds]
    ids = {c.fellow_id for c in candidates}
    if any(p.fellow_id not in ids for p in baseline) or not any(a in ids and b in ids and a != b for a, b in hops):
        return Arrangement(baseline, [])  # a speed or every link not measured yet: as before
    ring = _Ring(size, speeds, hops, hidden_bytes, context_tokens)
    blind_ms = ring.cost(baseline)
    names = {c.fellow_id: c.name for c in candidates}
    by_id = {c.fellow_id: c for c in candidates}
    kept = [by_id[p.fellow_id] for p in baseline]
    left_out: list[str] = []
    if choose_count:
        best = ring.best(kept)
        while best is not None and len(kept) > 1:
            plans, ms = best
            drop = None
            for fellow in kept:
                rest = [f for f in kept if f is not fellow]
                without = ring.best(rest)
                if without is None:
                    continue
                gain = ms - without[1]
                link_gain = gain - max(ring.cost(plans, "none") - ring.cost(without[0], "none"), 0.0)
                if clearly_faster(without[1], ms) and link_gain >= max(MIN_GAIN_MS, MIN_GAIN_SHARE * ms) and \
                        (drop is None or without[1] < drop[1][1]):
                    drop = (fellow, without)
            if drop is None:
                break
            fellow, without = drop
            left_out.append(_why(fellow, plans, hops, names, ring.cost(plans, "measured"),
                                 ring.cost(without[0], "measured")))
            kept = [f for f in kept if f is not fellow]
            best = without
    else:
        k = len(baseline)
        sets = math.comb(len(candidates), k) * math.factorial(min(k, MAX_ORDERED + 1))
        choices = itertools.combinations(candidates, k) if sets <= MAX_SUBSETS else [tuple(kept)]
        best = None
        for subset in choices:
            found = ring.best(subset)
            if found is not None and (best is None or found[1] < best[1] - 1e-9):
                best = found
        if best is not None:
            chosen = {p.fellow_id for p in best[0]}
            left_out = [_why(by_id[p.fellow_id], baseline, hops, names, ring.cost(baseline, "measured"),
                             ring.cost(best[0], "measured")) for p in baseline if p.fellow_id not in chosen]
    measured_blind_ms = ring.cost(baseline, "measured")
    if best is None or not clearly_faster(best[1], blind_ms):
        return Arrangement(baseline, [], measured_blind_ms, measured_blind_ms)
    return Arrangement(best[0], left_out, ring.cost(best[0], "measured"), measured_blind_ms)


def _why(fellow: FellowCapacity, plans: list[StagePlan], hops: dict[tuple[int, int], Hop], names: dict[int, str],
         with_ms: float, without_ms: float) -> str:
    """'pc-3 left out: 140 ms to pc-1 (a token takes 190 ms with it, 52 ms without)': its slowest measured link to
    the others of the ring it was in."""
    others = [p.fellow_id for p in plans if p.fellow_id != fellow.fellow_id]
    worst = max(((hop.rtt_ms, other) for other in others
                 for hop in (hops.get((fellow.fellow_id, other)), hops.get((other, fellow.fellow_id)))
                 if hop is not None), key=lambda t: (t[0], -t[1]), default=None)  # a tie: the first fellow
    link = f"{worst[0]:.0f} ms to {names.get(worst[1], worst[1])}" if worst else "its links are slow"
    return (f"{fellow.name} left out: {link} (a token takes {with_ms:.0f} ms with it, {without_ms:.0f} ms "
            "without)")
