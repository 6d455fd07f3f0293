"""Narrowing a loaded stage in place (issue 37's re-layouts): a stage of layers a..b-1 becomes one of a sub-range
c..d-1 of them, keeping the weights it holds for those layers and freeing the rest, so that a fellow of a serving ring
takes its part of a layout with more stages without loading anything beside its stage.

What indexes layers inside a stage, and is made to fit the kept ones:

- the slice's config (swarm.stage.slice_load: its layer count, ``layer_types``, GLM's ``first_k_dense_replace``),
  changed in place: the layers' modules keep a reference to that very object;
- each layer's ``layer_idx`` (the index of its cache layer in a request's DynamicCache, numbered from the stage's
  first layer) and the compiled decode step's copy of it (swarm.stage.compiled_decode);
- the per-layer mask types and devices, the lean decode step (swarm.stage.lean_decode: rebuilt over the kept layers,
  which compute what they computed, so its warm-up check holds for them);
- the prefix cache (swarm.stage.prefix_cache): each block keeps the rows of the kept layers, so blocks stay valid;
- the embedding (kept only by a stage that stays first), the final norm and head and the draft model (only by one
  that stays last).

Requests' caches are dropped: the switch that narrows a stage resends the running requests anyway.
"""

from __future__ import annotations

import torch
from torch import nn

from swarm.errors import ModelError
from swarm.stage.devices import return_freed_memory
from swarm.stage.slice import StageModel, layer_mask_types
from swarm.stage.slice_load import StageSpec


def narrow(stage: StageModel, first_layer: int, end_layer: int, is_first: bool, is_last: bool) -> int:
    """Make ``stage`` the stage of the model's layers ``first_layer``..``end_layer - 1`` (first and last as said),
    a sub-range of what it holds; the bytes of weights freed. ModelError, with the stage unchanged, when the new stage
    needs layers or parts (the embedding of a first stage, the head of a last one) it does not hold."""
    spec = stage.spec
    what = f"layers {first_layer}-{end_layer - 1}"
    if not spec.first_layer <= first_layer < end_layer <= spec.end_layer:
        raise ModelError(f"this stage holds layers {spec.first_layer}-{spec.end_layer - 1} and cannot narrow to "
                         f"{what}: it would need layers it does not hold; load the stage instead")
    if (is_first and not spec.is_first) or (is_last and not spec.is_last):
        part = "the embedding of a first stage" if is_first and not spec.is_first else "the head of a last stage"
        raise ModelError(f"this stage cannot narrow to {what}: it lacks {part}; load the stage instead")
    before = stage.parameter_bytes()
    for rid in stage.requests():
        stage.drop(rid)
    offset, count = first_layer - spec.first_layer, end_layer - first_layer
    layers = list(stage.layers)
    kept, dropped = layers[offset : offset + count], layers[:offset] + layers[offset + count :]
    for layer in kept:
        renumber(layer, offset)
    _narrow_config(stage.config, offset, count)
    stage.layers = nn.ModuleList(kept)
    stage.layer_devices = stage.layer_devices[offset : offset + count]
    if stage.layer_devices[0] != stage.device:  # spread over cards, and the first card's layers went
        stage.device = stage.layer_devices[0]
        stage.rotary.to(stage.device)
    stage.mask_types = layer_mask_types(stage.config)
    parts: list[nn.Module] = list(dropped)
    if not is_first and stage.embed is not None:
        parts.append(stage.embed)
        stage.embed = None
    if not is_last:
        # at gguf a first stage's embedding may look its rows up in the tied head's bytes (gguf_linear.GGUFEmbedding
        # .share): that head stays, as the embedding's
        shared = getattr(stage.embed, "head", None) if is_first else None
        parts += [m for m in (stage.norm, stage.lm_head) if m is not None and m is not shared]
        stage.norm = stage.lm_head = None
        drafter, stage.drafter = stage.drafter, None
        if drafter is not None:
            parts += drafter.model.modules()
    stage.spec = StageSpec(first_layer, end_layer, is_first, is_last)
    if stage.lean is not None:
        from swarm.stage.lean_decode import LeanDecode

        stage.lean = LeanDecode(stage)
    _slice_prefix_store(stage, offset, count)
    _free(parts)
    return before - stage.parameter_bytes()


def renumber(layer: nn.Module, offset: int) -> None:
    """The layer's cache index, counted from the narrowed stage's first layer (less ``offset``; swarm.stage.resplit
    gives a negative one to count the layers spliced before it)."""
    for module in layer.modules():
        index = getattr(module, "layer_idx", None)
        if isinstance(index, int) and not isinstance(index, bool):
            module.layer_idx = index - offset  # type: ignore[assignment]  # nn.Module types attributes as modules
    step = getattr(layer, "compiled_step", None)
    if step is not None:
        step.index -= offset


def _narrow_config(config, offset: int, count: int) -> None:
    """The slice's config for its layers ``offset``..``offset + count - 1`` (swarm.stage.slice_load._slice_config's
    rules, counted from the stage's own first layer)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        config.layer_types = list(layer_types[offset : offset + count])
    dense = getattr(config, "first_k_dense_replace", None)
    if dense is not None:
        config.first_k_dense_replace = max(int(dense) - offset, 0)
    config.num_hidden_layers = count


def _slice_prefix_store(stage: StageModel, offset: int, count: int) -> None:
    """The prefix cache's blocks, each the rows of the kept layers (one Rows per cache layer of the stage)."""
    store = getattr(stage, "prefix_store", None)
    if store is None:
        return
    for name, rows in list(store.blocks.items()):
        store.blocks[name] = rows[offset : offset + count]


def _free(parts: list[nn.Module]) -> None:
    """Hand the dropped modules' memory back now (as swarm.fellow.loading frees an unloaded stage: their tensors are
    taken out, so they go by reference counting; a weight another kept module shares -- a tied head -- stays)."""
    for part in parts:
        for module in part.modules():
            module._parameters.clear()
            module._buffers.clear()
            if getattr(module, "compiled_step", None) is not None:
                module.compiled_step = None  # type: ignore[assignment]  # the step keeps the layer's tensors alive
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return_freed_memory()
