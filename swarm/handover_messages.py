"""The control link's messages of a KV handover at a drain or a re-layout (swarm.leader.serving.kv_carry,
swarm.fellow.handover), as typed records checked on decode (swarm.wire), beside swarm.control_messages.

  leader -> fellow    KvKeep (every stage of the old ring: keep the running requests' blocks; a stage whose layers a
                      new stage needs also exports them, all its layers or ``export_layers``), KvImport (a new stage:
                      hold these blocks, its layers put together in order)
  fellow -> leader    KvKept, KvImported: the names held, or why not (``message``); an export larger than a control
                      link message may be comes in several KvKept, all but the last with ``more``, its blocks cut
                      between layers where they must be (:func:`split_blocks`, :func:`join_blocks`)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from swarm.wire import message


@message("kv_keep")
class KvKeep:
    model: str
    ring_id: str
    handover: str
    epoch: int
    block: int  # tokens a block
    requests: list[list[Any]]  # [ring request id, [block name, ...]] of each running request
    export: bool = False
    # [first, end) of the stage's own cache layers (0: its first) to export; empty: all of them. A fellow from before
    # ignores it and exports all, which the leader then does not use.
    export_layers: list[int] = dataclasses.field(default_factory=list)


@message("kv_import")
class KvImport:
    model: str
    handover: str
    epoch: int
    blocks: list[dict]  # swarm.stage.kv_handover.export_blocks's maps
    # [first, end) of the model's layers of the stage the fellow's stage extends to at the switch: the blocks are the
    # rows of the layers it lacks for that, in layer order, held with the parts loaded beside it (swarm.fellow
    # .extending) until they are spliced in; empty: the blocks are of the fellow's stage's own layers
    extension: list[int] = dataclasses.field(default_factory=list)


@message("kv_kept")
class KvKept:
    model: str
    handover: str
    names: list[bytes] = dataclasses.field(default_factory=list)
    blocks: list[dict] = dataclasses.field(default_factory=list)  # its export, when asked for one
    message: str | None = None
    more: bool = False  # more parts of this export follow (:func:`split_blocks`)


@message("kv_imported")
class KvImported:
    model: str
    handover: str
    names: list[bytes] = dataclasses.field(default_factory=list)
    message: str | None = None


# What one KvKept carries of an export's rows at most: the leader's control link takes messages of at most 4 MiB
# (swarm.leader.fleet.fellows.CONTROL_MAX_BYTES: a bigger one closes the link); names, dtypes and shapes add a few
# hundred bytes a layer (_LAYER_OVERHEAD), well within the rest.
PART_BYTES = 3 * 1024 * 1024
_LAYER_OVERHEAD = 256


def _layer_bytes(layer: Any) -> int:
    return sum(len(t.get("data", b"")) + _LAYER_OVERHEAD for side in layer[:2] for t in side if isinstance(t, dict))


def split_blocks(blocks: list[dict], most: int = PART_BYTES) -> list[list[dict]]:
    """An export's blocks (swarm.stage.kv_handover.export_blocks's maps) as parts of at most ``most`` bytes of rows
    each, one KvKept a part; a block that does not fit what is left of a part is cut between its layers, each piece
    ``{"name", "layers", "at": the place of its first layer in the block}``. A block with a layer over ``most`` alone
    is left out (a message that big would close the link). -> at least one part."""
    parts: list[list[dict]] = [[]]
    room = most
    for block in blocks:
        layers = block["layers"]
        sizes = [_layer_bytes(layer) for layer in layers]
        if any(size > most for size in sizes):
            continue
        at = 0
        while at < len(layers):
            end, used = at, 0
            while end < len(layers) and used + sizes[end] <= room:
                used, end = used + sizes[end], end + 1
            if end == at:  # not one more layer fits this part
                parts.append([])
                room = most
                continue
            parts[-1].append({"name": block["name"], "layers": layers[at:end], "at": at})
            room -= used
            at = end
    return parts


def join_blocks(pieces: list[Any]) -> list[dict]:
    """The blocks of an export's parts, in the order they came (the inverse of :func:`split_blocks`; a map without
    ``at`` is a whole block, as a fellow from before sends). A block whose pieces do not follow on is left out."""
    whole: dict[bytes, list] = {}
    broken: set[bytes] = set()
    for piece in pieces:
        name = piece.get("name") if isinstance(piece, dict) else None
        layers, at = (piece.get("layers"), piece.get("at", 0)) if isinstance(piece, dict) else (None, None)
        if not isinstance(name, bytes) or not isinstance(layers, list) or not isinstance(at, int):
            continue
        held = whole.setdefault(name, [])
        if at == len(held):
            held.extend(layers)
        else:
            broken.add(name)
    return [{"name": name, "layers": layers} for name, layers in whole.items() if name not in broken]


def join_layers(pieces: list[dict[bytes, list]]) -> dict[bytes, list]:
    """Blocks put together from pieces of their layers (each piece: block name -> its rows of some layers), the pieces
    in layer order: only the blocks every piece has, whole (the leader's assembly of a new stage's blocks,
    swarm.leader.serving.kv_carry, and an extending stage's splice, swarm.stage.resplit)."""
    if not pieces:
        return {}
    return {name: [row for piece in pieces for row in piece[name]]
            for name in pieces[0] if all(name in piece for piece in pieces)}
