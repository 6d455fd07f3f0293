"""Extending a loaded stage in place (swarm.stage.resplit, a re-layout's switch): the stage, spliced with parts of the
layers it lacks loaded beside it, computes exactly what a stage of the new range loaded fresh computes -- prompts and
decode steps, through the lean and compiled decode paths where they are taken -- and holds what that one holds."""

from __future__ import annotations

import pytest
import torch

from swarm.errors import ModelError
from swarm.stage import StageModel, int4_kernel
from swarm.stage.prefix_cache import PrefixStore, keep_rows
from swarm.stage.resplit import extend, lacking
from swarm.stage.slice_load import StageSpec
from swarm.store.manifest import load_manifest
from test_narrow_stage import load, passes

# (family, quantization, held, extended)
CASES = [
    ("llama", "none", (1, 3), (0, 4)),  # a middle stage -> the whole model: embedding and head come
    ("llama", "int4-fast", (0, 2), (0, 3)),  # a first stage -> a longer first stage
    ("qwen2", "none", (3, 6), (1, 5)),  # a last stage shifted: layers before come, the head and layer 5 go
    ("gemma3", "int8", (3, 6), (0, 6)),  # a last stage -> the whole model (a rotary table per layer type)
]


@pytest.mark.parametrize(("family", "quantization", "held", "extended"), CASES)
def test_an_extended_stage_computes_what_a_fresh_stage_of_its_layers_computes(tiny_model_dirs, family, quantization,
                                                                              held, extended):
    if quantization == "int4-fast" and int4_kernel.kernel() is None:
        pytest.skip("no C compiler here to build the int4-fast kernel")
    model_dir = tiny_model_dirs[family]
    layers = load_manifest(model_dir).num_layers
    first, end = extended
    stage = load(model_dir, *held, quantization)
    fresh = load(model_dir, first, end, quantization)
    specs = lacking(stage.spec, first, end, first == 0, end == layers)
    parts = [load(model_dir, s.first_layer, s.end_layer, quantization) for s in specs]
    passes(stage, "running", 1)  # a request in flight and a prefix block: both go
    store = stage.prefix_store = PrefixStore()
    keep_rows(store, stage.request_cache("running"), 4, [b"block"], [0])

    extend(stage, parts, first, end, first == 0, end == layers)

    assert stage.requests() == [] and store.blocks == {}
    assert stage.spec == fresh.spec and len(stage.layers) == end - first == stage.config.num_hidden_layers
    assert stage.mask_types == fresh.mask_types
    assert getattr(stage.config, "layer_types", None) == getattr(fresh.config, "layer_types", None)
    assert (stage.embed is None, stage.lm_head is None) == (fresh.embed is None, fresh.lm_head is None)
    assert stage.parameter_bytes() == fresh.parameter_bytes()
    assert (stage.lean is not None) == (fresh.lean is not None)
    for seed in (2, 3):
        for got, want in zip(passes(stage, f"r{seed}", seed), passes(fresh, f"r{seed}", seed)):
            assert torch.equal(got, want)


def test_a_stage_extends_only_with_the_parts_it_lacks(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama"]
    stage = load(model_dir, 1, 3, "none")
    before = stage.parameter_bytes()
    with pytest.raises(ModelError, match="holds layers 1-2 and shares none with layers 3-3"):
        lacking(stage.spec, 3, 4, False, True)
    assert lacking(stage.spec, 0, 4, True, True) == [StageSpec(0, 1, True, False), StageSpec(3, 4, False, True)]
    wrong = [load(model_dir, 0, 1, "none")]
    with pytest.raises(ModelError, match=r"not those it lacks for layers 0-3 \(layers 0-0, layers 3-3\)"):
        extend(stage, wrong, 0, 4, True, True)
    assert stage.spec == StageSpec(1, 3, False, False) and stage.parameter_bytes() == before


def test_a_gguf_stage_extended_to_the_whole_tied_model_computes_what_a_fresh_one_does(tmp_path):
    from gguf_files import write_llama_gguf
    from swarm.store.importer import import_model

    gguf = tmp_path / "m.gguf"
    write_llama_gguf(gguf, hidden=256, intermediate=512, layers=3, vocab=256, heads=4, kv_heads=2, tied=True)
    import_model(str(gguf), tmp_path / "models", "tied")
    model_dir = tmp_path / "models" / "tied"
    # not warmed up, as in test_narrow_stage: the lean check trips over an unfused GgufQ8Linear
    stage = StageModel.load_dir(model_dir, StageSpec(0, 2, True, False), quantization="gguf")
    part = StageModel.load_dir(model_dir, StageSpec(2, 3, False, True), quantization="gguf")
    fresh = StageModel.load_dir(model_dir, StageSpec(0, 3, True, True), quantization="gguf")
    extend(stage, [part], 0, 3, True, True)
    assert (getattr(stage.embed, "head", None) is stage.lm_head) == (getattr(fresh.embed, "head", None) is
                                                                     fresh.lm_head)
    assert stage.parameter_bytes() == fresh.parameter_bytes()
    for got, want in zip(passes(stage, "r", 4), passes(fresh, "r", 4)):
        assert torch.equal(got, want)


async def test_a_fellows_stage_holds_its_parts_beside_it_until_spliced_or_dropped(tiny_model_dirs):
    """swarm.fellow.stages.LoadedStage: parts held beside the stage count in what it holds (the fellow's free memory
    says so) and change nothing it computes; dropped, their memory goes; spliced (a link's extend), the stage is the
    new range and says so in its summary (what a restarted leader adopts)."""
    import types

    from swarm import control_messages as cm
    from swarm.fellow.stages import LoadedStage

    model_dir = tiny_model_dirs["llama"]

    async def send(message):
        pass

    fellow = types.SimpleNamespace(send_to_leader=send, threads_for=lambda n: None,
                                   settings=types.SimpleNamespace(serve_prefill_chunk=64, serve_max_batch=4))
    slot = cm.StageSlot(1, 2, 2, 4, is_first=False, is_last=True)
    stage = LoadedStage(fellow, cm.Load("m", "L1", slot, {}, []), load(model_dir, 2, 4, "none"))
    held = stage.placement()["bytes"]
    for drop in (True, False):
        part = load(model_dir, 0, 2, "none")
        stage.hold_extension((0, 4, True, True), [part])
        assert stage.placement()["bytes"] == held + part.parameter_bytes()
        if drop:
            stage.drop_extension()
            assert stage.extension is None and part.parameter_bytes() == 0 and stage.placement()["bytes"] == held
    await stage.extend()
    fresh = load(model_dir, 0, 4, "none")
    assert stage.extension is None and stage.summary()["first_layer"] == 0 and stage.summary()["end_layer"] == 4
    assert stage.placement()["bytes"] == fresh.parameter_bytes()
    for got, want in zip(passes(stage.driver.stage_model, "r", 5), passes(fresh, "r", 5)):
        assert torch.equal(got, want)
