"""The ring end to end on loopback: a greedy reply over 2 stages is token for token transformers' generate."""

from __future__ import annotations

import pytest
import torch
import trio

from harness import running_swarm

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]


@pytest.fixture(scope="module")
def reference(smollm_model_dir):
    from swarm.leader.chat_format import encode_chat
    from swarm.store.model_files import load_reference_model

    model = load_reference_model(smollm_model_dir, dtype=torch.float32)
    out = {}
    for prompt in PROMPTS:
        ids = encode_chat(smollm_model_dir, [{"role": "user", "content": prompt}], None)
        with torch.inference_mode():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
        out[prompt] = gen[0, len(ids):].tolist()
    return out


async def _replies(tmp_path, model_dir, transport):
    with trio.fail_after(300):
        async with running_swarm(tmp_path, [model_dir], leader_env={"SWARM_PIPELINE_TRANSPORT": transport}) as swarm:
            view = await swarm.load(model_dir.name, 2)
            assert [s["layers"] for s in view["stages"]] == [[0, 15], [15, 30]]
            replies = {}
            for prompt in PROMPTS:
                data = await swarm.chat(model_dir.name, [{"role": "user", "content": prompt}], max_tokens=24)
                replies[prompt] = data
            paths = {f.name: [s.runtime.out_hop.path for s in f.stages.values()] for f in swarm.fellows}
            return replies, paths


@pytest.mark.parametrize("transport", ["auto", "relay"])
async def test_two_stage_ring_matches_generate(tmp_path, smollm_model_dir, reference, transport):
    replies, paths = await _replies(tmp_path, smollm_model_dir, transport)
    expected_path = "direct" if transport == "auto" else "relay"
    assert paths == {"fellow-0": [expected_path], "fellow-1": [expected_path]}
    for prompt, data in replies.items():
        choice = data["choices"][0]
        want = reference[prompt]
        eos = 2
        if eos in want:
            want = want[: want.index(eos) + 1]
        assert choice["token_ids"] == want, prompt
        assert choice["finish_reason"] == ("stop" if want[-1] == eos else "length")
        assert data["usage"]["completion_tokens"] == len(want)
        assert data["usage"]["prompt_tokens"] == len(choice["prompt_token_ids"])
    assert "Paris" in replies[PROMPTS[0]]["choices"][0]["message"]["content"]
