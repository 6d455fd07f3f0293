"""A KV handover at a drain or a re-layout, on a stage: the running requests' computed rows kept as prefix cache
blocks, and the layers a new stage needs carried to it from the old stages that hold them.

At a drain's or a re-layout's switch (swarm.leader.serving.kv_carry) the new ring would otherwise prefill every
running request's prompt and streamed tokens again on every stage -- ~80 % of a drain's pause, and all of a
re-layout's (bench/RESULTS.md). Instead, before the switch:

  keep    every stage of the old ring keeps each running request's first full blocks (rows computed on every stage:
          all but the latest token's) under names the leader gives -- the blocks' chained hashes, as the prefix
          cache names a prompt's blocks (swarm.leader.serving.prefix_index) -- so the resent request reuses them;
  export  a stage whose layers a new stage needs sends those blocks' rows (raw bytes with dtype and shape,
          swarm.wire), of all its cache layers or of a range of them, over the leader's control links, encrypted as
          every link is;
  import  a new stage (a drain's taker, or a stage a re-layout loaded beside the ring) stores them under the same
          names, its layers' pieces put together in layer order by the leader; a stage that extends at the switch
          gets only the rows of the layers it lacks, held by the parts loaded beside it until the splice joins them
          with its own (swarm.stage.resplit).

A decoder layer's keys and values do not depend on how the layers are split into stages (the keys are rotated at
their absolute positions), so any split can take them. A stage's cache layer i is its decoder layer first_layer + i
for every family here (swarm.stage.slice_load builds the cache from the stage's slice of the config, one cache layer
per decoder layer); sliding-window layers keep only a window and give no rows back (prefix_cache.keep_rows), so such
a stage keeps, exports and imports nothing. Packed caches (--kv-cache q8, f16) travel packed and are taken only by a
stage whose layers hold them alike.

Stages that stay keep their store across the relink (the leader carries the cache's epoch), so after the switch each
stage computes only the tokens after the last whole block, plus one step.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from swarm import wire
from swarm.errors import ProtocolError
from swarm.stage.kv_cache import FloatLayer, Q8Layer, new_cache
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


def export_blocks(stage: Any, names: list[bytes], layers: tuple[int, int] | None = None) -> list[dict]:
    """The rows of blocks ``names`` this stage holds, as wire maps (:func:`import_blocks` takes them): of every cache
    layer, or of ``layers`` [first, end) only (counted from the stage's first layer). ProtocolError for a range
    outside the stage."""
    store = store_of(stage)
    count = len(new_cache(stage.config, stage.kv_cache, stage.dtype).layers)
    first, end = layers if layers is not None else (0, count)
    if not 0 <= first < end <= count:
        raise ProtocolError(f"layers {first}-{end - 1} asked for are not all among this stage's {count}")
    out = []
    for name in names:
        held = store.blocks.get(name)
        if held is not None:
            out.append({"name": name, "layers": [
                [[wire.tensor_to_wire(k) for k in keys], [wire.tensor_to_wire(v) for v in values],
                 str(dtype).removeprefix("torch.")] for keys, values, dtype in held[first:end]]})
    return out


def import_blocks(stage: Any, epoch: int, blocks: list, parts: list[Any] | None = None) -> list[bytes]:
    """Store blocks exported for this stage (:func:`export_blocks`: another fellow's copy of it, or the pieces of its
    layers from the stages that held them, put together in layer order) at the leader's ``epoch``. With ``parts``
    (the stages loaded beside an extending stage, swarm.stage.resplit.lacking's, in layer order) the blocks are the
    rows of those parts' layers instead, each part storing its own until they are spliced in. -> the names stored.
    ProtocolError when they do not fit (another cache layer count, rows held otherwise than its cache holds them, a
    bad tensor): then none is stored."""
    stages = [stage] if parts is None else list(parts)
    if not stages or not all(store_of(s).adopt(epoch) for s in stages):
        return []
    layouts = [_held_as(s) for s in stages]
    held = [(s, i, how) for s, layout in zip(stages, layouts) for i, how in enumerate(layout)]  # in layer order
    parsed: list[tuple[bytes, list[Rows]]] = []
    for block in blocks:
        name, layers = block.get("name") if isinstance(block, dict) else None, \
            block.get("layers") if isinstance(block, dict) else None
        if not isinstance(name, bytes) or not isinstance(layers, list) or len(layers) != len(held):
            raise ProtocolError(f"a handed-over block does not fit this stage ({len(held)} cache layers)")
        rows = []
        for i, (layer, (owner, at, (kinds, attend))) in enumerate(zip(layers, held)):
            if not (isinstance(layer, list) and len(layer) == 3 and isinstance(layer[0], list)
                    and isinstance(layer[1], list) and layer[2] in _ATTEND_DTYPES):
                raise ProtocolError("a handed-over block's layer is not [keys, values, dtype]")
            to = _device_of(owner, at)
            keys = tuple(wire.tensor_from_wire(k).to(to) for k in layer[0])
            values = tuple(wire.tensor_from_wire(v).to(to) for v in layer[1])
            if [k.dtype for k in keys] != kinds or [v.dtype for v in values] != kinds \
                    or _ATTEND_DTYPES[layer[2]] != attend \
                    or len({t.shape[-2] for t in (*keys, *values)}) != 1 or any(t.dim() != 4 for t in (*keys, *values)):
                raise ProtocolError(f"a handed-over block's layer {i} is not held as this stage holds its rows")
            rows.append((keys, values, _ATTEND_DTYPES[layer[2]]))
        parsed.append((name, rows))
    for name, rows in parsed:  # all checked first: a bad block stores none
        at = 0
        for owner, layout in zip(stages, layouts):
            store_of(owner).blocks[name] = rows[at:at + len(layout)]
            at += len(layout)
    return [name for name, _ in parsed]


def _device_of(stage: Any, layer: int) -> Any:
    """Where the stage's cache layer ``layer`` holds its rows (several cards: each layer's on its own)."""
    devices = list(getattr(stage, "layer_devices", None) or ())
    if layer < len(devices):
        return devices[layer]
    return getattr(stage, "device", None) or "cpu"


def _held_as(stage: Any) -> list[tuple[list[torch.dtype], torch.dtype]]:
    """How each cache layer of a request on this stage holds its rows: the dtypes of its keys' (and values') parts,
    and the dtype it attends in (the stage's). ProtocolError for a stage whose caches cannot take rows (a sliding
    window, or a layer that keeps no keys)."""
    out: list[tuple[list[torch.dtype], torch.dtype]] = []
    for layer in new_cache(stage.config, stage.kv_cache, stage.dtype).layers:
        if isinstance(layer, Q8Layer):
            out.append(([torch.int8, torch.float16], stage.dtype))
        elif isinstance(layer, FloatLayer):
            out.append(([layer.held], stage.dtype))
        elif type(layer) is DynamicLayer:
            out.append(([stage.dtype], stage.dtype))
        else:
            raise ProtocolError("this stage's caches cannot take handed-over rows (a sliding window, or layers "
                                "that keep no keys)")
    return out
