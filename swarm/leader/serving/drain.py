"""Draining a fellow: it hands its stages over before it goes (`swarm leave`, SIGTERM of its process, the admin
page's Drain), so a reply streaming through it pauses only for the switch, not for a failover.

For each stage the leaving fellow holds, on a model that is serving:

  1. the stage's taker: its hot cover when one is loaded, else a standby or an idle fellow with the stage's memory
     free (the failover's choice, swarm.leader.planning.failover, with the leaving fellow left out);
  2. the taker loads the stage as a cover beside the old one, which keeps serving meanwhile (no load with a hot
     cover: it is there already);
  3. the ring switches at a token boundary: the leader takes every running request of the model off the ring between
     two of its tokens (what streamed so far is kept), links a new ring generation with the taker in the stage's
     place, and sends the requests on as their prompt plus the tokens they had streamed; the client's stream just
     goes on (greedy replies are those of an uninterrupted run). Just before, the running requests' KV is handed over
     (swarm.leader.serving.kv_carry: the stages that stay keep it, the leaving one sends its part to the taker), so
     the new ring computes only each request's tokens after its last whole block;
  4. once the new ring is ready the old stage is unloaded; when every stage is handed over, the fellow is told to
     leave.

A stage nobody can take refuses the drain with what it needs (DrainRefused), before anything moves; with ``force``
the fellow leaves anyway, handing over what it can, and the rest fails over as if it had dropped out.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Set as AbstractSet

import trio

from swarm import control_messages as cm
from swarm import wire
from swarm.errors import AuthError, DrainRefused, SwarmError
from swarm.leader.planning.failover import Candidate, choose_replacement
from swarm.leader.planning.placement import GB, StagePlan
from swarm.leader.serving.kv_carry import KvCarry
from swarm.leader.serving.models import ModelServing, ModelStatus, StageState, load_message
from swarm.tunnel.channel import send_last
from swarm.tunnel.keys import fingerprint

log = logging.getLogger(__name__)

READY_WAIT_S = 30.0  # after the switch, how long the new ring may take to link before the old stage goes anyway
# The switch waits for the next token of the model's running requests, at most this long (a decode step is 0.02-0.4 s
# on the machines measured): switched right after a token, the ring throws away no step in flight. Before, the switch
# came anywhere between two tokens, and the step under way was lost and done again on the new ring: on average half a
# step added to the stream's pause (bench/drain_gap.py).
TOKEN_WAIT_S = 1.0


@dataclasses.dataclass(frozen=True)
class Handover:
    """Who takes stage ``index`` of ``model`` from the leaving fellow: ``fellow_id``, holding a hot cover of it
    already (``hot``) or loading it first."""

    model: str
    index: int
    fellow_id: int
    name: str
    hot: bool


def choose_taker(model: str, plan: StagePlan, cover: int | None, cover_ready: bool, candidates: list[Candidate],
                 leaving: AbstractSet[int]) -> Handover | None:
    """The fellow that should take stage ``plan`` off a leaving fellow: its hot cover (``cover``, loaded or still
    loading) first, else the failover's choice among ``candidates``; never a fellow in ``leaving``. None when nobody
    can."""
    online = {c.fellow_id: c for c in candidates}
    if cover is not None and cover in online and cover not in leaving:  # loaded, or loading: no second copy
        return Handover(model, plan.index, cover, online[cover].name, cover_ready)
    choice = choose_replacement(plan, candidates, exclude=leaving)
    if choice is None:
        return None
    return Handover(model, plan.index, choice.fellow_id, choice.name, False)


def why_nobody_takes(model: str, plan: StagePlan, candidates: list[Candidate], leaving: AbstractSet[int]) -> str:
    """One line a user can act on: the stage that has no taker, what it needs, and what each other fellow does."""
    others = [c for c in candidates if c.fellow_id != plan.fellow_id and c.fellow_id not in leaving]
    states = []
    for c in others:
        if c.outdated:
            states.append(c.outdated.rstrip("."))
        elif c.serving and not c.standby:
            states.append(f"{c.name} serves another stage")
        else:
            states.append(f"{c.name} has {c.free_bytes / GB:.1f} GB free")
    found = "; ".join(states) if states else "no other fellow of its pool is online"
    return (f"no fellow can take stage {plan.index} of {model} from {plan.fellow_name}: it needs "
            f"{plan.need_bytes / GB:.1f} GB free on a standby or an idle fellow ({found})")


@dataclasses.dataclass(frozen=True)
class Switch:
    """One switch's times (trio's clock): the running requests' latest token before it, the switch, the new ring
    linked (the requests then go on, prefilling what streamed so far past the blocks handed over); and how many KV
    blocks were carried across it (swarm.leader.serving.kv_carry)."""

    model: str
    last_token_at: float | None
    switched_at: float
    linked_at: float
    carried: int = 0


class Drains:
    """The leader's drains, one at a time (they are rare, and two at once would pick the same taker)."""

    def __init__(self, serving):
        self.serving = serving
        self.leaving: set[int] = set()  # fellows draining now: they take nothing
        self.switches: list[Switch] = []  # the latest switches' times, for bench/drain_gap.py and the tests
        self.kv = KvCarry(serving)  # the running requests' KV handed over at a switch
        self._lock = trio.Lock()

    def plan(self, fellow_id: int) -> tuple[list[tuple[ModelServing, StageState, Handover]], list[str]]:
        """The handovers a drain of ``fellow_id`` would make now, and why each stage with no taker has none."""
        recovery = self.serving.recovery
        leaving = self.leaving | {fellow_id}
        moves, refusals = [], []
        for model in list(self.serving.models.values()):
            slot = model.slot_of(fellow_id)
            if slot is None or model.status != ModelStatus.READY:
                continue  # a model still loading or recovering: its stage goes the failover's way
            # a fellow holds one stage or cover per model: one that covers another stage of it cannot load this one
            candidates = [c for c in recovery.candidates(model, slot.plan.index)
                          if not any(s.cover == c.fellow_id for s in model.stages if s is not slot)]
            handover = choose_taker(model.name, slot.plan, slot.cover, slot.cover_ready, candidates, leaving)
            if handover is None:
                refusals.append(why_nobody_takes(model.name, slot.plan, candidates, leaving))
            else:
                moves.append((model, slot, handover))
        return moves, refusals

    async def drain(self, fellow_id: int, *, force: bool = False, wait_s: float = 60.0) -> str:
        """Hand every stage of ``fellow_id`` over, then tell it to leave. Returns what was done, in words; raises
        DrainRefused (before anything moves) when a stage has no taker and ``force`` is not set."""
        conn = self.serving.hub.online.get(fellow_id)
        if conn is None:
            raise DrainRefused(f"fellow {fellow_id} is not online: there is nothing to hand over.")
        async with self._lock:
            self.leaving.add(fellow_id)
            try:
                done = await self._drain(conn, force, wait_s)
            finally:
                self.leaving.discard(fellow_id)
        conn.post(cm.Leave(message=done))
        log.info("%s", done)
        return done

    async def on_leave(self, conn, message: cm.Leave) -> None:
        """The fellow itself asks to leave (Leave: its process got SIGTERM): drain it, then it is told to leave
        (Leave), or why it may not (LeaveRefused, only without ``force``)."""
        wait = message.wait_s
        wait_s = min(600.0, max(1.0, wait)) if wait is not None else self.serving.settings.leave_wait_s
        try:
            await self.drain(conn.id, force=message.force, wait_s=wait_s)
        except DrainRefused as exc:
            conn.post(cm.LeaveRefused(str(exc)))

    async def _drain(self, conn, force: bool, wait_s: float) -> str:
        moves, refusals = self.plan(conn.id)
        if refusals and not force:
            raise DrainRefused(
                f"{conn.name} holds stages no other fellow can take, so it stays: " + "; ".join(refusals)
                + ". Start a fellow with room (`swarm join --standby` keeps one ready), or leave anyway with "
                  "`swarm leave --force` (the stage then fails over: replies pause until it is loaded elsewhere).")
        self._drop_covers(conn.id)
        moved, failed = [], list(refusals)
        with trio.move_on_after(wait_s) as scope:
            for model, slot, handover in moves:
                why = await self._hand_over(model, slot, handover, conn)
                if why is None:
                    moved.append(f"stage {handover.index} of {model.name} to {handover.name}"
                                 + (" (hot cover)" if handover.hot else ""))
                else:
                    failed.append(why)
        if scope.cancelled_caught:
            failed.append(f"the handover did not finish within {wait_s:.0f} s (SWARM_LEAVE_WAIT_S)")
            for model, slot, _ in moves:
                self._cancel_cover(model, slot, conn.id)
        if failed and not force:
            raise DrainRefused(f"{conn.name} could not hand everything over, so it stays: " + "; ".join(failed)
                               + ". Try again, or leave anyway with `swarm leave --force` (failover).")
        text = f"{conn.name} handed over " + (", ".join(moved) if moved else "nothing (it held no serving stage)")
        if failed:
            text += "; the rest fails over: " + "; ".join(failed)
        return text

    async def move(self, model: ModelServing, slot: StageState, handover: Handover, old) -> str | None:
        """A live move (swarm.leader.serving.rebalance): stage ``slot`` from fellow ``old`` (which stays) to its taker,
        the way a drain hands it over. None when done, else why not."""
        async with self._lock:
            return await self._hand_over(model, slot, handover, old)

    async def _hand_over(self, model: ModelServing, slot: StageState, handover: Handover, leaving) -> str | None:
        """Load the stage on its taker (unless it holds a hot cover), switch the ring, unload the old stage. None
        when done, else why not."""
        serving = self.serving
        taker = serving.hub.online.get(handover.fellow_id)
        if taker is None:
            return f"{handover.name} went offline"
        if not handover.hot:
            log.info("%s loads stage %d of %s to take it over from %s", taker.name, handover.index, model.name,
                     leaving.name)
            if slot.cover != taker.id:  # (a hot cover still loading is waited for, not loaded twice)
                slot.cover, slot.cover_ready, slot.cover_given = taker.id, False, taker.id
                taker.post(load_message(model, handover.index, cover=True))
            model.notify()
            while not (slot.cover == taker.id and slot.cover_ready):
                if slot.cover != taker.id or serving.hub.online.get(taker.id) is not taker:
                    return f"{taker.name} could not load stage {handover.index} of {model.name}"
                await model.changed.wait()
        if model.status != ModelStatus.READY or model.slot_of(leaving.id) is not slot:
            return f"{model.name} is recovering from another loss; stage {handover.index} goes the failover's way"
        carried = await self.kv.prepare(model, slot, taker, leaving)  # the running requests' KV, while they stream
        if model.status != ModelStatus.READY or model.slot_of(leaving.id) is not slot:
            return f"{model.name} is recovering from another loss; stage {handover.index} goes the failover's way"
        last_token = await self.next_token(model)
        if model.status != ModelStatus.READY or model.slot_of(leaving.id) is not slot \
                or serving.hub.online.get(taker.id) is not taker:
            return f"{model.name} changed while stage {handover.index} waited for a token; it goes the failover's way"
        switched_at = trio.current_time()
        self._switch(model, slot, taker)
        with trio.move_on_after(READY_WAIT_S):
            while model.status != ModelStatus.READY:
                await model.changed.wait()
        log.info("the ring of %s switched stage %d from %s to %s in %.0f ms", model.name, handover.index,
                 leaving.name, taker.name, 1000 * (trio.current_time() - switched_at))
        self.switches = [*self.switches[-15:], Switch(model.name, last_token, switched_at, trio.current_time(),
                                                      carried)]
        leaving.post(cm.Unload(model.name))
        return None

    async def next_token(self, model: ModelServing) -> float | None:
        """Return as the next token of a running request of ``model`` arrives (at once when none runs; TOKEN_WAIT_S at
        most): a token boundary, the moment a switch loses no work. -> when the latest token came (None: no token)."""
        running = self.serving.book.of_model(model.name)
        if not running:
            return None
        counts = [len(r.tokens) for r in running]
        with trio.move_on_after(TOKEN_WAIT_S):
            while all(len(r.tokens) == n and not r.ended for r, n in zip(running, counts)):
                async with trio.open_nursery() as nursery:  # any request's change wakes the check
                    for request in running:
                        nursery.start_soon(_then_cancel, request.changed.wait, nursery.cancel_scope)
        return max((r.last_token_at for r in running if r.last_token_at is not None), default=None)

    def _switch(self, model: ModelServing, slot: StageState, taker) -> None:
        """Between two tokens: the model's running requests come off the ring (keeping what streamed), the taker's
        loaded copy takes the stage's place, and a new ring generation is linked; once it is, the requests go on
        (swarm.leader.serving.recovery links, marks the model ready and sends them)."""
        serving = self.serving
        serving.perform(serving.book.interrupt(model.name))
        model.status, model.error, model.recovering_since = ModelStatus.RECOVERING, None, trio.current_time()
        slot.plan = dataclasses.replace(slot.plan, fellow_id=taker.id, fellow_name=taker.name)
        # its free memory already counts the copy's weights (and a last stage's draft model), which the budget
        # subtracts again -- as a hot cover's takeover counts them (swarm.leader.serving.recovery)
        slot.free_bytes = (taker.hardware.serving_free_bytes(serving.settings.device) + slot.plan.weight_bytes
                           + slot.plan.draft_bytes)
        slot.cover, slot.cover_ready, slot.cover_given = None, False, None
        slot.ready, slot.phase, slot.fraction, slot.error = True, "ready", 1.0, None
        serving.recovery.link(model)
        model.notify()

    def _drop_covers(self, fellow_id: int) -> None:
        """The leaving fellow's hot covers are no one's any more: it unloads them."""
        conn = self.serving.hub.online.get(fellow_id)
        for model in self.serving.models.values():
            for slot in model.stages:
                if slot.cover == fellow_id:
                    slot.cover, slot.cover_ready, slot.cover_given = None, False, None
                    if conn is not None:
                        conn.post(cm.Unload(model.name))
                    model.notify()

    def _cancel_cover(self, model: ModelServing, slot: StageState, leaving_id: int) -> None:
        """A handover that ran out of time: the copy still loading is unloaded (the failover picks its own)."""
        if slot.plan.fellow_id != leaving_id or slot.cover is None or slot.cover_ready:
            return
        conn = self.serving.hub.online.get(slot.cover)
        if conn is not None:
            conn.post(cm.Unload(model.name))
        slot.cover, slot.cover_given = None, None
        model.notify()


async def _then_cancel(wait, scope: trio.CancelScope) -> None:
    await wait()
    scope.cancel()


async def leave_session(hub, channel, hello: dict) -> None:
    """Answer `swarm leave` (a control session of the fellow's own key, next to the running fellow's link): drain the
    running fellow and tell it to leave -> Left, or Refused saying why it stays."""
    key = channel.remote_static
    try:
        known = await trio.to_thread.run_sync(hub.store.fellow_by_key, key)
        if known is None or await trio.to_thread.run_sync(hub.store.fellow_key_removed, key):
            raise AuthError(f"this leader has no fellow with key {fingerprint(key)}: there is nothing to leave.")
        if known.id not in hub.online:
            raise DrainRefused(f"{known.name} is not running (the leader sees no link from it): it holds nothing "
                               "and has nothing to hand over.")
        wait = hello.get("wait_s")
        wait_s = min(600.0, max(1.0, float(wait))) if isinstance(wait, (int, float)) and \
            not isinstance(wait, bool) else hub.serving.settings.leave_wait_s
        done = await hub.serving.drains.drain(known.id, force=hello.get("force") is True, wait_s=wait_s)
        reply: cm.Left | cm.Refused = cm.Left(done)
    except SwarmError as exc:
        log.info("refused a leave for key %s: %s", fingerprint(key), exc)
        reply = cm.Refused(str(exc))
    await send_last(channel, wire.encode(reply))
