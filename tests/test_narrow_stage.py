"""Narrowing a loaded stage in place (swarm.stage.narrow, a re-layout's switch): the narrowed stage computes exactly
what a stage of that range loaded fresh computes -- prompts and decode steps, through the lean and the compiled decode
paths where they are taken -- holds what that one holds, and keeps its prefix cache's blocks for the kept layers."""

from __future__ import annotations

import pytest
import torch

from swarm.errors import ModelError
from swarm.stage import StageModel, int4_kernel
from swarm.stage.prefix_cache import PrefixStore, keep_rows
from swarm.stage.slice_load import StageSpec
from swarm.store.manifest import load_manifest

# (family, quantization, held, narrowed): the tiny llama (tied head, lean step) at none and int4-fast (its C step),
# the tiny qwen2 (sliding window on its upper layers: per-layer layer_types) and gemma3 (a rotary table per layer type)
CASES = [
    ("llama", "none", (0, 4), (1, 3)),  # the whole model -> a middle stage: embedding and head go
    ("llama", "int4-fast", (0, 4), (0, 2)),  # -> a first stage: the head goes
    ("qwen2", "none", (1, 6), (2, 6)),  # a last stage -> a shorter last stage, across the sliding window's start
    ("gemma3", "int8", (0, 6), (3, 6)),  # -> a last stage: the embedding goes
]


def load(model_dir, first: int, end: int, quantization: str) -> StageModel:
    layers = load_manifest(model_dir).num_layers
    stage = StageModel.load_dir(model_dir, StageSpec(first, end, first == 0, end == layers), quantization=quantization)
    stage.warm_up()
    return stage


def passes(stage: StageModel, rid: str, seed: int) -> list[torch.Tensor]:
    """A prompt of 7 tokens in two chunks, then three decode steps: each pass's output."""
    generator = torch.Generator().manual_seed(seed)
    stage.new_request(rid)
    out = []
    for position, n in ((0, 4), (4, 3), (7, 1), (8, 1), (9, 1)):
        if stage.spec.is_first:
            ids = torch.randint(3, stage.config.vocab_size, (1, n), generator=generator)
            out.append(stage.forward(rid, position, input_ids=ids))
        else:
            hidden = torch.randn((1, n, stage.config.hidden_size), generator=generator)
            out.append(stage.forward(rid, position, hidden=hidden))
    return out


@pytest.mark.parametrize(("family", "quantization", "held", "narrowed"), CASES)
def test_a_narrowed_stage_computes_what_a_fresh_stage_of_its_layers_computes(tiny_model_dirs, family, quantization,
                                                                             held, narrowed):
    if quantization == "int4-fast" and int4_kernel.kernel() is None:
        pytest.skip("no C compiler here to build the int4-fast kernel")
    model_dir = tiny_model_dirs[family]
    layers = load_manifest(model_dir).num_layers
    wide = load(model_dir, *held, quantization)
    fresh = load(model_dir, *narrowed, quantization)
    first, end = narrowed
    # a request in flight and a prefix block kept before the switch: the request goes, the block stays, sliced
    wide_in = StageModel.load_dir(model_dir, wide.spec, quantization=quantization)  # the rows the block holds
    passes(wide, "running", 1)
    store = wide.prefix_store = PrefixStore()
    keep_rows(store, wide.request_cache("running"), 4, [b"block"], [0])
    had_lean = wide.lean is not None
    before = wide.parameter_bytes()

    freed = wide.narrow(first, end, first == 0, end == layers)

    assert wide.requests() == []
    assert wide.spec == fresh.spec and len(wide.layers) == end - first == wide.config.num_hidden_layers
    assert wide.mask_types == fresh.mask_types
    assert (wide.embed is None, wide.lm_head is None) == (fresh.embed is None, fresh.lm_head is None)
    assert wide.parameter_bytes() == fresh.parameter_bytes() and freed == before - fresh.parameter_bytes() > 0
    assert (wide.lean is not None) == had_lean == (fresh.lean is not None)
    for seed in (2, 3):
        for got, want in zip(passes(wide, f"r{seed}", seed), passes(fresh, f"r{seed}", seed)):
            assert torch.equal(got, want)
    # the kept block's rows are those of the kept layers: a fresh stage's rows for the same prompt
    if wide.prefix_store.blocks:
        rows = wide.prefix_store.blocks[b"block"]
        assert len(rows) == end - first
        passes(wide_in, "same", 1)
        full = wide_in.request_cache("same")
        offset = first - held[0]
        for i, (keys, values, _) in enumerate(rows):
            assert torch.equal(keys[0], full.layers[offset + i].keys[:, :, :4])
            assert torch.equal(values[0], full.layers[offset + i].values[:, :, :4])


def test_a_stage_cannot_narrow_to_layers_or_parts_it_lacks(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama"]
    stage = load(model_dir, 1, 3, "none")
    before = stage.parameter_bytes()
    with pytest.raises(ModelError, match="holds layers 1-2 and cannot narrow to layers 0-1"):
        stage.narrow(0, 2, True, False)
    with pytest.raises(ModelError, match="cannot narrow to layers 2-2: it lacks the head of a last stage"):
        stage.narrow(2, 3, False, True)
    assert stage.spec == StageSpec(1, 3, False, False) and stage.parameter_bytes() == before


def test_a_gguf_stage_whose_embedding_reads_the_tied_head_keeps_that_head_when_it_stops_being_last(tmp_path):
    """At gguf a first-and-last stage of a tied model looks its embedding's rows up in the head's 8-bit blocks
    (swarm.stage.gguf_linear.GGUFEmbedding.share): narrowed to a first stage, the head goes as a head but its bytes
    stay for the embedding, which computes what a fresh first stage's own blocks compute."""
    from gguf_files import write_llama_gguf
    from swarm.store.importer import import_model

    gguf = tmp_path / "m.gguf"
    write_llama_gguf(gguf, hidden=256, intermediate=512, layers=3, vocab=256, heads=4, kv_heads=2, tied=True)
    import_model(str(gguf), tmp_path / "models", "tied")
    model_dir = tmp_path / "models" / "tied"
    # not warmed up: the lean step's check trips over an unfused GgufQ8Linear's ``rows`` (an embedding lookup there)
    wide = StageModel.load_dir(model_dir, StageSpec(0, 3, True, True), quantization="gguf")
    fresh = StageModel.load_dir(model_dir, StageSpec(0, 2, True, False), quantization="gguf")
    if getattr(wide.embed, "head", None) is not wide.lm_head:
        pytest.skip("this machine's gguf kind keeps the embedding's own blocks (no 8-bit kernel for the head)")
    head_bytes = wide.lm_head.packed.numel()
    wide.narrow(0, 2, True, False)
    assert wide.lm_head is None and wide.norm is None and wide.embed.head.packed.numel() == head_bytes
    assert wide.parameter_bytes() >= head_bytes  # what it still holds, counted
    for got, want in zip(passes(wide, "r", 4), passes(fresh, "r", 4)):
        assert torch.equal(got, want)
