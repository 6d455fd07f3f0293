"""Mixture-of-experts families (qwen3_moe, mixtral, qwen2_moe with its shared expert, olmoe): tiny random models
saved by transformers (per-expert checkpoint tensors), imported (experts fused as the decoder layer holds them),
split over 1, 2 and 3 stages, and matched token for token against transformers' generate -- in one process, as
concurrent chats over real fellows, and quantized to int8."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import trio

from conftest import shared_once
from exactness import check_reply, reference

PROMPTS = [[5, 17, 42, 99, 7, 150, 3, 88, 21, 64, 9, 200], [11, 12, 13], list(range(30, 70)), [1, 250, 31, 5],
           [300, 4], list(range(100, 119)), [7] * 9, [60, 61, 250, 3, 9, 14]]  # 8 chats at once in the ring test
NEW_TOKENS = 12
_COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
               max_position_embeddings=256, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
               num_hidden_layers=3, tie_word_embeddings=False)
MOE_MODELS = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48)),
    "olmoe": ("OlmoeConfig", dict(num_experts=8, num_experts_per_tok=2)),
}


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """family -> (the transformers folder, the imported model dir)."""
    import transformers

    from swarm.store.importer import import_model

    def build(root: Path) -> None:
        for kind, (class_name, kwargs) in MOE_MODELS.items():
            config = getattr(transformers, class_name)(**_COMMON, **kwargs)
            torch.manual_seed(1234)
            transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / f"src-{kind}")
            import_model(str(root / f"src-{kind}"), root / "models", kind)

    root = shared_once(tmp_path_factory, "moe", build)
    return {kind: (root / f"src-{kind}", root / "models" / kind) for kind in MOE_MODELS}


def _source_model(source: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", list(MOE_MODELS))
def test_layer_files_hold_what_the_decoder_layer_expects(moe_dirs, kind):
    from safetensors import safe_open
    from safetensors.torch import load_file

    source, model_dir = moe_dirs[kind]
    with safe_open(str(source / "model.safetensors"), framework="pt") as handle:
        assert any(".experts.0." in k for k in handle.keys())  # the checkpoint is in the per-expert layout
    model = _source_model(source)  # transformers' own load, its conversion applied
    for i in range(len(model.model.layers)):
        stored = load_file(model_dir / "weights" / f"layer_{i:03d}.safetensors")
        want = model.model.layers[i].state_dict()
        assert set(stored) == set(want)
        assert all(torch.equal(stored[k], want[k]) for k in want), kind
        experts = getattr(model.config, "num_experts", None) or model.config.num_local_experts
        assert stored["mlp.experts.gate_up_proj"].shape[0] == experts


@pytest.mark.parametrize("kind", list(MOE_MODELS))
def test_placement_counts_every_expert(moe_dirs, kind):
    from swarm.leader.serving.models import model_size
    from swarm.store.manifest import load_manifest

    source, model_dir = moe_dirs[kind]
    manifest = load_manifest(model_dir)
    layer = _source_model(source).model.layers[0]
    real = sum(p.numel() * 4 for p in layer.state_dict().values())  # float32: all experts, router, shared expert
    assert real <= manifest.bytes_per_layer < real + 4096  # the layer file: its tensors and a small header
    as_dict = json.loads(manifest.to_json())  # the leader reads the manifest as JSON
    assert all(real <= b < real + 4096 for b in model_size(as_dict, cpu=True).layer_bytes)
    # an int8 load quantizes the experts too (swarm.stage.moe_experts): a byte a weight
    assert all(real / 4 < b < real / 3 for b in model_size(as_dict, cpu=True, quantization="int8").layer_bytes)


@pytest.mark.parametrize("kind", list(MOE_MODELS))
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_stages_in_one_process_match_generate(moe_dirs, kind, stages):
    from swarm.stage.local import LocalRing
    from swarm.stage.slice import StageModel
    from swarm.stage.slice_load import stage_specs

    source, model_dir = moe_dirs[kind]
    model = _source_model(source)
    ring = LocalRing([StageModel.load_dir(model_dir, s) for s in stage_specs(3, stages)])
    for prompt in PROMPTS[:2]:
        want, margins = reference(model, prompt, NEW_TOKENS)
        assert check_reply(ring.generate(prompt, NEW_TOKENS), want, margins) == "identical"


def test_int8_load_quantizes_the_linears_and_replies_as_the_quantized_model(moe_dirs):
    from reference_model import load_reference_model
    from swarm.stage.local import LocalRing
    from swarm.stage.quantize import quantize_model
    from swarm.stage.slice import StageModel
    from swarm.stage.slice_load import stage_specs

    _, model_dir = moe_dirs["qwen2_moe"]
    full = [StageModel.load_dir(model_dir, s) for s in stage_specs(3, 2)]
    stages = [StageModel.load_dir(model_dir, s, quantization="int8") for s in stage_specs(3, 2)]
    assert all(q.parameter_bytes() < f.parameter_bytes() for q, f in zip(stages, full))
    prompt = [1, 17, 42, 99, 7, 250, 31, 5]
    want, margins = reference(quantize_model(load_reference_model(model_dir), "int8"), prompt, NEW_TOKENS)
    assert check_reply(LocalRing(stages).generate(prompt, NEW_TOKENS), want, margins) == "identical"


@pytest.mark.e2e
async def test_moe_over_the_ring_matches_generate_alone_and_as_concurrent_chats(tmp_path, moe_dirs):
    from harness import running_swarm

    kinds = ["qwen3_moe", "mixtral"]
    expected = {}
    for kind in kinds:
        model = _source_model(moe_dirs[kind][0])
        expected[kind] = [reference(model, p, NEW_TOKENS) for p in PROMPTS]

    async def tokens(swarm, name, prompt):
        return await swarm.greedy(name, prompt, NEW_TOKENS)

    with trio.fail_after(280):
        async with running_swarm(tmp_path, [moe_dirs[k][1] for k in kinds], fellows=3,
                                 fellow_env={"SWARM_SERVE_PREFILL_CHUNK": "8"}) as swarm:
            for kind in kinds:
                for stages in (1, 2, 3):
                    view = await swarm.load(kind, stages)
                    assert len(view["stages"]) == stages
                    for prompt, (want, margins) in zip(PROMPTS[:1], expected[kind]):
                        assert check_reply(await tokens(swarm, kind, prompt), want, margins) == "identical"
                    got: dict[int, list[int]] = {}

                    async def chat(i, prompt, kind=kind, got=got):
                        got[i] = await tokens(swarm, kind, prompt)

                    async with trio.open_nursery() as nursery:  # concurrent chats: batched decode
                        for i, prompt in enumerate(PROMPTS):
                            nursery.start_soon(chat, i, prompt)
                    verdicts = [check_reply(got[i], want, margins) for i, (want, margins) in enumerate(expected[kind])]
                    assert verdicts == ["identical"] * len(PROMPTS), (kind, stages, verdicts)
                    await swarm.leader.serving.loader.unload(kind)
