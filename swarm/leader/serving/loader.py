"""Loading and unloading models over the fellows: where a load puts its stages (placement), sending each fellow its
stage, unloading, waiting for a model to be ready, and loading again a model a fellow says it lost."""

from __future__ import annotations

import json
import logging
import secrets
from typing import TYPE_CHECKING

import trio

from swarm import control_messages as cm
from swarm.errors import ModelNotLoaded, PlacementError
from swarm.leader.api.limits import model_context, served_context
from swarm.leader.planning.auto_load import room
from swarm.leader.planning.draft_model import resolve
from swarm.leader.planning.link_placement import arrange, fellow_speeds
from swarm.leader.planning.placement import place
from swarm.leader.serving.drafting import sliding
from swarm.leader.serving.models import (
    ModelServing,
    ModelStatus,
    StageState,
    check_quantization,
    draft_message,
    draft_size,
    full_weight_bytes,
    load_message,
    model_size,
    quantized_fellows,
)
from swarm.quantization import check_model_kind, default_kind

if TYPE_CHECKING:
    from swarm.leader.serving.serving import Serving

log = logging.getLogger(__name__)


class Loader:
    """Loads and unloads the models of one leader (its :class:`~swarm.leader.serving.serving.Serving`)."""

    def __init__(self, serving: Serving):
        self.serving = serving

    def placement(self, name: str, manifest: dict, num_stages: int | None, fellow_id: int | None, asked: str,
                  pool_id: int | None = None, draft_manifest: dict | None = None, kv_cache: str | None = None,
                  releasing: frozenset[str] = frozenset()):
        """Where a load of ``name`` (its ``manifest``) would put its stages on the pool now
        (swarm.leader.planning.placement.place): the plans, the model's sizes, the quantization kind, the fellows it
        chose from and their capacities. Raises PlacementError when nothing fits. The load and the planner
        (swarm.leader.planning.planner) both use it. ``draft_manifest``: a draft model the last stage holds beside its
        layers (SWARM_SERVE_DRAFT_MODEL), counted in its fellow's memory where the ring has several stages and that
        fellow runs draft models (else left out: the last plan's draft_bytes say which). Every stage keeps room for one
        conversation of the model's served context (:meth:`context_tokens`) with its keys and values at ``kv_cache``
        (None: as last loaded). Each fellow's memory is what it has beside the other models placed on it
        (swarm.leader.planning.auto_load.room), but those in ``releasing``."""
        # only the model's pool's fellows (swarm.store.fleet); standbys wait for failovers, unless one is asked for
        if pool_id is not None and fellow_id is not None and fellow_id in self.serving.online and \
                self.serving.online[fellow_id].pool_id != pool_id:
            raise PlacementError(f"fellow {self.serving.online[fellow_id].name} is in another pool than {name}; a "
                                 "model loads over its own pool's fellows only.")
        fellows = [f for f in self.serving.online.values() if (not f.standby or f.id == fellow_id)
                   and (pool_id is None or f.pool_id == pool_id)]
        # A fellow on another wire protocol is never sent a message it cannot read: the load goes without it, or is
        # refused naming it when it was asked for or nothing fits without it.
        outdated = [f for f in fellows if not f.compatible]
        if any(f.id == fellow_id for f in outdated):
            raise PlacementError(next(f for f in outdated if f.id == fellow_id).why_incompatible())
        fellows = [f for f in fellows if f.compatible]
        choose_count = num_stages is None  # the leader chooses: a fellow may be left out for its links
        if num_stages is None:
            num_stages = max(1, min(len(fellows), manifest["num_layers"]))
        fellows, kind = quantized_fellows(asked, fellows, num_stages, self.serving.settings.device)
        if kind != asked:
            log.info("%s loads in full precision: fewer than %d fellows report quantized loads", name, num_stages)
        # A CPU fellow holds 16-bit weights widened to float32: a pool with one budgets every stage so (its GPU
        # fellows then keep room to spare, never too little).
        cpu = not fellows or not all(f.hardware.gpus for f in fellows)
        kv = kv_cache or self.serving.kv_cache_of.get(name) or self.serving.settings.serve_kv_cache
        size = model_size(manifest, cpu=cpu, quantization=kind, kv_cache=kv)
        context = self.serving.contexts.context_tokens(name)
        capacities = room(self.serving, fellows, releasing | {name})  # a load again (the planner) replaces its own
        try:
            plans = place(size, capacities, num_stages, context, fellow_id)
            if draft_manifest is not None and len(plans) > 1:
                plans = self._with_draft_model(name, plans, size, capacities, num_stages,
                                               draft_size(draft_manifest, cpu, kind), context)
        except PlacementError:
            if outdated:
                raise PlacementError(" ".join(f.why_incompatible() for f in outdated)) from None
            raise
        self.serving.left_out[name] = []
        if fellow_id is None and not plans[-1].draft_bytes:  # the ring's order and fellows by the measured links
            arranged = arrange(size, capacities, plans, fellow_speeds(fellows), self.serving.link_matrix.hops(),
                               int(manifest.get("hidden_size") or 0) * (4 if cpu else 2), context, choose_count)
            if arranged.plans != plans:
                log.info("%s: link-aware placement, %.0f ms a token instead of %.0f%s", name, arranged.ms_per_token,
                         arranged.link_blind_ms_per_token, "".join(f"; {why}" for why in arranged.left_out))
            plans, self.serving.left_out[name] = arranged.plans, arranged.left_out
        check_quantization(kind, plans, {f.id: f for f in fellows}, self.serving.settings.device)
        return plans, size, kind, fellows, capacities

    def _with_draft_model(self, name: str, plans: list, size, capacities: list, num_stages: int, draft,
                          context: int | None = None) -> list:
        """``plans`` placed again with a draft model (a swarm.leader.planning.placement.DraftSize) on the last stage's
        fellow; ``plans`` as they are where that fellow runs a version without draft models or --
        SWARM_SERVE_DRAFT_MODEL=auto
        -- where the draft model does not fit (a named one: the PlacementError says what it needs)."""
        try:
            if context is None:
                context = served_context(None, self.serving.settings.serve_context_tokens)
            with_draft = place(size, capacities, num_stages, context, None, draft)
        except PlacementError as exc:
            if self.serving.settings.serve_draft_model != "auto":
                raise
            log.warning("%s loads without a draft model (SWARM_SERVE_DRAFT_MODEL=auto): it does not fit. %s", name,
                        exc)
            return plans
        assert self.serving.hub is not None  # set by the app
        last = self.serving.hub.online[with_draft[-1].fellow_id]
        if not last.draft_model:
            log.info("%s drafts without its draft model: %s, which holds its last stage, runs a version without "
                     "draft models", name, last.name)
            return plans
        return with_draft

    def restarts(self, name: str, num_stages: int | None = None, fellow_id: int | None = None,
                 quantization: str | None = None, context_tokens: int | None = None,
                 kv_cache: str | None = None) -> bool:
        """Whether a load of ``name`` as asked would unload the model serving now and start over -- ending every
        request it is answering: another quantization, context cap or KV cache kind, or another shape while it is
        recovering."""
        current = self.serving.models.get(name)
        if current is None or current.status not in (ModelStatus.LOADING, ModelStatus.READY, ModelStatus.RECOVERING):
            return False
        asked_otherwise = (num_stages is not None and num_stages != len(current.stages)) or \
            (fellow_id is not None and current.stages[0].plan.fellow_id != fellow_id)
        last_kind = self.serving.quantization_of.get(name, current.quantization)
        requantized = quantization is not None and quantization != last_kind
        requantized |= context_tokens is not None and context_tokens != self.serving.context_caps.get(name)
        requantized |= kv_cache is not None and kv_cache != current.kv_cache
        return requantized or (current.status == ModelStatus.RECOVERING and asked_otherwise)

    def kind_of(self, name: str, manifest: dict | None) -> str:
        """The kind ``name`` loads at when none is asked: as it was last asked, else its own default (gguf for a model
        that keeps a GGUF's blocks, none otherwise: swarm.quantization.default_kind)."""
        return self.serving.quantization_of.get(name) or default_kind(manifest)

    async def load(self, name: str, num_stages: int | None = None, fellow_id: int | None = None,
                   quantization: str | None = None, context_tokens: int | None = None,
                   kv_cache: str | None = None) -> ModelServing:
        """Place ``name`` and send each fellow its stage. ``quantization`` (swarm.quantization.KINDS; None: as it
        was last loaded, else none) is how the stages hold their weights; a load asked at another kind than the one
        serving starts over at that kind. ``context_tokens`` caps the model's served context below its own (None: as
        last loaded, else its own, capped by SWARM_SERVE_CONTEXT_TOKENS); ``kv_cache`` (swarm.kv_kinds; None: as last
        loaded, else SWARM_SERVE_KV_CACHE) is how its stages hold keys and values."""
        row = await self.serving.model_row(name)
        manifest = row.manifest
        if quantization is not None:  # refused before anything serving is unloaded for it
            check_model_kind(quantization, manifest, name)
        current = self.serving.models.get(name)
        if current is not None and current.status in (ModelStatus.LOADING, ModelStatus.READY, ModelStatus.RECOVERING):
            if not self.restarts(name, num_stages, fellow_id, quantization, context_tokens, kv_cache):
                return current
            # asked for another shape while the old one is still being put back together, or another quantization:
            # start over as asked
            await self.unload(name, reason=f"model {name} is being loaded again as asked")
        asked = quantization if quantization is not None else self.kind_of(name, manifest)
        config_file = self.serving.models_root / name / "config.json"
        config = await trio.to_thread.run_sync(lambda: json.loads(config_file.read_text()))
        self.serving.own_contexts[name] = model_context(config)
        if context_tokens is not None:
            self.serving.context_caps[name] = context_tokens
        kv = kv_cache or self.serving.kv_cache_of.get(name) or self.serving.settings.serve_kv_cache
        draft = None  # SWARM_SERVE_DRAFT_MODEL: checked before anything is placed (a wrong name refuses the load)
        if self.serving.settings.serve_draft_model and self.serving.settings.serve_speculative > 0 and num_stages != 1 \
                and not sliding(config):  # a sliding model does not draft at all (swarm.leader.serving.drafting)
            draft = await trio.to_thread.run_sync(resolve, self.serving.settings.serve_draft_model, name, row.pool_id,
                                                  self.serving.store, self.serving.models_root)
        # From placement to the last load message nothing awaits: a fellow that went offline during an await here
        # was still in the placement, and posting its stage failed (a KeyError under load, the model left 'loading').
        plans, size, kind, fellows, capacities = self.placement(name, manifest, num_stages, fellow_id, asked,
                                                                row.pool_id, draft.manifest if draft else None, kv)
        cpu = not fellows or not all(f.hardware.gpus for f in fellows)
        free = {c.fellow_id: c.free_bytes for c in capacities}
        serving = ModelServing(name, "l" + secrets.token_hex(6), [StageState(p, free_bytes=free[p.fellow_id])
                                                                  for p in plans],
                               manifest=manifest, config=config, size=size, quantization=kind,
                               full_weight_bytes=full_weight_bytes(manifest, cpu, plans), pool_id=row.pool_id)
        serving.speculative = self.serving.settings.serve_speculative  # drafting ahead: the setting at this load
        serving.context_tokens = self.serving.served_contexts[name] = self.serving.contexts.context_tokens(name)
        serving.kv_cache = self.serving.kv_cache_of[name] = kv
        if draft is not None and plans[-1].draft_bytes:
            serving.draft = draft_message(draft)
        self.serving.models[name] = serving
        self.serving.quantization_of[name] = asked
        self.serving.reload_on_request.discard(name)
        for i, plan in enumerate(plans):
            self.serving.online[plan.fellow_id].post(load_message(serving, i))
        self.serving.start_task(self._warm_tokenizer, name)
        serving.notify()
        return serving

    async def unload(self, name: str, *, reason: str | None = None, keep_state: bool = False) -> None:
        """Unload ``name`` from every fellow; its requests end with ``reason`` (an admin's unload says so)."""
        serving = self.serving.models.get(name)
        if serving is None:
            return
        for fellow_id in serving.fellow_ids | {s.cover for s in serving.stages if s.cover is not None}:
            conn = self.serving.online.get(fellow_id)
            if conn is not None:
                conn.post(cm.Unload(name))
        self.serving.recovery.close_ring(serving)
        self.serving.book.end_model(name, reason or f"model {name} was unloaded")
        self.serving.prefix.forget(name)  # the stages drop their blocks with the model
        if not keep_state:
            del self.serving.models[name]
        await trio.to_thread.run_sync(self.serving.store.delete_serving, name)
        serving.notify()

    async def wait_ready(self, name: str, timeout: float) -> ModelServing:
        with trio.move_on_after(timeout):
            while True:
                serving = self.serving.models.get(name)
                if serving is None:
                    raise ModelNotLoaded(f"model {name} is not loaded")
                if serving.status == ModelStatus.READY:
                    return serving
                if serving.status == ModelStatus.FAILED:
                    raise PlacementError(f"loading {name} failed: {serving.error}")
                await serving.changed.wait()
        raise ModelNotLoaded(f"model {name} did not become ready within {timeout:.0f} s")

    async def _warm_tokenizer(self, name: str) -> None:
        """Load the tokenizer and chat template while the fellows load, so the first chat does not pay for it."""
        from swarm.leader.chat.chat_format import warm_up

        try:
            await trio.to_thread.run_sync(warm_up, self.serving.models_root / name)
        except Exception as exc:  # the first request reports whatever is wrong with the tokenizer
            log.warning("could not prepare the tokenizer of %s: %s", name, exc)

    async def reload(self, name: str, why: str) -> None:
        """A fellow said it does not hold the model: unload what is left and load it again; the requests that were
        running wait for it and go out again."""
        serving = self.serving.models.get(name)
        if serving is None or serving.status != ModelStatus.READY:
            return
        log.info("%s; loading %s again", why, name)
        self.serving.perform(self.serving.book.interrupt(name))
        waiting = self.serving.book.waiting.pop(name, [])
        await self.unload(name)
        self.serving.reload_on_request.add(name)
        try:
            await self.load(name, len(serving.stages))
        except Exception as exc:  # any failure ends the model's requests with its reason; the leader serves on
            for request in waiting:
                self.serving.book.hold(request)
            self.serving.book.end_model(name, f"{why}, and loading it again failed: {exc}")
            return
        for request in waiting:
            self.serving.book.hold(request)
