"""int4-fast's decoder-layer step in C for single rows (swarm.stage.compiled_decode): which layers take it, that it is
the library's step, that a batch computes each request's rows as alone, and that a wrong step is not taken."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.cache_utils import DynamicCache

from swarm.stage import compiled_decode, int4_kernel
from swarm.stage.ragged import forward_batch
from swarm.stage.slice import StageModel, stage_specs
from swarm.store.manifest import load_manifest

pytestmark = pytest.mark.skipif(int4_kernel.kernel() is None, reason="no C compiler here to build the kernel")


def stages_of(model_dir, quantization="int4-fast", count=2):
    return [StageModel.load_dir(model_dir, s, quantization=quantization)
            for s in stage_specs(load_manifest(model_dir).num_layers, count)]


@pytest.mark.parametrize("family", ["llama", "qwen3", "r1-qwen"])
def test_int4_fast_layers_take_the_step_and_it_computes_the_librarys(tiny_model_dirs, family):
    stages = stages_of(tiny_model_dirs[family])
    for stage in stages:
        assert compiled_decode.compiled(stage.layers)
    stage = stages[0]
    layer = stage.layers[1]
    generator = torch.Generator().manual_seed(7)
    hidden = stage.config.hidden_size
    with torch.inference_mode():
        cache = DynamicCache(config=stage.config)
        stage.run_layers(torch.randn((1, 6, hidden), generator=generator), 0, cache)
        ours = copy.deepcopy(cache)
        x = torch.randn((1, 1, hidden), generator=generator)
        position_ids = torch.tensor([[6]])
        cos, sin = stage.position_embeddings(x, position_ids)["full_attention"]
        # the library's layer itself (the class's forward, not the one install gave the layer) and the step
        want = type(layer).forward(layer, x, position_ids=position_ids, cache=cache, use_cache=True,
                                   position_embeddings=(cos, sin))
        got = layer(x, position_ids=position_ids, cache=ours, use_cache=True, position_embeddings=(cos, sin))
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    assert (got - want).abs().mean() <= 0.01 * want.abs().mean()
    index = layer.self_attn.layer_idx
    assert ours.layers[index].keys.shape == cache.layers[index].keys.shape  # the cache took the new row
    assert torch.allclose(ours.layers[index].values, cache.layers[index].values, atol=0.05)


def test_a_batch_of_single_rows_and_chunks_computes_each_request_as_alone(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama"]
    stage = stages_of(model_dir, count=3)[1]  # neither first nor last: hidden states in and out
    assert not stage.spec.is_first and not stage.spec.is_last
    hidden = stage.config.hidden_size
    generator = torch.Generator().manual_seed(3)
    prompts = {rid: torch.randn((1, n, hidden), generator=generator) for rid, n in (("a", 4), ("b", 6), ("c", 3))}
    steps = {"a": torch.randn((1, 1, hidden), generator=generator), "b": torch.randn((1, 5, hidden), generator=generator),
             "c": torch.randn((1, 1, hidden), generator=generator)}
    alone = {}
    for rid in prompts:  # each request alone: its prompt, then its next rows
        stage.new_request(rid)
        stage.forward(rid, 0, hidden=prompts[rid], final_states=True)
        alone[rid] = stage.forward(rid, prompts[rid].shape[1], hidden=steps[rid], final_states=True)
        stage.drop(rid)
    for rid in prompts:
        stage.new_request(rid)
        stage.forward(rid, 0, hidden=prompts[rid], final_states=True)
    stage.lean = None  # the library's batched pass (swarm.stage.ragged), with the single rows split off
    items = [(rid, prompts[rid].shape[1], steps[rid], False) for rid in ("a", "b", "c")]
    states = forward_batch(stage, items)
    at = 0
    for rid in ("a", "b", "c"):
        n = steps[rid].shape[1]
        assert torch.equal(states[:, at : at + n], alone[rid]), rid
        at += n


def test_other_kinds_and_torchs_kernel_keep_the_librarys_layers(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama"]
    for kind in ("none", "int8", "nf4"):
        assert not any(getattr(layer, "compiled_step", None) for s in stages_of(model_dir, kind) for layer in s.layers)
    int4_kernel.use(False)
    try:
        assert not compiled_decode.compiled(stages_of(model_dir)[0].layers)
    finally:
        int4_kernel.use(True)
    # a family with sliding windows keeps them too
    assert not compiled_decode.compiled(stages_of(tiny_model_dirs["mistral"])[0].layers)


def test_a_step_that_differs_from_the_librarys_is_not_taken(tiny_model_dirs, monkeypatch, caplog):
    step = compiled_decode.CompiledStep.step

    def off(self, x, cos, sin, caches):
        return step(self, x, cos, sin, caches) * 1.2  # as a wrong scale or rotation would be

    monkeypatch.setattr(compiled_decode.CompiledStep, "step", off)
    stages = stages_of(tiny_model_dirs["llama"])
    assert not any(getattr(layer, "compiled_step", None) for s in stages for layer in s.layers)
    assert "keeps the library's decode step" in caplog.text
