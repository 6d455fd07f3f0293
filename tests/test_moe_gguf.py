"""Mixture-of-experts models from GGUF files: tiny random models of qwen3_moe, qwen2_moe (shared expert) and mixtral
(a llama file with experts), built by transformers from each family's config and written with gguf-py's writer as
llama.cpp lays them out -- the experts as 3-D ffn_gate_exps / ffn_up_exps / ffn_down_exps tensors quantized by
gguf-py (Q4_0, Q8_0, Q4_1 with Q8_0 down experts; Q4_K with Q6_K down, as Q4_K_M files have them: random
valid blocks, gguf-py has no K-quantizer), the rest F32. Imported with every tensor's blocks kept, they
place at those bytes and answer over 1, 2 and 3 stages: at ``none`` as transformers' float32 reference loaded from
the same GGUF (Mixtral, which transformers' GGUF loader reads as a dense Llama: as the source model with its experts
set to the file's values), at ``gguf`` as the gguf kind in one process; each expert's matrices on the kernels are
gguf-py's values, to the bit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import shared_once
from exactness import check_reply, reference
from gguf_moe_files import build_model, write_moe_gguf

LAYERS = 3
PROMPT = [5, 17, 42, 99, 7, 150, 3, 88, 21, 64]
NEW_TOKENS = 10
# rms_norm_eps a power of two: a GGUF holds it in float32, so the source model's value is the file's
_COMMON = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
               max_position_embeddings=256, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
               num_hidden_layers=LAYERS, tie_word_embeddings=False, rms_norm_eps=2.0 ** -17)
FAMILIES = {  # model -> (family, config, expert type, down experts' type)
    "qwen3_moe": ("qwen3_moe", dict(intermediate_size=128, head_dim=32, num_experts=8, num_experts_per_tok=2,
                                    moe_intermediate_size=64, norm_topk_prob=True), "Q4_0", ""),
    "qwen2_moe": ("qwen2_moe", dict(intermediate_size=128, num_experts=6, num_experts_per_tok=2,
                                    moe_intermediate_size=64, shared_expert_intermediate_size=64), "Q8_0", ""),
    "mixtral": ("mixtral", dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2), "Q4_1", "Q8_0"),
    # the common downloads' experts: Q4_K, down in Q6_K (Q4_K_M); rows of whole 256-value super-blocks
    "qwen3_moe-q4_k_m": ("qwen3_moe", dict(hidden_size=256, intermediate_size=256, head_dim=64, num_experts=4,
                                           num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True),
                         "Q4_K", "Q6_K"),
}


@pytest.fixture(scope="module")
def moe_ggufs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """model -> (the GGUF file, the imported model dir)."""
    from swarm.store.importer import import_model

    def build(root: Path) -> None:
        for name, (family, config, experts, down) in FAMILIES.items():
            model = build_model(family, **{**_COMMON, **config})
            write_moe_gguf(root / f"{name}.gguf", model, experts, down=down)
            import_model(str(root / f"{name}.gguf"), root / "models", name)

    root = shared_once(tmp_path_factory, "moe-gguf", build)
    return {name: (root / f"{name}.gguf", root / "models" / name) for name in FAMILIES}


def _float_reference(name: str, gguf: Path, model_dir: Path):
    """transformers' float32 model of the GGUF: loaded from the file itself (with the imported config: transformers'
    GGUF config leaves the expert sizes at the class defaults), or for Mixtral the source model with its experts
    replaced by the file's values."""
    import transformers
    from gguf import GGMLQuantizationType, quants

    family, config, experts, down = FAMILIES[name]
    if family != "mixtral":
        imported = transformers.AutoConfig.from_pretrained(model_dir)
        return transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, config=imported,
                                                                 dtype=torch.float32).eval()
    model = build_model(family, **{**_COMMON, **config})
    state = model.state_dict()
    for name in [k for k in state if ".experts." in k]:
        kind = GGMLQuantizationType[down if down and name.endswith("down_proj") else experts]
        values = quants.dequantize(quants.quantize(state[name].numpy(), kind), kind)
        state[name] = torch.from_numpy(np.ascontiguousarray(values))
    model.load_state_dict(state)
    return model


def _experts_bytes(stages) -> int:
    return sum(t.numel() * t.element_size() for s in stages for layer in s.layers
               for t in [*layer.mlp.experts.parameters(), *layer.mlp.experts.buffers()])


def _layer_bytes(stage, local: int) -> int:
    layer = stage.layers[local]
    return sum(t.numel() * t.element_size() for t in [*layer.parameters(), *layer.buffers()])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_import_keeps_each_expert_tensors_blocks_and_placement_counts_them(moe_ggufs, name):
    from gguf import GGUFReader
    from safetensors import safe_open

    from swarm.leader.planning.moe_speed import expert_weight_bytes, with_active_experts
    from swarm.leader.serving.models import model_size
    from swarm.stage.slice import StageModel
    from swarm.stage.slice_load import stage_specs
    from swarm.store.manifest import load_manifest

    gguf, model_dir = moe_ggufs[name]
    reader = GGUFReader(str(gguf))
    file_tensors = {t.name: t for t in reader.tensors}
    with safe_open(str(model_dir / "weights" / "layer_001.safetensors"), "pt") as f:
        for kind in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            key = {"ffn_down_exps": "mlp.experts.down_proj"}.get(kind, f"mlp.experts.gate_up_proj.{kind}")
            _, _, experts, down = FAMILIES[name]
            want_type = (down or experts) if kind == "ffn_down_exps" else experts
            assert file_tensors[f"blk.1.{kind}.weight"].tensor_type.name == want_type, kind
            stored = f.get_tensor(key)
            want = np.asarray(file_tensors[f"blk.1.{kind}.weight"].data)
            assert stored.dtype == torch.uint8 and stored.numpy().tobytes() == want.tobytes(), kind
    manifest = load_manifest(model_dir)
    stored_bytes = sum(e.size for e in manifest.files if e.kind in ("layer", "embed", "final"))
    assert stored_bytes <= 1.02 * gguf.stat().st_size
    # placement counts each layer at its blocks' bytes and a kernel's layout, at least what a stage then holds
    as_dict = json.loads(manifest.to_json())  # the leader reads the manifest as JSON
    size = model_size(as_dict, cpu=True, quantization="gguf")
    planned = size.layer_bytes
    expert_bytes = sum(int(file_tensors[f"blk.0.{k}.weight"].n_bytes)
                       for k in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
    stage = StageModel.load_dir(model_dir, stage_specs(LAYERS, 1)[0], quantization="gguf")
    for i in range(LAYERS):
        held = _layer_bytes(stage, i)
        assert expert_bytes < held <= planned[i] <= 1.25 * held, (i, held, planned[i])
    # the planner's speed follows a token's routed experts, at the bytes a weight the kernels hold
    config = json.loads((model_dir / "config.json").read_text())
    active = with_active_experts(size, config, expert_weight_bytes(as_dict, True, "gguf")).compute_bytes
    experts, top_k = (config.get("num_experts") or config["num_local_experts"]), config["num_experts_per_tok"]
    idle = expert_bytes * (experts - top_k) / experts  # the unrouted experts' blocks
    assert all(0.7 * idle < b - a < 1.3 * idle for a, b in zip(active, planned)), (active, planned, idle)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_experts_blocks_on_the_kernels_are_gguf_pys_values(moe_ggufs, name):
    from gguf import GGUFReader
    from gguf import dequantize as gguf_dequantize

    from swarm.stage.gguf_experts import GGUFExperts
    from swarm.stage.gguf_linear import dequantized
    from swarm.stage.slice import StageModel
    from swarm.stage.slice_load import stage_specs

    def values(module) -> torch.Tensor:
        held = module.dequantized() if callable(getattr(module, "dequantized", None)) else dequantized(module)
        return (held.float() + 0.0).view(torch.int32)  # bits; -0 as +0

    gguf, model_dir = moe_ggufs[name]
    tensors = {t.name: t for t in GGUFReader(str(gguf)).tensors}
    stage = StageModel.load_dir(model_dir, stage_specs(LAYERS, 2)[1], quantization="gguf")
    experts = stage.layers[0].mlp.experts
    assert isinstance(experts, GGUFExperts) and stage.spec.first_layer == 2
    assert getattr(experts.up[0], "kernel", None) is not None or hasattr(experts.up[0], "packed")  # on a kernel
    for kind, modules in (("ffn_gate_exps", experts.up), ("ffn_up_exps", experts.up), ("ffn_down_exps", experts.down)):
        t = tensors[f"blk.2.{kind}.weight"]
        want = torch.from_numpy(np.ascontiguousarray(gguf_dequantize(t.data, t.tensor_type), dtype=np.float32))
        for e, module in enumerate(modules):
            got = values(module)
            if kind != "ffn_down_exps":  # the expert's gate rows, then its up rows
                rows = want.shape[1]
                got = got[:rows] if kind == "ffn_gate_exps" else got[rows:]
            assert torch.equal(got, (want[e] + 0.0).view(torch.int32)), (kind, e)


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_moe_gguf_answers_at_none_as_transformers_and_at_gguf_as_one_process(moe_ggufs, name, stages):
    from reference_model import gguf_reference_model
    from swarm.stage.local import LocalRing
    from swarm.stage.slice import StageModel
    from swarm.stage.slice_load import stage_specs

    gguf, model_dir = moe_ggufs[name]
    specs = stage_specs(LAYERS, stages)
    want, margins = reference(_float_reference(name, gguf, model_dir), PROMPT, NEW_TOKENS)
    at_none = [StageModel.load_dir(model_dir, s) for s in specs]
    assert check_reply(LocalRing(at_none).generate(PROMPT, NEW_TOKENS), want, margins) == "identical"
    want, margins = reference(gguf_reference_model(model_dir), PROMPT, NEW_TOKENS)
    at_gguf = [StageModel.load_dir(model_dir, s, quantization="gguf") for s in specs]
    # the experts held as their blocks (a byte a weight or less), not as float32
    assert 3 * _experts_bytes(at_gguf) < _experts_bytes(at_none)
    assert check_reply(LocalRing(at_gguf).generate(PROMPT, NEW_TOKENS), want, margins) == "identical"


def test_a_moe_gguf_widened_at_import_holds_the_same_values(moe_ggufs, tmp_path):
    """--dtype float32: the gate and up experts joined into gate_up_proj at import, the values a load at none holds."""
    from swarm.stage.slice import StageModel
    from swarm.stage.slice_load import stage_specs
    from swarm.store.importer import import_model

    gguf, model_dir = moe_ggufs["qwen2_moe"]
    import_model(str(gguf), tmp_path, "wide", dtype="float32")
    wide = StageModel.load_dir(tmp_path / "wide", stage_specs(LAYERS, 1)[0])
    kept = StageModel.load_dir(model_dir, stage_specs(LAYERS, 1)[0])
    for (key, a), (_, b) in zip(wide.named_parameters(), kept.named_parameters(), strict=True):
        assert torch.equal(a, b), key


# 4 chats at once, batched in each stage; one longer than a prefill chunk of 8
CHATS = [PROMPT, [11, 12, 13], list(range(30, 50)), [1, 250, 31, 5]]


@pytest.mark.e2e
async def test_a_moe_gguf_over_real_fellows_answers_at_gguf_and_none_as_one_process(tmp_path, moe_ggufs):
    """qwen3_moe's GGUF over 3 fellows: its default kind (gguf), then none, over 1, 2 and 3 stages; each chat alone
    and as concurrent chats (batched decode, rows grouped by expert) as the reference of its kind in one process."""
    import trio

    from harness import running_swarm
    from reference_model import gguf_reference_model

    gguf, model_dir = moe_ggufs["qwen3_moe"]
    name = model_dir.name
    expected = {"gguf": [reference(gguf_reference_model(model_dir), p, NEW_TOKENS) for p in CHATS],
                "none": [reference(_float_reference("qwen3_moe", gguf, model_dir), p, NEW_TOKENS) for p in CHATS]}

    async def tokens(swarm, prompt):
        return await swarm.greedy(name, prompt, NEW_TOKENS)

    with trio.fail_after(200):
        async with running_swarm(tmp_path, [model_dir], fellows=3,
                                 fellow_env={"SWARM_SERVE_PREFILL_CHUNK": "8"}) as swarm:
            for kind, stages in (("gguf", 3), ("gguf", 2), ("gguf", 1), ("none", 3), ("none", 2)):
                view = await swarm.load(name, stages, quantization=None if kind == "gguf" else kind)
                assert view["quantization"] == kind and len(view["stages"]) == stages, view
                want, margins = expected[kind][0]
                assert check_reply(await tokens(swarm, PROMPT), want, margins) == "identical", (kind, stages)
                got: dict[int, list[int]] = {}

                async def chat(i, prompt, got=got):
                    got[i] = await tokens(swarm, prompt)

                async with trio.open_nursery() as nursery:
                    for i, prompt in enumerate(CHATS):
                        nursery.start_soon(chat, i, prompt)
                verdicts = [check_reply(got[i], w, m) for i, (w, m) in enumerate(expected[kind])]
                assert verdicts == ["identical"] * len(CHATS), (kind, stages, verdicts)
                await swarm.leader.serving.loader.unload(name)


def test_gate_and_up_experts_of_different_types_compute_side_by_side():
    """A file may keep a layer's gate and up experts in different types: each expert's matrix is then two layers, the
    gate rows' and the up rows', whose outputs are side by side as in the joined gate_up_proj."""
    from gguf import GGMLQuantizationType
    from gguf import dequantize as gguf_dequantize

    from gguf_files import quantized_blocks
    from swarm.stage.gguf_experts import expert_linear
    from swarm.stage.gguf_linear import GGUFBlocks

    experts, rows, cols = 3, 32, 128
    rng = np.random.default_rng(3)
    parts = []
    for kind in ("Q4_0", "Q8_0"):
        blocks = quantized_blocks(kind, experts * rows, cols, rng)
        parts.append((kind, blocks, GGUFBlocks(torch.from_numpy(blocks), kind, (rows, cols), experts=experts)))
    x = torch.randn(2, cols, generator=torch.Generator().manual_seed(0))
    for e in range(experts):
        module = expert_linear([p for _, _, p in parts], e, "cpu", torch.float32)
        assert len(module.parts) == 2  # the two parts apart, each on its kernel
        halves = [gguf_linear_of(kind, blocks[e * rows : (e + 1) * rows], rows, cols) for kind, blocks, _ in parts]
        assert torch.equal(module(x), torch.cat([h(x) for h in halves], dim=-1))
        want = [torch.from_numpy(gguf_dequantize(blocks[e * rows : (e + 1) * rows], GGMLQuantizationType[kind]))
                for kind, blocks, _ in parts]
        exact = x.double() @ torch.cat(want).double().T
        assert ((module(x).double() - exact).abs() / exact.abs().max()).max() < 0.02


def gguf_linear_of(kind: str, blocks: np.ndarray, rows: int, cols: int):
    from swarm.stage.gguf_linear import gguf_linear

    return gguf_linear(torch.from_numpy(np.ascontiguousarray(blocks)), kind, (rows, cols), None)


def test_a_qwen3_30b_a3b_q4_k_m_header_maps_every_expert_tensor_as_the_file_has_it(tmp_path):
    """The header of Qwen3-30B-A3B Q4_K_M (llama.cpp's names, types and shapes, its metadata; the data a hole):
    the config takes the file's expert sizes, and each layer's three expert tensors are kept as the file's blocks."""
    import gguf
    from gguf import GGUFWriter

    import real_moe_models as real
    from swarm.store.gguf_source import GGUFSource

    config = real.QWEN3_30B
    path = tmp_path / "Qwen3-30B-A3B-Q4_K_M.gguf"
    writer = GGUFWriter(str(path), "qwen3moe")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(40960)
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(6144)
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_expert_count(config["num_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    real.write_tensor_infos(writer, path, real.tensors(config, "Q4_K_M"))

    source = GGUFSource(path)
    model = source.config()
    assert (model.model_type, model.num_experts, model.moe_intermediate_size) == ("qwen3_moe", 128, 768)
    tensors = source.tensors(model)
    assert sum(t.raw_bytes for t in tensors) == sum(int(t.n_bytes) for t in source.reader.tensors)  # all of it
    layer = {t.hf_name.removeprefix("model.layers.47."): t for t in tensors if t.hf_name.startswith("model.layers.47.")}
    experts = {k: (t.gguf_type, t.shape, t.into, t.part) for k, t in layer.items() if ".experts." in k}
    assert experts == {
        "mlp.experts.gate_up_proj.ffn_gate_exps": ("Q4_K", (128, 768, 2048), "model.layers.47.mlp.experts.gate_up_proj",
                                                   0),
        "mlp.experts.gate_up_proj.ffn_up_exps": ("Q4_K", (128, 768, 2048), "model.layers.47.mlp.experts.gate_up_proj",
                                                 1),
        "mlp.experts.down_proj": ("Q6_K", (128, 2048, 768), "", 0)}  # the last layer's down experts: more bits
    assert not any(t.fixup for t in layer.values() if ".experts." in t.hf_name)
