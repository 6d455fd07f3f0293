"""Building and rebuilding rings: a ring is linked once every stage is loaded, rebuilt when a fellow drops out, and
adopted when a restarted leader's fellows come back still holding their stages.

Every link is a new generation of the ring (``ring_id``): new hop ids, new relay channels, new Noise sessions, and
every stage drops what the old ring left behind. The steps when a stage's fellow goes away (its control link closes,
or goes silent for a few seconds):

  1. the model is ``recovering``; its running requests wait to be sent again, the other stages drop their work;
  2. the lost stage is loaded on another fellow -- a hot cover when a standby holds one, else a standby, else an
     idle fellow with the stage's memory free (swarm.leader.planning.failover) -- or the same fellow if it comes back
     first;
  3. once every stage is loaded, the ring is linked again and the requests go out again as their prompt plus the
     tokens they had streamed. New requests wait meanwhile. If no fellow can take the stage within
     SWARM_SERVE_FAILOVER_WAIT_S, the model is unloaded and the waiting requests get the error.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets

import trio

from swarm import control_messages as cm
from swarm import wire
from swarm.leader.planning.failover import Candidate, choose_cover, choose_replacement, why_no_replacement
from swarm.leader.planning.placement import StagePlan
from swarm.leader.serving.adoption import Adoption
from swarm.leader.serving.models import (
    LOAD_PHASES,
    ModelServing,
    ModelStatus,
    StageState,
    link_message,
    load_message,
)

log = logging.getLogger(__name__)
# What a fellow says of loading and linking a stage (swarm.control_messages)
StageEvent = cm.LoadProgress | cm.Loaded | cm.LoadFailed | cm.Linked | cm.LinkFailed

HOT_COVER = "hot_cover"  # the store setting the admin page writes (SWARM_SERVE_HOT_COVER=1 turns it on too)
RETRY_S = 1.0  # how often a stage with no replacement yet looks again (also woken when a fellow joins)


class Recovery:
    def __init__(self, serving):
        self.serving = serving
        self._fleet = trio.Event()  # set whenever a fellow joins: stages waiting for one look again
        self.adoption = Adoption(self)  # a rejoining fellow's stages, a restarted leader's models

    def keeps(self, conn, stages: list) -> list[str]:
        return self.adoption.keeps(conn, stages)

    def adopt(self, conn, stages: list) -> list[str]:
        return self.adoption.adopt(conn, stages)

    async def restore(self) -> None:
        await self.adoption.restore()

    def fleet_changed(self) -> None:
        self._fleet.set()
        self._fleet = trio.Event()

    # --- events from fellows ------------------------------------------------------------------------------------

    def on_stage_event(self, conn, message: StageEvent) -> None:
        model = self.serving.models.get(message.model)
        if model is None:
            return
        if isinstance(message, (cm.Linked, cm.LinkFailed)):
            self._on_link_event(model, conn, message)
            return
        kind = wire.type_of(message)
        if model.load_id != message.load_id:
            return
        slot = model.slot_of(conn.id)
        if slot is not None and self.serving.rebalance.relayouts.extends(model, conn.id):
            if self.serving.rebalance.relayouts.on_stage_event(model, conn, message):
                model.notify()  # a re-layout waits for what the stage lacks (swarm.leader.serving.relayout)
            return
        cover = next((s for s in model.stages if s.cover == conn.id), None)
        if slot is None and cover is not None:
            self._on_cover_event(model, cover, conn, kind)
            model.notify()  # a drain waits for its taker's copy (swarm.leader.serving.drain)
            return
        if slot is None:
            if self.serving.rebalance.relayouts.on_stage_event(model, conn, message):
                model.notify()  # a re-layout waits for its next stages (swarm.leader.serving.relayout)
            return
        if isinstance(message, cm.LoadProgress):
            if message.phase not in LOAD_PHASES:
                return  # malformed: a fellow's bug or a forgery, not worth its link
            slot.phase, slot.fraction = message.phase, min(1.0, max(0.0, message.fraction))
        elif isinstance(message, cm.Loaded):
            slot.phase, slot.fraction, slot.ready, slot.error = "ready", 1.0, True, None
            self.link_when_loaded(model)
        elif isinstance(message, cm.LoadFailed):
            self._on_load_failed(model, slot, conn, message.message)
        model.notify()

    def _on_load_failed(self, model: ModelServing, slot: StageState, conn, text: str | None) -> None:
        slot.error = text
        log.warning("loading %s failed: %s", model.name, text)
        if model.status == ModelStatus.LOADING:
            model.status, model.error = ModelStatus.FAILED, text
            self.serving.book.end_model(model.name, f"loading {model.name} failed: {text}")
        else:  # a replacement failed to load: try another fellow
            slot.failed_on.add(conn.id)
            self.serving.start_task(self.replace, model, slot.plan.index)

    def _on_cover_event(self, model: ModelServing, slot: StageState, conn, kind: str) -> None:
        if kind == "loaded":
            slot.cover_ready = True
            log.info("%s holds a hot cover of stage %d of %s", conn.name, slot.plan.index, model.name)
        elif kind == "load_failed":
            slot.cover, slot.cover_ready, slot.cover_given = None, False, None

    def _on_link_event(self, model: ModelServing, conn, message: cm.Linked | cm.LinkFailed) -> None:
        if message.ring_id != model.ring_id:
            return  # an older generation's answer
        slot = model.slot_of(conn.id)
        if slot is None:
            return
        if isinstance(message, cm.LinkFailed):
            log.warning("linking %s failed: %s", model.name, message.message)
            slot.ready = False
            self.serving.start_task(self.replace, model, slot.plan.index)
            return
        slot.linked = True
        if all(s.linked for s in model.stages) and model.status in (ModelStatus.LOADING, ModelStatus.RECOVERING):
            was = model.status
            model.status, model.error, model.recovering_since = ModelStatus.READY, None, None
            log.info("model %s is %s over %d stages", model.name, "ready" if was == "loading" else "back",
                     len(model.stages))
            model.notify()
            self.serving.start_task(self._ready, model)

    async def _ready(self, model: ModelServing) -> None:
        for slot in model.stages:
            conn = self.serving.hub.online.get(slot.plan.fellow_id)
            if conn is not None:
                conn.post(cm.RingReady(model.name, model.ring_id))
        self.serving.resume(model.name)
        await self._save(model)
        if len(model.stages) > 1 and self.serving.direct_links is not None:
            await self.serving.direct_links.start(model)
        await self._cover(model)
        await self.serving.verifier.cover(model)  # spot checks: a checker for every stage a standby has room for

    async def _save(self, model: ModelServing) -> None:
        """What a restarted leader restores (``restore``): the stages' plans, the draft model, whose covers they are."""
        plans = [{**_plan_to_dict(s.plan), "free_bytes": s.free_bytes, "quantization": model.quantization,
                  "cover": s.cover_given, "kv_cache": model.kv_cache, "context_tokens": model.context_tokens}
                 for s in model.stages]
        if model.draft is not None:  # the last stage's draft model (SWARM_SERVE_DRAFT_MODEL), for a restarted leader
            plans[-1]["draft"] = model.draft
        await trio.to_thread.run_sync(self.serving.store.save_serving, model.name, model.load_id, plans)

    # --- linking ------------------------------------------------------------------------------------------------

    def link_when_loaded(self, model: ModelServing) -> None:
        if all(s.ready for s in model.stages) and model.status in (ModelStatus.LOADING, ModelStatus.RECOVERING):
            self.link(model)

    def link(self, model: ModelServing) -> None:
        """Start a new generation of ``model``'s ring over the fellows that hold its stages now."""
        serving = self.serving
        self.close_ring(model)
        n = len(model.stages)
        model.ring_id = "g" + secrets.token_hex(6)
        model.hop_ids = ["h" + secrets.token_hex(8) for _ in range(n)] if n > 1 else []
        for i, hop_id in enumerate(model.hop_ids):
            serving.relay.open_channel(hop_id, model.stages[i].plan.fellow_id, model.stages[(i + 1) % n].plan.fellow_id)
        for i, slot in enumerate(model.stages):
            slot.linked = False
            conn = serving.hub.online.get(slot.plan.fellow_id)
            if conn is not None:
                conn.post(link_message(model, i, serving.hub.online, serving.settings.pipeline_transport))

    def close_ring(self, model: ModelServing) -> None:
        for hop_id in model.hop_ids:
            self.serving.relay.close_channel(hop_id)
            self.serving.hop_stats.pop(hop_id, None)
        model.hop_ids = []

    # --- a fellow goes --------------------------------------------------------------------------------------------

    def fellow_lost(self, conn) -> None:
        for model in list(self.serving.models.values()):
            for slot in model.stages:
                if slot.cover == conn.id:
                    slot.cover, slot.cover_ready = None, False
            slot = model.slot_of(conn.id)
            if slot is not None:
                self.slot_lost(model, slot, f"stage {slot.plan.index} of {model.name} on {conn.name} went away")

    def take_out(self, model: ModelServing, slot: StageState, why: str) -> None:
        """Take a stage's fellow out of service (it failed its spot checks, swarm.leader.serving.verify): as if it were
        lost."""
        self.slot_lost(model, slot, why)

    async def save(self, model: ModelServing) -> None:
        await self._save(model)

    def slot_lost(self, model: ModelServing, slot: StageState, why: str) -> None:
        log.warning("%s; recovering", why)
        slot.ready = slot.linked = False
        slot.phase, slot.fraction = "queued", 0.0
        if model.status in (ModelStatus.READY, ModelStatus.RECOVERING):
            self.begin_recovery(model)
        self.serving.start_task(self.replace, model, slot.plan.index)
        model.notify()

    def begin_recovery(self, model: ModelServing) -> None:
        serving = self.serving
        if model.status != ModelStatus.RECOVERING:
            model.status = ModelStatus.RECOVERING
            model.error = None
            model.recovering_since = trio.current_time()
        serving.perform(serving.book.interrupt(model.name))
        model.ring_id = None
        self.close_ring(model)
        for slot in model.stages:  # the stages still there drop their work until the ring is linked again
            conn = serving.hub.online.get(slot.plan.fellow_id)
            if conn is not None and slot.ready:
                conn.post(cm.Unlink(model.name))

    async def replace(self, model: ModelServing, index: int) -> None:
        """Find a fellow for stage ``index`` of ``model`` and load it there; give up after the failover wait."""
        serving = self.serving
        started = model.recovering_since if model.recovering_since is not None else trio.current_time()
        deadline = started + serving.settings.serve_failover_wait_s
        while serving.models.get(model.name) is model and model.status in (ModelStatus.RECOVERING, ModelStatus.LOADING):
            slot = model.stages[index]
            if slot.ready or serving.hub.online.get(slot.plan.fellow_id) is not None and slot.phase != "queued":
                return  # it came back, or a load is under way
            if self._take_over(model, slot):
                return
            if trio.current_time() >= deadline:
                why = why_no_replacement(slot.plan, self.candidates(model, index), slot.failed_on)
                await self._give_up(model, why)
                return
            fleet = self._fleet
            with trio.move_on_after(min(RETRY_S, max(0.0, deadline - trio.current_time()))):
                await fleet.wait()

    def _take_over(self, model: ModelServing, slot: StageState) -> bool:
        """Put stage ``slot`` on a hot cover or a new fellow; False when none can take it now."""
        serving = self.serving
        index = slot.plan.index
        if slot.cover is not None and slot.cover_ready and serving.hub.online.get(slot.cover) is not None:
            conn = serving.hub.online[slot.cover]
            log.info("stage %d of %s moves to its hot cover on %s", index, model.name, conn.name)
            slot.plan = _moved(slot.plan, conn)
            # its free memory already counts the cover's weights (and a last stage's draft model, which a cover loads
            # too), which the budget subtracts again
            slot.free_bytes = (conn.hardware.serving_free_bytes(serving.settings.device) + slot.plan.weight_bytes
                               + slot.plan.draft_bytes)
            slot.cover, slot.cover_ready, slot.cover_given, slot.ready, slot.phase = None, False, None, True, "ready"
            self.link_when_loaded(model)
            model.notify()
            return True
        # the lost fellow itself, back without its stage (restarted), may load it again
        back = serving.hub.online.get(slot.plan.fellow_id)
        back = back if back is not None and back.compatible else None  # back on another protocol: not for it
        choice = choose_replacement(slot.plan, self.candidates(model, index), slot.failed_on)
        target = back if back is not None and slot.plan.fellow_id not in slot.failed_on else \
            (serving.hub.online.get(choice.fellow_id) if choice is not None else None)
        if target is None:
            return False
        log.info("stage %d of %s goes to %s", index, model.name, target.name)
        slot.plan = _moved(slot.plan, target)
        slot.free_bytes = target.hardware.serving_free_bytes(serving.settings.device)
        slot.ready, slot.phase, slot.fraction, slot.error = False, "queued", 0.0, None
        target.post(load_message(model, index))
        model.notify()
        return True

    async def _give_up(self, model: ModelServing, why: str) -> None:
        wait = self.serving.settings.serve_failover_wait_s
        text = (f"model {model.name} lost a stage and no fellow could take it over within {wait:.0f} s "
                f"(SWARM_SERVE_FAILOVER_WAIT_S): {why}. Start or free a fellow, then load the model again.")
        log.warning("%s", text)
        await self.serving.unload(model.name, reason=text)

    def candidates(self, model: ModelServing, index: int | None = None) -> list[Candidate]:
        """Every online fellow as a candidate to take a stage of ``model`` (``index``: the stage to replace)."""
        serving = self.serving
        out = []
        for conn in serving.hub.online.values():
            if not model.takes(conn):  # another pool's fellow never takes this model's stage
                continue
            serves = any(s.plan.fellow_id == conn.id and not (m is model and s.plan.index == index)
                         for m in serving.models.values() for s in m.stages)
            covering = any(s.cover == conn.id for m in serving.models.values() for s in m.stages)
            out.append(Candidate(conn.id, conn.name, conn.hardware.serving_free_bytes(serving.settings.device),
                                 conn.standby, serves, covering,
                                 "" if conn.compatible else conn.why_incompatible()))
        return out

    # --- hot cover ----------------------------------------------------------------------------------------------

    async def cover_all(self) -> None:
        """Hot cover was just turned on: cover the models already serving."""
        for model in list(self.serving.models.values()):
            await self._cover(model)

    async def _cover(self, model: ModelServing) -> None:
        """Keep a loaded copy of one stage on a standby, when hot cover is on: a failover is then a rewire."""
        serving = self.serving
        enabled = serving.settings.serve_hot_cover or bool(
            await trio.to_thread.run_sync(serving.store.get_setting, HOT_COVER, False))
        if not enabled or model.status != ModelStatus.READY or any(s.cover is not None for s in model.stages):
            return
        await self.place_cover(model, set(), "a hot cover")

    async def place_cover(self, model: ModelServing, covered: set[int], what: str) -> bool:
        """Load a copy of one stage not in ``covered`` on the standby that fits it best (what hot cover and the spot
        checks' checkers both are); ``what`` names the copy in the log. False when no standby can take one."""
        serving = self.serving
        choice = choose_cover([s.plan for s in model.stages], self.candidates(model), covered)
        if choice is None:
            return False
        index, standby = choice
        conn = serving.hub.online.get(standby.fellow_id)
        if conn is None:
            return False
        slot = model.stages[index]
        slot.cover, slot.cover_ready, slot.cover_given = conn.id, False, conn.id
        log.info("%s loads %s of stage %d of %s", conn.name, what, index, model.name)
        conn.post(load_message(model, index, cover=True))
        await self._save(model)  # a restarted leader knows whose cover it is
        return True

def _moved(plan: StagePlan, conn) -> StagePlan:
    return dataclasses.replace(plan, fellow_id=conn.id, fellow_name=conn.name)


def _plan_to_dict(plan: StagePlan) -> dict:
    return dataclasses.asdict(plan)
