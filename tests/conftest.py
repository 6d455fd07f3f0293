"""Shared fixtures: tiny random models of each supported family, and the real built-in model, each imported once."""

from __future__ import annotations

from pathlib import Path

import pytest

# name -> (config class, config kwargs). Hidden 64, a few layers, vocab 320: milliseconds per token on a laptop CPU.
# initializer_range 0.2 (library default 0.02) makes random models produce varied tokens instead of one token
# repeated, so an exact-match comparison means something.
_TINY_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    max_position_embeddings=256,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
TINY_MODELS = {
    # Qwen2 with sliding-window attention on its upper layers: exercises per-layer layer_types slicing.
    "qwen2": ("Qwen2Config", dict(num_hidden_layers=6, use_sliding_window=True, sliding_window=16, max_window_layers=3,
                                  tie_word_embeddings=False)),
    # Qwen3: q_norm/k_norm and an explicit head_dim.
    "qwen3": ("Qwen3Config", dict(num_hidden_layers=5, head_dim=16, tie_word_embeddings=False)),
    # Llama with tied embeddings, like the built-in SmolLM2.
    "llama": ("LlamaConfig", dict(num_hidden_layers=4, tie_word_embeddings=True)),
}


def build_tiny_source(folder: Path, kind: str, dtype=None) -> Path:
    """Save a random-weight model of family ``kind`` as a transformers folder (no tokenizer) and return it."""
    import torch
    import transformers

    class_name, kwargs = TINY_MODELS[kind]
    config = getattr(transformers, class_name)(**_TINY_COMMON, **kwargs)
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """kind -> imported model dir, for every family in TINY_MODELS."""
    from swarm.store.importer import import_model

    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for kind in TINY_MODELS:
        source = build_tiny_source(root / f"src-{kind}", kind)
        import_model(str(source), root / "models", kind)
        out[kind] = root / "models" / kind
    return out


@pytest.fixture(scope="session")
def smollm_model_dir(tmp_path_factory) -> Path:
    """The built-in SmolLM2-135M-Instruct, imported once per test session (~30 s: GGUF dequantization)."""
    from swarm.store.importer import builtin_gguf_path, import_model

    try:
        builtin_gguf_path()
    except Exception as exc:  # the package is a declared dependency; skip rather than fail where it is absent
        pytest.skip(str(exc))
    root = tmp_path_factory.mktemp("models")
    import_model("smollm2-135m-instruct", root)
    return root / "smollm2-135m-instruct"
