"""Applying a re-layout (issue 37's live moves; the layout is swarm.leader.planning.relayout's): a serving model goes
to another number of stages, or another split of its layers, without a pause longer than a switch.

  1. each stage of the new ring that is not already held (the same stage kept by a fellow of the old ring, or one it
     narrows: swarm.leader.planning.relayout) loads on its idle fellow beside the old ring, which keeps serving
     meanwhile (the new stages are held as hot covers are until they are linked: ModelServing.relayout); a fellow
     of the old ring whose new stage extends its own loads only what that lacks, beside it (control_messages.Load's
     ``extend``: swarm.fellow.extending);
  2. the running requests' KV goes to the new stages while the old ring streams (swarm.leader.serving.kv_carry: each
     new stage gets its layers' rows from the old stages that held them; a kept or narrowed stage keeps its own),
     then the ring switches at a token boundary, the drain's way (swarm.leader.serving.drain: its ``next_token``):
     every running request comes off the ring keeping what streamed, the new ring is linked, and the requests go on
     as their prompt plus the tokens they had streamed, computing only those after their last whole block -- greedy
     replies are those of an uninterrupted run. A fellow of the old ring whose stage narrows is told its new layers
     by its link (control_messages.Link's first and end layer): it drops the others then (swarm.stage.narrow), not
     before, so the old ring serves untouched until the switch; one that extends splices what it loaded in then
     (swarm.stage.resplit);
  3. once the new ring is ready, the old stages (and their hot covers) that are not in it unload.

A new stage that fails to load, a fellow that goes, or a model that changes meanwhile (a failover, a drain) stops
the re-layout before the switch: the stages loaded for it unload, what was loaded beside a stage of the ring is
dropped (control_messages.DropExtension), and the old ring serves on.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import trio

from swarm import control_messages as cm
from swarm.leader.api.limits import FALLBACK_CONTEXT
from swarm.leader.planning.placement import StagePlan
from swarm.leader.planning.relayout import describe, narrows, same_stage
from swarm.leader.serving.models import LOAD_PHASES, ModelServing, ModelStatus, StageState, load_message

if TYPE_CHECKING:
    from swarm.leader.serving.recovery import StageEvent

log = logging.getLogger(__name__)

# How long the new stages may take to load beside the old ring before the re-layout is given up (a model of a few GB
# downloads and loads in a minute or two on a home LAN; the old ring serves meanwhile, so waiting costs nothing).
LOAD_WAIT_S = 600.0
READY_WAIT_S = 30.0  # after the switch, how long the new ring may take to link before the old stages go anyway


def served_context(model: ModelServing, settings) -> int:
    """The context the model's stages were placed for, so that a re-layout places the same: the served context of its
    load, else (a record of an earlier version) what a stage's KV cache holds -- the last stage's counts its draft
    model's cache too (swarm.leader.planning.placement), and a stage on one fellow keeps spare room (place_on_one)."""
    if model.context_tokens:
        return model.context_tokens
    size = model.size
    for slot in model.stages if len(model.stages) > 1 else []:
        per_token = size.kv_bytes_per_token_per_layer * (slot.plan.end_layer - slot.plan.first_layer) if size else 0
        per_token += slot.plan.draft_kv_per_token
        if per_token > 0 and slot.plan.kv_bytes > 0:
            return max(1, round(slot.plan.kv_bytes / per_token))
    return settings.serve_context_tokens or FALLBACK_CONTEXT


class Relayouts:
    """The leader's re-layouts, one at a time."""

    def __init__(self, serving):
        self.serving = serving
        self.carried = 0  # KV blocks the latest switch carried to the new ring
        self._lock = trio.Lock()
        self._extending: dict[str, set[int]] = {}  # model -> the ring's fellows loading what their stage lacks

    def extends(self, model: ModelServing, fellow_id: int) -> bool:
        """Whether ``fellow_id``, of ``model``'s ring, loads what its stage lacks for a re-layout now: its load events
        are the re-layout's, not its stage's."""
        return fellow_id in self._extending.get(model.name, ())

    def on_stage_event(self, model: ModelServing, conn, message: StageEvent) -> bool:
        """A load event of a fellow that holds no stage of ``model``, or extends the one it holds: a re-layout's next
        stage? -> handled."""
        state = next((s for s in model.relayout if s.plan.fellow_id == conn.id and not s.linked), None)
        if state is None:
            return False
        if isinstance(message, cm.LoadProgress):
            if message.phase in LOAD_PHASES:
                state.phase, state.fraction = message.phase, min(1.0, max(0.0, message.fraction))
        elif isinstance(message, cm.Loaded):
            state.phase, state.fraction, state.ready, state.error = "ready", 1.0, True, None
        elif isinstance(message, cm.LoadFailed):
            state.error = message.message or f"{conn.name} could not load it"
        return True

    async def apply(self, model: ModelServing, plans: list[StagePlan]) -> str:
        """Re-lay ``model`` out as ``plans`` (see the module). Returns what was done, in words."""
        async with self._lock:
            current = [s.plan for s in model.stages]
            what = f"{model.name}: {describe(current, plans)}"
            new: list[StageState] = []
            extending: set[int] = set()
            for plan in plans:
                if self.serving.hub.online.get(plan.fellow_id) is None:
                    return f"{what} not done: {plan.fellow_name} went offline"
                state = StageState(plan)
                old = model.slot_of(plan.fellow_id)
                if old is not None:  # it keeps the stage it holds, narrows or extends it (planning.relayout)
                    # its free memory before the stage, as placed: a narrower stage's budget counts what it frees
                    # (swarm.leader.serving.admission: the room is that less the new plan's weights)
                    state.free_bytes = old.free_bytes
                    if same_stage(plan, len(plans), old.plan, len(current)) or \
                            narrows(plan, len(plans), old.plan, len(current)):
                        state.ready, state.phase, state.fraction = True, "ready", 1.0
                    else:
                        extending.add(plan.fellow_id)
                new.append(state)
            model.relayout = new
            loading = [i for i, s in enumerate(new) if not s.ready]
            self._extending[model.name] = extending
            for i in loading:
                fellow_id = new[i].plan.fellow_id
                log.info("%s loads %sstage %d of %s's next layout beside its ring", new[i].plan.fellow_name,
                         "what its stage lacks for " if fellow_id in extending else "", i, model.name)
                message = load_message(_next(model, new), i, extend=True) if fellow_id in extending \
                    else load_message(_next(model, new), i, cover=True)
                self.serving.hub.online[fellow_id].post(message)
            model.notify()
            try:
                why = await self._loaded(model, new, current)
                if why is None:
                    why = await self._switch(model, new, current)
            finally:
                self._extending.pop(model.name, None)
                if model.relayout is new:  # not switched: the old ring serves on, the new stages go
                    model.relayout = []
                    for i in loading:
                        fellow_id = new[i].plan.fellow_id
                        if fellow_id in extending:  # its stage serves on; what it loaded beside goes
                            conn = self.serving.hub.online.get(fellow_id)
                            if conn is not None:
                                conn.post(cm.DropExtension(model.name))
                        else:
                            self._unload(model, fellow_id)
                    model.notify()
            return f"{what} not done: {why}" if why else f"{what}: re-laid out"

    async def _loaded(self, model: ModelServing, new: list[StageState], current: list[StagePlan]) -> str | None:
        """Wait until every next stage is loaded and the model serves on its old ring; None, else why not."""
        serving = self.serving
        with trio.move_on_after(LOAD_WAIT_S):
            while True:
                failed = next((s for s in new if s.error), None)
                if failed is not None:
                    return f"stage {failed.plan.index} did not load on {failed.plan.fellow_name}: {failed.error}"
                gone = next((s for s in new if serving.hub.online.get(s.plan.fellow_id) is None), None)
                if gone is not None:
                    return f"{gone.plan.fellow_name} went offline"
                if serving.models.get(model.name) is not model or [s.plan for s in model.stages] != current:
                    return "the ring changed meanwhile (a failover, a drain or a new load)"
                if all(s.ready for s in new) and model.status == ModelStatus.READY:
                    return None
                await model.changed.wait()
        return f"the next stages did not load within {LOAD_WAIT_S:.0f} s"

    async def _switch(self, model: ModelServing, new: list[StageState], current: list[StagePlan]) -> str | None:
        """At a token boundary, the new ring takes over; then the old stages unload. None when done."""
        serving = self.serving
        # the running requests' KV to the new stages, while the old ring streams (swarm.leader.serving.kv_carry)
        self.carried = await serving.drains.kv.hand_over(model, [s.plan for s in new])
        await serving.drains.next_token(model)
        if serving.models.get(model.name) is not model or [s.plan for s in model.stages] != current \
                or model.status != ModelStatus.READY \
                or any(serving.hub.online.get(s.plan.fellow_id) is None for s in new):
            return "the ring changed while it waited for a token"
        switched_at = trio.current_time()
        old = list(model.stages)
        kept = {s.plan.fellow_id for s in old}
        serving.perform(serving.book.interrupt(model.name))  # the running requests keep what streamed
        model.status, model.error, model.recovering_since = ModelStatus.RECOVERING, None, switched_at
        device = serving.settings.device
        for state in new:
            if state.plan.fellow_id not in kept:  # loaded beside: its free memory counts the stage's weights
                conn = serving.hub.online[state.plan.fellow_id]
                state.free_bytes = conn.hardware.serving_free_bytes(device) + state.plan.weight_bytes \
                    + state.plan.draft_bytes
            state.ready, state.phase, state.fraction = True, "ready", 1.0
        model.stages, model.relayout, model.draft = new, [], _next(model, new).draft
        serving.recovery.link(model)  # once linked: ready, and the requests go on (swarm.leader.serving.recovery)
        model.notify()
        with trio.move_on_after(READY_WAIT_S):
            while model.status != ModelStatus.READY:
                await model.changed.wait()
        log.info("the ring of %s switched to its new layout in %.0f ms", model.name,
                 1000 * (trio.current_time() - switched_at))
        staying = {s.plan.fellow_id for s in new}
        for slot in old:
            for fellow_id in {slot.plan.fellow_id, slot.cover} - staying - {None}:
                self._unload(model, fellow_id)
        return None

    def _unload(self, model: ModelServing, fellow_id: int | None) -> None:
        """Unload ``model`` from a fellow, unless it holds a stage or a cover of the ring now (a drain or the hot
        cover may have given it one meanwhile)."""
        conn = self.serving.hub.online.get(fellow_id) if fellow_id is not None else None
        if conn is None or model.slot_of(conn.id) is not None or any(s.cover == conn.id for s in model.stages):
            return
        conn.post(cm.Unload(model.name))


def _next(model: ModelServing, stages: list[StageState]) -> ModelServing:
    """The model as its next layout: what its stages' load messages are made from. Its draft model goes with it
    where its last stage was placed holding one (over several stages, as a load places it), else it drafts by
    prompt lookup alone."""
    draft = model.draft if stages and stages[-1].plan.draft_bytes else None
    return dataclasses.replace(model, stages=stages, relayout=[], draft=draft)
