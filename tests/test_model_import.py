"""Importing a model into per-layer files: refusals, the manifest, which files a stage needs, streaming a GGUF in
bounded memory, 16-bit storage, sharded folders, free disk, interruptions and --replace."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import build_tiny_source
from swarm.errors import ImportFailed, ModelNotFound, UnsupportedArchitecture
from swarm.store.importer import import_model
from swarm.store.manifest import Manifest, kv_bytes_per_token, load_manifest, sha256_file, stage_files


def test_refuses_unsupported_architecture(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    source = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=64)).save_pretrained(source)
    with pytest.raises(UnsupportedArchitecture) as caught:
        import_model(str(source), tmp_path / "models")
    message = str(caught.value)
    assert "gpt2" in message and "llama" in message and "qwen3" in message
    assert not (tmp_path / "models").exists()  # refused before anything was written


def test_refuses_missing_or_broken_sources(tmp_path):
    with pytest.raises(ImportFailed, match="neither a folder"):
        import_model(str(tmp_path / "nowhere"), tmp_path / "models")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ImportFailed, match="config.json"):
        import_model(str(tmp_path / "empty"), tmp_path / "models")
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ImportFailed, match="gguf"):
        import_model(str(tmp_path / "weights.bin"), tmp_path / "models")
    with pytest.raises(ModelNotFound):
        load_manifest(tmp_path / "empty")


def test_manifest_describes_the_files(tiny_model_dirs):
    model_dir = tiny_model_dirs["qwen3"]
    manifest = load_manifest(model_dir)
    assert manifest.architecture == "qwen3" and manifest.num_layers == 5 and manifest.hidden_size == 64
    assert manifest.vocab_size == 320 and manifest.dtype == "float32" and not manifest.tie_word_embeddings
    assert manifest.eos_token_ids == [2]
    assert manifest.warnings and "tokenizer" in manifest.warnings[0]  # the tiny folders carry none
    for entry in manifest.files:
        path = model_dir / entry.path
        assert sha256_file(path) == entry.sha256 and path.stat().st_size == entry.size
    layers = [e for e in manifest.files if e.kind == "layer"]
    assert [e.layer for e in layers] == list(range(5))
    assert manifest.bytes_per_layer == max(e.size for e in layers)
    assert manifest.total_bytes == sum(e.size for e in manifest.files)
    assert {e.kind for e in manifest.files} == {"config", "embed", "layer", "final"}
    # Layer tensors are named relative to their layer; Qwen3 layers carry q_norm/k_norm.
    with safe_open(model_dir / "weights/layer_003.safetensors", framework="pt") as f:
        keys = set(f.keys())
    assert "self_attn.q_proj.weight" in keys and "self_attn.q_norm.weight" in keys
    with safe_open(model_dir / "weights/final.safetensors", framework="pt") as f:
        assert set(f.keys()) == {"norm.weight", "lm_head.weight"}  # untied: the head travels with the last stage
    assert Manifest.from_json(manifest.to_json()) == manifest
    # 2 (k and v) * 2 kv heads * head_dim 16 * 4 bytes
    assert manifest.kv_bytes_per_token == 256
    assert kv_bytes_per_token(json.loads((model_dir / "config.json").read_text()), "bfloat16") == 128


def test_stage_files_tied_and_untied(tiny_model_dirs):
    tied = load_manifest(tiny_model_dirs["llama"])  # 4 layers, tied
    with safe_open(tiny_model_dirs["llama"] / "weights/final.safetensors", framework="pt") as f:
        assert set(f.keys()) == {"norm.weight"}

    def paths(entries):
        return [e.path for e in entries]

    assert paths(stage_files(tied, 0, 2, True, False)) == [
        "config.json", "weights/embed.safetensors", "weights/layer_000.safetensors", "weights/layer_001.safetensors"
    ]
    assert paths(stage_files(tied, 2, 4, False, True)) == [
        "config.json", "weights/embed.safetensors", "weights/layer_002.safetensors", "weights/layer_003.safetensors",
        "weights/final.safetensors",
    ]
    untied = load_manifest(tiny_model_dirs["qwen2"])  # 6 layers
    assert paths(stage_files(untied, 2, 4, False, False)) == ["config.json", "weights/layer_002.safetensors",
                                                              "weights/layer_003.safetensors"]
    assert paths(stage_files(untied, 4, 6, False, True)) == [
        "config.json", "weights/layer_004.safetensors", "weights/layer_005.safetensors", "weights/final.safetensors"
    ]
    entry = stage_files(untied, 0, 6, True, True)[1]
    assert entry.kind == "embed" and entry.sha256 == untied.file("weights/embed.safetensors").sha256


def test_existing_name_needs_replace_and_keeps_source_dtype(tmp_path):
    source = build_tiny_source(tmp_path / "src", "llama", dtype=torch.bfloat16)
    seen = []
    manifest = import_model(str(source), tmp_path / "models", "m",
                            progress=lambda s, f, detail="": seen.append((s, f)))
    assert manifest.dtype == "bfloat16" and manifest.kv_bytes_per_token == 2 * 2 * 16 * 2
    with safe_open(tmp_path / "models/m/weights/layer_000.safetensors", framework="pt") as f:
        assert f.get_tensor("mlp.up_proj.weight").dtype == torch.bfloat16
    assert ("write layers", 1.0) in seen and seen[-1] == ("done", 1.0)
    with pytest.raises(ImportFailed, match="already exists"):
        import_model(str(source), tmp_path / "models", "m")
    again = import_model(str(source), tmp_path / "models", "m", replace=True)
    assert again.files == manifest.files
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["m"]


def test_interrupted_import_leaves_nothing(tmp_path):
    source = build_tiny_source(tmp_path / "src", "llama")

    def progress(stage, fraction, detail=""):
        if stage == "write layers" and fraction > 0.5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        import_model(str(source), tmp_path / "models", "m", progress=progress)
    assert list((tmp_path / "models").iterdir()) == []


def test_refuses_bad_names(tmp_path):
    source = build_tiny_source(tmp_path / "src", "llama")
    with pytest.raises(ImportFailed, match="cannot be a model name"):
        import_model(str(source), tmp_path / "models", "../escape")


# --- streaming, storage dtype, sources -------------------------------------------------------------------------------


@pytest.mark.e2e
def test_streamed_gguf_import_equals_transformers_load(tmp_path):
    """The built-in SmolLM2 GGUF (Q4_1): by default its blocks are kept -- the model takes at most 1.02x the file
    (it took 273 MB for the 98 MB file as bfloat16) -- and read back as a stage reads them, every tensor is exactly
    what transformers' whole-file float32 from_pretrained produces; dequantized at import (--dtype float32) too."""
    from transformers import AutoModelForCausalLM

    from swarm.stage.weights import read_weights
    from swarm.store.importer import builtin_gguf_path

    path = builtin_gguf_path()
    f32 = import_model("smollm2-135m-instruct", tmp_path, "f32", dtype="float32")
    auto = import_model("smollm2-135m-instruct", tmp_path, "auto")
    assert f32.dtype == "float32" and f32.storage == ""
    assert auto.storage == "gguf" and auto.dtype == "bfloat16"  # bfloat16: what a GPU computes its blocks in
    print(f"stored {auto.total_bytes / 1e6:.1f} MB for the {path.stat().st_size / 1e6:.1f} MB file")
    assert auto.total_bytes <= 1.02 * path.stat().st_size
    weights = sum(e.size for e in auto.files if e.path.endswith(".safetensors"))
    assert weights < path.stat().st_size  # the file's tensor bytes, without its vocabulary
    for entry in auto.files:  # each file counts its weight values, which placement sizes the stages by
        if entry.path.endswith(".safetensors"):
            assert entry.params == sum(v.numel() for v in load_file(tmp_path / "f32" / entry.path).values())
    config = json.loads((tmp_path / "auto" / "config.json").read_text())
    whole = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).state_dict()
    compared = 0
    for entry in f32.files:
        if not entry.path.endswith(".safetensors"):
            continue
        prefix = f"model.layers.{entry.layer}." if entry.kind == "layer" else "model."
        a = load_file(tmp_path / "f32" / entry.path)
        b = read_weights(tmp_path / "auto" / entry.path, config)
        assert a.keys() == b.keys()
        for key, value in a.items():
            want = whole["lm_head.weight" if key == "lm_head.weight" else prefix + key]
            assert torch.equal(value, want), key
            assert b[key].dtype == torch.float32 and torch.equal(b[key], want), key
            compared += 1
    assert compared == len(whole) - 1  # everything but the tied head


@pytest.mark.e2e
@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_gguf_import_holds_a_layer_at_a_time(tmp_path, dtype):
    """A generated Llama GGUF of ~270 MB (Q8_0; 1 GB dequantized to float32) imports with the importing process's
    peak RSS less than a quarter of the dequantized size above what it held before: its blocks kept (the default, at
    the file's size) or dequantized to bfloat16."""
    import subprocess
    import sys

    from gguf_files import write_llama_gguf

    gguf = tmp_path / "big.gguf"
    values = write_llama_gguf(gguf, hidden=1024, intermediate=4096, layers=12, vocab=32000)
    dequantized = values * 4
    assert gguf.stat().st_size > 250e6
    child = (
        "import json, sys, torch, transformers, gguf\n"
        "from transformers import AutoModelForCausalLM, LlamaForCausalLM\n"
        "from swarm.store.importer import import_model\n"
        "def status(key):\n"
        "    return next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith(key))\n"
        "before = status('VmRSS')\n"
        "m = import_model(sys.argv[1], sys.argv[2], 'big', dtype=sys.argv[3])\n"
        "print(json.dumps({'raise': status('VmHWM') - before, 'dtype': m.dtype, 'bytes': m.total_bytes}))\n"
    )
    out = subprocess.run([sys.executable, "-c", child, str(gguf), str(tmp_path / "models"), dtype], capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"peak RSS raised by {figures['raise'] / 1e6:.0f} MB importing {dequantized / 1e6:.0f} MB of float32 values")
    assert figures["raise"] < dequantized / 4, figures
    assert figures["dtype"] == "bfloat16"
    if dtype == "auto":
        assert figures["bytes"] <= 1.02 * gguf.stat().st_size
    else:
        assert figures["bytes"] < dequantized / 2 + 10e6
    manifest = load_manifest(tmp_path / "models" / "big")
    assert manifest.num_layers == 12 and not manifest.tie_word_embeddings


def test_sharded_folder_imports_by_its_index_in_its_16_bit_dtype(tmp_path):
    source = build_tiny_source(tmp_path / "src", "qwen3", dtype=torch.bfloat16, max_shard_size="40KB")
    assert (source / "model.safetensors.index.json").is_file() and len(list(source.glob("*.safetensors"))) > 2
    whole = {}
    for shard in source.glob("*.safetensors"):
        whole.update(load_file(shard))
    # A stray copy that the index does not list (Mistral folders carry consolidated.safetensors) is not read.
    torch.save({}, source / "ignored.bin")
    (source / "consolidated.safetensors").write_bytes(b"not read")
    manifest = import_model(str(source), tmp_path / "models", "m")
    assert manifest.dtype == "bfloat16" and manifest.num_layers == 5
    layer = load_file(tmp_path / "models/m/weights/layer_004.safetensors")
    for key, value in layer.items():
        assert torch.equal(value, whole[f"model.layers.4.{key}"])
    assert json.loads((tmp_path / "models/m/config.json").read_text())["dtype"] == "bfloat16"
    # A float32 checkpoint can be stored in 16 bits on request, and a 16-bit one widened.
    f16 = import_model(str(source), tmp_path / "models", "m16", dtype="float16")
    assert f16.dtype == "float16" and f16.kv_bytes_per_token == manifest.kv_bytes_per_token
    assert load_file(tmp_path / "models/m16/weights/embed.safetensors")["embed_tokens.weight"].dtype == torch.float16


def test_sharded_folder_missing_a_shard_is_refused(tmp_path):
    source = build_tiny_source(tmp_path / "src", "llama", max_shard_size="40KB")
    max(source.glob("model-*.safetensors")).unlink()
    with pytest.raises(ImportFailed, match="missing 1 of the"):
        import_model(str(source), tmp_path / "models")
    assert not (tmp_path / "models").exists()


# --- refusals before writing, disk, interruptions, --replace --------------------------------------------------------


def test_refuses_when_the_disk_is_too_small_saying_how_much_it_needs(tmp_path, monkeypatch):
    from swarm.store import import_plan

    source = build_tiny_source(tmp_path / "src", "llama")
    monkeypatch.setattr(import_plan, "_free_bytes", lambda path: 100 << 20)
    with pytest.raises(ImportFailed) as caught:
        import_model(str(source), tmp_path / "models", "m")
    message = str(caught.value)
    assert "needs 0.3 GB free" in message and "has 0.1 GB free" in message and "float32" in message
    assert list((tmp_path / "models").iterdir()) == []


def test_refuses_a_gguf_quant_type_it_cannot_read_before_writing(tmp_path, monkeypatch):
    from gguf_files import write_llama_gguf
    from swarm.store import gguf_source

    gguf = tmp_path / "q.gguf"
    write_llama_gguf(gguf, hidden=64, intermediate=128, layers=2, vocab=320)
    monkeypatch.setattr(gguf_source, "supported_quant_types", lambda: ["F16", "F32", "Q4_K"])
    with pytest.raises(ImportFailed) as caught:
        import_model(str(gguf), tmp_path / "models")
    message = str(caught.value)
    assert "Q8_0 (16 tensors, e.g. token_embd.weight)" in message and "F16, F32, Q4_K" in message
    assert not (tmp_path / "models").exists()


def test_refuses_an_unsupported_gguf_architecture_naming_the_supported(tmp_path):
    from gguf import GGUFWriter

    gguf = tmp_path / "gpt2.gguf"
    writer = GGUFWriter(str(gguf), "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedArchitecture, match="gpt2 model.*llama.*qwen3"):
        import_model(str(gguf), tmp_path / "models")
    assert not (tmp_path / "models").exists()


def test_progress_goes_tensor_by_tensor_and_layer_by_layer(tmp_path):
    source = build_tiny_source(tmp_path / "src", "llama")
    seen = []
    import_model(str(source), tmp_path / "models", "m", progress=lambda *a: seen.append(a))
    writes = [a for a in seen if a[0] == "write layers"]
    fractions = [a[1] for a in writes]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    details = [a[2] for a in writes]
    assert "layer 1 of 4: self_attn.q_proj.weight" in details and "layer 4 of 4 written" in details
    assert "embedding written" in details


def test_failed_replace_keeps_the_old_model_and_its_listing(tmp_path):
    from swarm.model_import import import_into_leader
    from swarm.store.db import Store

    source = build_tiny_source(tmp_path / "src", "llama")
    first = import_into_leader(str(source), tmp_path / "leader", "m")

    def fail(phase, fraction, detail=""):
        if phase == "write layers" and fraction > 0.5:
            raise OSError("disk full")

    from swarm.store import importer

    with pytest.raises(OSError):
        importer.import_model(str(source), tmp_path / "leader/models", "m", progress=fail, replace=True,
                              dtype="bfloat16")
    assert load_manifest(tmp_path / "leader/models/m") == first
    assert sorted(p.name for p in (tmp_path / "leader/models").iterdir()) == ["m"]
    store = Store(tmp_path / "leader/leader.db")
    try:
        assert "m" in [m.name for m in store.list_models()]
    finally:
        store.close()


def test_leftovers_of_a_killed_import_are_cleared_by_the_next(tmp_path):
    source = build_tiny_source(tmp_path / "src", "llama")
    models = tmp_path / "models"
    (models / ".m.importing-999999-abcd/weights").mkdir(parents=True)  # pid 999999: long gone
    (models / ".other.importing-999999-abcd").mkdir()  # another model's: left alone
    import_model(str(source), models, "m")
    assert sorted(p.name for p in models.iterdir()) == [".other.importing-999999-abcd", "m"]


def test_budget_counts_what_a_stage_holds_not_what_the_file_holds(tmp_path):
    """A bfloat16 model budgets float32 bytes on CPU fellows (they compute in float32) and its own bytes on GPUs."""
    from swarm.leader.serving.models import model_size

    source = build_tiny_source(tmp_path / "src", "llama")
    import_model(str(source), tmp_path / "models", "m16", dtype="bfloat16")
    import_model(str(source), tmp_path / "models", "m32", dtype="float32")
    m16 = json.loads((tmp_path / "models/m16/manifest.json").read_text())
    m32 = json.loads((tmp_path / "models/m32/manifest.json").read_text())
    cpu16, cpu32, gpu16 = model_size(m16, cpu=True), model_size(m32, cpu=True), model_size(m16, cpu=False)
    assert abs(cpu16.layer_bytes[0] - cpu32.layer_bytes[0]) < 1000  # the file headers differ, not the weights
    assert abs(gpu16.layer_bytes[0] * 2 - cpu32.layer_bytes[0]) < 1000
    assert (cpu16.kv_bytes_per_token_per_layer == cpu32.kv_bytes_per_token_per_layer
            == 2 * gpu16.kv_bytes_per_token_per_layer)


def test_refuses_attention_soft_capping_before_writing(tmp_path):
    """Stages attend through SDPA, which has no attention-score soft-capping: such a model would answer otherwise
    than transformers, so it is refused rather than imported."""
    import transformers

    config = transformers.Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=16, num_hidden_layers=2, vocab_size=320,
                                           attn_logit_softcapping=50.0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "src")
    with pytest.raises(UnsupportedArchitecture, match="soft-caps attention scores"):
        import_model(str(tmp_path / "src"), tmp_path / "models")
    assert not (tmp_path / "models").exists()


@pytest.mark.parametrize(("matrices", "stored"), [("Q8_0", "bfloat16"), ("F16", "float16"), ("F32", "float32")])
def test_gguf_keeps_the_file_s_tensors_and_values_follow_transformers(tmp_path, matrices, stored):
    """A GGUF's tensors are stored as the file has them (Q8_0 blocks as their bytes, F16 and F32 as those dtypes, the
    q/k rows as the file orders them); the manifest's dtype is what a GPU computes them in (bfloat16 for a quantized
    file, else the file's own). Read as a stage reads them, every tensor is exactly transformers' whole-file float32
    load (Llama's q/k rows permuted back); with --dtype, the import dequantizes into that dtype as before."""
    from transformers import AutoModelForCausalLM

    from gguf_files import write_llama_gguf
    from swarm.stage.weights import read_weights

    gguf = tmp_path / "m.gguf"
    write_llama_gguf(gguf, hidden=128, intermediate=256, layers=2, vocab=320, heads=4, kv_heads=2, matrices=matrices)
    manifest = import_model(str(gguf), tmp_path / "models", "m")
    assert manifest.dtype == stored and manifest.storage == "gguf"
    whole = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).state_dict()
    layer_file = tmp_path / "models/m/weights/layer_001.safetensors"
    stored_as = {key: tensor.dtype for key, tensor in load_file(layer_file).items()}
    want_dtype = {"Q8_0": torch.uint8, "F16": torch.float16, "F32": torch.float32}[matrices]
    assert stored_as["mlp.up_proj.weight"] == want_dtype and stored_as["input_layernorm.weight"] == torch.float32
    config = json.loads((tmp_path / "models/m/config.json").read_text())
    layer = read_weights(layer_file, config)
    assert len(layer) == 9
    for key, value in layer.items():
        assert torch.equal(value, whole[f"model.layers.1.{key}"]), key
    # dequantized at import into the asked dtype (the form every import had before the blocks were kept)
    rounded = import_model(str(gguf), tmp_path / "models", "r", dtype=stored)
    assert rounded.storage == "" and rounded.dtype == stored
    for key, value in load_file(tmp_path / "models/r/weights/layer_001.safetensors").items():
        assert torch.equal(value, whole[f"model.layers.1.{key}"].to(getattr(torch, stored))), key


@pytest.mark.e2e
def test_sharded_folder_import_holds_a_slice_at_a_time(tmp_path):
    """A generated ~540 MB bfloat16 Llama folder in two shards imports with the importing process's peak RSS less than
    a quarter of the folder's size above what it held before (tensors are read with plain reads, a slice at a time,
    not through safetensors' memory map)."""
    import subprocess
    import sys

    import transformers
    from safetensors.torch import save_file

    config = transformers.LlamaConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=12,
                                      num_attention_heads=8, num_key_value_heads=4, vocab_size=32000,
                                      tie_word_embeddings=False, dtype="bfloat16")
    source = tmp_path / "src"
    source.mkdir()
    config.save_pretrained(source)
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(config)
    shapes = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    weight_map, shard, total = {}, {}, 0
    for i, (key, shape) in enumerate(shapes.items()):
        shard[key] = (0.02 * torch.randn(shape, generator=generator)).to(torch.bfloat16)
        name = f"model-0000{1 + (i >= len(shapes) // 2)}-of-00002.safetensors"
        weight_map[key] = name
        total += shard[key].numel() * 2
        if i == len(shapes) // 2 - 1 or i == len(shapes) - 1:
            save_file(shard, str(source / name), metadata={"format": "pt"})
            shard = {}
    (source / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert total > 500e6
    child = (
        "import json, sys, torch, transformers, safetensors\n"
        "from transformers import AutoModelForCausalLM, LlamaForCausalLM\n"
        "from swarm.store.importer import import_model\n"
        "def status(key):\n"
        "    return next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith(key))\n"
        "before = status('VmRSS')\n"
        "m = import_model(sys.argv[1], sys.argv[2], 'big')\n"
        "print(json.dumps({'raise': status('VmHWM') - before, 'dtype': m.dtype}))\n"
    )
    out = subprocess.run([sys.executable, "-c", child, str(source), str(tmp_path / "models")], capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"peak RSS raised by {figures['raise'] / 1e6:.0f} MB importing a {total / 1e6:.0f} MB folder")
    assert figures["raise"] < total / 4, figures
    assert figures["dtype"] == "bfloat16"
    layer = load_file(tmp_path / "models/big/weights/layer_011.safetensors")
    with safe_open(source / weight_map["model.layers.11.mlp.up_proj.weight"], framework="pt") as f:
        assert torch.equal(layer["mlp.up_proj.weight"], f.get_tensor("model.layers.11.mlp.up_proj.weight"))
