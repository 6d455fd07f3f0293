"""Drafting ahead over a real ring (a leader with SWARM_SERVE_SPECULATIVE=3 and two fellows on loopback, the
built-in model): a code edit's greedy reply is transformers' generate (near-tie rule) with most tokens coming from
kept guesses, as swarm.timing counts; a ring with a fellow that does not support drafting serves without it."""

from __future__ import annotations

import pytest
import torch
import trio

from exactness import check_reply, reference
from harness import running_swarm
from swarm.store.manifest import load_manifest

pytestmark = pytest.mark.e2e

CODE = """def area(width, height):
    result = width * height
    return result
"""
EDIT = [{"role": "user", "content": f"Rewrite this function with `result` renamed to `size`. Code only.\n\n{CODE}"}]
TOKENS = 32


async def test_code_edit_with_drafting_is_generate_in_fewer_passes(tmp_path, smollm_model_dir):
    from reference_model import load_reference_model
    from swarm.leader.chat.chat_format import encode_chat

    model = smollm_model_dir.name
    ids = encode_chat(smollm_model_dir, EDIT, None)
    eos = load_manifest(smollm_model_dir).eos_token_ids
    want, margins = reference(load_reference_model(smollm_model_dir, dtype=torch.float32), ids, TOKENS, eos=eos)
    with trio.fail_after(600):
        async with running_swarm(tmp_path, [smollm_model_dir], leader_env={"SWARM_SERVE_SPECULATIVE": "3"}) as swarm:
            await swarm.load(model, 2)
            assert swarm.leader.serving.models[model].speculative == 3
            data = await swarm.chat(model, EDIT, max_tokens=TOKENS)
            got = data["choices"][0]["token_ids"]
            check_reply(got, want, margins)
            timing = data["swarm"]["timing"]
            assert timing["spec_tokens"] == timing["tokens"] == data["usage"]["completion_tokens"] == len(got)
            assert 0 < timing["spec_accepted"] <= timing["spec_drafted"]
            assert timing["spec_passes"] == timing["spec_tokens"] - timing["spec_accepted"]
            assert timing["spec_passes"] <= len(got) * 3 // 4, timing  # a quarter of the passes saved at least
            # the split is per token, as without drafting (the stages measure per pass): it adds up to the measured
            # time per token within 20 % (per pass it came to 2-3x that)
            split = sum(s["compute_ms_per_token"] for s in timing["stages"]) + timing["link_ms_per_token"]
            assert split == pytest.approx(timing["ms_per_token"], rel=0.2), timing

            # a fellow that does not say it drafts (an older version): the same reply, no guesses
            for conn in swarm.leader.serving.hub.online.values():
                if conn.name == "fellow-1":
                    conn.drafting = False
            data = await swarm.chat(model, EDIT, max_tokens=TOKENS)
            check_reply(data["choices"][0]["token_ids"], want, margins)
            timing = data["swarm"]["timing"]
            assert timing["spec_passes"] == timing["spec_drafted"] == 0 and timing["tokens"] == len(got)
