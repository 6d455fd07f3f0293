"""The fellow's side of a drain's KV handover (swarm.stage.kv_handover does the work, on the compute thread, between
the stage's passes): the leader asks each stage of the old ring to keep its running requests' blocks ({"t": "kv_keep"},
the leaving stage also exports them) and the taker's copy of the stage to import them ({"t": "kv_import"}); each
answers with the names it holds ({"t": "kv_kept"} / {"t": "kv_imported"}), or why not ("message")."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from swarm.errors import SwarmError
from swarm.fellow import compute

log = logging.getLogger(__name__)


def _requests(raw: Any) -> list[tuple[str, list[bytes]]]:
    """The running requests of a kv_keep: [[ring id, [block name, ...]], ...], checked."""
    out = []
    for item in raw if isinstance(raw, list) else []:
        if isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], list) \
                and all(isinstance(name, bytes) for name in item[1]):
            out.append((item[0], list(item[1])))
    return out


async def answer(fellow: Any, send: Callable[[Any], Awaitable[None]], message: dict) -> None:
    """Carry out a kv_keep or kv_import of the leader and answer it."""
    from swarm.stage import kv_handover  # torch: a stage is loaded here

    kind, model = message["t"], message.get("model")
    epoch, block = message.get("epoch"), message.get("block")
    reply: dict[str, Any] = {"t": "kv_kept" if kind == "kv_keep" else "kv_imported", "model": model,
                             "handover": message.get("handover"), "names": []}
    stage = fellow.stages.get(model) if isinstance(model, str) else None
    try:
        if stage is None or not isinstance(epoch, int):
            reply["message"] = f"{fellow.name} holds no stage of {model}"
        elif kind == "kv_keep":
            if stage.ring_id != message.get("ring_id") or not isinstance(block, int) or block <= 0:
                reply["message"] = f"{fellow.name} serves another ring of {model} now"
            else:
                stage_model = stage.driver.stage_model
                names = await compute.run(kv_handover.keep_running, stage_model, epoch, block,
                                          _requests(message.get("requests")))
                reply["names"] = names
                if message.get("export") is True:
                    reply["blocks"] = await compute.run(kv_handover.export_blocks, stage_model, names)
        else:
            blocks = message.get("blocks")
            reply["names"] = await compute.run(kv_handover.import_blocks, stage.driver.stage_model, epoch,
                                               blocks if isinstance(blocks, list) else [])
    except (SwarmError, RuntimeError, ValueError) as exc:  # torch's too: the new ring then prefills, as without one
        log.warning("the KV handover of %s failed here: %s", model, exc)
        reply["names"], reply["message"] = [], str(exc)
    try:
        await send(reply)
    except SwarmError as exc:
        log.warning("could not answer the leader's %s: %s", kind, exc)
