"""A model split over 1, 2 or 3 in-process stages answers token for token what transformers' generate answers."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import TINY_MODELS
from reference_model import load_reference_model
from swarm import model_format
from swarm.errors import ModelError
from swarm.stage import LocalRing, StageModel, StageSpec, architectures, stage_specs
from swarm.stage.local import forward_through
from swarm.store.manifest import load_manifest

PROMPTS = [
    [1, 17, 42, 99, 3, 250, 7],
    [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16],
    # longer than the Qwen2 model's 16-token sliding window once the reply is added
    [1, 300, 200, 100, 50, 25, 12, 6, 3, 77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87, 88],
]
NEW_TOKENS = 20
# Every family's tiny model (conftest.TINY_MODELS): Qwen2, Qwen3, Llama, Mistral, Phi-3, Gemma 3 and the DeepSeek-R1
# distills' Qwen2 and Llama bodies (stored in bfloat16).
FAMILIES = list(TINY_MODELS)
PREFILL_CHUNK = 5  # smaller than every prompt, so prefill always takes several chunks


def reference_reply(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,  # random weights: run the full length rather than stop on a chance EOS
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def references(tiny_model_dirs):
    """kind -> the reference model's greedy replies to PROMPTS."""
    out = {}
    for kind, model_dir in tiny_model_dirs.items():
        model = load_reference_model(model_dir)
        model.generation_config.eos_token_id = None
        out[kind] = [reference_reply(model, p) for p in PROMPTS]
    return out


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_chain_matches_generate(tiny_model_dirs, references, kind, stages):
    model_dir = tiny_model_dirs[kind]
    manifest = load_manifest(model_dir)
    chain = LocalRing([StageModel.load_dir(model_dir, s) for s in stage_specs(manifest.num_layers, stages)],
                      prefill_chunk=PREFILL_CHUNK)
    for prompt, want in zip(PROMPTS, references[kind]):
        assert len(set(want)) > 3, "the random model is degenerate; the comparison would prove little"
        got = chain.generate(prompt, NEW_TOKENS)
        assert got == want, f"{kind} over {stages} stages, prompt of {len(prompt)} tokens"
    for stage in chain.stages:
        assert stage.requests() == []  # every request's cache was dropped


@pytest.mark.parametrize("kind", FAMILIES)
def test_requests_in_the_ring_at_once_each_match_generate(tiny_model_dirs, references, kind):
    """Several requests interleaved through the same stages: each keeps its own caches and gets its own reply."""
    model_dir = tiny_model_dirs[kind]
    chain = LocalRing([StageModel.load_dir(model_dir, s) for s in stage_specs(load_manifest(model_dir).num_layers, 2)],
                      prefill_chunk=PREFILL_CHUNK)
    replies = [chain.submit(f"r{i}", prompt, NEW_TOKENS) for i, prompt in enumerate(PROMPTS)]
    chain.run()
    assert [r.tokens for r in replies] == references[kind]
    assert all(stage.requests() == [] for stage in chain.stages)


@pytest.mark.parametrize("chunk", [3, 7])
@pytest.mark.parametrize("kind", FAMILIES)
def test_chunked_prefill_logits_match_full_forward(tiny_model_dirs, kind, chunk):
    """Logits at the end of every prefill chunk equal the library's one-pass forward: masks, positions, windows."""
    model_dir = tiny_model_dirs[kind]
    model = load_reference_model(model_dir)
    prompt = PROMPTS[2] + PROMPTS[1]  # 34 tokens: twice the Qwen2 model's sliding window
    with torch.inference_mode():
        want = model(torch.tensor([prompt])).logits[0]
    specs = stage_specs(load_manifest(model_dir).num_layers, 2)
    stages = [StageModel.load_dir(model_dir, s) for s in specs]
    for stage in stages:
        stage.new_request("r")
    for start in range(0, len(prompt), chunk):
        ids = prompt[start : start + chunk]
        got = forward_through(stages, "r", start, ids)
        torch.testing.assert_close(got, want[start + len(ids) - 1], rtol=1e-4, atol=1e-4)


def test_chain_stops_after_eos(tiny_model_dirs, references):
    chain = LocalRing([StageModel.load_dir(tiny_model_dirs["llama"], s) for s in stage_specs(4, 2)],
                      prefill_chunk=PREFILL_CHUNK)
    want = references["llama"][1]
    eos = want[5]
    got = chain.generate(PROMPTS[1], NEW_TOKENS, eos_token_ids=[eos])
    assert got == want[: want.index(eos) + 1]


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_rollback_then_recompute_gives_same_logits(tiny_model_dirs, kind):
    manifest = load_manifest(tiny_model_dirs[kind])
    stages = [StageModel.load_dir(tiny_model_dirs[kind], s) for s in stage_specs(manifest.num_layers, 2)]
    prompt, extra = PROMPTS[1], [40, 41, 42, 43]
    for stage in stages:
        stage.new_request("r")
    forward_through(stages, "r", 0, prompt)
    first = [forward_through(stages, "r", len(prompt) + i, [t]) for i, t in enumerate(extra)]
    assert all(s.cached_length("r") == len(prompt) + len(extra) for s in stages)

    keep = len(prompt) + 1
    for stage in stages:
        stage.rollback("r", keep)
        assert stage.cached_length("r") == keep
    # Recompute the rolled-back tokens in one chunk, as a speculative verification would.
    again = forward_through(stages, "r", keep, extra[1:])
    torch.testing.assert_close(again, first[-1], rtol=1e-4, atol=1e-4)
    # ... and one by one, after rolling back again.
    for stage in stages:
        stage.rollback("r", keep)
    again = [forward_through(stages, "r", keep + i, [t]) for i, t in enumerate(extra[1:])]
    for a, b in zip(again, first[1:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    for stage in stages:
        stage.rollback("r", 0)
        assert stage.cached_length("r") == 0
        with pytest.raises(ModelError):
            stage.rollback("r", 3)  # cannot roll forward


def test_stage_holds_only_its_own_layers(tiny_model_dirs):
    model_dir = tiny_model_dirs["qwen2"]  # 6 layers, untied head
    specs = stage_specs(6, 3)
    assert [(s.first_layer, s.end_layer) for s in specs] == [(0, 2), (2, 4), (4, 6)]
    first, middle, last = (StageModel.load_dir(model_dir, s) for s in specs)

    names = [n for n, _ in middle.named_parameters()]
    assert {n.split(".")[0] for n in names} == {"layers"}
    assert len(middle.layers) == 2 and middle.embed is None and middle.norm is None and middle.lm_head is None
    on_disk = load_file(model_dir / "weights" / "layer_002.safetensors")
    assert set(dict(middle.layers[0].named_parameters())) == set(on_disk)
    torch.testing.assert_close(middle.layers[0].self_attn.q_proj.weight, on_disk["self_attn.q_proj.weight"])
    layer_bytes = sum(t.numel() * t.element_size() for t in on_disk.values())
    assert middle.parameter_bytes() == 2 * layer_bytes
    # The stage config speaks of the slice: two layers, layer types of global layers 2 and 3.
    assert middle.config.num_hidden_layers == 2
    assert middle.config.layer_types == ["full_attention", "sliding_attention"]

    assert first.embed is not None and first.lm_head is None and first.norm is None
    assert {n.split(".")[0] for n, _ in first.named_parameters()} == {"embed", "layers"}
    assert last.embed is None and last.lm_head is not None
    final = load_file(model_dir / "weights" / "final.safetensors")
    torch.testing.assert_close(last.lm_head.weight, final["lm_head.weight"])
    for stage in (first, middle, last):
        assert not any(p.is_meta for _, p in stage.named_parameters())


def test_tied_last_stage_uses_the_embedding_as_head(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama"]
    last = StageModel.load_dir(model_dir, StageSpec(2, 4, is_first=False, is_last=True))
    embed = load_file(model_dir / "weights" / "embed.safetensors")["embed_tokens.weight"]
    torch.testing.assert_close(last.lm_head.weight, embed)
    assert last.embed is None
    whole = StageModel.load_dir(model_dir, StageSpec(0, 4, is_first=True, is_last=True))
    assert whole.lm_head.weight.data_ptr() == whole.embed.weight.data_ptr()  # one copy, not two


def test_forward_checks_position_and_inputs(tiny_model_dirs):
    stage = StageModel.load_dir(tiny_model_dirs["llama"], StageSpec(0, 2, is_first=True, is_last=False))
    stage.new_request("r")
    hidden = stage.forward("r", 0, input_ids=torch.tensor([[1, 2, 3]]))
    assert hidden.shape == (1, 3, 64)
    with pytest.raises(ModelError, match="holds 3 tokens"):
        stage.forward("r", 5, input_ids=torch.tensor([[4]]))
    with pytest.raises(ModelError):
        stage.forward("r", 3, hidden=hidden[:, -1:])  # the first stage embeds token ids
    with pytest.raises(ModelError):
        stage.forward("nobody", 0, input_ids=torch.tensor([[4]]))
    stage.drop("r")
    assert stage.requests() == []


def test_last_stage_skips_head_for_intermediate_chunks(tiny_model_dirs):
    stage = StageModel.load_dir(tiny_model_dirs["qwen3"], StageSpec(0, 5, is_first=True, is_last=True))
    stage.new_request("r")
    assert stage.forward("r", 0, input_ids=torch.tensor([[1, 2, 3]]), want_logits=False) is None
    logits = stage.forward("r", 3, input_ids=torch.tensor([[4, 5]]))
    assert logits.shape == (320,) and logits.dtype == torch.float32


def test_warm_up_leaves_no_cache(tiny_model_dirs):
    for spec in stage_specs(4, 2):
        stage = StageModel.load_dir(tiny_model_dirs["llama"], spec)
        stage.warm_up()
        assert stage.requests() == []


def test_load_refuses_missing_files_and_bad_slices(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama"]
    config = json.loads((model_dir / "config.json").read_text())
    only_first = {"weights/layer_000.safetensors": model_dir / "weights/layer_000.safetensors"}
    with pytest.raises(ModelError, match="layer_001"):
        StageModel.load(config, only_first, StageSpec(0, 2, is_first=False, is_last=False))
    with pytest.raises(ModelError, match="does not fit"):
        StageModel.load_dir(model_dir, StageSpec(2, 9, is_first=False, is_last=True))


def test_every_supported_architecture_has_its_building_blocks():
    for model_type in model_format.SUPPORTED_ARCHITECTURES:
        blocks = architectures.blocks_for(model_type)
        assert blocks.decoder_layer.__name__.endswith("DecoderLayer")


def test_rollback_past_a_full_sliding_window_is_refused_and_harmless(tiny_model_dirs):
    stage = StageModel.load_dir(tiny_model_dirs["qwen2"], StageSpec(0, 6, is_first=True, is_last=True))
    stage.new_request("r")
    stage.forward("r", 0, input_ids=torch.tensor([PROMPTS[2]]))  # 21 tokens > window of 16
    with pytest.raises(ModelError, match="sliding-window"):
        stage.rollback("r", 10)
    assert stage.cached_length("r") == 21
    stage.rollback("r", 0)  # starting over is always possible
    assert stage.cached_length("r") == 0


def test_layers_spread_over_the_cards_of_one_pc():
    from swarm.stage.devices import layer_devices

    GB = 10**9
    eight = [GB] * 8
    assert layer_devices(eight, [("cuda:0", 24 * GB), ("cuda:1", 24 * GB)]) == ["cuda:0"] * 8  # one card holds it
    # two 6 GB cards hold 8 GB of layers together, each a contiguous run; the head rides with the last layer
    spread = layer_devices(eight, [("cuda:0", 6 * GB), ("cuda:1", 6 * GB)], first_extra=GB // 2, last_extra=GB // 2)
    assert spread == ["cuda:0"] * 4 + ["cuda:1"] * 4
    with pytest.raises(ModelError, match="cannot hold it"):
        layer_devices(eight, [("cuda:0", 4 * GB), ("cuda:1", 4 * GB)])


def test_a_stage_with_a_device_map_computes_what_the_plain_stage_does(tiny_model_dirs):
    """On this machine every "card" is the CPU: the map's bookkeeping (per-layer moves, the head with the last layer)
    runs, and must not change a single value."""
    from swarm.stage.ragged import forward_batch

    model_dir = tiny_model_dirs["qwen3"]
    spec = StageSpec(0, 5, is_first=True, is_last=True)
    plain = StageModel.load_dir(model_dir, spec)
    config = json.loads((model_dir / "config.json").read_text())
    files = {rel: model_dir / rel for rel in spec.files(False)}
    mapped = StageModel.load(config, files, spec, layer_devices=["cpu", "cpu", "cpu:0", "cpu:0", "cpu:0"])
    assert [str(d) for d in mapped.layer_devices] == ["cpu", "cpu", "cpu:0", "cpu:0", "cpu:0"]
    for stage in (plain, mapped):
        stage.new_request("a")
        stage.new_request("b")
    ids = torch.tensor([PROMPTS[2]])
    assert torch.equal(plain.forward("a", 0, input_ids=ids), mapped.forward("a", 0, input_ids=ids))
    items = [("b", 0, torch.tensor([PROMPTS[0]]), True), ("a", ids.shape[1], torch.tensor([[7]]), True)]
    for want, got in zip(forward_batch(plain, items), forward_batch(mapped, items)):
        assert torch.equal(want, got)
