"""The leader's serving brain: load and unload models over fellows, run requests on the ring, stream their tokens.

State lives here, on the leader: which fellow holds which stage (swarm.leader.serving.models), and every request in
flight (swarm.leader.serving.requests decides what happens to them; this module sends what it asks). Rings are built,
rebuilt after a fellow drops out, and adopted after a leader restart by swarm.leader.serving.recovery. Nothing here
waits on a client: messages to fellows are posted to each fellow's outbox, and tokens pile up in the requests.
"""

from __future__ import annotations

import json
import logging
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from swarm import messages
from swarm.config import Settings
from swarm.errors import ContextTooLong, ModelNotFound, ModelNotLoaded, PlacementError, PoolBusy, QueueTimeout, counted
from swarm.leader.api.limits import context_reason, model_context, served_context
from swarm.leader.fleet.link_matrix import LinkMatrix
from swarm.leader.fleet.relay import RelayHub
from swarm.leader.planning.auto_load import AutoLoad, room
from swarm.leader.planning.draft_model import resolve
from swarm.leader.planning.link_placement import arrange, fellow_speeds
from swarm.leader.planning.placement import place
from swarm.leader.serving.drafting import sliding, with_drafting
from swarm.leader.serving.drain import Drains
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
from swarm.leader.serving.performance import hop_rate
from swarm.leader.serving.prefix_index import PrefixCaches
from swarm.leader.serving.rebalance import Rebalancer
from swarm.leader.serving.recovery import Recovery
from swarm.leader.serving.requests import NotLoaded, Request, RequestBook, RequestState, ToStage0, too_long
from swarm.leader.serving.verify import Verifier
from swarm.quantization import check_model_kind, default_kind

if TYPE_CHECKING:
    from swarm.leader.fleet.direct_links import DirectLinkCoordinator
    from swarm.leader.fleet.fellows import FellowConn, FellowHub
    from swarm.leader.serving.quotas import QuotaBook

log = logging.getLogger(__name__)


class Serving:
    def __init__(self, store, settings: Settings, models_root: Path, relay: RelayHub):
        self.store = store
        self.settings = settings
        self.models_root = models_root
        self.relay = relay
        self.hub: FellowHub | None = None  # set by the app
        self.quotas: QuotaBook | None = None  # set by the app: per user and token limits (swarm.leader.serving.quotas)
        self.nursery: trio.Nursery | None = None  # set while the leader serves: background work
        self.direct_links: DirectLinkCoordinator | None = None  # set by the app
        self.models: dict[str, ModelServing] = {}
        self.book = RequestBook()
        self.hop_stats: dict[str, dict] = {}  # hop id -> what its sending fellow last reported
        self.placements: dict[int, dict] = {}  # fellow id -> model -> where its stage runs {"devices", "bytes"}
        # Models that went because nobody used them (or a fellow dropped them): a request loads them again.
        self.reload_on_request: set[str] = set()
        self.quantization_of: dict[str, str] = {}  # the kind each model was last asked to load at
        self.own_contexts: dict[str, int | None] = {}  # model -> its own context, read from its config when asked
        # model -> the context its last load asked for (context_tokens, --context-tokens): a cap below its own
        self.context_caps: dict[str, int] = {}
        self.kv_cache_of: dict[str, str] = {}  # model -> how its last load asked stages to hold keys and values
        self.left_out: dict[str, list[str]] = {}  # model -> why fellows are left out of its ring (link-aware)
        self.served_contexts: dict[str, int] = {}  # model -> its served context when it was last loaded (body limits)
        self.recovery = Recovery(self)
        self.auto_load = AutoLoad(self)  # loads what a request asks for, making room where allowed
        self.link_matrix = LinkMatrix(self)  # measured links between each pool's fellows (the admin page's matrix)
        self.prefix = PrefixCaches(settings.serve_prefix_cache_tokens)  # the prefix cache's index, per model
        self.verifier = Verifier(self)  # spot checks of the fellows' work (SWARM_SERVE_VERIFY)
        self.drains = Drains(self)  # fellows that leave hand their stages over first
        self.rebalance = Rebalancer(self)  # live moves to faster fellows (SWARM_SERVE_REBALANCE)

    # --- queries --------------------------------------------------------------------------------------------------

    @property
    def requests(self) -> dict[str, Request]:
        return self.book.by_rid

    def models_on_fellow(self, fellow_id: int) -> list[str]:
        """The models a fellow holds a stage (or a hot cover) of."""
        return [m.name for m in self.models.values()
                if any(s.plan.fellow_id == fellow_id or s.cover == fellow_id for s in m.stages)]

    def may_fetch(self, fellow_id: int, name: str, path: str) -> bool:
        """Whether fellow ``fellow_id`` may download file ``path`` of model ``name``: a file of a stage placed on it,
        or of the draft model its last stage holds."""
        serving = self.models.get(name)
        if serving is not None and path in serving.files_for(fellow_id):
            return True
        return any(m.draft is not None and m.draft["model"] == name and path in m.draft_files_for(fellow_id)
                   for m in self.models.values())

    def status(self, name: str) -> str:
        serving = self.models.get(name)
        return serving.status if serving else "not_loaded"

    async def manifest(self, name: str) -> dict:
        return (await self.model_row(name)).manifest

    async def model_row(self, name: str):
        """The catalogue's record of model ``name`` (its id): its manifest and its pool."""
        row = await trio.to_thread.run_sync(self.store.get_model, name)
        if row is None:
            raise ModelNotFound(f"model {name!r} is not in the catalogue. Import it with `swarm model import`.")
        return row

    # --- load / unload --------------------------------------------------------------------------------------------

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
        if pool_id is not None and fellow_id is not None and fellow_id in self.online and \
                self.online[fellow_id].pool_id != pool_id:
            raise PlacementError(f"fellow {self.online[fellow_id].name} is in another pool than {name}; a model "
                                 "loads over its own pool's fellows only.")
        fellows = [f for f in self.online.values() if (not f.standby or f.id == fellow_id)
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
        fellows, kind = quantized_fellows(asked, fellows, num_stages, self.settings.device)
        if kind != asked:
            log.info("%s loads in full precision: fewer than %d fellows report quantized loads", name, num_stages)
        # A CPU fellow holds 16-bit weights widened to float32: a pool with one budgets every stage so (its GPU
        # fellows then keep room to spare, never too little).
        cpu = not fellows or not all(f.hardware.gpus for f in fellows)
        kv = kv_cache or self.kv_cache_of.get(name) or self.settings.serve_kv_cache
        size = model_size(manifest, cpu=cpu, quantization=kind, kv_cache=kv)
        context = self.context_tokens(name)
        capacities = room(self, fellows, releasing | {name})  # a load again (the planner) replaces its own
        try:
            plans = place(size, capacities, num_stages, context, fellow_id)
            if draft_manifest is not None and len(plans) > 1:
                plans = self._with_draft_model(name, plans, size, capacities, num_stages,
                                               draft_size(draft_manifest, cpu, kind), context)
        except PlacementError:
            if outdated:
                raise PlacementError(" ".join(f.why_incompatible() for f in outdated)) from None
            raise
        self.left_out[name] = []
        if fellow_id is None and not plans[-1].draft_bytes:  # the ring's order and fellows by the measured links
            arranged = arrange(size, capacities, plans, fellow_speeds(fellows), self.link_matrix.hops(),
                               int(manifest.get("hidden_size") or 0) * (4 if cpu else 2), context, choose_count)
            if arranged.plans != plans:
                log.info("%s: link-aware placement, %.0f ms a token instead of %.0f%s", name, arranged.ms_per_token,
                         arranged.link_blind_ms_per_token, "".join(f"; {why}" for why in arranged.left_out))
            plans, self.left_out[name] = arranged.plans, arranged.left_out
        check_quantization(kind, plans, {f.id: f for f in fellows}, self.settings.device)
        return plans, size, kind, fellows, capacities

    def _with_draft_model(self, name: str, plans: list, size, capacities: list, num_stages: int, draft,
                          context: int | None = None) -> list:
        """``plans`` placed again with a draft model (a swarm.leader.planning.placement.DraftSize) on the last stage's
        fellow; ``plans`` as they are where that fellow runs a version without draft models or --
        SWARM_SERVE_DRAFT_MODEL=auto
        -- where the draft model does not fit (a named one: the PlacementError says what it needs)."""
        try:
            context = context if context is not None else served_context(None, self.settings.serve_context_tokens)
            with_draft = place(size, capacities, num_stages, context, None, draft)
        except PlacementError as exc:
            if self.settings.serve_draft_model != "auto":
                raise
            log.warning("%s loads without a draft model (SWARM_SERVE_DRAFT_MODEL=auto): it does not fit. %s", name,
                        exc)
            return plans
        assert self.hub is not None  # set by the app
        last = self.hub.online[with_draft[-1].fellow_id]
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
        current = self.models.get(name)
        if current is None or current.status not in (ModelStatus.LOADING, ModelStatus.READY, ModelStatus.RECOVERING):
            return False
        asked_otherwise = (num_stages is not None and num_stages != len(current.stages)) or \
            (fellow_id is not None and current.stages[0].plan.fellow_id != fellow_id)
        requantized = quantization is not None and quantization != self.quantization_of.get(name, current.quantization)
        requantized |= context_tokens is not None and context_tokens != self.context_caps.get(name)
        requantized |= kv_cache is not None and kv_cache != current.kv_cache
        return requantized or (current.status == ModelStatus.RECOVERING and asked_otherwise)

    def kind_of(self, name: str, manifest: dict | None) -> str:
        """The kind ``name`` loads at when none is asked: as it was last asked, else its own default (gguf for a model
        that keeps a GGUF's blocks, none otherwise: swarm.quantization.default_kind)."""
        return self.quantization_of.get(name) or default_kind(manifest)

    async def load(self, name: str, num_stages: int | None = None, fellow_id: int | None = None,
                   quantization: str | None = None, context_tokens: int | None = None,
                   kv_cache: str | None = None) -> ModelServing:
        """Place ``name`` and send each fellow its stage. ``quantization`` (swarm.quantization.KINDS; None: as it
        was last loaded, else none) is how the stages hold their weights; a load asked at another kind than the one
        serving starts over at that kind. ``context_tokens`` caps the model's served context below its own (None: as
        last loaded, else its own, capped by SWARM_SERVE_CONTEXT_TOKENS); ``kv_cache`` (swarm.kv_kinds; None: as last
        loaded, else SWARM_SERVE_KV_CACHE) is how its stages hold keys and values."""
        row = await self.model_row(name)
        manifest = row.manifest
        if quantization is not None:  # refused before anything serving is unloaded for it
            check_model_kind(quantization, manifest, name)
        current = self.models.get(name)
        if current is not None and current.status in (ModelStatus.LOADING, ModelStatus.READY, ModelStatus.RECOVERING):
            if not self.restarts(name, num_stages, fellow_id, quantization, context_tokens, kv_cache):
                return current
            # asked for another shape while the old one is still being put back together, or another quantization:
            # start over as asked
            await self.unload(name, reason=f"model {name} is being loaded again as asked")
        asked = quantization if quantization is not None else self.kind_of(name, manifest)
        config_file = self.models_root / name / "config.json"
        config = await trio.to_thread.run_sync(lambda: json.loads(config_file.read_text()))
        self.own_contexts[name] = model_context(config)
        if context_tokens is not None:
            self.context_caps[name] = context_tokens
        kv = kv_cache or self.kv_cache_of.get(name) or self.settings.serve_kv_cache
        draft = None  # SWARM_SERVE_DRAFT_MODEL: checked before anything is placed (a wrong name refuses the load)
        if self.settings.serve_draft_model and self.settings.serve_speculative > 0 and num_stages != 1 \
                and not sliding(config):  # a sliding model does not draft at all (swarm.leader.serving.drafting)
            draft = await trio.to_thread.run_sync(resolve, self.settings.serve_draft_model, name, row.pool_id,
                                                  self.store, self.models_root)
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
        serving.speculative = self.settings.serve_speculative  # drafting ahead: the setting at this load
        serving.context_tokens = self.served_contexts[name] = self.context_tokens(name)
        serving.kv_cache = self.kv_cache_of[name] = kv
        if draft is not None and plans[-1].draft_bytes:
            serving.draft = draft_message(draft)
        self.models[name] = serving
        self.quantization_of[name] = asked
        self.reload_on_request.discard(name)
        for i, plan in enumerate(plans):
            self.online[plan.fellow_id].post(load_message(serving, i))
        self.start_task(self._warm_tokenizer, name)
        serving.notify()
        return serving

    async def unload(self, name: str, *, reason: str | None = None, keep_state: bool = False) -> None:
        """Unload ``name`` from every fellow; its requests end with ``reason`` (an admin's unload says so)."""
        serving = self.models.get(name)
        if serving is None:
            return
        for fellow_id in serving.fellow_ids | {s.cover for s in serving.stages if s.cover is not None}:
            conn = self.online.get(fellow_id)
            if conn is not None:
                conn.post({"t": "unload", "model": name})
        self.recovery.close_ring(serving)
        self.book.end_model(name, reason or f"model {name} was unloaded")
        self.prefix.forget(name)  # the stages drop their blocks with the model
        if not keep_state:
            del self.models[name]
        await trio.to_thread.run_sync(self.store.delete_serving, name)
        serving.notify()

    async def wait_ready(self, name: str, timeout: float) -> ModelServing:
        with trio.move_on_after(timeout):
            while True:
                serving = self.models.get(name)
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
            await trio.to_thread.run_sync(warm_up, self.models_root / name)
        except Exception as exc:  # the first request reports whatever is wrong with the tokenizer
            log.warning("could not prepare the tokenizer of %s: %s", name, exc)

    @property
    def online(self) -> dict[int, FellowConn]:
        """The fellows online now, by id (the app's FellowHub)."""
        assert self.hub is not None, "the app sets Serving.hub before the leader serves"
        return self.hub.online

    def start_task(self, fn, *args) -> None:
        """Run ``fn(*args)`` in the background. These tasks share the leader's nursery: a bug in one is logged and
        must not take the leader down."""
        if self.nursery is None:
            return

        async def guarded() -> None:
            try:
                await fn(*args)
            except Exception:
                log.exception("background work %s failed", getattr(fn, "__name__", fn))

        self.nursery.start_soon(guarded)

    # --- requests -------------------------------------------------------------------------------------------------

    async def submit(self, request: Request) -> Request:
        """Send ``request`` to its model's ring, or let it wait while the model loads or recovers; a model that went
        idle is loaded again for it."""
        await self.check(request)
        self.perform(self.book.submit(request))  # runs now, or waits for the ring or for room
        return request

    async def submit_group(self, requests: list[Request]) -> list[Request]:
        """Sampled choices of one prompt, as :meth:`submit`, started together so that the ring prefills the prompt
        once (RequestBook.submit_group)."""
        for i, request in enumerate(requests):
            await self.check(request, group=len(requests) if i == 0 else 0)  # the quotas count the group once
        self.perform(self.book.submit_group(requests))
        return requests

    async def check(self, request: Request, group: int = 1) -> None:
        """Refuses ``request`` when its model is not served, it is longer than the pool, its user or API token is
        over a quota (counting ``group`` requests of its kind), or the queue is full."""
        serving = self.models.get(request.model)
        if serving is None:  # it went idle, or auto-load is on: loaded for this request (it waits meanwhile)
            serving = await self.auto_load.ensure(request.model)
        else:
            self.auto_load.touch(request.model)
        if serving is None or serving.status == ModelStatus.FAILED:
            state = "not loaded" if serving is None else f"failed to load ({serving.error})"
            off = ", and auto-load is off (the admin page)" if serving is None else ""
            raise ModelNotLoaded(
                f"model {request.model} is {state}{off}. Load it first (swarm model-load {request.model}, or Load on "
                f"the chat page), then send the request again."
            )
        self.check_context(request.model, request.need, len(request.prompt), request.max_tokens)
        if self.quotas is not None:
            self.quotas.check(request, serving.pool_id, group)
        limit = self.settings.serve_queue_limit
        if self.book.queued(request.model) >= limit:
            wait = self.book.retry_after(request.model)
            raise PoolBusy(f"the pool serving {request.model} is busy: its queue is full, with "
                           f"{counted(limit, 'request')} waiting (SWARM_SERVE_QUEUE_LIMIT). Send this one again in "
                           f"about {wait} s.", wait)

    async def wait_started(self, requests: list[Request], receive=None) -> bool:
        """Until every one of ``requests`` (the replies of one API request) leaves the queue: it runs on the ring, or
        it ended. A request that waits longer than SWARM_SERVE_QUEUE_TIMEOUT_S is taken out of the queue and refused
        (QueueTimeout: a 503), and the others with it. With ``receive`` (the ASGI receive of the client's connection),
        a client that goes away meanwhile cancels every one of them at once rather than leave them to run for nobody
        (issue 32: a streamed request of 16 replies left 15 running): True then, else False."""
        gone = False

        async def watch(cancel_scope: trio.CancelScope) -> None:
            nonlocal gone
            await client_gone(receive)
            gone = True
            log.info("request %s: its client went away while it waited to start", requests[0].id)
            for request in requests:
                self.cancel(request)
            cancel_scope.cancel()

        refused: QueueTimeout | None = None
        async with trio.open_nursery() as nursery:
            if receive is not None:
                nursery.start_soon(watch, nursery.cancel_scope)
            try:
                for request in requests:
                    await self._wait_one(request)
            except QueueTimeout as exc:  # raised out here, not as an exception group of the nursery
                refused = exc
            nursery.cancel_scope.cancel()
        if refused is not None:
            raise refused
        return gone

    async def _wait_one(self, request: Request) -> None:
        timeout = self.settings.serve_queue_timeout_s
        with trio.move_on_after(max(0.0, request.created_at + timeout - trio.current_time())):
            while request.state in (RequestState.NEW, RequestState.WAITING):
                await request.changed.wait()
        if request.state in (RequestState.NEW, RequestState.WAITING):
            ahead = self.book.queued(request.model) + len(self.book.of_model(request.model))
            self.cancel(request)
            status = self.status(request.model)
            if status == ModelStatus.READY:
                raise QueueTimeout(
                    f"this request waited {timeout:.0f} s for room on the pool serving {request.model} and did not "
                    f"start (SWARM_SERVE_QUEUE_TIMEOUT_S), with {counted(ahead - 1, 'other request')} running or "
                    "waiting. Try again later, or serve the model on more fellows.")
            raise QueueTimeout(
                f"model {request.model} was not ready within {timeout:.0f} s (SWARM_SERVE_QUEUE_TIMEOUT_S): it is "
                f"still {status.replace('_', ' ')}. Try again later.")

    def context_tokens(self, name: str) -> int:
        """The served context of ``name`` (swarm.leader.api.limits.served_context): the longest conversation, prompt and
        reply, it takes -- its own context, capped by SWARM_SERVE_CONTEXT_TOKENS and its load's context_tokens. Never
        the pool's KV budget, which may hold far more than the model was made for (issue 32)."""
        return served_context(self._own_context(name), self.settings.serve_context_tokens, self.context_caps.get(name))

    def largest_context(self) -> int:
        """The longest served context of the models loaded since the leader started (FALLBACK_CONTEXT before any):
        what a /v1 body may carry (swarm.leader.api.limits.chat_body_limit). A chat needs its model loaded (or loaded
        before, to load again on request), so no chat is refused by it that its model would take."""
        known = [*self.served_contexts.values(), *(self.context_tokens(m) for m in self.models)]
        return max(known, default=served_context(None, self.settings.serve_context_tokens))

    async def context_of(self, name: str) -> int:
        """``context_tokens``, reading the model's config (in a worker thread) when it is not served yet."""
        if name not in self.models and name not in self.own_contexts:
            path = self.models_root / name / "config.json"

            def read() -> int | None:
                try:
                    return model_context(json.loads(path.read_text()))
                except (OSError, ValueError):
                    return None

            self.own_contexts[name] = await trio.to_thread.run_sync(read)
        return self.context_tokens(name)

    def _own_context(self, name: str) -> int | None:
        serving = self.models.get(name)
        if serving is not None and serving.config:
            return model_context(serving.config)
        return self.own_contexts.get(name)

    def check_context(self, name: str, need: int, prompt: int, reply: int) -> None:
        """ContextTooLong when a conversation of ``need`` tokens (``prompt`` and up to ``reply``) is longer than the
        served context of ``name``."""
        context = self.context_tokens(name)
        if need > context:
            why = context_reason(self._own_context(name), self.settings.serve_context_tokens,
                                 self.context_caps.get(name))
            raise ContextTooLong(too_long(need, prompt, reply, context, why))

    def find(self, request_id: str) -> Request | None:
        return self.book.find(request_id)

    def cancel(self, request: Request) -> None:
        self.perform(self.book.cancel(request))

    def perform(self, actions: list) -> None:
        for action in actions:
            if isinstance(action, ToStage0):
                serving = self.models.get(action.model)
                conn = self.online.get(serving.stages[0].plan.fellow_id) if serving else None
                if conn is not None:
                    message = with_drafting(action.message, serving, self.online)
                    # spot checks first (their picks reach stage 0 before the request); a checked request is computed
                    # whole, as its checker recomputes it: no prefix cache hit for it
                    checked = isinstance(message, messages.Generate) and serving is not None and \
                        self.verifier.on_generate(serving, message)
                    conn.post(self._with_prefix(message, reuse=not checked))
                elif isinstance(action.message, messages.Generate):
                    for rid in action.message.rids:  # a group start: each of its choices
                        self.perform(self.book.on_failed(messages.Failed(
                            action.model, rid, f"stage 0 of {action.model} is offline")))
            elif isinstance(action, NotLoaded):
                self.start_task(self._reload, action.model, action.text)

    def _with_prefix(self, message: Any, reuse: bool = True) -> Any:
        """A Generate with the prefix cache's plan (swarm.leader.serving.prefix_index), within what the model's KV
        budget leaves free beside its running requests; a Cancel frees the blocks its request used."""
        if isinstance(message, messages.Cancel):
            self.prefix.ended(message.model, message.rid)
            return message
        if not isinstance(message, messages.Generate):
            return message
        budget = self.book.budgets.get(message.model)
        serving = self.models.get(message.model)
        if budget is None or serving is None or not self.prefix.ring_takes_plans(serving, self.online):
            return message
        room = budget.tokens - sum(r.need for r in self.book.of_model(message.model))
        message = self.prefix.attach(message, room, reuse)
        request = self.book.by_rid.get(message.rid)
        if request is not None and request.attempts == 1:  # what the reply's usage reports
            request.cached_tokens = message.prefix.cached if message.prefix is not None else 0
        return message

    async def _reload(self, name: str, why: str) -> None:
        """A fellow said it does not hold the model: unload what is left and load it again; the requests that were
        running wait for it and go out again."""
        serving = self.models.get(name)
        if serving is None or serving.status != ModelStatus.READY:
            return
        log.info("%s; loading %s again", why, name)
        self.perform(self.book.interrupt(name))
        waiting = self.book.waiting.pop(name, [])
        await self.unload(name)
        self.reload_on_request.add(name)
        try:
            await self.load(name, len(serving.stages))
        except Exception as exc:
            for request in waiting:
                self.book.hold(request)
            self.book.end_model(name, f"{why}, and loading it again failed: {exc}")
            return
        for request in waiting:
            self.book.hold(request)

    def resume(self, name: str) -> None:
        """The ring of ``name`` is whole: send the requests that waited for it, as its budget allows."""
        serving = self.models.get(name)
        if serving is not None:
            self.prefix.reset(name, serving.config)  # a new ring, or the same one after a failover: a cache anew
            self.perform(self.book.resume(name, serving.budget(self.settings)))

    # --- messages from fellows ------------------------------------------------------------------------------------

    async def on_fellow_message(self, conn, message: Any) -> None:
        """Everything a fellow's control link brings. Never waits on a client or another fellow."""
        if isinstance(message, messages.Tokens):
            if self._serves(conn, message.model):
                self.prefix.on_tokens(message)  # first: the requests this ending starts may reuse its blocks
                self.perform(self.book.on_tokens(message))
        elif isinstance(message, messages.Failed):
            if self._serves(conn, message.model):
                log.info("request %s failed on stage %s: %s", message.rid, message.stage, message.message)
                self.prefix.failed(message.model, message.rid)
                self.perform(self.book.on_failed(message))
        elif isinstance(message, messages.StageTimes):
            if self._serves(conn, message.model):
                self.book.on_stage_times(message)
        elif isinstance(message, messages.HopLost):
            if self._serves(conn, message.model):
                log.info("a link of %s over the %s broke; re-sending its requests", message.model, message.path)
                self.perform(self.book.on_path_lost(message.model))
        elif not isinstance(message, dict):
            log.debug("ignoring a %s from %s", type(message).__name__, conn.name)
        elif message["t"] == "heartbeat":
            # A fellow reports the hops it sends on (hop i leaves stage i), and only those.
            own = {m.hop_ids[s.plan.index] for m in self.models.values() for s in m.stages
                   if s.plan.fellow_id == conn.id and s.plan.index < len(m.hop_ids)}
            hops = message.get("hops")
            for hop in hops if isinstance(hops, list) else []:
                if isinstance(hop, dict) and hop.get("hop_id") in own:
                    previous = self.hop_stats.get(hop["hop_id"])
                    self.hop_stats[hop["hop_id"]] = hop_rate(previous, hop, trio.current_time())
            placement = message.get("placement")
            self.placements[conn.id] = placement if isinstance(placement, dict) else {}
        elif message["t"] in ("load_progress", "loaded", "load_failed", "linked", "link_failed"):
            self.recovery.on_stage_event(conn, message)
        elif message["t"] in ("verify_sample", "verify_result"):
            self.verifier.on_message(conn, message)
        elif message["t"] == "leave":  # SIGTERM of the fellow's process: hand its stages over, then it goes
            self.start_task(self.drains.on_leave, conn, message)
        elif message["t"] == "unloaded" and message.get("reason") == "idle":
            await self._idle(conn, message)
        elif message["t"] == "link_report":
            self.link_matrix.on_report(conn, message)
            self.rebalance.pool_changed()
        elif message["t"] in ("punch_candidates", "punch_result", "punch_pong") and self.direct_links is not None:
            self.direct_links.on_message(conn, message)

    def _serves(self, conn, model: str) -> bool:
        """Whether ``conn`` serves a stage of ``model``: only those fellows speak for its requests."""
        serving = self.models.get(model)
        return serving is not None and conn.id in serving.fellow_ids

    async def _idle(self, conn, message: dict) -> None:
        serving = self.models.get(message.get("model", ""))
        if serving is None or serving.load_id != message.get("load_id") or conn.id not in serving.fellow_ids:
            return
        log.info("%s went idle on %s: unloading it from every fellow", serving.name, conn.name)
        await self.unload(serving.name, reason=f"model {serving.name} was unloaded: nobody used it for a while")
        self.reload_on_request.add(serving.name)

    def on_fellow_joined(self, conn, stages: list) -> list[str]:
        """A fellow (re)connected holding ``stages``: the models whose stage it keeps (it unloads the others).
        What follows from it -- adopting its stages, linking rings -- runs once its welcome has gone out."""
        self.start_task(self._adopt, conn, stages)
        self.link_matrix.fleet_changed()  # its links are measured soon
        self.rebalance.pool_changed()
        return sorted(set(self.recovery.keeps(conn, stages)) | set(self.models_on_fellow(conn.id)))

    async def _adopt(self, conn, stages: list) -> None:
        joined = self.online.get(conn.id)
        if joined is None or joined is not conn:
            return
        self.recovery.adopt(joined, stages)
        self.recovery.fleet_changed()
        if joined.standby and self.verifier.fraction > 0:
            await self.verifier.cover_all()  # spot checks: a standby that joins checks a stage nothing checks

    async def on_fellow_lost(self, conn) -> None:
        self.recovery.fellow_lost(conn)


async def client_gone(receive) -> None:
    """Returns once the client of an ASGI request has gone (http.disconnect). Trio's memory channels lose nothing to a
    cancelled receive, so a watch cancelled before that leaves the message for whoever reads next."""
    while (await receive())["type"] != "http.disconnect":
        pass
