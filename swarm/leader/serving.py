"""The leader's serving brain: load and unload models over fellows, run requests on the ring, stream their tokens.

State lives here, on the leader: which fellow holds which stage (swarm.leader.models), and every request in flight
(swarm.leader.requests decides what happens to them; this module sends what it asks). Nothing here waits on a
client: messages to fellows are posted to each fellow's outbox, and tokens pile up in the requests.
"""

from __future__ import annotations

import json
import logging
import secrets
from pathlib import Path
from typing import Any

import trio

from swarm import messages
from swarm.config import Settings
from swarm.errors import ModelNotFound, ModelNotLoaded, PlacementError, SwarmError
from swarm.leader.models import ModelServing, StageState, load_message, model_size
from swarm.leader.placement import FellowCapacity, place
from swarm.leader.relay import RelayHub
from swarm.leader.requests import NotLoaded, Request, RequestBook, ToStage0

log = logging.getLogger(__name__)


class Serving:
    def __init__(self, store, settings: Settings, models_root: Path, relay: RelayHub):
        self.store = store
        self.settings = settings
        self.models_root = models_root
        self.relay = relay
        self.hub = None  # set by the app: FellowHub
        self.nursery: trio.Nursery | None = None  # set while the leader serves: background work (Direct links)
        self.direct_links = None  # set by the app: swarm.leader.direct_links.DirectLinkCoordinator
        self.on_ready = None  # set by the app: called with a model's name when it becomes ready
        self.models: dict[str, ModelServing] = {}
        self.book = RequestBook()
        self.hop_stats: dict[str, dict] = {}  # hop id -> what its sending fellow last reported

    # --- queries --------------------------------------------------------------------------------------------------

    @property
    def requests(self) -> dict[str, Request]:
        return self.book.by_rid

    def models_on_fellow(self, fellow_id: int) -> list[str]:
        return [m.name for m in self.models.values() if any(s.plan.fellow_id == fellow_id for s in m.stages)]

    def status(self, name: str) -> str:
        serving = self.models.get(name)
        return serving.status if serving else "not_loaded"

    async def manifest(self, name: str) -> dict:
        row = await trio.to_thread.run_sync(self.store.get_model, name)
        if row is None:
            raise ModelNotFound(f"model {name!r} is not in the catalogue. Import it with `swarm model import`.")
        return row.manifest

    # --- load / unload --------------------------------------------------------------------------------------------

    async def load(self, name: str, num_stages: int | None = None) -> ModelServing:
        manifest = await self.manifest(name)
        current = self.models.get(name)
        if current is not None and current.status in ("loading", "ready"):
            return current
        fellows = list(self.hub.online.values())
        if num_stages is None:
            num_stages = max(1, min(len(fellows), manifest["num_layers"]))
        size = model_size(manifest, cpu=not any(f.hardware.gpus for f in fellows))
        capacities = [FellowCapacity(f.id, f.name, f.hardware.serving_free_bytes(self.settings.device)) for f in fellows]
        plans = place(size, capacities, num_stages, self.settings.serve_context_tokens)
        serving = ModelServing(name, "l" + secrets.token_hex(6), [StageState(p) for p in plans])
        self.models[name] = serving
        config = await trio.to_thread.run_sync(lambda: json.loads((self.models_root / name / "config.json").read_text()))
        n = len(plans)
        serving.hop_ids = ["h" + secrets.token_hex(8) for _ in range(n)] if n > 1 else []
        for i, hop_id in enumerate(serving.hop_ids):
            self.relay.open_channel(hop_id, plans[i].fellow_id, plans[(i + 1) % n].fellow_id)
        for i, plan in enumerate(plans):
            self.hub.online[plan.fellow_id].post(load_message(serving, manifest, config, i, self.hub.online,
                                                              self.settings.pipeline_transport))
        serving.notify()
        return serving

    async def unload(self, name: str, keep_state: bool = False) -> None:
        serving = self.models.get(name)
        if serving is None:
            return
        for stage in serving.stages:
            conn = self.hub.online.get(stage.plan.fellow_id)
            if conn is not None:
                conn.post({"t": "unload", "model": name})
        for hop_id in serving.hop_ids:
            self.relay.close_channel(hop_id)
            self.hop_stats.pop(hop_id, None)
        self.book.end_model(name, f"model {name} was unloaded")
        if not keep_state:
            del self.models[name]
        serving.notify()

    async def wait_ready(self, name: str, timeout: float) -> ModelServing:
        with trio.move_on_after(timeout):
            while True:
                serving = self.models.get(name)
                if serving is None:
                    raise ModelNotLoaded(f"model {name} is not loaded")
                if serving.status == "ready":
                    return serving
                if serving.status == "failed":
                    raise PlacementError(f"loading {name} failed: {serving.error}")
                await serving.changed.wait()
        raise ModelNotLoaded(f"model {name} did not become ready within {timeout:.0f} s")

    # --- requests -------------------------------------------------------------------------------------------------

    def submit(self, request: Request) -> Request:
        serving = self.models.get(request.model)
        if serving is None or serving.status != "ready":
            state = "loading" if serving and serving.status == "loading" else "not loaded"
            raise ModelNotLoaded(
                f"model {request.model} is {state}. Load it first (swarm model-load {request.model}, or Load on the "
                f"chat page), then send the request again."
            )
        if self.hub.online.get(serving.stages[0].plan.fellow_id) is None:
            raise ModelNotLoaded(f"stage 0 of {request.model} is offline")
        self._perform(self.book.submit(request))
        return request

    def find(self, request_id: str) -> Request | None:
        return self.book.find(request_id)

    def cancel(self, request: Request) -> None:
        self._perform(self.book.cancel(request))

    def _perform(self, actions: list) -> None:
        for action in actions:
            if isinstance(action, ToStage0):
                serving = self.models.get(action.model)
                conn = self.hub.online.get(serving.stages[0].plan.fellow_id) if serving else None
                if conn is not None:
                    conn.post(action.message)
                elif isinstance(action.message, messages.Generate):
                    self._perform(self.book.on_failed(messages.Failed(
                        action.model, action.message.rid, f"stage 0 of {action.model} is offline")))
            elif isinstance(action, NotLoaded):
                serving = self.models.get(action.model)
                if serving is not None:
                    serving.status, serving.error = "failed", action.text
                    serving.notify()

    # --- messages from fellows ------------------------------------------------------------------------------------

    async def on_fellow_message(self, conn, message: Any) -> None:
        """Everything a fellow's control link brings. Never waits on a client or another fellow."""
        if isinstance(message, messages.Tokens):
            self.book.on_tokens(message)
        elif isinstance(message, messages.Failed):
            log.info("request %s failed on stage %s: %s", message.rid, message.stage, message.message)
            self._perform(self.book.on_failed(message))
        elif isinstance(message, messages.HopLost):
            log.info("a link of %s over the %s broke; re-sending its requests", message.model, message.path)
            self._perform(self.book.on_path_lost(message.model))
        elif not isinstance(message, dict):
            log.debug("ignoring a %s from %s", type(message).__name__, conn.name)
        elif message["t"] == "heartbeat":
            for hop in message.get("hops") or []:
                if isinstance(hop, dict) and isinstance(hop.get("hop_id"), str):
                    self.hop_stats[hop["hop_id"]] = hop
        elif message["t"] in ("load_progress", "loaded", "load_failed"):
            self._on_load_event(conn, message)
        elif message["t"] in ("punch_candidates", "punch_result", "punch_pong") and self.direct_links is not None:
            self.direct_links.on_message(conn, message)

    def _on_load_event(self, conn, message: dict) -> None:
        serving = self.models.get(message["model"])
        if serving is None or serving.load_id != message.get("load_id"):
            return
        stage = next((s for s in serving.stages if s.plan.fellow_id == conn.id), None)
        if stage is None:
            return
        if message["t"] == "load_progress":
            stage.phase, stage.fraction = message["phase"], float(message["fraction"])
        elif message["t"] == "loaded":
            stage.phase, stage.fraction, stage.ready = "ready", 1.0, True
            if all(s.ready for s in serving.stages) and serving.status == "loading":
                serving.status = "ready"
                log.info("model %s is ready over %d stages", serving.name, len(serving.stages))
                if len(serving.stages) > 1 and self.nursery is not None:
                    self.nursery.start_soon(self._ring_ready, serving)
        elif message["t"] == "load_failed":
            stage.error = message.get("message")
            serving.status, serving.error = "failed", stage.error
            log.warning("loading %s failed: %s", serving.name, stage.error)
        serving.notify()

    async def _ring_ready(self, serving: ModelServing) -> None:
        for stage in serving.stages:
            conn = self.hub.online.get(stage.plan.fellow_id)
            if conn is not None:
                conn.post({"t": "ring_ready", "model": serving.name})
        if self.direct_links is not None:
            await self.direct_links.start(serving)

    async def on_fellow_lost(self, conn) -> None:
        for serving in list(self.models.values()):
            lost = [s for s in serving.stages if s.plan.fellow_id == conn.id]
            if not lost:
                continue
            serving.status = "failed"
            serving.error = f"stage {lost[0].plan.index} on {conn.name} went away"
            self.book.end_model(serving.name, f"{serving.error} while answering; send the message again once the "
                                              f"model is loaded")
            serving.notify()


__all__ = ["Serving", "Request", "ModelServing", "SwarmError"]
