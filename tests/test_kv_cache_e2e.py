"""The built-in model over 2 stages with ``kv_cache: q8`` and a context cap on the load call (issue 36): fellow
processes in the test's trio loop, the leader's HTTP API."""

from __future__ import annotations

import pytest
import torch
import trio

from harness import running_swarm
from swarm.stage.kv_cache import PackedCache, new_cache

pytestmark = pytest.mark.e2e

PROMPTS = ["What is the capital of France?", "List three prime numbers."]
TOKENS = 16


@pytest.fixture(scope="module")
def references(smollm_model_dir):
    """The model whole in one process, float32 from the per-layer files as the stages read them
    (tests/reference_model.py), generating greedily with the same q8 cache class: (tokens, margins) per prompt."""
    from reference_model import load_reference_model
    from swarm.leader.chat.chat_format import encode_chat

    model = load_reference_model(smollm_model_dir)
    out = {}
    for prompt in PROMPTS:
        ids = torch.tensor([encode_chat(smollm_model_dir, [{"role": "user", "content": prompt}], None)])
        with torch.inference_mode():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=TOKENS, do_sample=False,
                                 cache=new_cache(model.config, "q8"), output_logits=True,
                                 return_dict_in_generate=True)
        margins = [float(torch.topk(step[0], 2).values.diff().abs()) for step in gen.logits]
        out[prompt] = (gen.sequences[0, ids.shape[1]:].tolist(), margins)
    return out


def test_a_q8_ring_with_a_capped_context_answers_as_generate_and_refuses_longer(tmp_path, smollm_model_dir,
                                                                                references):
    from exactness import check_reply

    name = smollm_model_dir.name

    async def main():
        with trio.fail_after(280):
            async with running_swarm(tmp_path, [smollm_model_dir]) as swarm:
                response = await swarm.http.post(f"/api/v1/models/{name}/load",
                                                 json={"num_stages": 2, "kv_cache": "q8", "context_tokens": 1024,
                                                       "quantization": "none"})  # float32: the reference's
                assert response.status_code == 202, response.text
                await swarm.leader.serving.loader.wait_ready(name, 200)
                view = (await swarm.http.get(f"/api/v1/models/{name}")).json()
                assert view["kv_cache"] == "q8" and view["context_tokens"] == 1024, view
                for index in range(2):
                    stage_model = swarm.stage(name, index).driver.stage_model
                    assert stage_model.kv_cache == "q8"
                    stage_model.new_request("probe")  # the class a request's cache is made of
                    assert isinstance(stage_model.request_cache("probe"), PackedCache)
                    stage_model.drop("probe")
                # placement kept room for 1,024 tokens at q8's bytes: 0.27x of float32's
                serving = swarm.leader.serving.models[name]
                assert serving.size.kv_bytes_per_token_per_layer == 3 * 64 * 2 * 34 // 32  # 3 KV heads of 64
                for prompt in PROMPTS:
                    data = await swarm.chat(name, [{"role": "user", "content": prompt}], max_tokens=TOKENS)
                    want, margins = references[prompt]
                    check_reply(data["choices"][0]["token_ids"], want, margins)
                # longer than the load's context: the 413 and its words, naming where the limit comes from
                long = {"model": name, "messages": [{"role": "user", "content": "word " * 1100}], "max_tokens": 8}
                refused = await swarm.http.post("/v1/chat/completions", json=long)
                error = refused.json()["error"]
                assert refused.status_code == 413 and error["code"] == "context_length_exceeded", refused.text
                assert "maximum context length" in error["message"]
                assert "the context its load asked for" in error["message"], error["message"]
                # max_tokens past SWARM_MAX_TOKENS_LIMIT: the 400 as before
                over = await swarm.http.post("/v1/chat/completions", json={**long, "messages": [
                    {"role": "user", "content": "hi"}], "max_tokens": 100_000})
                assert over.status_code == 400 and over.json()["error"]["code"] == "invalid_max_tokens"
                return True

    assert trio.run(main)
