"""The leader's serving brain: load and unload models over fellows, run requests on the ring, stream their tokens.

State lives here, on the leader: which fellow holds which stage (swarm.leader.serving.models), and every request in
flight (swarm.leader.serving.requests decides what happens to them; this module sends what it asks). Rings are built,
rebuilt after a fellow drops out, and adopted after a leader restart by swarm.leader.serving.recovery. Nothing here
waits on a client: messages to fellows are posted to each fellow's outbox, and tokens pile up in the requests.

The work is done by parts, each in its own module: :attr:`Serving.loader` loads and unloads models
(swarm.leader.serving.loader), :attr:`Serving.intake` takes requests in (swarm.leader.serving.intake),
:attr:`Serving.contexts` knows how long a conversation each model takes (swarm.leader.serving.contexts), and
:attr:`Serving.fellow_messages` hands what the fellows send to the part it concerns
(swarm.leader.serving.fellow_messages). Serving itself holds the state they share and sends what the request book
decides (:meth:`Serving.perform`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from swarm import messages
from swarm.config import Settings
from swarm.errors import ModelNotFound
from swarm.leader.fleet.link_matrix import LinkMatrix
from swarm.leader.fleet.relay import RelayHub
from swarm.leader.planning.auto_load import AutoLoad
from swarm.leader.serving.contexts import Contexts
from swarm.leader.serving.drafting import with_drafting
from swarm.leader.serving.drain import Drains
from swarm.leader.serving.fellow_messages import FellowMessages
from swarm.leader.serving.intake import Intake
from swarm.leader.serving.loader import Loader
from swarm.leader.serving.models import ModelServing
from swarm.leader.serving.prefix_index import PrefixCaches
from swarm.leader.serving.rebalance import Rebalancer
from swarm.leader.serving.recovery import Recovery
from swarm.leader.serving.request import Request
from swarm.leader.serving.requests import NotLoaded, RequestBook, ToStage0
from swarm.leader.serving.verify import Verifier

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
        self.loader = Loader(self)  # loads and unloads models
        self.intake = Intake(self)  # takes requests in
        self.contexts = Contexts(self)  # the models' served contexts
        self.fellow_messages = FellowMessages(self)  # what the fellows send
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

    # --- the parts' methods others call on Serving (swarm.leader.serving.recovery, planning.planner, fleet.fellows)

    async def unload(self, name: str, *, reason: str | None = None, keep_state: bool = False) -> None:
        await self.loader.unload(name, reason=reason, keep_state=keep_state)

    def placement(self, *args, **kwargs):
        return self.loader.placement(*args, **kwargs)

    def kind_of(self, name: str, manifest: dict | None) -> str:
        return self.loader.kind_of(name, manifest)

    async def context_of(self, name: str) -> int:
        return await self.contexts.context_of(name)

    async def on_fellow_message(self, conn, message: Any) -> None:
        await self.fellow_messages.on_fellow_message(conn, message)

    def on_fellow_joined(self, conn, stages: list) -> list[str]:
        return self.fellow_messages.on_fellow_joined(conn, stages)

    async def on_fellow_lost(self, conn) -> None:
        await self.fellow_messages.on_fellow_lost(conn)

    # --- background work ------------------------------------------------------------------------------------------

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
            except Exception:  # a bug in one background task is logged; the leader serves on
                log.exception("background work %s failed", getattr(fn, "__name__", fn))

        self.nursery.start_soon(guarded)

    # --- requests -------------------------------------------------------------------------------------------------

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
                self.start_task(self.loader.reload, action.model, action.text)

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

    def resume(self, name: str) -> None:
        """The ring of ``name`` is whole: send the requests that waited for it, as its budget allows."""
        serving = self.models.get(name)
        if serving is not None:
            # a new ring, or the same one after a failover: a cache anew (a drain's switch carries what it handed over)
            self.prefix.reset(name, serving.config, tuple(stage.plan.fellow_id for stage in serving.stages))
            self.perform(self.book.resume(name, serving.budget(self.settings)))
