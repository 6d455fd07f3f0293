"""Loading a stage on this fellow: fetch its files from the leader (only this stage's, resumed and verified, cached
by content hash), build the slice of the model, warm it up, then serve it until it is unloaded.

Progress goes to the leader per load (download -> extract -> load), so the page and the CLI show each stage's bar.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import httpx
import trio

from swarm.errors import SwarmError, first_leaf
from swarm.fellow.downloads import fetch_with_retries
from swarm.fellow.ring import StageDriver
from swarm.mesh.hop import HopConfig, OutgoingHop
from swarm.tunnel.channel import CLEANUP_S

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 0.5
CREDENTIAL_WAIT_S = 60.0  # how long a download waits for the control link to come back with a new credential


@dataclasses.dataclass(eq=False)
class LoadedStage:
    driver: StageDriver
    cancel_scope: trio.CancelScope  # cancelled on unload
    nursery: trio.Nursery  # the stage's tasks: links, tunnels
    hop_in: dict | None  # the hop this stage receives on: id and the previous stage's key
    load_id: str


class LoadProgress:
    """One load's progress, posted to the leader every PROGRESS_EVERY_S while its files download."""

    def __init__(self, fellow, model: str, load_id: str):
        self.fellow = fellow
        self.model = model
        self.load_id = load_id
        self.fraction = 0.0

    async def report(self, phase: str, fraction: float) -> None:
        try:
            await self.fellow.send_to_leader({"t": "load_progress", "model": self.model, "load_id": self.load_id,
                                              "phase": phase, "fraction": round(fraction, 4)})
        except SwarmError:
            pass

    async def pump(self) -> None:
        while True:
            await self.report("download", self.fraction)
            await trio.sleep(PROGRESS_EVERY_S)


class StageLoader:
    def __init__(self, fellow):
        self.fellow = fellow

    async def load(self, message: dict) -> None:
        fellow = self.fellow
        model, load_id = message["model"], message["load_id"]
        fellow.unload(model)
        progress = LoadProgress(fellow, model, load_id)
        try:
            try:
                stage_model = await self._fetch_and_build(message, progress)
            except BaseExceptionGroup as group:
                raise first_leaf(group) from None
        except Exception as exc:
            if not isinstance(exc, SwarmError):
                log.exception("loading %s failed", model)
            text = str(exc) if isinstance(exc, SwarmError) else f"{type(exc).__name__}: {exc}"
            try:
                await fellow.send_to_leader({"t": "load_failed", "model": model, "load_id": load_id,
                                             "message": f"stage {message['stage']['index']} on {fellow.name}: {text}"})
            except SwarmError:
                pass
            return
        await fellow.nursery.start(self._serve, message, stage_model)

    async def _fetch(self, message: dict, progress: LoadProgress) -> dict[str, Path]:
        fellow = self.fellow
        files = message["files"]
        total = sum(f["size"] for f in files) or 1
        done_before = 0
        local: dict[str, Path] = {}
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=60.0)) as client, trio.open_nursery() as pump:
            pump.start_soon(progress.pump)
            for f in files:
                url = f"{fellow.leader_url}/api/v1/models/{message['model']}/files/{f['path']}"

                def on_bytes(done: int, _size: int, base: int = done_before) -> None:
                    progress.fraction = (base + done) / total

                local[f["path"]] = await fetch_with_retries(
                    client, url, fellow.cache_dir, f["sha256"], f["size"], self._credential_headers, on_bytes,
                    renew_credential=self._renewed_credential,
                )
                done_before += f["size"]
            pump.cancel_scope.cancel()
        return local

    def _credential_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.fellow.credential}"}

    async def _renewed_credential(self) -> None:
        """The leader refused the credential: the control link was re-made meanwhile and the leader issued a new
        one. Wait for it (the partial file is kept)."""
        with trio.fail_after(CREDENTIAL_WAIT_S):
            await self.fellow.connected.wait()

    async def _fetch_and_build(self, message: dict, progress: LoadProgress):
        from swarm.stage.slice import StageModel, StageSpec  # torch is heavy: import when a stage is placed here
        import torch

        local = await self._fetch(message, progress)
        await progress.report("download", 1.0)
        await progress.report("extract", 1.0)  # shards are verified safetensors: nothing to unpack
        spec_msg = message["stage"]
        spec = StageSpec(spec_msg["first_layer"], spec_msg["end_layer"], spec_msg["is_first"], spec_msg["is_last"])
        device = self.fellow.settings.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        # On CPU compute in float32; on a GPU in the checkpoint's half precision (DESIGN.md, The ring).
        dtype = torch.float32 if device == "cpu" else getattr(torch, message.get("gpu_dtype") or "float16")
        await progress.report("load", 0.0)
        stage_model = await trio.to_thread.run_sync(
            lambda: StageModel.load(message["config"], local, spec, dtype=dtype, device=device)
        )
        await trio.to_thread.run_sync(stage_model.warm_up)
        await progress.report("load", 1.0)
        return stage_model

    def _out_hop(self, message: dict, nursery: trio.Nursery) -> OutgoingHop | None:
        fellow = self.fellow
        hop_out = message.get("hop_out")
        if not hop_out:
            return None
        hop = OutgoingHop(
            HopConfig(
                hop_id=hop_out["hop_id"],
                peer_public=hop_out["peer_key"],
                peer_name=hop_out["peer_name"],
                direct=tuple(hop_out["direct"]) if hop_out.get("direct") else None,
                transport=hop_out.get("transport", "auto"),
            ),
            nursery=nursery,
            leader_url=fellow.leader_url,
            credential=lambda: fellow.credential,
            local_private=fellow.private,
            connect_timeout=fellow.settings.direct_connect_timeout_s,
        )

        async def lost(hop: OutgoingHop, model: str = message["model"]) -> None:
            try:
                await fellow.send_to_leader({"t": "hop_lost", "model": model, "hop_id": hop.config.hop_id,
                                             "path": hop.path})
            except SwarmError:
                pass

        hop.on_lost = lost
        return hop

    async def _serve(self, message: dict, stage_model, task_status=trio.TASK_STATUS_IGNORED) -> None:
        fellow = self.fellow
        model, spec_msg, hop_in = message["model"], message["stage"], message.get("hop_in")
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                out_hop = self._out_hop(message, nursery)
                driver = StageDriver(
                    model=model, index=spec_msg["index"], num_stages=spec_msg["num_stages"], stage_model=stage_model,
                    out_hop=out_hop, send_to_leader=fellow.send_to_leader,
                    prefill_chunk=fellow.settings.serve_prefill_chunk,
                )
                fellow.stages[model] = LoadedStage(driver, scope, nursery, hop_in, message["load_id"])
                await nursery.start(driver.run)
                if hop_in:
                    nursery.start_soon(fellow.links.relay_listener, driver, hop_in)
                await fellow.send_to_leader({"t": "loaded", "model": model, "load_id": message["load_id"]})
                task_status.started()
                try:
                    await trio.sleep_forever()
                finally:
                    if out_hop is not None:
                        with trio.move_on_after(CLEANUP_S, shield=True):
                            await out_hop.aclose()
        stage = fellow.stages.get(model)
        if stage is not None and stage.cancel_scope is scope:
            del fellow.stages[model]
        if hop_in:
            fellow.links.forget_hop(hop_in["hop_id"])
        del driver, stage_model
        _free_memory()


def _free_memory() -> None:
    """Hand an unloaded stage's memory back: Python's cycles first, then the CUDA caching allocator's pool."""
    import gc

    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass
