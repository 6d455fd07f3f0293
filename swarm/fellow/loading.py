"""Loading a stage on this fellow: fetch its files from the leader (only this stage's, resumed and verified, cached
by content hash), build the slice of the model, warm it up (its first request's path too), then hold it
(swarm.fellow.stages) until it is unloaded; the leader links it into a ring once every stage is loaded.

Progress goes to the leader per load (download -> extract -> load), so the page and the CLI show each stage's bar.
"""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import trio

from swarm import control_messages as cm
from swarm.control_messages import DraftPart, Load, Loaded, LoadFailed
from swarm.errors import ModelError, SwarmError, first_leaf
from swarm.fellow import compute
from swarm.fellow.downloads import fetch_with_retries
from swarm.fellow.stages import LoadedStage
from swarm.kv_kinds import check_kv_kind
from swarm.quantization import check_kind, kinds_on, needs
from swarm.tunnel.tls import context_for

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 0.5
CREDENTIAL_WAIT_S = 60.0  # how long a download waits for the control link to come back with a new credential


class LoadProgress:
    """One load's progress, posted to the leader every PROGRESS_EVERY_S while its files download."""

    def __init__(self, fellow, model: str, load_id: str):
        self.fellow = fellow
        self.model = model
        self.load_id = load_id
        self.fraction = 0.0

    async def report(self, phase: str, fraction: float) -> None:
        try:
            await self.fellow.send_to_leader(cm.LoadProgress(self.model, self.load_id, phase, round(fraction, 4)))
        except SwarmError:  # progress is for the page only: a lost link must not stop the load
            pass

    async def pump(self) -> None:
        while True:
            await self.report("download", self.fraction)
            await trio.sleep(PROGRESS_EVERY_S)


class StageLoader:
    def __init__(self, fellow):
        self.fellow = fellow
        self._loading: dict[str, trio.CancelScope] = {}  # model -> its load in flight
        self.extending: set[str] = set()  # the models whose load in flight is an extension (Load.extend)

    async def load(self, message: Load) -> None:
        """Load the stage ``message`` places here. A newer load of the same model (the leader placed it again, a
        failover) supersedes one still in flight: the older stops where it is, without a word to the leader."""
        model = message.model
        earlier = self._loading.get(model)
        if earlier is not None:
            earlier.cancel()
        with trio.CancelScope() as scope:
            self._loading[model] = scope
            try:
                if message.extend:  # only what its stage of the model lacks, beside it (swarm.fellow.extending)
                    from swarm.fellow.extending import load_extension

                    await load_extension(self, message)
                else:
                    await self._load(message)
            finally:
                if self._loading.get(model) is scope:
                    del self._loading[model]
        if scope.cancelled_caught:
            log.info("a newer load of %s replaced load %s before it finished", model, message.load_id)

    def cancel(self, model: str, extension_only: bool = False) -> None:
        """Stop a load of ``model`` still in flight (the leader unloaded the model; ``extension_only``: only one of
        the parts a stage lacks, Load.extend -- a re-layout given up)."""
        scope = self._loading.get(model)
        if scope is not None and (not extension_only or model in self.extending):
            scope.cancel()

    async def _load(self, message: Load) -> None:
        fellow = self.fellow
        model, load_id = message.model, message.load_id
        fellow.unload(model)
        progress = LoadProgress(fellow, model, load_id)
        try:
            try:
                stage_model = await self._fetch_and_build(message, progress)
            except BaseExceptionGroup as group:
                raise first_leaf(group) from None
        except Exception as exc:  # any failure is told to the leader (load_failed); the fellow runs on
            if not isinstance(exc, SwarmError):
                log.exception("loading %s failed", model)
            await self.failed(message, exc)
            return
        await self._serve(message, stage_model)

    async def failed(self, message: Load, exc: Exception) -> None:
        """Tell the leader the load of ``message`` failed, and why."""
        fellow = self.fellow
        text = str(exc) if isinstance(exc, SwarmError) else f"{type(exc).__name__}: {exc}"
        try:
            await fellow.send_to_leader(LoadFailed(message.model, message.load_id,
                                                   f"stage {message.stage.index} on {fellow.name}: {text}"))
        except SwarmError:  # the leader is out of reach: the heartbeat once it is back says what is held
            pass

    async def fetch(self, message: Load, progress: LoadProgress) -> tuple[dict[str, Path], dict[str, Path]]:
        """The stage's files, and the draft model's (the last stage's, SWARM_SERVE_DRAFT_MODEL; {} without one): each
        path to its local file."""
        fellow = self.fellow
        draft = _draft_part(message)
        wanted = [(message.model, f) for f in message.files]
        wanted += [(draft.model, f) for f in draft.files] if draft else []
        total = sum(f.size for _, f in wanted) or 1
        done_before = 0
        local: dict[str, Path] = {}
        draft_local: dict[str, Path] = {}
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=60.0),
                                     verify=context_for(fellow.leader_url) or True) as client, \
                trio.open_nursery() as pump:
            pump.start_soon(progress.pump)
            for i, (model, f) in enumerate(wanted):
                url = f"{fellow.leader_url}/api/v1/models/{model}/files/{f.path}"

                def on_bytes(done: int, _size: int, base: int = done_before) -> None:
                    progress.fraction = (base + done) / total

                into = local if i < len(message.files) else draft_local
                into[f.path] = await fetch_with_retries(
                    client, url, fellow.cache_dir, f.sha256, f.size, self._credential_headers, on_bytes,
                    renew_credential=self._renewed_credential,
                )
                done_before += f.size
            pump.cancel_scope.cancel()
        return local, draft_local

    def _credential_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.fellow.credential}"}

    async def _renewed_credential(self) -> None:
        """The leader refused the credential: the control link was re-made meanwhile and the leader issued a new
        one. Wait for it (the partial file is kept)."""
        with trio.fail_after(CREDENTIAL_WAIT_S):
            await self.fellow.connected.wait()

    async def _fetch_and_build(self, message: Load, progress: LoadProgress):
        # torch, transformers and the stage code take seconds to import, more on a busy machine: in a worker thread,
        # so that the control link's heartbeats go on meanwhile (a loop held that long is a fellow gone silent)
        await trio.to_thread.run_sync(import_stage_code)
        import torch

        from swarm.stage import int4_kernel, q8_kernel
        from swarm.stage.slice import StageModel  # torch is heavy: import when a stage is placed here
        from swarm.stage.slice_load import StageSpec
        from swarm.stage.warm_up import warm_up_batch_path

        local, draft_local = await self.fetch(message, progress)
        await progress.report("download", 1.0)
        await progress.report("extract", 1.0)  # shards are verified safetensors: nothing to unpack
        slot = message.stage
        spec = StageSpec(slot.first_layer, slot.end_layer, slot.is_first, slot.is_last)
        device = self.fellow.settings.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        # On CPU compute in float32; on a GPU in the checkpoint's half precision (DESIGN.md, The ring).
        dtype = torch.float32 if device == "cpu" else getattr(torch, message.gpu_dtype or "float16")
        await progress.report("load", 0.0)
        layer_devices = _spread_over_cards(message, spec, device, dtype)
        quantization = check_kind(message.quantization)  # a leader from before sends none
        if quantization not in kinds_on("cpu" if device == "cpu" else "cuda"):
            raise ModelError(f"this fellow cannot load {quantization} on {device}: it needs "
                             f"{needs(quantization, 'cpu' if device == 'cpu' else 'cuda')}")
        int4_kernel.use(self.fellow.settings.int4_kernel)
        q8_kernel.use(self.fellow.settings.int4_kernel)  # SWARM_INT4_KERNEL: swarm's kernels at all
        stage_model = await compute.run(
            lambda: StageModel.load(message.config, local, spec, dtype=dtype, device=device,
                                    layer_devices=layer_devices, quantization=quantization)
        )
        stage_model.tokenizer_dir = tokenizer_dir_for(local, self.fellow.cache_dir, message)
        stage_model.kv_cache = check_kv_kind(message.kv_cache)  # a leader from before sends none: auto
        draft = _draft_part(message)
        if draft is not None:  # the last stage's draft model, whole, as the stage: dtype, device, quantization
            stage_model.drafter = await compute.run(
                lambda: build_draft_model(draft, draft_local, message, dtype, device, quantization))
        await compute.run(stage_model.warm_up)
        # then the first request's own path (swarm.stage.warm_up), on the threads a lone request gets: the leader
        # hears "loaded" only after it, so the first chat does not pay for it
        await compute.run(warm_up_batch_path, stage_model, self.fellow.threads_for(1))
        await progress.report("load", 1.0)
        return stage_model

    async def _serve(self, message: Load, stage_model) -> None:
        fellow = self.fellow
        stage = LoadedStage(fellow, message, stage_model)
        await fellow.nursery.start(self._hold, stage)
        try:
            await fellow.send_to_leader(Loaded(stage.model, stage.load_id, stage.summary()))
        except SwarmError:  # the link dropped meanwhile: the hello of the next one tells the leader of the stage
            log.info("loaded %s while not connected to the leader", stage.model)

    async def _hold(self, stage: LoadedStage, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve ``stage`` until it is unloaded, then hand its memory back."""
        fellow = self.fellow
        fellow.stages[stage.model] = stage
        try:
            await stage.serve(task_status=task_status)
        finally:
            if fellow.stages.get(stage.model) is stage:
                del fellow.stages[stage.model]
            stage.drop_extension()
            free_memory(stage.driver.stage_model)


def _draft_part(message: Load) -> DraftPart | None:
    """The draft model a last stage's load message sends (SWARM_SERVE_DRAFT_MODEL), None without one."""
    return message.draft if message.stage.is_last else None


def build_draft_model(draft: DraftPart, local: dict[str, Path], message: Load, dtype, device: str, quantization: str):
    """Build the draft model whole from its fetched files (swarm.stage.draft_model) at the stage's ``quantization``
    (its guesses are checked by the ring, so a 4-bit draft model costs no exactness, only a few guesses), warmed
    up."""
    from swarm.stage.draft_model import DraftModel
    from swarm.stage.slice import StageModel
    from swarm.stage.slice_load import StageSpec

    layers = draft.num_layers
    model = StageModel.load(draft.config, local, StageSpec(0, layers, True, True), dtype=dtype, device=device,
                            quantization=quantization)
    drafter = DraftModel(model, vocab_size=int(message.config.get("vocab_size") or 0) or None)
    drafter.warm_up()
    return drafter


def _spread_over_cards(message: Load, spec, device: str, dtype) -> list[str] | None:
    """On a PC with several GPUs and SWARM_DEVICE=auto/cuda, the cards that together hold the stage (None: one)."""
    if device != "cuda":
        return None
    from swarm.fellow.hardware import nvidia_gpus
    from swarm.model_format import EMBED_FILE, FINAL_FILE, dtype_bytes, layer_file
    from swarm.stage.devices import layer_devices

    gpus = nvidia_gpus()
    if len(gpus) < 2:
        return None
    scale = dtype.itemsize / dtype_bytes(message.stored_dtype or "float32")  # file bytes -> memory bytes
    # a GGUF's blocks: their weight values at the compute dtype, not the stored bytes
    sizes = {f.path: f.params * dtype.itemsize if f.params else f.size * scale for f in message.files}

    layers = [int(sizes.get(layer_file(i), 0)) for i in range(spec.first_layer, spec.end_layer)]
    first = int(sizes.get(EMBED_FILE, 0)) if spec.is_first else 0
    last = int(sizes.get(FINAL_FILE, 0)) if spec.is_last else 0
    cards = sorted(((f"cuda:{g.index}", g.free_bytes) for g in gpus), key=lambda c: -c[1])
    devices = layer_devices(layers, cards, first, last)
    return devices if len(set(devices)) > 1 else None


def free_memory(stage_model) -> None:
    """Hand an unloaded stage's memory back now. The stage sits in reference cycles (its tasks and hops refer to
    each other), which only a full ``gc.collect()`` frees: a walk over the whole heap, holding the event loop and so
    the fellow's control link -- measured here ~1 s per stage, 3.3 s in a process of 4 M objects (a long test
    session's; in-process fellows share one loop with their leader, which then took them for silent and dropped
    them). Instead the stage's weights, buffers and KV caches are taken out of its modules, so they go at once by
    reference counting; the small shells left are Python's collector's to take in its own time. Then the CUDA
    caching allocator's pool."""
    for rid in stage_model.requests():
        stage_model.drop(rid)
    drafter, stage_model.drafter = getattr(stage_model, "drafter", None), None
    if drafter is not None:  # the last stage's draft model goes with it
        free_memory(drafter.model)
    for part in stage_model.modules():
        for module in part.modules():
            module._parameters.clear()
            module._buffers.clear()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:  # no torch: no CUDA cache to give back
        pass


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "config.json")


def tokenizer_dir_for(local: dict[str, Path], cache_dir: Path, message: Load) -> Path | None:
    """A folder with the tokenizer's files under their own names (links into the content-addressed cache), for the
    last stage's constrained sampling; None when the leader sent no tokenizer (a leader from before)."""
    if not message.stage.is_last or "tokenizer.json" not in local and "tokenizer_config.json" not in local:
        return None
    folder = Path(cache_dir) / "tokenizers" / f"{message.model}-{message.load_id}"
    folder.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if name in local:
            link = folder / name
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(Path(local[name]).resolve())
    return folder


def import_stage_code() -> None:
    """Import what a stage computes with (the fellow joins without it: swarm/stage/__init__.py is lazy)."""
    import importlib

    for module in ("torch", "transformers", "swarm.stage.slice", "swarm.stage.execute", "swarm.stage.int4_kernel",
                   "swarm.stage.warm_up", "swarm.stage.draft_model", "swarm.stage.devices"):
        importlib.import_module(module)
