"""A tiny random Llama that speaks another model's tokenizer: a draft model whose guesses are nearly all wrong
(tests/test_draft_model_e2e.py, bench/drafting.py)."""

from __future__ import annotations

import shutil
from pathlib import Path


def with_tokenizer_of(model_dir: Path, root: Path, name: str, seed: int = 7) -> Path:
    """Import a 2-layer random Llama with ``model_dir``'s vocabulary and tokenizer files as ``root``/``name``."""
    import torch
    import transformers

    from swarm.store.importer import import_model
    from swarm.store.manifest import load_manifest

    source = root / f"{name}-src"
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, tie_word_embeddings=True,
                                      vocab_size=load_manifest(model_dir).vocab_size)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(source)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / file, source / file)
    import_model(str(source), root, name)
    return root / name
