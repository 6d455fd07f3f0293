"""The leader's serving brain: load and unload models over fellows, run requests on the ring, stream their tokens.

State lives here, on the leader: which fellow holds which stage, each request's prompt, settings and the tokens it has
streamed so far. A request that fails before its first token is sent again once, unnoticed by the user (the hop whose
direct link broke is on the relay by then).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
from pathlib import Path

import trio

from swarm.config import Settings
from swarm.errors import ModelNotFound, ModelNotLoaded, PlacementError, RequestFailed, SwarmError
from swarm.leader.placement import FellowCapacity, ModelSize, StagePlan, place
from swarm.leader.relay import RelayHub

log = logging.getLogger(__name__)

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
RETRIES_BEFORE_FIRST_TOKEN = 1


@dataclasses.dataclass
class StageState:
    plan: StagePlan
    phase: str = "queued"  # queued -> download -> extract -> load -> ready
    fraction: float = 0.0
    ready: bool = False
    error: str | None = None


@dataclasses.dataclass
class ModelServing:
    name: str
    load_id: str
    stages: list[StageState]
    status: str = "loading"  # loading | ready | failed
    error: str | None = None
    hop_ids: list[str] = dataclasses.field(default_factory=list)
    changed: trio.Event = dataclasses.field(default_factory=trio.Event)

    def notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def progress(self) -> dict:
        phases = ["queued", "download", "extract", "load", "ready"]
        overall = 0.0
        for s in self.stages:
            step = phases.index(s.phase) if s.phase in phases else 0
            overall += (step - 1 + s.fraction) / 3 if step >= 1 else 0.0
        overall = max(0.0, min(1.0, overall / max(len(self.stages), 1)))
        return {"fraction": round(overall, 3), "stages": [
            {"index": s.plan.index, "fellow": s.plan.fellow_name, "phase": s.phase, "fraction": s.fraction}
            for s in self.stages]}

    def hops(self, hop_stats: dict[str, dict]) -> list[dict]:
        """Each link of the ring in order, stage i -> i+1 (the last one carries the token back to stage 0)."""
        n = len(self.stages)
        out = []
        for i, hop_id in enumerate(self.hop_ids):
            stats = hop_stats.get(hop_id, {})
            out.append({
                "from_stage": i, "to_stage": (i + 1) % n,
                "from": self.stages[i].plan.fellow_name, "to": self.stages[(i + 1) % n].plan.fellow_name,
                "transport": stats.get("transport"), "rtt_ms": stats.get("rtt_ms"),
                "bytes_per_token": stats.get("bytes_per_token"), "bytes_sent": stats.get("bytes_sent", 0),
            })
        return out

    def describe(self) -> dict:
        return {
            "status": self.status,
            "error": self.error,
            "num_stages": len(self.stages),
            "stages": [
                {"index": s.plan.index, "fellow_id": s.plan.fellow_id, "fellow": s.plan.fellow_name,
                 "layers": [s.plan.first_layer, s.plan.end_layer], "memory_bytes": s.plan.weight_bytes,
                 "phase": s.phase, "ready": s.ready}
                for s in self.stages
            ],
            "progress": self.progress(),
        }


@dataclasses.dataclass
class Request:
    model: str
    prompt: list[int]
    max_tokens: int
    sampling: dict
    eos: list[int]
    rid: str = dataclasses.field(default_factory=lambda: "r" + secrets.token_hex(8))  # this attempt, on the ring
    id: str = ""  # stable across attempts: what clients see (x-swarm-request-id) and cancel by
    tokens: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    attempts: int = 0
    events_send: trio.MemorySendChannel | None = None
    events: trio.MemoryReceiveChannel | None = None

    def __post_init__(self) -> None:
        self.events_send, self.events = trio.open_memory_channel(1000)
        self.id = self.id or self.rid

    async def next_event(self, stall_s: float) -> tuple[str, object]:
        """The next ("tokens", ids) / ("done", reason) / ("error", text); an error when the ring goes silent."""
        with trio.move_on_after(stall_s):
            return await self.events.receive()
        return ("error", f"the ring stopped answering: no token for {stall_s:.0f} s (SWARM_REQUEST_STALL_S). "
                         "A fellow may have gone away; send the message again.")


class Serving:
    def __init__(self, store, settings: Settings, models_root: Path, relay: RelayHub):
        self.store = store
        self.settings = settings
        self.models_root = models_root
        self.relay = relay
        self.hub = None  # set by the app: FellowHub
        self.nursery: trio.Nursery | None = None  # set while the leader serves: background work (punch coordination)
        self.punching = None  # set by the app: swarm.leader.direct_links.PunchCoordinator
        self.models: dict[str, ModelServing] = {}
        self.requests: dict[str, Request] = {}
        self.hop_stats: dict[str, dict] = {}  # hop id -> what its sending fellow last reported

    # --- queries --------------------------------------------------------------------------------------------------

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
        size = _model_size(manifest, cpu=not any(f.hardware.gpus for f in fellows))
        capacities = [FellowCapacity(f.id, f.name, f.hardware.serving_free_bytes(self.settings.device)) for f in fellows]
        plans = place(size, capacities, num_stages, self.settings.serve_context_tokens)
        serving = ModelServing(name, "l" + secrets.token_hex(6), [StageState(p) for p in plans])
        self.models[name] = serving
        config = json.loads((self.models_root / name / "config.json").read_text())
        n = len(plans)
        serving.hop_ids = ["h" + secrets.token_hex(8) for _ in range(n)] if n > 1 else []
        for i, hop_id in enumerate(serving.hop_ids):
            self.relay.open_channel(hop_id, plans[i].fellow_id, plans[(i + 1) % n].fellow_id)
        try:
            for i, plan in enumerate(plans):
                conn = self.hub.online[plan.fellow_id]
                await conn.send(self._load_message(serving, manifest, config, i))
        except SwarmError as exc:
            serving.status, serving.error = "failed", f"could not reach a fellow: {exc}"
            await self.unload(name, keep_state=True)
        serving.notify()
        return serving

    def _load_message(self, serving: ModelServing, manifest: dict, config: dict, i: int) -> dict:
        from swarm.store.importer import Manifest, stage_files

        plans = [s.plan for s in serving.stages]
        plan, n = plans[i], len(plans)
        spec = {"index": i, "num_stages": n, "first_layer": plan.first_layer, "end_layer": plan.end_layer,
                "is_first": i == 0, "is_last": i == n - 1}
        files = stage_files(Manifest.from_json(json.dumps(manifest)), plan.first_layer, plan.end_layer,
                            spec["is_first"], spec["is_last"])
        message = {
            "t": "load", "model": serving.name, "load_id": serving.load_id, "stage": spec, "config": config,
            "files": [{"path": f.path, "sha256": f.sha256, "size": f.size} for f in files],
            "gpu_dtype": manifest.get("dtype") if manifest.get("dtype") in ("float16", "bfloat16") else "float16",
        }
        if n > 1:
            nxt = self.hub.online.get(plans[(i + 1) % n].fellow_id)
            direct = None
            if self.settings.pipeline_transport != "relay" and nxt and nxt.serve_port:
                direct = [nxt.serve_host, nxt.serve_port]
            message["hop_out"] = {"hop_id": serving.hop_ids[i], "peer_key": nxt.public_key if nxt else b"",
                                  "peer_name": plans[(i + 1) % n].fellow_name, "direct": direct,
                                  "transport": self.settings.pipeline_transport}
            prev = self.hub.online.get(plans[(i - 1) % n].fellow_id)
            message["hop_in"] = {"hop_id": serving.hop_ids[(i - 1) % n], "peer_key": prev.public_key if prev else b""}
        return message

    async def unload(self, name: str, keep_state: bool = False) -> None:
        serving = self.models.get(name)
        if serving is None:
            return
        for stage in serving.stages:
            conn = self.hub.online.get(stage.plan.fellow_id)
            if conn is not None:
                try:
                    await conn.send({"t": "unload", "model": name})
                except SwarmError:
                    pass
        for hop_id in serving.hop_ids:
            self.relay.close_channel(hop_id)
            self.hop_stats.pop(hop_id, None)
        for request in [r for r in self.requests.values() if r.model == name]:
            await self._end(request, error=f"model {name} was unloaded")
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

    async def submit(self, request: Request) -> Request:
        serving = self.models.get(request.model)
        if serving is None or serving.status != "ready":
            state = "loading" if serving and serving.status == "loading" else "not loaded"
            raise ModelNotLoaded(
                f"model {request.model} is {state}. Load it first (swarm model-load {request.model}, or Load on the "
                f"chat page), then send the request again."
            )
        request.attempts += 1
        self.requests[request.rid] = request
        conn = self.hub.online.get(serving.stages[0].plan.fellow_id)
        if conn is None:
            raise ModelNotLoaded(f"stage 0 of {request.model} is offline")
        await conn.send({"t": "gen", "model": request.model, "rid": request.rid, "prompt": request.prompt,
                         "max_tokens": request.max_tokens, "sampling": request.sampling, "eos": request.eos})
        return request

    def find(self, request_id: str) -> Request | None:
        return next((r for r in self.requests.values() if r.id == request_id), None)

    async def cancel(self, request: Request) -> None:
        if request.finish_reason is not None or request.error is not None:
            return
        await self._cancel_on_ring(request)
        await self._end(request, finish="cancelled")

    async def _end(self, request: Request, finish: str | None = None, error: str | None = None) -> None:
        log.debug("request %s ends: %s", request.id, finish or error)
        self.requests.pop(request.rid, None)
        if request.finish_reason is None and request.error is None:
            request.finish_reason, request.error = finish, error
            await request.events_send.send(("error", error) if error else ("done", finish))

    # --- messages from fellows ------------------------------------------------------------------------------------

    async def on_fellow_message(self, conn, message: dict) -> None:
        kind = message["t"]
        if kind == "heartbeat":
            for hop in message.get("hops") or []:
                if isinstance(hop, dict) and isinstance(hop.get("hop_id"), str):
                    self.hop_stats[hop["hop_id"]] = hop
        elif kind == "tokens":
            for batch in message["batches"]:
                request = self.requests.get(batch["rid"])
                if request is None:
                    continue
                request.tokens.extend(batch["tokens"])
                await request.events_send.send(("tokens", list(batch["tokens"])))
                if batch.get("done"):
                    await self._end(request, finish=batch.get("finish_reason") or "stop")
        elif kind == "failed":
            await self._on_failed(message)
        elif kind == "hop_lost":
            await self._on_hop_lost(message)
        elif kind in ("load_progress", "loaded", "load_failed"):
            self._on_load_event(conn, message)
        elif kind in ("punch_candidates", "punch_result", "punch_pong") and self.punching is not None:
            self.punching.on_message(conn, message)

    async def _on_failed(self, message: dict) -> None:
        request = message.get("_request") or self.requests.pop(message.get("rid"), None)
        if request is None:
            return
        text = message.get("message", "a stage failed")
        if message.get("not_loaded"):
            serving = self.models.get(request.model)
            if serving is not None:
                serving.status, serving.error = "failed", text
                serving.notify()
        elif not request.tokens and request.attempts <= RETRIES_BEFORE_FIRST_TOKEN:
            log.info("request %s failed before its first token (%s); sending it again", request.rid, text)
            request.rid = "r" + secrets.token_hex(8)
            try:
                await self.submit(request)
                return
            except SwarmError as exc:
                text = str(exc)
        log.warning("request %s failed: %s", request.id, text)
        await self._end(request, error=text)

    async def _ring_ready(self, serving: ModelServing) -> None:
        for stage in serving.stages:
            conn = self.hub.online.get(stage.plan.fellow_id)
            if conn is not None:
                try:
                    await conn.send({"t": "ring_ready", "model": serving.name})
                except SwarmError:
                    pass
        if self.punching is not None:
            await self.punching.start(serving)

    async def _on_hop_lost(self, message: dict) -> None:
        """A path between two stages broke under the requests in flight: what it carried may be lost. Requests
        with nothing streamed yet are sent again; the others end with an error rather than hang."""
        model = message.get("model")
        log.info("a link of %s over the %s broke; re-sending its requests", model, message.get("path"))
        for request in [r for r in self.requests.values() if r.model == model]:
            await self._cancel_on_ring(request)
            self.requests.pop(request.rid, None)
            await self._on_failed({"rid": request.rid, "message": "a link between stages broke",
                                   "_request": request})

    async def _cancel_on_ring(self, request: Request) -> None:
        serving = self.models.get(request.model)
        conn = self.hub.online.get(serving.stages[0].plan.fellow_id) if serving else None
        if conn is not None:
            try:
                await conn.send({"t": "cancel", "model": request.model, "rid": request.rid})
            except SwarmError:
                pass

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

    async def on_fellow_lost(self, conn) -> None:
        for serving in list(self.models.values()):
            lost = [s for s in serving.stages if s.plan.fellow_id == conn.id]
            if not lost:
                continue
            serving.status = "failed"
            serving.error = f"stage {lost[0].plan.index} on {conn.name} went away"
            for request in [r for r in self.requests.values() if r.model == serving.name]:
                await self._end(request, error=f"{serving.error} while answering; send the message again once the "
                                               f"model is loaded")
            serving.notify()


def _model_size(manifest: dict, cpu: bool) -> ModelSize:
    """Bytes a stage will hold, from the manifest; CPU stages compute (and hold) weights in float32."""
    stored = DTYPE_BYTES.get(manifest.get("dtype", "float32"), 4)
    scale = 4 / stored if cpu else 1.0
    files = manifest["files"]
    layers = [0] * manifest["num_layers"]
    embed = final = 0
    for f in files:
        if f["kind"] == "layer":
            layers[f["layer"]] = int(f["size"] * scale)
        elif f["kind"] == "embed":
            embed = int(f["size"] * scale)
        elif f["kind"] == "final":
            final = int(f["size"] * scale)
    kv = manifest.get("kv_bytes_per_token_per_layer") or 0
    return ModelSize(tuple(layers), embed, final, bool(manifest.get("tie_word_embeddings")), int(kv * scale))


__all__ = ["Serving", "Request", "ModelServing", "RequestFailed"]
