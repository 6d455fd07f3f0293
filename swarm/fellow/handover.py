"""The fellow's side of a KV handover at a drain or a re-layout (swarm.stage.kv_handover does the work, on the compute
thread, between the stage's passes): the leader asks each stage of the old ring to keep its running requests' blocks
(KvKeep; a stage whose layers a new stage needs also exports them, all or a range) and each new stage to import them
(KvImport: a stage that extends at the switch holds the rows of the layers it lacks with the parts loaded beside it,
swarm.fellow.extending); each answers with the names it holds (KvKept / KvImported), or why not (``message``):
swarm.handover_messages."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from swarm import handover_messages as hm
from swarm.errors import SwarmError
from swarm.fellow import compute

log = logging.getLogger(__name__)


def _requests(raw: list[list[Any]]) -> list[tuple[str, list[bytes]]]:
    """The running requests of a KvKeep: [[ring id, [block name, ...]], ...], checked."""
    out = []
    for item in raw:
        if len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], list) \
                and all(isinstance(name, bytes) for name in item[1]):
            out.append((item[0], list(item[1])))
    return out


async def answer(fellow: Any, send: Callable[[Any], Awaitable[None]], message: hm.KvKeep | hm.KvImport) -> None:
    """Carry out a KvKeep or KvImport of the leader and answer it."""
    from swarm.stage import kv_handover  # torch: a stage is loaded here

    model, keep = message.model, isinstance(message, hm.KvKeep)
    stage = fellow.stages.get(model)
    names: list[bytes] = []
    blocks: list[dict] = []
    why: str | None = None
    try:
        if stage is None:
            why = f"{fellow.name} holds no stage of {model}"
        elif isinstance(message, hm.KvKeep):
            if stage.ring_id != message.ring_id or message.block <= 0:
                why = f"{fellow.name} serves another ring of {model} now"
            else:
                stage_model = stage.driver.stage_model
                names = await compute.run(kv_handover.keep_running, stage_model, message.epoch, message.block,
                                          _requests(message.requests))
                if message.export:
                    layers = message.export_layers
                    blocks = await compute.run(kv_handover.export_blocks, stage_model, names,
                                               (layers[0], layers[1]) if len(layers) == 2 else None)
        elif message.extension:  # the rows of the layers the stage lacks: held with the parts loaded for them
            extension = stage.extension
            if extension is None or list(extension[0][:2]) != message.extension:
                why = (f"{fellow.name} holds no parts beside its stage of {model} for layers "
                       f"{message.extension[0]}-{message.extension[-1] - 1}")
            else:
                names = await compute.run(kv_handover.import_blocks, stage.driver.stage_model, message.epoch,
                                          message.blocks, extension[1])
        else:
            names = await compute.run(kv_handover.import_blocks, stage.driver.stage_model, message.epoch,
                                      message.blocks)
    except (SwarmError, RuntimeError, ValueError) as exc:  # torch's too: the new ring then prefills, as without one
        log.warning("the KV handover of %s failed here: %s", model, exc)
        names, blocks, why = [], [], str(exc)
    if keep:  # an export in parts that each fit a control link message
        parts = hm.split_blocks(blocks)
        replies: list[hm.KvKept | hm.KvImported] = [
            hm.KvKept(model, message.handover, names if i == len(parts) - 1 else [], part, why, i < len(parts) - 1)
            for i, part in enumerate(parts)]
    else:
        replies = [hm.KvImported(model, message.handover, names, why)]
    try:
        for reply in replies:
            await send(reply)
    except SwarmError as exc:
        log.warning("could not answer the leader's %s: %s", type(message).__name__, exc)
