"""A GGUF's tensors kept as the file has them: every accepted type imports as its own bytes and, read back through a
stage's loader, is bit for bit what gguf-py dequantizes; other types are refused before anything is written; the
leader budgets the stages by the values they will hold, and a manifest from before still loads."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from gguf_files import write_llama_gguf
from swarm.errors import ImportFailed
from swarm.model_format import GGUF_TENSORS_KEY, GGUF_TYPES, layer_file
from swarm.stage import weights
from swarm.store.importer import import_model
from swarm.store.manifest import load_manifest

# gguf-py has no quantizer for the K-quants and IQ4 types (Q2_K ... Q6_K, IQ4_NL, IQ4_XS): their test blocks are
# random bytes with finite fp16 scales (tests/gguf_files.py), as no file holding them is at hand here; the others are
# random data quantized by gguf-py.


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("kind", GGUF_TYPES)
def test_each_type_is_kept_as_its_bytes_and_loads_as_gguf_py_dequantizes_it(tmp_path, monkeypatch, kind):
    """Matrices of ``kind`` (quantized by gguf-py where it can, else random blocks) are stored as the file's bytes;
    the stage's loader, dequantizing a few rows at a time, gives gguf-py's dequantization of the whole tensor bit for
    bit, with Llama's q/k row permutation applied as transformers applies it."""
    from gguf import GGUFReader, dequantize
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    gguf = tmp_path / "m.gguf"
    write_llama_gguf(gguf, hidden=256, intermediate=512, layers=2, vocab=256, heads=4, kv_heads=2, matrices=kind)
    manifest = import_model(str(gguf), tmp_path / "models", "m")
    assert manifest.storage == "gguf"
    assert manifest.total_bytes <= 1.02 * gguf.stat().st_size
    path = tmp_path / "models/m" / layer_file(1)
    reader = GGUFReader(str(gguf))
    in_file = {t.name: t for t in reader.tensors}
    with safe_open(str(path), framework="pt") as f:
        kept = json.loads(f.metadata()[GGUF_TENSORS_KEY])
        stored = {key: f.get_tensor(key) for key in f.keys()}
    assert kept["mlp.up_proj.weight"]["type"] == kind and kept["mlp.up_proj.weight"]["shape"] == [512, 256]
    for key, info in kept.items():  # the file's very bytes
        raw = in_file[info["name"]].data
        assert np.array_equal(stored[key].contiguous().view(torch.uint8).numpy().reshape(-1),
                              np.ascontiguousarray(raw).view(np.uint8).reshape(-1)), key

    monkeypatch.setattr(weights, "DEQUANT_SLICE_ELEMENTS", 1000)  # several slices per matrix
    config = json.loads((tmp_path / "models/m/config.json").read_text())
    loaded = weights.read_weights(path, config)
    processor = LlamaTensorProcessor(config=config)
    for key, info in kept.items():
        tensor = in_file[info["name"]]
        want = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type)))
        want = want.reshape(info["shape"])
        if info["fixup"]:
            want = processor.process(weights=want, name=info["name"]).weights
        assert loaded[key].dtype == torch.float32 and torch.equal(_bits(loaded[key]), _bits(want)), key
        assert torch.isfinite(loaded[key]).all(), key
    assert {k for k, i in kept.items() if i["fixup"]} == {"self_attn.q_proj.weight", "self_attn.k_proj.weight"}


def test_a_type_outside_the_list_is_refused_naming_type_and_tensor_before_writing(tmp_path):
    """IQ2_XXS (which gguf-py could dequantize, but which is not among the kept types) is refused, naming the type and
    a tensor of it, with nothing written."""
    gguf = tmp_path / "m.gguf"
    write_llama_gguf(gguf, hidden=256, intermediate=512, layers=1, vocab=256, heads=4, kv_heads=2, matrices="IQ2_XXS")
    with pytest.raises(ImportFailed) as caught:
        import_model(str(gguf), tmp_path / "models")
    message = str(caught.value)
    assert "IQ2_XXS (9 tensors, e.g. token_embd.weight)" in message and "Q4_K" in message and "MXFP4" in message
    assert not (tmp_path / "models").exists()


def test_the_leader_budgets_the_values_a_stage_holds_not_the_blocks(tmp_path):
    """A Q8_0 GGUF kept as blocks downloads its blocks' bytes but is budgeted, like its float32 import, as float32
    values on a CPU fellow (bfloat16 on a GPU); a manifest written before (no storage, no params) still reads and is
    budgeted by its files' sizes."""
    from swarm.leader.serving.models import model_size
    from swarm.store.manifest import Manifest, stage_files

    gguf = tmp_path / "m.gguf"
    write_llama_gguf(gguf, hidden=256, intermediate=512, layers=2, vocab=256, heads=4, kv_heads=2)
    import_model(str(gguf), tmp_path / "models", "blocks")
    import_model(str(gguf), tmp_path / "models", "f32", dtype="float32")
    blocks = json.loads((tmp_path / "models/blocks/manifest.json").read_text())
    f32 = json.loads((tmp_path / "models/f32/manifest.json").read_text())
    cpu, gpu, want = model_size(blocks, cpu=True), model_size(blocks, cpu=False), model_size(f32, cpu=True)
    assert cpu.layer_bytes[0] == sum(v.numel() * 4 for v in weights.read_weights(
        tmp_path / "models/blocks" / layer_file(0), {}).values())
    assert all(abs(a - b) < 1000 for a, b in zip(cpu.layer_bytes, want.layer_bytes))  # f32's file headers differ
    assert abs(cpu.embed_bytes - want.embed_bytes) < 1000 and gpu.layer_bytes[0] * 2 == cpu.layer_bytes[0]
    layer_entry = next(f for f in blocks["files"] if f["path"] == layer_file(0))
    assert layer_entry["size"] < cpu.layer_bytes[0] / 3.5  # the download: Q8_0 is 34 bytes per 32 values

    old = dict(f32)  # as an older leader wrote it
    old.pop("storage")
    old["files"] = [{k: v for k, v in f.items() if k != "params"} for f in f32["files"]]
    manifest = Manifest.from_dict(old)
    assert manifest.storage == "" and stage_files(manifest, 0, 1, True, False)
    assert model_size(old, cpu=True) == want
    assert load_manifest(tmp_path / "models/blocks").storage == "gguf"

    # Ollama's clients see the file's quantization as llama.cpp names it, a float import its dtype
    from types import SimpleNamespace

    from swarm.leader.api.ollama_api import tag_entry

    assert blocks["file_type"] == "Q8_0" and f32["file_type"] == ""
    details = [tag_entry(SimpleNamespace(name="m", manifest=m, created_at=0))["details"] for m in (blocks, f32)]
    assert [(d["format"], d["quantization_level"]) for d in details] == [("gguf", "Q8_0"), ("safetensors", "float32")]


def test_a_model_imported_before_blocks_were_kept_still_loads_as_it_did(tmp_path):
    """A GGUF imported as bfloat16 files with a manifest as older leaders wrote it (no storage, no params) loads into
    a stage that holds exactly those bfloat16 values widened to float32, and answers like the reference assembled
    from the same files."""
    from safetensors.torch import load_file

    from reference_model import load_reference_model
    from swarm.stage import StageModel, StageSpec

    gguf = tmp_path / "m.gguf"
    write_llama_gguf(gguf, hidden=256, intermediate=512, layers=2, vocab=256, heads=4, kv_heads=2)
    import_model(str(gguf), tmp_path / "models", "old", dtype="bfloat16")
    path = tmp_path / "models/old/manifest.json"
    data = json.loads(path.read_text())
    data.pop("storage")
    data["files"] = [{k: v for k, v in f.items() if k != "params"} for f in data["files"]]
    path.write_text(json.dumps(data))
    assert load_manifest(tmp_path / "models/old").dtype == "bfloat16"
    stage = StageModel.load_dir(tmp_path / "models/old", StageSpec(0, 2, True, True))
    stored = load_file(tmp_path / "models/old" / layer_file(1))
    held = dict(stage.named_parameters())
    for key, value in stored.items():
        assert value.dtype == torch.bfloat16 and torch.equal(held[f"layers.1.{key}"], value.float()), key
    stage.new_request("r")
    logits = stage.forward("r", 0, input_ids=torch.tensor([[1, 2, 3]]))
    model = load_reference_model(tmp_path / "models/old")
    with torch.inference_mode():
        want = model(torch.tensor([[1, 2, 3]])).logits[0, -1]
    assert torch.allclose(logits, want, atol=1e-5)


def test_the_header_reader_gives_each_field_as_its_kind_or_none(tmp_path):
    """swarm.store.gguf_header, which every header read of an import goes through: strings, integers, floats and
    bools as themselves; a missing field, an array, or a field of another kind than asked as None."""
    from gguf import GGUFReader, GGUFWriter

    from swarm.store.gguf_header import header_field, header_value

    writer = GGUFWriter(str(tmp_path / "h.gguf"), "llama")
    writer.add_string("t.name", "Größe 135M")
    writer.add_uint32("t.count", 32)
    writer.add_float32("t.base", 10000.5)
    writer.add_bool("t.flag", True)
    writer.add_array("t.list", [1, 2, 3])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = GGUFReader(str(tmp_path / "h.gguf"))
    assert [header_value(reader, f"t.{k}") for k in ("name", "count", "base", "flag", "list", "absent")] == \
        ["Größe 135M", 32, 10000.5, True, None, None]
    assert header_field(reader, "general.architecture", str) == "llama"
    assert header_field(reader, "t.count", int) == 32 and header_field(reader, "t.base", float) == 10000.5
    assert header_field(reader, "t.name", int) is None and header_field(reader, "t.count", str) is None
