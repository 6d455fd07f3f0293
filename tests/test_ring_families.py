"""Every supported family over the real ring: tiny random-weight models built from their transformers configs
(Qwen2, Qwen3, Llama, Mistral, Phi-3, Gemma 3, and the DeepSeek-R1 distills' Qwen2 and Llama bodies stored in
bfloat16), imported, loaded over 2 and 3 fellows, and matched token for token against generate with the same stored
weights computed in the same precision (float32 on CPU)."""

from __future__ import annotations

import pytest
import torch
import trio

from conftest import TINY_MODELS
from harness import running_swarm
from reference_model import load_reference_model
from swarm.store.manifest import load_manifest

pytestmark = pytest.mark.e2e

PROMPTS = [[5, 17, 42, 99, 7, 150, 3, 88, 21, 64, 9, 200], [11, 12, 13], list(range(30, 70))]
NEW_TOKENS = 16


def _reference(model_dir, prompt):
    model = load_reference_model(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


async def _ring_tokens(swarm, model, prompt):
    return await swarm.greedy_done(model, prompt, NEW_TOKENS)


@pytest.mark.parametrize("stages", [2, 3])
async def test_tiny_families_over_the_ring_match_generate(tmp_path, tiny_model_dirs, stages):
    dirs = [tiny_model_dirs[k] for k in TINY_MODELS]
    expected = {d.name: [_reference(d, p) for p in PROMPTS] for d in dirs}
    with trio.fail_after(240):
        async with running_swarm(tmp_path, dirs, fellows=stages,
                                 fellow_env={"SWARM_SERVE_PREFILL_CHUNK": "8"}) as swarm:
            for model_dir in dirs:
                view = await swarm.load(model_dir.name, stages)
                layers = [s["layers"] for s in view["stages"]]
                assert len(layers) == stages and layers[0][0] == 0
                assert layers[-1][1] == load_manifest(model_dir).num_layers
                for prompt, want in zip(PROMPTS, expected[model_dir.name]):
                    tokens, finish = await _ring_tokens(swarm, model_dir.name, prompt)
                    assert tokens == want, (model_dir.name, prompt)
                    assert finish == "length"
                await swarm.leader.serving.loader.unload(model_dir.name)
