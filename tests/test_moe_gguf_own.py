"""MoE GGUFs that transformers' GGUF loader cannot read, mapped by swarm (swarm.store.gguf_names): tiny random models
of GLM-4.5 (glm4_moe: a dense first layer, shared experts, the router's score-correction bias, q/k/v biases, partial
rotary, a NextN layer after the decoder's; experts Q8_0) and gpt-oss (attention sinks, biased router and experts,
sliding-window layers, YaRN; experts MXFP4, written apart and transposed as llama.cpp does), built by transformers
from each config, written with gguf-py's writer as convert_hf_to_gguf.py writes them (the rest F32), imported with
their blocks kept. Over 1, 2 and 3 stages each answers at ``none`` as the source model with its experts set to the
file's values, at ``gguf`` as the gguf kind in one process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import shared_once
from exactness import check_reply, reference
from gguf_moe_files import build_model, byte_level_vocabulary, write_moe_gguf

LAYERS = 3
PROMPT = [5, 17, 42, 99, 7, 150, 3, 88, 21, 64]
NEW_TOKENS = 10
_COMMON = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
               max_position_embeddings=256, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
               num_hidden_layers=LAYERS, tie_word_embeddings=False, rms_norm_eps=2.0 ** -17)
FAMILIES = {  # model -> (family, config, expert type)
    "glm4_moe": ("glm4_moe", dict(intermediate_size=128, head_dim=32, moe_intermediate_size=64, n_routed_experts=8,
                                  num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                                  topk_group=1, attention_bias=True, routed_scaling_factor=2.5, norm_topk_prob=True,
                                  num_nextn_predict_layers=1,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                   "partial_rotary_factor": 0.5}), "Q8_0"),
    # sliding windows shorter than a reply, YaRN rope, MXFP4 experts as gpt-oss files have them
    "gpt_oss": ("gpt_oss", dict(intermediate_size=64, head_dim=32, num_local_experts=4, num_experts_per_tok=2,
                                sliding_window=8, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                   "beta_fast": 32.0, "beta_slow": 1.0,
                                                                   "truncate": False, "rope_theta": 150000.0,
                                                                   "original_max_position_embeddings": 64}),
                "MXFP4"),
}

_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "head_dim", "num_key_value_heads",
         "attention_bias", "rope_parameters", "num_experts_per_tok", "vocab_size")
# a byte-level vocabulary of the models' size, its token 2 (eos) "<|endoftext|>", and a chat template
VOCABULARY = byte_level_vocabulary(_COMMON["vocab_size"], [])
VOCABULARY[0][2] = "<|endoftext|>"
TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
CONFIG_KEYS = {  # the config attributes the header gives, as the source model has them
    "glm4_moe": (*_KEYS, "n_routed_experts", "n_shared_experts", "first_k_dense_replace", "moe_intermediate_size",
                 "routed_scaling_factor", "num_nextn_predict_layers", "norm_topk_prob"),
    "gpt_oss": (*_KEYS, "num_local_experts", "sliding_window", "layer_types"),
}


def _source(name: str):
    """The family's random float32 model, its biases (zeros as transformers makes them) random too."""
    family, config, _ = FAMILIES[name]
    model = build_model(family, **{**_COMMON, **config})
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for key, value in model.named_parameters():
            if key.endswith(("bias", "sinks")):
                value.copy_(torch.randn(value.shape, generator=generator) * 0.3)
        for key, value in model.named_buffers():
            if key.endswith("e_score_correction_bias"):
                value.copy_(torch.randn(value.shape, generator=generator) * 0.3)
    return model


@pytest.fixture(scope="module")
def own_ggufs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """model -> (the GGUF file, the imported model dir)."""
    from swarm.store.importer import import_model

    def build(root: Path) -> None:
        for name, (_, _, experts) in FAMILIES.items():
            write_moe_gguf(root / f"{name}.gguf", _source(name), experts, tokenizer=(*VOCABULARY, TEMPLATE))
            import_model(str(root / f"{name}.gguf"), root / "models", name)

    root = shared_once(tmp_path_factory, "moe-gguf-own", build)
    return {name: (root / f"{name}.gguf", root / "models" / name) for name in FAMILIES}


def _float_reference(name: str):
    """The source model with its experts set to the file's (quantized) values."""
    from gguf import GGMLQuantizationType, quants

    model = _source(name)
    kind = GGMLQuantizationType[FAMILIES[name][2]]
    state = model.state_dict()
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        value = state[key].numpy()
        if name == "gpt_oss":  # quantized in the file's layout: rows of the transposed matrix
            value = value.swapaxes(-1, -2)
        value = quants.dequantize(quants.quantize(np.ascontiguousarray(value), kind), kind)
        if name == "gpt_oss":
            value = value.swapaxes(-1, -2)
        state[key] = torch.from_numpy(np.ascontiguousarray(value))
    model.load_state_dict(state)
    return model


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_tensor_but_the_nextn_layers_is_mapped_and_the_config_is_the_sources(own_ggufs, name):
    from gguf import GGUFReader

    from swarm.store.gguf_source import GGUFSource

    gguf, _ = own_ggufs[name]
    source = GGUFSource(gguf)
    config = source.config()
    want = _source(name).config
    for key in CONFIG_KEYS[name]:
        assert getattr(config, key) == getattr(want, key), key
    mapped = {t.gguf_name for t in source.tensors(config)}
    every = {t.name for t in GGUFReader(str(gguf)).tensors}
    assert every - mapped == {n for n in every if n.startswith(f"blk.{LAYERS}.")}  # GLM's NextN layer only


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_an_own_mapped_moe_gguf_answers_at_none_as_its_source_and_at_gguf_as_one_process(own_ggufs, name, stages):
    from reference_model import gguf_reference_model
    from swarm.stage.gguf_experts import GGUFExperts
    from swarm.stage.gguf_q8 import GgufQ8Linear
    from swarm.stage.local import LocalRing
    from swarm.stage.slice import StageModel
    from swarm.stage.slice_load import stage_specs

    _, model_dir = own_ggufs[name]
    specs = stage_specs(LAYERS, stages)
    source = _float_reference(name)
    want, margins = reference(source, PROMPT, NEW_TOKENS)
    at_none = [StageModel.load_dir(model_dir, s) for s in specs]
    for key, value in at_none[-1].layers[-1].mlp.experts.state_dict().items():  # gpt-oss's: transposed, interleaved
        assert torch.equal(value, source.state_dict()[f"model.layers.{LAYERS - 1}.mlp.experts.{key}"]), key
    assert check_reply(LocalRing(at_none).generate(PROMPT, NEW_TOKENS), want, margins) == "identical"
    at_none_reply, at_none_margins = want, margins
    at_gguf_model = gguf_reference_model(model_dir)
    want, margins = reference(at_gguf_model, PROMPT, NEW_TOKENS)
    at_gguf = [StageModel.load_dir(model_dir, s, quantization="gguf") for s in specs]
    experts = at_gguf[-1].layers[-1].mlp.experts
    assert isinstance(experts, GGUFExperts)  # the experts on the file's blocks: the 8-bit kernel's modules
    assert all(isinstance(m, GgufQ8Linear) for m in (*experts.up, *experts.down))
    assert check_reply(LocalRing(at_gguf).generate(PROMPT, NEW_TOKENS), want, margins) == "identical"
    # the file's values on the kernels, activations at 8 bits: on this prompt the reply the float values give
    # the file's values on the kernels, activations at 8 bits: the prompt's logits within a small shift of the float
    # values', and the reply the float values' until a token whose top two logits are within twice that shift
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        floats = source(ids).logits[0, -1]
        shift = (at_gguf_model(ids).logits[0, -1] - floats).abs().max().item()
    assert shift < 0.05 * floats.abs().max().item()  # measured: 1 % (glm4_moe), 1.6 % (gpt_oss)
    check_reply(want, at_none_reply, at_none_margins, tol=2 * shift)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_an_own_mapped_moe_gguf_widened_at_import_holds_the_same_values(own_ggufs, name, tmp_path):
    """--dtype float32: the experts laid out (gpt-oss: transposed, gate and up interleaved) and joined at import, the
    values a load of the kept blocks at none holds."""
    from swarm.stage.slice import StageModel
    from swarm.stage.slice_load import stage_specs
    from swarm.store.importer import import_model

    gguf, model_dir = own_ggufs[name]
    import_model(str(gguf), tmp_path, "wide", dtype="float32")
    wide = StageModel.load_dir(tmp_path / "wide", stage_specs(LAYERS, 1)[0])
    kept = StageModel.load_dir(model_dir, stage_specs(LAYERS, 1)[0])
    for (key, a), (_, b) in zip(wide.named_parameters(), kept.named_parameters(), strict=True):
        assert torch.equal(a, b), key


@pytest.mark.parametrize("name", list(FAMILIES))
def test_an_own_mapped_moe_gguf_brings_its_tokenizer_and_chat_template(own_ggufs, name):
    from transformers import AutoTokenizer

    _, model_dir = own_ggufs[name]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.encode(" swarm of fellows", add_special_tokens=False)
    assert ids[:2] == [VOCABULARY[0].index("\u0120s"), VOCABULARY[0].index("w")]  # " s" merged, as the merges say
    assert tokenizer.decode(ids) == " swarm of fellows" and tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.chat_template == TEMPLATE


@pytest.mark.e2e
async def test_a_gpt_oss_gguf_over_real_fellows_answers_as_one_process(tmp_path, own_ggufs):
    """gpt-oss's GGUF over real fellows, at its default kind (gguf: the MXFP4 experts on the 8-bit kernel) over 2 stages
    and at none over 3: a reply alone and two concurrent chats (batched decode, sliding windows) as the reference of
    the kind in one process."""
    import trio

    from harness import running_swarm
    from reference_model import gguf_reference_model

    _, model_dir = own_ggufs["gpt_oss"]
    chats = [PROMPT, list(range(30, 50))]
    expected = {"gguf": [reference(gguf_reference_model(model_dir), p, NEW_TOKENS) for p in chats],
                "none": [reference(_float_reference("gpt_oss"), p, NEW_TOKENS) for p in chats]}
    with trio.fail_after(200):
        async with running_swarm(tmp_path, [model_dir], fellows=3) as swarm:
            for kind, stages in (("gguf", 2), ("none", 3)):
                view = await swarm.load(model_dir.name, stages, quantization=None if kind == "gguf" else kind)
                assert view["quantization"] == kind and len(view["stages"]) == stages, view
                want, margins = expected[kind][0]
                assert check_reply(await swarm.greedy(model_dir.name, PROMPT, NEW_TOKENS), want, margins) == "identical"
                got: dict[int, list[int]] = {}

                async def chat(i, prompt, got=got):
                    got[i] = await swarm.greedy(model_dir.name, prompt, NEW_TOKENS)

                async with trio.open_nursery() as nursery:
                    for i, prompt in enumerate(chats):
                        nursery.start_soon(chat, i, prompt)
                verdicts = [check_reply(got[i], w, m) for i, (w, m) in enumerate(expected[kind])]
                assert verdicts == ["identical"] * len(chats), (kind, stages, verdicts)
                await swarm.leader.serving.loader.unload(model_dir.name)


@pytest.mark.parametrize("model", ["GLM-4.5-Air Q4_K_M", "gpt-oss-120b MXFP4"])
def test_a_real_models_header_maps_every_tensor_as_the_file_has_it(tmp_path, model):
    """The header of GLM-4.5-Air Q4_K_M or gpt-oss-120b MXFP4 (llama.cpp's names, types and shapes, the header keys
    convert_hf_to_gguf.py writes; the data a hole): the config is the model's, and every tensor is kept as the file's
    blocks, gpt-oss's expert matrices transposed where a stage widens them."""
    import gguf
    from gguf import GGUFWriter

    import real_moe_models as real
    from swarm.store.gguf_source import GGUFSource

    model_type, config, file_type = real.MODELS[model]
    arch = {"glm4_moe": "glm4moe", "gpt_oss": "gpt-oss"}[model_type]
    path = tmp_path / "model.gguf"
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(131072)
    writer.add_embedding_length(config["hidden_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_expert_count(config.get("n_routed_experts") or config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if arch == "glm4moe":
        writer.add_feed_forward_length(config["intermediate_size"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_expert_shared_count(config["n_shared_experts"])
        writer.add_leading_dense_block_count(config["first_k_dense_replace"])
        writer.add_rope_dimension_count(config["head_dim"] // 2)
    else:
        writer.add_expert_feed_forward_length(config["intermediate_size"])
        writer.add_sliding_window(128)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(32.0)
        writer.add_rope_scaling_orig_ctx_len(4096)
    real.write_tensor_infos(writer, path, real.tensors(config, file_type))

    source = GGUFSource(path)
    got = source.config()
    assert got.model_type == model_type
    assert all(getattr(got, k) == v for k, v in config.items()), {k: getattr(got, k) for k in config}
    tensors = source.tensors(got)
    assert len(tensors) == len(source.reader.tensors) and not any(t.fixup for t in tensors if t.gguf_type != "MXFP4")
    last = config["num_hidden_layers"] - 1
    layer = {t.hf_name.removeprefix(f"model.layers.{last}."): t for t in tensors
             if t.hf_name.startswith(f"model.layers.{last}.")}
    experts = getattr(got, "n_routed_experts", None) or got.num_local_experts
    rows, h = getattr(got, "moe_intermediate_size", None) or got.intermediate_size, got.hidden_size
    gate = layer["mlp.experts.gate_up_proj.ffn_gate_exps"]
    assert (gate.gguf_type, gate.shape, gate.part) == ("MXFP4" if arch == "gpt-oss" else "Q4_K", (experts, rows, h), 0)
    assert layer["mlp.experts.gate_up_proj.ffn_up_exps"].part == 1
    if arch == "gpt-oss":  # transposed where a stage widens them, as GptOssExperts holds them
        assert (gate.read_shape or gate.shape) == (experts, h, rows) and gate.join == "interleave"
        assert gate.fixup  # the transposition, at load
        assert layer["mlp.experts.gate_up_proj_bias.ffn_up_exps"].into.endswith("gate_up_proj_bias")
        assert "self_attn.sinks" in layer
    else:
        assert "mlp.gate.e_score_correction_bias" in layer and "mlp.shared_experts.down_proj.weight" in layer


@pytest.mark.parametrize("matrices", ["BF16", "F32"])
def test_a_gpt_oss_gguf_at_gguf_holds_its_mxfp4_experts_at_the_planned_bytes(tmp_path, matrices):
    """gpt-oss as ggml-org publishes it (experts MXFP4, the other matrices BF16), and with F32 matrices: at gguf on CPU
    each expert is an 8-bit-kernel module holding 0.6875 bytes a weight (Q5_0's layout) plus its biases, and the
    planner counts each layer at what the stage then holds (its other matrices widened to float32) from the weights
    of each type the import counted -- not at float32 throughout, nor F32 matrices as 16-bit ones."""
    import json

    from swarm.leader.serving.models import model_size
    from swarm.stage.gguf_experts import GGUFExperts
    from swarm.stage.slice import StageModel
    from swarm.stage.slice_load import stage_specs
    from swarm.store.importer import import_model
    from swarm.store.manifest import load_manifest

    write_moe_gguf(tmp_path / "gpt_oss.gguf", _source("gpt_oss"), "MXFP4", matrices=matrices,
                   tokenizer=(*VOCABULARY, TEMPLATE))
    import_model(str(tmp_path / "gpt_oss.gguf"), tmp_path / "models", "gpt_oss")
    model_dir = tmp_path / "models" / "gpt_oss"
    manifest = json.loads(load_manifest(model_dir).to_json())
    planned = model_size(manifest, cpu=True, quantization="gguf").layer_bytes
    stage = StageModel.load_dir(model_dir, stage_specs(LAYERS, 1)[0], quantization="gguf")
    _, config, _ = FAMILIES["gpt_oss"]
    hidden, inter, experts = _COMMON["hidden_size"], config["intermediate_size"], config["num_local_experts"]
    for i, layer in enumerate(stage.layers):
        module = layer.mlp.experts
        assert isinstance(module, GGUFExperts)
        held_experts = sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
        weights, biases = experts * 3 * hidden * inter, experts * (2 * inter + hidden)
        assert held_experts == 0.6875 * weights + 4 * biases, i  # MXFP4 at Q5_0's bytes; float32 biases
        held = sum(t.numel() * t.element_size() for t in [*layer.parameters(), *layer.buffers()])
        assert held <= planned[i] <= 1.01 * held, (i, held, planned[i])  # exact, as it stands
    # a manifest written before the import counted the types: the estimate from the file's bytes, at least as much
    # (it takes F32 matrices for 16-bit ones)
    for entry in manifest["files"]:
        entry.pop("types")
    estimated = model_size(manifest, cpu=True, quantization="gguf").layer_bytes
    assert all(p <= e <= (1.25 if matrices == "BF16" else 2.5) * p for p, e in zip(planned, estimated))
