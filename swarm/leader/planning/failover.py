"""Failover decisions as plain functions over made-up or real fleets: which fellow takes a lost stage, which stage a
standby covers, and what a cut-off request is sent again as.

A lost stage goes to a standby first (it joined to do exactly that), else to an online fellow that serves nothing,
and only to one with the stage's memory free by the same budgeting as a load; among those, the roomiest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Set as AbstractSet

from swarm.leader.planning.placement import GB, StagePlan


@dataclasses.dataclass(frozen=True)
class Candidate:
    fellow_id: int
    name: str
    free_bytes: int
    standby: bool
    serving: bool  # holds a stage of some model (a hot cover does not count)
    covering: bool = False  # holds a hot cover of some stage
    outdated: str = ""  # why it cannot take a stage: it speaks another wire protocol (never sent what it cannot read)


def choose_replacement(plan: StagePlan, candidates: list[Candidate], exclude: AbstractSet[int] = frozenset()
                       ) -> Candidate | None:
    """The fellow that should take over ``plan``'s stage, or None when no fellow can."""
    usable = [c for c in candidates
              if c.fellow_id not in exclude and c.fellow_id != plan.fellow_id and (c.standby or not c.serving)
              and c.free_bytes >= plan.need_bytes and not c.outdated]
    usable.sort(key=lambda c: (not c.standby, -c.free_bytes, c.fellow_id))
    return usable[0] if usable else None


def why_no_replacement(plan: StagePlan, candidates: list[Candidate],
                       exclude: AbstractSet[int] = frozenset()) -> str:
    """One line a user can act on: what the stage needs and what each fellow has or does."""
    others = [c for c in candidates if c.fellow_id != plan.fellow_id]
    if not others:
        return (f"stage {plan.index} needs another fellow with {plan.need_bytes / GB:.1f} GB free and none is online; "
                "start one with `swarm join` (--standby keeps one ready for this)")
    states = []
    for c in others:
        if c.outdated:
            states.append(c.outdated.rstrip("."))
        elif c.fellow_id in exclude:
            states.append(f"{c.name} failed to load it")
        elif c.serving and not c.standby:
            states.append(f"{c.name} serves another stage")
        else:
            states.append(f"{c.name} has {c.free_bytes / GB:.1f} GB free")
    return (f"stage {plan.index} needs {plan.need_bytes / GB:.1f} GB free on a standby or an idle fellow: "
            + "; ".join(states))


def choose_cover(plans: list[StagePlan], candidates: list[Candidate],
                 covered: set[int]) -> tuple[int, Candidate] | None:
    """(stage index, standby) for the next hot cover: the uncovered stage whose loss would cost most to reload (the
    most weight bytes to fetch and load), on a standby that holds no cover yet and has room for it."""
    standbys = [c for c in candidates if c.standby and not c.covering and not c.serving and not c.outdated]
    for plan in sorted(plans, key=lambda p: (-p.weight_bytes, p.index)):
        if plan.index in covered:
            continue
        fits = [c for c in standbys if c.free_bytes >= plan.need_bytes and c.fellow_id != plan.fellow_id]
        if fits:
            return plan.index, max(fits, key=lambda c: (c.free_bytes, -c.fellow_id))
    return None


@dataclasses.dataclass(frozen=True)
class Resume:
    """A cut-off request, sent again: its prompt plus the tokens it had streamed, with the tokens it had left."""

    prompt: list[int]
    max_tokens: int
    drawn: int  # tokens already sampled: a seeded sampler goes on from there


def resume(prompt: list[int], streamed: list[int], max_tokens: int) -> Resume | None:
    """What to send again, or None when nothing is left to generate."""
    left = max_tokens - len(streamed)
    if left <= 0:
        return None
    return Resume(list(prompt) + list(streamed), left, len(streamed))
