"""Importing a model into per-layer files: refusals, the manifest, and which files a stage needs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
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
    assert list((tmp_path / "models").iterdir()) == []  # no half-imported model, no leftover temp folder


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
    paths = lambda entries: [e.path for e in entries]  # noqa: E731
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
    manifest = import_model(str(source), tmp_path / "models", "m", progress=lambda s, f: seen.append((s, f)))
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

    def progress(stage, fraction):
        if stage == "write layers" and fraction > 0.5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        import_model(str(source), tmp_path / "models", "m", progress=progress)
    assert list((tmp_path / "models").iterdir()) == []


def test_refuses_bad_names(tmp_path):
    source = build_tiny_source(tmp_path / "src", "llama")
    with pytest.raises(ImportFailed, match="cannot be a model name"):
        import_model(str(source), tmp_path / "models", "../escape")
