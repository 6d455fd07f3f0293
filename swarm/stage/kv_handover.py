"""A drain's KV handover, on a stage: the running requests' computed rows kept as prefix cache blocks, and the
leaving stage's blocks carried to the fellow that takes its place.

At a drain's switch (swarm.leader.serving.kv_carry) the new ring would otherwise prefill every running request's
prompt and streamed tokens again on every stage -- ~80 % of the switch's pause (bench/RESULTS.md, Failover). Instead,
before the switch:

  keep    every stage of the old ring keeps each running request's first full blocks (rows computed on every stage:
          all but the latest token's) under names the leader gives -- the blocks' chained hashes, as the prefix
          cache names a prompt's blocks (swarm.leader.serving.prefix_index) -- so the resent request reuses them;
  export  the leaving stage sends those blocks' rows (raw bytes with dtype and shape, swarm.wire) over the leader's
          control links, encrypted as every link is;
  import  the taker's copy of the stage (a hot cover, or the copy it just loaded) stores them under the same names.

Stages that stay keep their store across the relink (the leader carries the cache's epoch), so after the switch each
stage computes only the tokens after the last whole block, plus one step.
"""

from __future__ import annotations

from typing import Any

import torch

from swarm import wire
from swarm.errors import ProtocolError
from swarm.stage.prefix_cache import Rows, keep_rows, store_of

# What keys and values are attended in; a name outside this set is refused before torch sees it.
_ATTEND_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def keep_running(stage: Any, epoch: int, block: int, requests: list[tuple[str, list[bytes]]]) -> list[bytes]:
    """Keep each running request's first blocks (``requests``: its ring id and the names of its blocks, from the
    first on) in the stage's prefix store, at the leader's ``epoch``. -> the names now held (a request this stage no
    longer has, or whose cache is shorter, keeps less)."""
    store = store_of(stage)
    if not store.adopt(epoch):
        return []
    with torch.inference_mode():
        for rid, names in requests:
            if stage.has_request(rid):
                keep_rows(store, stage.request_cache(rid), block, names, list(range(len(names))))
    return [name for _, names in requests for name in names if name in store.blocks]


def export_blocks(stage: Any, names: list[bytes]) -> list[dict]:
    """The rows of blocks ``names`` this stage holds, as wire maps (:func:`import_blocks` takes them)."""
    store = store_of(stage)
    out = []
    for name in names:
        layers = store.blocks.get(name)
        if layers is not None:
            out.append({"name": name, "layers": [
                [[wire.tensor_to_wire(k) for k in keys], [wire.tensor_to_wire(v) for v in values],
                 str(dtype).removeprefix("torch.")] for keys, values, dtype in layers]})
    return out


def import_blocks(stage: Any, epoch: int, blocks: list) -> list[bytes]:
    """Store blocks another fellow's copy of this stage exported (:func:`export_blocks`) at the leader's ``epoch``.
    -> the names stored. ProtocolError when they do not fit this stage (another layer count, a bad tensor)."""
    store = store_of(stage)
    if not store.adopt(epoch):
        return []
    device = getattr(stage, "device", None) or "cpu"
    devices = list(getattr(stage, "layer_devices", None) or ())  # several cards: each layer's rows on its own
    held = next(iter(store.blocks.values()), None)
    layer_count = len(held) if held is not None else None  # every block of a stage has one entry per cache layer
    parsed: list[tuple[bytes, list[Rows]]] = []
    for block in blocks:
        name, layers = block.get("name") if isinstance(block, dict) else None, \
            block.get("layers") if isinstance(block, dict) else None
        if not isinstance(name, bytes) or not isinstance(layers, list) or \
                (layer_count is not None and len(layers) != layer_count):
            raise ProtocolError(f"a handed-over block does not fit this stage ({layer_count} cache layers)")
        layer_count = len(layers)
        rows = []
        for i, layer in enumerate(layers):
            if not (isinstance(layer, list) and len(layer) == 3 and isinstance(layer[0], list)
                    and isinstance(layer[1], list) and layer[2] in _ATTEND_DTYPES):
                raise ProtocolError("a handed-over block's layer is not [keys, values, dtype]")
            to = devices[i] if len(devices) == len(layers) else device
            rows.append((tuple(wire.tensor_from_wire(k).to(to) for k in layer[0]),
                         tuple(wire.tensor_from_wire(v).to(to) for v in layer[1]), _ATTEND_DTYPES[layer[2]]))
        parsed.append((name, rows))
    for name, rows in parsed:  # all checked first: a bad block stores none
        store.blocks[name] = rows
    return [name for name, _ in parsed]
