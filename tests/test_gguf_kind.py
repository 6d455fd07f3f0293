"""The gguf kind: a GGUF model's linear layers computed on the file's own blocks (swarm.stage.gguf_linear).

Per 4-bit type, blocks written with gguf-py's writer (quantized by gguf-py where it can, random valid blocks for Q4_K)
are repacked into swarm's int4 kernel and dequantized back from its layout: gguf-py's values, to the bit; the kernel
computes them as its reference does, and as the float product to within its 8-bit activations. A GGUF imported and
loaded at gguf holds, in every linear layer, exactly the float weights a load at none holds (the q/k row permutation
included); a ring at gguf answers as the same kind in one process; the default kind of a GGUF model is gguf.
"""

from __future__ import annotations

import importlib.util
import platform

import numpy as np
import pytest
import torch
import trio

from exactness import check_reply, reference
from gguf_files import quantized_blocks, write_llama_gguf
from harness import running_swarm
from kernel_reference import int4_reference

TYPES = ["Q4_0", "Q4_1", "Q4_K"]


def _written(tmp_path, kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """(rows, bytes per row) blocks of a ``kind`` tensor written to a GGUF file by gguf-py and read back."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

    path = tmp_path / f"{kind}-{rows}x{cols}.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("w", quantized_blocks(kind, rows, cols, np.random.default_rng(seed)),
                      raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = GGUFReader(str(path)).tensors[0]
    assert tensor.tensor_type.name == kind
    return np.array(tensor.data).reshape(rows, -1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A float32 tensor's bits (-0 as +0: a Q4_0 level of 8 under a negative scale is -0 in gguf-py, +0 here)."""
    return (t.float() + 0.0).view(torch.int32)


# in features: Q4_0/Q4_1 -- a tail of pairs only (192), a block and an odd tail (576), blocks alone (1536); Q4_K (whole
# super-blocks of 256) -- a tail only (256), a block and an even tail (768), two blocks and a tail (1280)
SHAPES = {"Q4_0": [192, 576, 1536], "Q4_1": [192, 576, 1536], "Q4_K": [256, 768, 1280]}


@pytest.mark.parametrize("kind,k", [(kind, k) for kind in TYPES for k in SHAPES[kind]])
def test_each_4_bit_type_repacks_to_gguf_pys_values_and_computes_them(tmp_path, kind, k):
    from gguf import GGMLQuantizationType
    from gguf import dequantize as gguf_dequantize

    from swarm.stage.gguf_linear import dequantized, gguf_linear, levels

    n = 37  # odd: the packed layout's tail comes first on odd outputs
    blocks = _written(tmp_path, kind, n, k)
    want = torch.from_numpy(gguf_dequantize(blocks, GGMLQuantizationType[kind]).astype(np.float32))
    module = gguf_linear(torch.from_numpy(blocks), kind, (n, k), None)
    assert module.kernel is not None and module.packed.numel() == n * k // 2
    # the file's float16 scales as they are for Q4_0 and Q4_1; Q4_K's d * sc needs float32
    assert module.scale_zeros.dtype == (torch.float32 if kind == "Q4_K" else torch.float16)
    assert torch.equal(_bits(dequantized(module)), _bits(want))

    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1)) * 3
    x[0, 5] = 40.0  # an outlier: its group's other activations get a coarser step
    got = module(x)
    q, scale, factor = levels(torch.from_numpy(blocks), kind, (n, k))
    expected = int4_reference(x, q, scale.double(), factor.double() + 8 * scale.double())
    assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-4), (got.double() - expected).abs().max()
    # the float layer on the file's values, to within the activations' 8 bits (int4-fast's tolerance)
    exact = x.double() @ want.double().T
    assert ((got.double() - exact).abs() / exact.abs().max()).max() < 0.02
    bias = torch.randn(n)
    with_bias = gguf_linear(torch.from_numpy(blocks), kind, (n, k), bias)
    assert torch.equal(with_bias(x), got + bias)
    # each row alone, whatever the batch
    assert torch.equal(module(x[2:3]), got[2:3])


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the other builds are x86-64's")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])  # AVX2; plain C
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_the_kernels_other_builds_compute_exact_scales_the_same(march, dtype):
    from swarm.stage import int4_kernel

    flags = tuple("-march=" + march if f == "-march=native" else f for f in int4_kernel.FLAGS)
    other = int4_kernel.kernel(flags)
    assert other is not None
    g = torch.Generator().manual_seed(5)
    for k in (576, 896, 1536):
        q = torch.randint(0, 16, (37, k), generator=g)
        scale = (torch.rand(37, k // 32, generator=g) * 0.02 + 1e-3).to(dtype).float()
        factor = (torch.randn(37, k // 32, generator=g) * 0.01).to(dtype).float()
        packed, scales = other.pack_exact(q, scale, factor, dtype)
        assert torch.equal(other.unpack(packed, k), q.to(torch.uint8))
        x = torch.randn(6, k, generator=g)
        got = other.matmul(x, packed, scales, 37, None)
        want = int4_reference(x, q, scale.double(), factor.double() + 8 * scale.double())
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4)


def test_scales_a_type_cannot_hold_are_refused_before_the_kernel():
    from swarm.errors import KernelMismatch
    from swarm.stage import int4_kernel

    kernel = int4_kernel.kernel()
    q = torch.zeros(2, 64, dtype=torch.int64)
    with pytest.raises(KernelMismatch, match="cannot hold exactly"):
        kernel.pack_exact(q, torch.full((2, 2), 1 / 3), torch.zeros(2, 2), torch.float16)


def test_a_type_without_a_kernel_widens_to_the_files_values(tmp_path):
    from gguf import GGMLQuantizationType
    from gguf import dequantize as gguf_dequantize

    from swarm.stage.gguf_linear import gguf_linear

    blocks = _written(tmp_path, "Q6_K", 24, 512)
    want = torch.from_numpy(gguf_dequantize(blocks, GGMLQuantizationType.Q6_K).astype(np.float32))
    module = gguf_linear(torch.from_numpy(blocks), "Q6_K", (24, 512), None)
    x = torch.randn(3, 512)
    if importlib.util.find_spec("swarm.stage.gguf_q8") is None:  # before the 8-bit group kernel: float32
        assert isinstance(module, torch.nn.Linear) and torch.equal(module.weight, want)
        assert torch.equal(module(x), x @ want.T)
    else:
        exact = x.double() @ want.double().T
        assert ((module(x).double() - exact).abs() / exact.abs().max()).max() < 0.02


def _linears(stage) -> dict[str, torch.Tensor]:
    """Every decoder-layer linear weight a stage computes with, by name, as float32 (a fused part: its rows)."""
    from swarm.stage.gguf_linear import dequantized
    from swarm.stage.quantize import FusedPart

    out = {}
    for i, layer in enumerate(stage.layers):
        for name, module in layer.named_modules():
            if isinstance(module, FusedPart):
                start = sum(module.sizes[: module.index])
                out[f"{i}.{name}"] = dequantized(module.fused)[start : start + module.out_features]
            elif (isinstance(module, torch.nn.Linear) or hasattr(module, "packed")) and not name.endswith(".fused"):
                out[f"{i}.{name}"] = dequantized(module)
    return out


@pytest.mark.parametrize("kind,tied", [*((kind, False) for kind in TYPES), ("Q4_0", True)])
def test_a_gguf_of_each_type_loads_at_gguf_as_its_float_weights_and_answers_as_one_process(tmp_path, kind, tied):
    from reference_model import gguf_reference_model
    from swarm.stage.gguf_linear import GGUFEmbedding, dequantized
    from swarm.stage.local import LocalRing
    from swarm.stage.slice import StageModel
    from swarm.stage.slice_load import stage_specs
    from swarm.store.importer import import_model

    gguf = tmp_path / f"tiny-{kind}.gguf"
    write_llama_gguf(gguf, hidden=256, intermediate=512, layers=2, vocab=256, heads=4, kv_heads=2, matrices=kind,
                     tied=tied)
    import_model(str(gguf), tmp_path / "models", "m")
    model_dir = tmp_path / "models" / "m"
    at_gguf = [StageModel.load_dir(model_dir, s, quantization="gguf") for s in stage_specs(2, 2)]
    at_none = [StageModel.load_dir(model_dir, s) for s in stage_specs(2, 2)]
    for g, f in zip(at_gguf, at_none):
        assert g.quantization == "gguf" and g.parameter_bytes() < f.parameter_bytes()
        held, floats = _linears(g), _linears(f)
        assert sorted(held) == sorted(floats) and len(held) == 7  # q, k, v, o, gate, up, down
        for name, weight in floats.items():  # the file's values, q and k's rows permuted as transformers does
            assert torch.equal(_bits(held[name]), _bits(weight)), name
    # the first stage's embedding stays in blocks, looked up a row at a time; the last stage's head (tied: the
    # embedding's blocks) on the kernel
    embed = at_gguf[0].embed
    assert isinstance(embed, GGUFEmbedding) and at_gguf[1].lm_head.kernel is not None
    ids = torch.tensor([[3, 250, 3, 0]])
    assert torch.equal(_bits(embed(ids)), _bits(at_none[0].embed(ids)))
    assert torch.equal(_bits(dequantized(at_gguf[1].lm_head)), _bits(at_none[1].lm_head.weight))
    prompt = [1, 17, 42, 99, 7, 250, 31, 5]
    want, margins = reference(gguf_reference_model(model_dir), prompt, 16)
    assert check_reply(LocalRing(at_gguf).generate(prompt, 16), want, margins) == "identical"


def test_the_builtin_model_over_two_stages_at_gguf_answers_as_gguf_in_one_process(smollm_model_dir):
    from reference_model import gguf_reference_model
    from swarm.leader.chat.chat_format import encode_chat
    from swarm.stage.local import LocalRing
    from swarm.stage.slice import StageModel
    from swarm.stage.slice_load import stage_specs

    stages = [StageModel.load_dir(smollm_model_dir, s, quantization="gguf") for s in stage_specs(30, 2)]
    # the Q4_1 layers on the kernel with the file's float16 scales, and the C decode step over them
    layer = stages[1].layers[0]
    assert layer.mlp.down_proj.scale_zeros.dtype == torch.float16
    assert all(getattr(lay, "compiled_step", None) is not None for s in stages for lay in s.layers)
    ids = encode_chat(smollm_model_dir, [{"role": "user", "content": "Write a haiku about the sea."}], None)
    want, margins = reference(gguf_reference_model(smollm_model_dir), ids, 24, [2])
    assert check_reply(LocalRing(stages).generate(ids, 24, eos_token_ids=[2]), want, margins) == "identical"


def test_placement_counts_a_q4_1_layer_at_its_stored_bytes():
    from swarm.leader.serving.models import model_size

    manifest = {"dtype": "bfloat16", "num_layers": 2, "tie_word_embeddings": True, "kv_bytes_per_token": 1000,
                "storage": "gguf", "file_type": "Q4_1", "hidden_size": 576,
                "files": [{"kind": "layer", "layer": i, "size": 2_000_000, "params": 3_200_000} for i in range(2)]
                + [{"kind": "embed", "size": 30_000_000, "params": 28_000_000}, {"kind": "final", "size": 2304,
                                                                                 "params": 576}]}
    gguf = model_size(manifest, cpu=True, quantization="gguf")
    assert gguf.layer_bytes == (2_000_000, 2_000_000)  # Q4_1 repacks to its own size
    assert model_size(manifest, cpu=True).layer_bytes == (12_800_000, 12_800_000)  # float32 at none
    assert model_size({**manifest, "file_type": "Q4_0"}, cpu=True, quantization="gguf").layer_bytes[0] == 2_222_222
    # tied: the blocks, and the head on them at the most a kernel's layout holds per stored byte (Q4_K's 0.75 / 0.5625;
    # the 8-bit kernel's types at most 1.023x, Q5_K's 0.703 / 0.6875)
    assert gguf.embed_bytes == 30_000_000 + int(30_000_000 * 0.75 / 0.5625)
    untied = model_size({**manifest, "tie_word_embeddings": False}, cpu=True, quantization="gguf")
    assert untied.embed_bytes == 30_000_000  # stage 0 alone holds it, as its blocks
    # a file of mixed types counts at its most expensive type (Q4_K_M's: Q4_K at 0.75 bytes a weight for 0.5625,
    # above its Q6_K's 0.828 for 0.820 and Q5_0's own 0.6875)
    assert model_size({**manifest, "file_type": "Q4_K_M"}, cpu=True, quantization="gguf").layer_bytes[0] == \
        int(2_000_000 * 0.75 / 0.5625)
    # the 8-bit kernel's types, the 5- and 6-bit levels in nibbles and high-bit planes: Q5_0's and Q5_1's fp16 scales
    # as the file has them (their files' size), Q6_K's int8 sub-scales per 16 and fp16 d per 256 (0.828 bytes a weight
    # for 0.820)
    for file_type, held in (("Q5_0", 1.0), ("Q5_1", 1.0), ("Q8_0", 1.0), ("Q6_K", (0.75 + 2.5 / 32) / (210 / 256))):
        assert model_size({**manifest, "file_type": file_type}, cpu=True, quantization="gguf").layer_bytes[0] == \
            int(2_000_000 * held), file_type
    # a type no kernel takes widens to float32, never counted under
    assert model_size({**manifest, "file_type": "Q3_K_M"}, cpu=True, quantization="gguf").layer_bytes[0] == 12_800_000
    # where the import counted each type's weights (the manifest's "types"), each counts at its own layout: a mix's
    # Q6_K at 0.828 bytes a weight beside its Q4_K at 0.75, floats (and types no kernel takes) widened to float32
    typed = {**manifest, "file_type": "Q4_K_M", "files": [
        {**f, "types": {"Q4_K": 3_000_000, "Q6_K": 198_848, "F32": 1152}} if f["kind"] == "layer" else f
        for f in manifest["files"]]}
    assert model_size(typed, cpu=True, quantization="gguf").layer_bytes[0] == \
        int(3_000_000 * 0.75 + 198_848 * (0.75 + 2.5 / 32) + 1152 * 4)


def test_gguf_is_the_default_of_a_gguf_model_and_refused_for_a_folders():
    from swarm.errors import BadRequest
    from swarm.quantization import check_model_kind, default_kind

    assert default_kind({"storage": "gguf"}) == "gguf" and default_kind({"storage": ""}) == "none"
    with pytest.raises(BadRequest) as refused:
        check_model_kind("gguf", {"storage": ""}, "qwen-tiny")
    text = str(refused.value)
    assert "model qwen-tiny has none" in text and "Load it at none, int8, nf4 or int4-fast" in text


def test_a_stage_asked_for_gguf_on_float_files_refuses_instead_of_loading_floats(tiny_model_dirs):
    # the API refuses such a load (above); a stage asked directly must not quietly hold floats under the gguf name
    from swarm.errors import ModelError
    from swarm.stage import StageModel, StageSpec

    folder = tiny_model_dirs["llama"]
    with pytest.raises(ModelError, match="holds no GGUF blocks") as refused:
        StageModel.load_dir(folder, StageSpec(0, 1, True, False), quantization="gguf")
    assert "load the model at none, int8, nf4 or int4-fast" in str(refused.value)
    assert StageModel.load_dir(folder, StageSpec(0, 1, True, False)).quantization == "none"


# --- end to end: the built-in model over two fellows at its default kind --------------------------------------------


@pytest.mark.e2e
async def test_the_builtin_model_loads_at_gguf_by_default_and_answers_as_gguf_in_one_process(
        tmp_path, smollm_model_dir, tiny_model_dirs):
    from reference_model import gguf_reference_model
    from swarm.leader.chat.chat_format import encode_chat

    name, folder = smollm_model_dir.name, tiny_model_dirs["llama"].name
    prompt = "Write a haiku about the sea."
    ids = encode_chat(smollm_model_dir, [{"role": "user", "content": prompt}], None)
    with trio.fail_after(280):
        async with running_swarm(tmp_path, [smollm_model_dir, tiny_model_dirs["llama"]]) as swarm:
            refused = await swarm.http.post(f"/api/v1/models/{folder}/load", json={"quantization": "gguf"})
            assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_quantization"
            assert "has none" in refused.json()["error"]["message"]
            view = await swarm.load(name, 2, quantization=None)  # the model's own default
            assert view["quantization"] == "gguf", view
            assert [s.driver.stage_model.quantization for f in swarm.fellows for s in f.stages.values()] == \
                ["gguf", "gguf"]
            held = [s.driver.stage_model.parameter_bytes() for f in swarm.fellows for s in f.stages.values()]
            assert sum(held) <= view["weight_bytes"] and view["compression"] > 1.5, (held, view)
            data = await swarm.chat(name, [{"role": "user", "content": prompt}], max_tokens=24)
            want, margins = await trio.to_thread.run_sync(
                lambda: reference(gguf_reference_model(smollm_model_dir), ids, 24, [2]))
            assert check_reply(data["choices"][0]["token_ids"], want, margins) == "identical"


@pytest.mark.parametrize("kind", ["Q8_0", "Q6_K"])
def test_a_tied_8_bit_embedding_is_held_once_and_looks_up_the_files_values(tmp_path, kind):
    """One stage holding the embedding and its tied head on the 8-bit kernel keeps the matrix once: the embedding looks
    its rows up in the head's bytes; a first stage without the head decodes its own blocks. Both give the float
    weights a load at none holds, to the bit, and the ring answers as the file's reference."""
    from reference_model import gguf_reference_model
    from swarm.stage.gguf_linear import GGUFEmbedding
    from swarm.stage.local import LocalRing
    from swarm.stage.slice import StageModel
    from swarm.stage.slice_load import stage_specs
    from swarm.store.importer import import_model

    gguf = tmp_path / f"tiny-{kind}.gguf"
    write_llama_gguf(gguf, hidden=256, intermediate=512, layers=2, vocab=256, heads=4, kv_heads=2, matrices=kind,
                     tied=True)
    import_model(str(gguf), tmp_path / "models", "m")
    model_dir = tmp_path / "models" / "m"
    whole = StageModel.load_dir(model_dir, stage_specs(2, 1)[0], quantization="gguf")
    first = StageModel.load_dir(model_dir, stage_specs(2, 2)[0], quantization="gguf")
    at_none = StageModel.load_dir(model_dir, stage_specs(2, 1)[0])
    assert isinstance(whole.embed, GGUFEmbedding) and whole.embed.head is whole.lm_head
    assert whole.embed.blocks.numel() == 0 and whole.lm_head.kernel is not None
    assert isinstance(first.embed, GGUFEmbedding) and first.embed.head is None
    # the matrix once: the whole ring's stage holds what the two stages of a split hold, less the embedding's blocks
    last = StageModel.load_dir(model_dir, stage_specs(2, 2)[1], quantization="gguf")
    blocks = first.embed.blocks.numel()
    assert blocks > 0 and whole.parameter_bytes() == first.parameter_bytes() + last.parameter_bytes() - blocks
    ids = torch.tensor([[3, 250, 3, 0, 128]])
    want = _bits(at_none.embed(ids))
    assert torch.equal(_bits(whole.embed(ids)), want) and torch.equal(_bits(first.embed(ids)), want)
    # its layers' projections are on the 8-bit kernel, unfused: the lean path takes them as rows of a matrix (not
    # the tied lookup's rows of the weight), and warm-up verifies it to the bit
    whole.warm_up()
    assert whole.lean is not None
    prompt = [1, 17, 42, 99, 7, 250, 31, 5]
    reply, margins = reference(gguf_reference_model(model_dir), prompt, 12)
    assert check_reply(LocalRing([whole]).generate(prompt, 12), reply, margins) == "identical"
