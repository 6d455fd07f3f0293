"""Extending a loaded stage in place (issue 37's re-layouts): a stage of layers a..b-1 becomes one of c..d-1, a range
that shares layers with it but reaches beyond it (pc-1 0-14 -> 0-19, or a 2-stage ring -> 1 stage on pc-1), keeping
the weights it holds for the shared layers and taking the others from parts loaded beside it while the old ring
served.

The parts are plain stages (swarm.stage.slice_load) of the lacking ranges: the one before the kept layers (first when
the new stage is first: it brings the embedding) and the one after them (last when the new stage is last: the final
norm, the head, the draft model). :func:`lacking` says which; :func:`extend` narrows the stage to the shared layers
(swarm.stage.narrow: what it no longer needs goes) and splices the parts around them, in layer order, fixing what
indexes layers inside a stage as narrowing does: each layer's cache index (and its compiled decode step's), the
slice's config (layer count, ``layer_types``, GLM's ``first_k_dense_replace``), the mask types and layer devices, the
lean decode step (rebuilt where every piece had one: each piece's layers were checked, else checked anew), and a gguf
tied head the embedding reads its rows from. The prefix cache keeps the blocks the parts hold the other layers' rows of
(a KV handover imported them there: swarm.stage.kv_handover), each joined in layer order; the others go.

Requests' caches are dropped: the switch that extends a stage resends the running requests anyway.
"""

from __future__ import annotations

from torch import nn

from swarm.errors import ModelError
from swarm.handover_messages import join_layers
from swarm.stage.narrow import narrow, renumber
from swarm.stage.slice import StageModel, layer_mask_types
from swarm.stage.slice_load import StageSpec


def lacking(spec: StageSpec, first_layer: int, end_layer: int, is_first: bool, is_last: bool) -> list[StageSpec]:
    """The parts a stage of ``spec`` lacks to become the stage of layers ``first_layer``..``end_layer - 1`` (first
    and last as said): the range before its layers, the one after, or none (then it narrows). ModelError when the two
    share no layer (nothing to keep: load the stage instead) or the new stage needs a part no range brings."""
    what = f"layers {first_layer}-{end_layer - 1}"
    if max(first_layer, spec.first_layer) >= min(end_layer, spec.end_layer):
        raise ModelError(f"this stage holds layers {spec.first_layer}-{spec.end_layer - 1} and shares none with "
                         f"{what}: load the stage instead")
    parts = []
    if first_layer < spec.first_layer:
        parts.append(StageSpec(first_layer, spec.first_layer, is_first, False))
    elif is_first and not spec.is_first:
        raise ModelError(f"this stage cannot become the first stage of {what}: it starts at layer {spec.first_layer}")
    if end_layer > spec.end_layer:
        parts.append(StageSpec(spec.end_layer, end_layer, False, is_last))
    elif is_last and not spec.is_last:
        raise ModelError(f"this stage cannot become the last stage of {what}: it ends at layer {spec.end_layer - 1}")
    return parts


def extend(stage: StageModel, parts: list[StageModel], first_layer: int, end_layer: int, is_first: bool,
           is_last: bool) -> int:
    """Make ``stage`` the stage of layers ``first_layer``..``end_layer - 1`` from the layers it shares with it and
    ``parts`` (the stages of :func:`lacking`'s ranges, loaded at its dtype, device and quantization), which are used
    up. Returns the bytes its weights grew by (negative: shrank). ModelError, with the stage unchanged, when the parts
    are not those it lacks."""
    spec = stage.spec
    wanted = lacking(spec, first_layer, end_layer, is_first, is_last)
    if [p.spec for p in parts] != wanted:
        raise ModelError(f"the parts loaded beside the stage ({_ranges(p.spec for p in parts)}) are not those it "
                         f"lacks for layers {first_layer}-{end_layer - 1} ({_ranges(wanted)}); load the stage instead")
    before_bytes = stage.parameter_bytes()
    keep_first, keep_end = max(first_layer, spec.first_layer), min(end_layer, spec.end_layer)
    narrow(stage, keep_first, keep_end, is_first and spec.is_first, is_last and spec.is_last)
    before = next((p for p in parts if p.spec.end_layer == keep_first), None)
    after = next((p for p in parts if p.spec.first_layer == keep_end), None)
    kept = list(stage.layers)
    lean = stage.lean is not None and all(p.lean is not None for p in parts)
    layers: list[nn.Module] = []
    devices: list = []
    types: list | None = [] if getattr(stage.config, "layer_types", None) is not None else None
    for piece in [p for p in (before, stage, after) if p is not None]:
        pieces, start = (kept if piece is stage else list(piece.layers)), len(layers)
        for layer in pieces:
            renumber(layer, -start)
            if piece is not stage:
                _repoint_config(layer, piece.config, stage.config)
            layers.append(layer)
        devices += piece.layer_devices
        if types is not None:
            types += list(piece.config.layer_types)
    dense = getattr(stage.config, "first_k_dense_replace", None)
    if dense is not None and before is not None:
        stage.config.first_k_dense_replace = before.config.first_k_dense_replace
    if types is not None:
        stage.config.layer_types = types
    stage.config.num_hidden_layers = len(layers)
    stage.layers = nn.ModuleList(layers)
    stage.layer_devices = devices
    if devices[0] != stage.device:
        stage.device = devices[0]
        stage.rotary.to(stage.device)
    stage.mask_types = layer_mask_types(stage.config)
    if before is not None and is_first:
        stage.embed, before.embed = before.embed, None
    if after is not None and is_last:
        stage.norm, stage.lm_head, stage.drafter = after.norm, after.lm_head, after.drafter
        stage.tokenizer_dir = after.tokenizer_dir or stage.tokenizer_dir
        after.norm = after.lm_head = after.drafter = None
    if is_first and is_last and getattr(stage.config, "tie_word_embeddings", False):
        _tie(stage)
    stage.spec = StageSpec(first_layer, end_layer, is_first, is_last)
    from swarm.stage.lean_decode import LeanDecode, verified

    stage.lean = LeanDecode(stage) if lean else verified(stage)
    _join_prefix_stores(stage, [p for p in (before, stage, after) if p is not None])
    for part in parts:  # their layers are the stage's now; what else they hold goes with them
        part.layers = nn.ModuleList()
    return stage.parameter_bytes() - before_bytes


def _join_prefix_stores(stage: StageModel, pieces: list[StageModel]) -> None:
    """The prefix cache's blocks for the new layers: each block the stage kept (of its kept layers: narrow sliced
    them) joined in layer order with the rows of the other layers its parts imported at a KV handover
    (swarm.stage.kv_handover.import_blocks), all at the same epoch; a block some piece lacks goes whole."""
    store = getattr(stage, "prefix_store", None)
    if store is None:
        return
    stores = [getattr(p, "prefix_store", None) for p in pieces]
    held = [s.blocks for s in stores if s is not None and s.epoch == store.epoch]
    joined = join_layers(held) if len(held) == len(pieces) else {}
    store.blocks.clear()
    store.blocks.update(joined)


def _tie(stage: StageModel) -> None:
    """A first-and-last stage of a tied model holds the matrix once, as a fresh one does (swarm.stage.slice_load):
    the head reads the embedding's weight, or at gguf the embedding looks its rows up in the head's blocks."""
    embed, head = stage.embed, stage.lm_head
    share = getattr(embed, "share", None)
    if share is not None:
        if getattr(embed, "head", None) is None:
            share(head)
        return
    weight = getattr(embed, "weight", None)
    if isinstance(head, nn.Linear) and isinstance(weight, nn.Parameter) and weight.shape == head.weight.shape \
            and weight.device == head.weight.device and weight.dtype == head.weight.dtype:
        head.weight = weight


def _repoint_config(layer: nn.Module, old, new) -> None:
    """The layer's modules read the stage's config object (as narrow keeps it: changed in place), not the part's."""
    for module in layer.modules():
        if getattr(module, "config", None) is old:
            module.config = new


def _ranges(specs) -> str:
    return ", ".join(f"layers {s.first_layer}-{s.end_layer - 1}" for s in specs) or "none"
