"""Loading the parts a stage this fellow holds lacks for a re-layout's stage (control_messages.Load.extend; issue 37):
a fellow of a serving ring whose next stage shares layers with the one it holds but reaches beyond it (pc-1 0-14 ->
0-19; 2 stages -> 1 stage on pc-1) fetches and builds only the ranges of layers it lacks -- the one before its layers,
with the embedding where the next stage is first; the one after, with the final norm, head and draft model where it
is last (swarm.stage.resplit.lacking) -- while its stage serves on. Only those files download, with progress as a load
reports it; the parts are held beside the stage (LoadedStage.extension) until the Link that gives it the new layers
splices them in (swarm.stage.resplit.extend), or a DropExtension (the re-layout was given up) or an unload frees them.

The parts are built and warmed up on a worker thread, not the fellow's compute thread (swarm.fellow.compute): that
one keeps running the ring's passes meanwhile, which a load of seconds there would stall.
"""

from __future__ import annotations

import dataclasses
import logging

import trio

from swarm.control_messages import Load, Loaded
from swarm.errors import ModelError, SwarmError, first_leaf
from swarm.fellow.loading import LoadProgress, build_draft_model, import_stage_code, tokenizer_dir_for
from swarm.model_format import WEIGHTS_DIR

log = logging.getLogger(__name__)


async def load_extension(loader, message: Load) -> None:
    """Load what the stage of ``message.model`` this fellow holds lacks for ``message.stage``, and hold it beside the
    stage; Loaded to the leader once held, LoadFailed (the stage serving on untouched) if it cannot."""
    fellow = loader.fellow
    loader.extending.add(message.model)
    try:
        try:
            try:
                stage, parts = await _build(loader, message)
            except BaseExceptionGroup as group:
                raise first_leaf(group) from None
        except Exception as exc:  # any failure is told to the leader (load_failed); the stage serves on
            if not isinstance(exc, SwarmError):
                log.exception("loading the parts %s lacks failed", message.model)
            await loader.failed(message, exc)
            return
    finally:
        loader.extending.discard(message.model)
    if fellow.stages.get(message.model) is not stage:  # unloaded meanwhile: the parts go with it
        await loader.failed(message, ModelError(f"the stage of {message.model} was unloaded meanwhile"))
        return
    slot = message.stage
    stage.hold_extension((slot.first_layer, slot.end_layer, slot.is_first, slot.is_last), parts)
    log.info("loaded %s beside stage %d of %s: it becomes layers %d-%d at its next link",
             ", ".join(f"layers {p.spec.first_layer}-{p.spec.end_layer - 1}" for p in parts), stage.index,
             message.model, slot.first_layer, slot.end_layer - 1)
    try:
        await fellow.send_to_leader(Loaded(message.model, message.load_id, stage.summary()))
    except SwarmError:  # the link dropped: the re-layout waiting for it is given up, and its DropExtension lost
        stage.drop_extension()


async def _build(loader, message: Load):
    """(the stage held, its parts) -- fetched and built. ModelError when this fellow holds no stage of the model
    sharing layers with the one asked for."""
    from swarm.stage.resplit import lacking

    fellow = loader.fellow
    stage = fellow.stages.get(message.model)
    slot = message.stage
    if stage is None or stage.load_id != message.load_id:
        raise ModelError(f"{fellow.name} holds no stage of {message.model} to extend; load the stage instead")
    held = stage.driver.stage_model
    specs = lacking(held.spec, slot.first_layer, slot.end_layer, slot.is_first, slot.is_last)
    if not specs:
        raise ModelError(f"the stage of {message.model} on {fellow.name} lacks nothing for layers "
                         f"{slot.first_layer}-{slot.end_layer - 1}: it narrows at its link, nothing to load")
    tied = bool(message.config.get("tie_word_embeddings", False))
    needed = {path for spec in specs for path in spec.files(tied)}
    # weights only of the parts (the tokenizer and config as sent); the draft model only with a new last part
    files = [f for f in message.files if f.path in needed or not f.path.startswith(f"{WEIGHTS_DIR}/")]
    draft = message.draft if specs[-1].is_last else None
    wanted = dataclasses.replace(message, files=files, draft=draft)
    progress = LoadProgress(fellow, message.model, message.load_id)
    await trio.to_thread.run_sync(import_stage_code)
    local, draft_local = await loader.fetch(wanted, progress)
    await progress.report("download", 1.0)
    await progress.report("extract", 1.0)
    await progress.report("load", 0.0)
    from swarm.stage.slice import StageModel

    parts = []
    for spec in specs:
        def build(spec=spec):
            part = StageModel.load(message.config, local, spec, dtype=held.dtype, device=held.device,
                                   quantization=held.quantization)
            part.kv_cache = held.kv_cache
            part.warm_up()
            return part

        part = await trio.to_thread.run_sync(build)
        if spec.is_last:
            part.tokenizer_dir = tokenizer_dir_for(local, fellow.cache_dir, wanted)
            if draft is not None:
                part.drafter = await trio.to_thread.run_sync(
                    lambda: build_draft_model(draft, draft_local, wanted, held.dtype, str(held.device),
                                              held.quantization))
        parts.append(part)
    await progress.report("load", 1.0)
    return stage, parts
