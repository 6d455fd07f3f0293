"""int4-fast's decoder-layer step in C for single rows (swarm.stage.compiled_decode): which layers take it, that it is
the library's step, that a batch computes each request's rows as alone, and that a wrong step is not taken."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.cache_utils import DynamicCache

from swarm.stage import compiled_decode, int4_kernel
from swarm.stage.ragged import forward_batch
from swarm.stage.slice import StageModel
from swarm.stage.slice_load import stage_specs
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
    steps = {"a": torch.randn((1, 1, hidden), generator=generator),
             "b": torch.randn((1, 5, hidden), generator=generator),
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


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_decode_pass_of_several_rows_computes_each_as_its_own_decode_step(tiny_model_dirs, family):
    """Drafting ahead's verifying pass (one request's rows, ``alone``): each row through the C step attends to the
    keys up to its own, so the pass computes, to the bit, what the same rows give as decode steps one by one."""
    stage = stages_of(tiny_model_dirs[family], count=1)[0]
    stage.warm_up()
    assert stage.lean is not None
    generator = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, stage.config.vocab_size, (1, 9), generator=generator)
    rows = torch.randint(0, stage.config.vocab_size, (1, 5), generator=generator)
    for rid in ("pass", "steps", "library"):
        stage.new_request(rid)
        stage.forward(rid, 0, input_ids=prompt, want_logits=False)
    together = stage.forward("pass", 9, input_ids=rows, final_states=True, alone=True)
    one_by_one = torch.cat([stage.forward("steps", 9 + i, input_ids=rows[:, i : i + 1], final_states=True)
                            for i in range(5)], dim=1)
    assert torch.equal(together, one_by_one)
    for mine, theirs in zip(stage._caches["pass"].layers, stage._caches["steps"].layers):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
    # a prompt's chunk (not alone) keeps the library's computation: close to the steps, not the same path
    library = stage.forward("library", 9, input_ids=rows, final_states=True)
    assert torch.allclose(library, one_by_one, atol=0.1 * one_by_one.abs().max().item())


def test_a_batch_of_decode_passes_and_a_prompt_chunk_computes_each_request_as_alone(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama"]
    stage = stages_of(model_dir, count=3)[1]
    stage.warm_up()
    hidden = stage.config.hidden_size
    generator = torch.Generator().manual_seed(11)
    prompts = {rid: torch.randn((1, n, hidden), generator=generator) for rid, n in (("a", 4), ("b", 6), ("c", 3))}
    rows = {"a": torch.randn((1, 3, hidden), generator=generator),
            "b": torch.randn((1, 5, hidden), generator=generator),
            "c": torch.randn((1, 1, hidden), generator=generator)}
    flags = {"a": True, "b": False, "c": True}  # a: a verifying pass, b: the prompt's next chunk, c: a decode step
    alone = {}
    for rid in prompts:
        stage.new_request(rid)
        stage.forward(rid, 0, hidden=prompts[rid], final_states=True)
        alone[rid] = stage.forward(rid, prompts[rid].shape[1], hidden=rows[rid], final_states=True, alone=flags[rid])
        stage.drop(rid)
    for lean in (stage.lean, None):  # the lean step (decode passes only) and the library's batched pass
        stage.lean = lean
        for members in (("a", "b", "c"), ("a", "c")):
            for rid in members:
                stage.new_request(rid)
                stage.forward(rid, 0, hidden=prompts[rid], final_states=True)
            items = [(rid, prompts[rid].shape[1], rows[rid], False) for rid in members]
            states = forward_batch(stage, items, [flags[rid] for rid in members])
            at = 0
            for rid in members:
                n = rows[rid].shape[1]
                assert torch.equal(states[:, at : at + n], alone[rid]), (lean, members, rid)
                at += n
                stage.drop(rid)


def test_drafting_at_int4_fast_keeps_the_reply_without_drafting_to_the_bit(tiny_model_dirs, monkeypatch):
    """The verifying passes take the C step, so their rows compute what the decode steps compute and the reply is the
    one without drafting, token for token -- no near-tie exception. The target as its own draft model (int4-fast too)
    guesses nearly every token right (it feeds its cache the prompt and kept guesses in chunks, which the library's
    layers compute: not quite its decode steps' bits)."""
    from swarm.stage import LocalRing, StageSpec
    from swarm.stage.draft_model import DraftModel

    model_dir = tiny_model_dirs["llama"]
    prompt = [5, 17, 42, 99, 7, 3, 250, 11]
    plain = LocalRing(stages_of(model_dir), prefill_chunk=4).generate(prompt, 40)
    stages = stages_of(model_dir)
    for stage in stages:
        stage.warm_up()
    target = StageModel.load_dir(model_dir, StageSpec(0, load_manifest(model_dir).num_layers, True, True),
                                 quantization="int4-fast")
    stages[-1].drafter = DraftModel(target)
    passes = []
    step = compiled_decode.CompiledStep.step

    def counted(self, x, cos, sin, caches, sizes=None, **kwargs):
        passes.append(max(sizes or [1]))
        return step(self, x, cos, sin, caches, sizes, **kwargs)

    monkeypatch.setattr(compiled_decode.CompiledStep, "step", counted)
    ring = LocalRing(stages, prefill_chunk=4)
    reply = ring.submit("a", prompt, 40, draft=3)
    ring.run()
    assert reply.tokens == plain
    spec = ring.times["a"][1]
    assert spec.spec_drafted > 0 and spec.spec_accepted >= 0.8 * spec.spec_drafted, spec
    assert spec.spec_passes <= 40 // 2, spec
    assert max(passes) == 4  # verifying passes of 4 rows went through the C step


def test_decode_steps_write_the_cache_in_place_and_it_stays_the_librarys(tiny_model_dirs):
    """The C step writes each new row's keys and values into room kept at the end of the cache's buffers (no copy of
    the whole cache per step); the library's own passes, a rollback and a copy of the cache (a group's fan-out) work on
    it as on any cache, and every result equals the same requests' with the cache copied afresh after every pass."""
    stage = stages_of(tiny_model_dirs["qwen3"], count=1)[0]
    stage.warm_up()
    generator = torch.Generator().manual_seed(9)

    def ids(n):
        return torch.randint(0, stage.config.vocab_size, (1, n), generator=generator)

    plan = [("prompt", ids(7)), ("step", ids(1)), ("step", ids(1)), ("step", ids(1)), ("rollback", 8),
            ("step", ids(1)), ("chunk", ids(4)), ("step", ids(1)), ("pass", ids(3)), ("step", ids(1))]

    def run(fresh: bool):
        rid = f"fresh{fresh}"
        stage.new_request(rid)
        outs, ptrs = [], []
        for what, arg in plan:
            at = stage.cached_length(rid)
            if what == "rollback":
                stage.rollback(rid, arg)
                continue
            outs.append(stage.forward(rid, at, input_ids=arg, final_states=True, alone=what in ("step", "pass")))
            layer = stage._caches[rid].layers[0]
            ptrs.append((what, layer.keys.data_ptr()))
            if fresh:  # the library's own cache: plain tensors, so the next step moves it to new room
                for layer in stage._caches[rid].layers:
                    layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
        stage.fan_out(rid, [rid + "-a", rid + "-b"])
        for copy_rid in (rid + "-a", rid + "-b"):
            outs.append(stage.forward(copy_rid, stage.cached_length(copy_rid), input_ids=plan[-1][1],
                                      final_states=True, alone=True))
        caches = [stage._caches[r] for r in (rid + "-a", rid + "-b")]
        return outs, ptrs, caches

    ours, pointers, caches = run(False)
    theirs, _, expected = run(True)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    for mine, want in zip(caches, expected):
        for a, b in zip(mine.layers, want.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    # consecutive decode steps kept the same buffer: written in place, not copied
    assert pointers[1] == pointers[2] == pointers[3] == ("step", pointers[1][1])
    first, second = (stage._caches[f"freshFalse-{r}"].layers[0].keys for r in "ab")
    assert first.data_ptr() != second.data_ptr()
