"""Live moves (issue 37): when the pool changes -- a faster fellow joins, a fellow becomes idle, links are measured
anew -- the leader looks for stages of a serving model that an idle fellow would run clearly faster, counting the
ring's hops at the measured links (swarm.leader.planning.link_placement). A move the planner predicts at least
MIN_SPEEDUP faster is proposed on the admin API (GET /api/v1/rebalance); with SWARM_SERVE_REBALANCE=auto the leader
applies it through the drain's path (swarm.leader.serving.drain): the taker loads the stage beside the old one, the ring
switches at a token boundary, the old stage unloads, and requests in flight go on. SWARM_SERVE_REBALANCE=off looks for
none.

A move keeps each stage's layers and hands a whole stage to one idle fellow with room for it, as a drain does. A
re-layout changes the number of stages or the split of the layers: the planner's best layout for the pool now
(swarm.leader.planning.relayout), proposed when it is at least MIN_SPEEDUP faster than the ring and faster than the
best moves, and when its stages can load beside the old ones -- on idle fellows, or kept or narrowed in place by the
ring's fellows (else the proposal says why it is left out); it is applied by swarm.leader.serving.relayout (load
beside, switch at a token boundary, narrow the kept stages that narrow, unload the old stages). A model served with a
draft model is re-laid out as a load places it: the new last stage holds the draft model too.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection
from typing import TYPE_CHECKING

import trio

from swarm.leader.planning.link_placement import clearly_faster, fellow_speeds
from swarm.leader.planning.placement import DraftSize, FellowCapacity, ModelSize, StagePlan
from swarm.leader.planning.planner import Hop, LayerSpeed, hop_round_trips, predict
from swarm.leader.planning.relayout import best_layout, describe, same_split
from swarm.leader.serving.drain import Handover
from swarm.leader.serving.relayout import Relayouts, served_context

if TYPE_CHECKING:
    from swarm.leader.serving.serving import Serving

log = logging.getLogger(__name__)

MIN_SPEEDUP = 1.3  # the bar: a move costs a load and a switch, so only a clearly faster ring is worth one
SETTLE_S = 5.0  # after a change, wait this long for the links to be probed (link_matrix.JOIN_SETTLE_S + a probe)


@dataclasses.dataclass(frozen=True)
class Move:
    index: int
    from_id: int
    from_name: str
    to_id: int
    to_name: str


@dataclasses.dataclass(frozen=True)
class Proposal:
    model: str
    moves: list[Move]
    ms_per_token: float  # predicted now
    proposed_ms_per_token: float
    # a re-layout: the new ring's stages (``moves`` is then empty), and the ring it replaces
    layout: list[StagePlan] | None = None
    current: list[StagePlan] | None = None
    left_out: list[str] = dataclasses.field(default_factory=list)  # faster layouts that cannot load beside, and why

    @property
    def speedup(self) -> float:
        return self.ms_per_token / self.proposed_ms_per_token

    def text(self) -> str:
        if self.layout is not None and self.current is not None:
            what = f"re-lay out {describe(self.current, self.layout)}"
        else:
            what = "move " + ", ".join(f"stage {m.index} from {m.from_name} to {m.to_name}" for m in self.moves)
        return (f"{self.model}: {what}: about {self.speedup:.1f}x faster ({self.ms_per_token:.0f} -> "
                f"{self.proposed_ms_per_token:.0f} ms a token)")

    def view(self) -> dict:
        layout = None if self.layout is None else [
            {"index": p.index, "fellow_id": p.fellow_id, "fellow": p.fellow_name,
             "layers": [p.first_layer, p.end_layer]} for p in self.layout]
        return {"model": self.model, "kind": "move" if self.layout is None else "relayout",
                "moves": [dataclasses.asdict(m) for m in self.moves], "layout": layout,
                "ms_per_token": self.ms_per_token, "proposed_ms_per_token": self.proposed_ms_per_token,
                "speedup": self.speedup, "text": self.text(), "left_out": self.left_out}


def propose(model: str, plans: list[StagePlan], size: ModelSize, idle: list[FellowCapacity],
            speeds: dict[int, LayerSpeed], hops: dict[tuple[int, int], Hop], hidden_bytes: int) -> Proposal | None:
    """The moves of whole stages of ``plans`` to ``idle`` fellows (each with room for the stage it takes) that make
    the ring at least MIN_SPEEDUP faster by the prediction, greedily one stage at a time; None when there is none or
    a fellow's speed is unknown."""
    if any(p.fellow_id not in speeds for p in plans):
        return None

    def cost(ring: list[StagePlan]) -> float:
        return float(predict(ring, size, speeds, hop_round_trips(ring, hops), hidden_bytes)["ms_per_token"])

    now = best = cost(plans)
    ring, free = list(plans), [f for f in idle if f.fellow_id in speeds]
    moves: list[Move] = []
    while free:
        options = [(cost(tried), i, fellow, tried) for i, plan in enumerate(ring) for fellow in free
                   if fellow.free_bytes >= plan.need_bytes
                   for tried in [ring[:i] + [dataclasses.replace(plan, fellow_id=fellow.fellow_id,
                                                                 fellow_name=fellow.name)] + ring[i + 1:]]]
        if not options:
            break
        ms, i, fellow, tried = min(options, key=lambda o: (o[0], o[1], o[2].fellow_id))
        if ms >= best - 1e-9:
            break
        moves = [m for m in moves if m.index != i] + [Move(i, plans[i].fellow_id, plans[i].fellow_name,
                                                           fellow.fellow_id, fellow.name)]
        free = [f for f in free if f is not fellow]
        ring, best = tried, ms
    moves = [m for m in moves if m.from_id != m.to_id]
    if not moves or now < MIN_SPEEDUP * best:
        return None
    return Proposal(model, sorted(moves, key=lambda m: m.index), now, best)


def propose_layout(model: str, plans: list[StagePlan], size: ModelSize, idle: list[FellowCapacity],
                   held_free: dict[int, int], speeds: dict[int, LayerSpeed], hops: dict[tuple[int, int], Hop],
                   hidden_bytes: int, context_tokens: int, moves: Proposal | None, draft: DraftSize | None = None,
                   drafts: set[int] | None = None, narrowing: Collection[int] = (),
                   extending: Collection[int] = ()) -> tuple[Proposal | None, list[str]]:
    """The better of ``moves`` (:func:`propose`'s) and a re-layout of ``plans``: the planner's fastest layout for the
    pool that loads beside the ring (swarm.leader.planning.relayout), when it splits the layers otherwise, is at least
    MIN_SPEEDUP faster than the ring and clearly faster than the moves (a re-layout loads more than a move does, so
    noise must not tip it: link_placement.clearly_faster). ``held_free``: the free memory of each fellow of the
    ring now; ``draft``: the draft model its last stage holds, which a layout over several stages places there too,
    on a fellow of ``drafts`` (those that run draft models; None: all); ``narrowing``/``extending``: the ring's
    fellows that can narrow / extend their stage in place. -> (the proposal or None, why faster layouts
    are left out: told with the proposal, or alone)."""
    if any(p.fellow_id not in speeds for p in plans):
        return moves, []
    now = float(predict(plans, size, speeds, hop_round_trips(plans, hops), hidden_bytes)["ms_per_token"])
    bar = now / MIN_SPEEDUP if moves is None else min(now / MIN_SPEEDUP, moves.proposed_ms_per_token)
    layout = best_layout(size, plans, [f for f in idle if f.fellow_id in speeds], held_free, speeds, hops,
                         hidden_bytes, context_tokens, worth_ms=bar, draft=draft, drafts=drafts,
                         narrowing=narrowing, extending=extending)
    if layout.plans is not None and layout.ms_per_token is not None and not same_split(layout.plans, plans) and \
            layout.ms_per_token <= bar + 1e-9 and \
            (moves is None or clearly_faster(layout.ms_per_token, moves.proposed_ms_per_token)):
        return Proposal(model, [], now, layout.ms_per_token, layout.plans, plans, layout.left_out), []
    if moves is not None:
        return dataclasses.replace(moves, left_out=layout.left_out), []
    return None, layout.left_out


class Rebalancer:
    """The leader's live moves: proposals on request, and with SWARM_SERVE_REBALANCE=auto applied after each change
    of the pool."""

    def __init__(self, serving: Serving):
        self.serving = serving
        self._wake = trio.Event()
        self.relayouts = Relayouts(serving)
        self.left_out: dict[str, list[str]] = {}  # model -> faster layouts left out, where nothing is proposed

    def pool_changed(self) -> None:
        self._wake.set()

    def proposals(self) -> list[Proposal]:
        serving = self.serving
        if serving.settings.serve_rebalance == "off" or serving.hub is None:
            return []
        hops = serving.link_matrix.hops()
        out = []
        self.left_out = {}
        for model in list(serving.models.values()):
            if model.status != "ready" or model.size is None or model.relayout:
                continue
            busy = {s.plan.fellow_id for m in serving.models.values() for s in [*m.stages, *m.relayout]} | \
                {s.cover for m in serving.models.values() for s in m.stages if s.cover is not None}
            idle = [c for c in serving.recovery.candidates(model)
                    if c.fellow_id not in busy and not c.outdated and not c.standby  # standbys wait for failovers
                    and c.fellow_id not in serving.drains.leaving]
            fellows = [serving.hub.online[c.fellow_id] for c in idle] + \
                [serving.hub.online[p] for p in model.fellow_ids if p in serving.hub.online]
            hidden = int(model.manifest.get("hidden_size") or 0) * (2 if all(f.hardware.gpus for f in fellows) else 4)
            plans, speeds = [s.plan for s in model.stages], fellow_speeds(fellows)
            capacities = [FellowCapacity(c.fellow_id, c.name, c.free_bytes) for c in idle]
            found = propose(model.name, plans, model.size, capacities, speeds, hops, hidden)
            held_free = {c.fellow_id: c.free_bytes for c in serving.recovery.candidates(model)
                         if c.fellow_id in model.fellow_ids}
            device = serving.settings.device
            runs = [c for c in capacities if model.quantization == "none"  # the new stages load at its kind
                    or model.quantization in (serving.hub.online[c.fellow_id].hardware.quantization_kinds(device)
                                              or [])]
            # a draft model (SWARM_SERVE_DRAFT_MODEL) goes to the new last stage, as a load places it
            draft = DraftSize(plans[-1].draft_bytes, plans[-1].draft_kv_per_token) if model.draft is not None \
                else None
            drafts = {i for i, conn in serving.hub.online.items() if conn.draft_model}
            narrowing = {p for p in model.fellow_ids if p in serving.hub.online and serving.hub.online[p].narrowing}
            extending = {p for p in model.fellow_ids if p in serving.hub.online and serving.hub.online[p].extending}
            found, left_out = propose_layout(model.name, plans, model.size, runs, held_free, speeds, hops, hidden,
                                             served_context(model, serving.settings), found, draft, drafts, narrowing,
                                             extending)
            if left_out:
                self.left_out[model.name] = left_out
            if found is not None:
                out.append(found)
        return out

    async def apply(self, proposal: Proposal) -> str:
        """Each move through the drain's handover (load beside, switch at a token boundary, unload the old stage)."""
        serving = self.serving
        if proposal.layout is not None and proposal.current is not None:
            model = serving.models.get(proposal.model)
            if model is None or [s.plan for s in model.stages] != proposal.current:
                return f"{proposal.model}: the ring changed meanwhile; nothing was re-laid out"
            text = await self.relayouts.apply(model, proposal.layout)
            log.info("re-layout: %s", text)
            return text
        done = []
        for move in proposal.moves:
            model = serving.models.get(proposal.model)
            old = serving.hub.online.get(move.from_id) if serving.hub else None
            slot = model.slot_of(move.from_id) if model is not None else None
            if model is None or old is None or slot is None or slot.plan.index != move.index:
                done.append(f"stage {move.index}: the ring changed meanwhile")
                continue
            why = await serving.drains.move(model, slot, Handover(model.name, move.index, move.to_id, move.to_name,
                                                                  False), old)
            done.append(why or f"stage {move.index} moved from {move.from_name} to {move.to_name}")
        text = f"{proposal.model}: " + "; ".join(done)
        log.info("live move: %s", text)
        return text

    async def run(self) -> None:
        """SWARM_SERVE_REBALANCE=auto: after each change of the pool (and its links' probe), apply what is proposed."""
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            await trio.sleep(SETTLE_S)
            if self.serving.settings.serve_rebalance != "auto":
                continue
            for proposal in self.proposals():
                log.info("applying a live move: %s", proposal.text())
                await self.apply(proposal)
