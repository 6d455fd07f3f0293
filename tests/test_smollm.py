"""The built-in model split over two in-process stages answers exactly what transformers' generate answers."""

from __future__ import annotations

import pytest
import torch

from reference_model import load_reference_model
from swarm.stage import LocalRing, StageModel, stage_specs
from swarm.store.manifest import load_manifest

pytestmark = pytest.mark.e2e


def test_two_stage_greedy_reply_matches_generate(smollm_model_dir):
    from transformers import AutoTokenizer

    manifest = load_manifest(smollm_model_dir)
    assert manifest.architecture == "llama" and manifest.num_layers == 30 and manifest.tie_word_embeddings
    # Stored in bfloat16 (the Q4 GGUF dequantized to 16 bits); the stages and the reference both compute in float32
    # from those same values, so the ring and generate agree exactly.
    assert manifest.dtype == "bfloat16" and 2 in manifest.eos_token_ids
    assert any(e.kind == "tokenizer" for e in manifest.files)

    tokenizer = AutoTokenizer.from_pretrained(smollm_model_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if not isinstance(prompt, list):  # some versions hand back a BatchEncoding
        prompt = prompt["input_ids"]
    prompt = [int(t) for t in prompt]

    model = load_reference_model(smollm_model_dir)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    want = out[0, len(prompt):].tolist()

    chain = LocalRing([StageModel.load_dir(smollm_model_dir, s) for s in stage_specs(30, 2)], prefill_chunk=16)
    got = chain.generate(prompt, 24, eos_token_ids=manifest.eos_token_ids)
    assert got == want
    assert "Paris" in tokenizer.decode(got, skip_special_tokens=True)
