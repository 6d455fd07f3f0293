"""Adoption: a fellow that rejoins still holding stages (or a hot cover) of the models the leader serves keeps them,
with no reload; a restarted leader restores the models that were serving from its database and waits ADOPT_WAIT_S for
their fellows to come back before it places their stages again (swarm.leader.serving.recovery does the rest)."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

import trio

from swarm.kv_kinds import check_kv_kind
from swarm.leader.planning.placement import StagePlan
from swarm.leader.serving.models import ModelServing, ModelStatus, StageState, full_weight_bytes, model_size
from swarm.quantization import check_kind

if TYPE_CHECKING:
    from swarm.leader.serving.recovery import Recovery

log = logging.getLogger(__name__)

ADOPT_WAIT_S = 15.0  # after a leader restart, how long fellows have to come back before their stages are re-placed


class Adoption:
    def __init__(self, recovery: Recovery):
        self.recovery = recovery
        self.serving = recovery.serving

    def keeps(self, conn, stages: list) -> list[str]:
        """The models whose stage (or hot cover) a rejoining fellow keeps: what it holds of the current loads."""
        keep: list[str] = []
        if not conn.compatible:  # it speaks another protocol: it is sent nothing of a ring, and drops what it holds
            return keep
        for summary in stages:
            if not isinstance(summary, dict):
                continue
            model = self.serving.models.get(summary.get("model"))
            index = summary.get("index")
            if model is None or model.load_id != summary.get("load_id") or not isinstance(index, int) \
                    or not 0 <= index < len(model.stages):
                continue
            slot = model.stages[index]
            if (slot.plan.fellow_id == conn.id and not summary.get("cover")) or \
                    (summary.get("cover") and self._cover_given(slot, conn)):
                keep.append(model.name)
        return keep

    def adopt(self, conn, stages: list) -> list[str]:
        """A fellow that rejoins still holding stages of models the leader serves keeps them: no reload. A stage the
        leader counted on it that it no longer holds (the fellow restarted) is lost, and fails over. Called once the
        fellow has its welcome: what this sends it (unlink, link) must come after."""
        adopted = self.claim(conn, stages)
        for model in list(self.serving.models.values()):
            slot = model.slot_of(conn.id)
            if slot is None or model.name in adopted:
                continue
            if slot.ready:
                self.recovery.slot_lost(model, slot,
                                        f"{conn.name} came back without stage {slot.plan.index} of {model.name}")
            elif model.status == ModelStatus.RECOVERING and slot.phase == "queued":
                # after a leader restart: its fellow is back but restarted too -- load the stage again right away
                self.serving.start_task(self.recovery.replace, model, slot.plan.index)
        return adopted

    @staticmethod
    def _cover_given(slot: StageState, conn) -> bool:
        """Whether ``conn`` may rejoin holding a hot cover of ``slot``: the leader gave it that cover (a forged claim
        used to make any fellow of the pool the cover of any stage, and let it download that stage's files)."""
        return slot.cover_given == conn.id and slot.cover in (None, conn.id) and slot.plan.fellow_id != conn.id

    def claim(self, conn, stages: list) -> list[str]:
        adopted: list[str] = []
        if not conn.compatible:
            return adopted
        for summary in stages:
            if not isinstance(summary, dict):
                continue
            model = self.serving.models.get(summary.get("model"))
            if model is None or model.load_id != summary.get("load_id") or not model.takes(conn):
                continue
            index = summary.get("index")
            slot = model.stages[index] if isinstance(index, int) and 0 <= index < len(model.stages) else None
            if slot is None:
                continue
            if summary.get("cover") and self._cover_given(slot, conn):
                slot.cover, slot.cover_ready = conn.id, True
                adopted.append(model.name)
            elif slot.plan.fellow_id == conn.id and not summary.get("cover"):
                log.info("%s rejoined holding stage %d of %s: adopted", conn.name, index, model.name)
                slot.ready, slot.phase, slot.fraction = True, "ready", 1.0
                adopted.append(model.name)
                if model.status == ModelStatus.READY:  # it was not noticed gone: the ring is rebuilt over its new link
                    self.recovery.begin_recovery(model)
                self.recovery.link_when_loaded(model)
                model.notify()
        return adopted

    async def restore(self) -> None:
        """After a leader restart: the models that were serving come back as recovering, waiting for their fellows."""
        serving = self.serving
        records = await trio.to_thread.run_sync(serving.store.list_serving)
        for name, load_id, plans in records:
            try:
                row = await serving.model_row(name)
                manifest = row.manifest
                config_file = serving.models_root / name / "config.json"
                config = json.loads(await trio.to_thread.run_sync(config_file.read_text))
                stages = [StageState(StagePlan(**{k: v for k, v in p.items()
                                                  if k not in ("free_bytes", "quantization", "draft", "cover",
                                                               "kv_cache", "context_tokens")}),
                                     free_bytes=int(p.get("free_bytes", 0)),
                                     cover_given=p["cover"] if isinstance(p.get("cover"), int) else None)
                          for p in plans]
                kind = check_kind(plans[0].get("quantization") if plans else None)
                kv = check_kv_kind(plans[0].get("kv_cache") if plans else None)
                context = plans[0].get("context_tokens") if plans else None
            except Exception as exc:  # a stored plan of any shape must not stop the leader: it forgets that one
                log.warning("cannot restore %s after the restart (%s); it is not serving", name, exc)
                await trio.to_thread.run_sync(serving.store.delete_serving, name)
                continue
            online = list(serving.hub.online.values())
            cpu = not online or not all(c.hardware.gpus for c in online)  # as load() budgets (serving.py)
            full = full_weight_bytes(manifest, cpu, [s.plan for s in stages])
            model = ModelServing(name, load_id, stages, status=ModelStatus.RECOVERING, manifest=manifest, config=config,
                                 recovering_since=trio.current_time(), size=model_size(manifest, cpu, kind, kv),
                                 quantization=kind, kv_cache=kv, context_tokens=context, full_weight_bytes=full,
                                 pool_id=row.pool_id)
            model.speculative = serving.settings.serve_speculative  # drafting ahead, as a load now would have it
            model.draft = plans[-1].get("draft") if plans else None  # the draft model its last fellow still holds
            serving.models[name] = model
            serving.quantization_of[name] = kind
            serving.kv_cache_of[name] = kv
            if isinstance(context, int):  # served as loaded: a cap below its own stays
                serving.served_contexts[name] = serving.context_caps[name] = context
            log.info("%s was serving before the restart: waiting for its fellows", name)
            serving.start_task(self._adopt_or_replace, model)

    async def _adopt_or_replace(self, model: ModelServing) -> None:
        await trio.sleep(ADOPT_WAIT_S)
        for slot in model.stages:
            if not slot.ready and self.serving.models.get(model.name) is model:
                self.serving.start_task(self.recovery.replace, model, slot.plan.index)
