"""swarm.timing over a real ring (leader and two fellows on loopback, the built-in model): every field present, the
fellows' split adding up to the time per token the leader measured, in a plain reply, the last chunk of a stream
and a legacy completion; and on one fellow, compute alone."""

from __future__ import annotations

import json

import pytest
import trio

from harness import running_swarm

pytestmark = pytest.mark.e2e

# A prompt whose greedy reply runs the whole 48 tokens (no end of turn before): enough steady tokens to average over.
COUNT = [{"role": "user", "content": "List the numbers from 1 to 80, separated by commas."}]
FIELDS = {"queue_ms", "ttft_ms", "prompt_ms", "tokens", "tokens_per_s", "ms_per_token", "stages", "links",
          "link_ms_per_token", "bytes_per_token", "split", "spec_passes", "spec_tokens", "spec_drafted",
          "spec_accepted", "cached_tokens"}


def check_split(timing: dict, fellows: list[str], transport: str | None) -> None:
    assert set(timing) == FIELDS
    assert timing["split"] == "fellows"
    assert timing["queue_ms"] >= 0 and timing["prompt_ms"] > 0 and timing["ttft_ms"] >= timing["prompt_ms"]
    assert timing["tokens_per_s"] > 0 and timing["ms_per_token"] == pytest.approx(1000 / timing["tokens_per_s"],
                                                                                  rel=0.01)
    assert [(s["stage"], s["fellow"]) for s in timing["stages"]] == list(enumerate(fellows))
    assert all(s["compute_ms_per_token"] > 0 and s["prefill_ms"] > 0 for s in timing["stages"])
    split = sum(s["compute_ms_per_token"] for s in timing["stages"]) + (timing["link_ms_per_token"] or 0)
    # The split is measured by the fellows, the time per token by the leader from the stream: within 20 %.
    assert split == pytest.approx(timing["ms_per_token"], rel=0.2), timing
    assert (timing["spec_passes"], timing["spec_tokens"], timing["spec_drafted"], timing["spec_accepted"]) == \
        (0, 0, 0, 0)
    if len(fellows) == 1:
        assert timing["links"] == [] and timing["link_ms_per_token"] is None
        return
    n = len(fellows)
    assert [(link["from_stage"], link["to_stage"], link["transport"]) for link in timing["links"]] == \
        [(i, (i + 1) % n, transport) for i in range(n)]
    assert sum(link["ms_per_token"] for link in timing["links"]) == pytest.approx(timing["link_ms_per_token"],
                                                                                   abs=0.05)
    # forward: one float32 hidden state of 576 values per token and the message around it; back: the token
    assert 576 * 4 < timing["bytes_per_token"]["forward"] < 576 * 4 + 400
    assert 0 < timing["bytes_per_token"]["back"] < 300
    assert timing["links"][0]["bytes_per_token"] == timing["bytes_per_token"]["forward"]


async def _stream(swarm, path: str, body: dict) -> list[dict]:
    chunks = []
    async with swarm.http.stream("POST", path, json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


async def test_timing_of_every_reply_over_two_stages_then_one(tmp_path, smollm_model_dir):
    model = smollm_model_dir.name
    with trio.fail_after(400):
        async with running_swarm(tmp_path, [smollm_model_dir], leader_env={"SWARM_PIPELINE_TRANSPORT": "relay"}) \
                as swarm:
            await swarm.load(model, 2)
            data = await swarm.chat(model, COUNT, max_tokens=48)
            timing = data["swarm"]["timing"]
            assert timing["tokens"] == data["usage"]["completion_tokens"] == 48
            check_split(timing, ["fellow-0", "fellow-1"], "relay")

            chunks = await _stream(swarm, "/v1/chat/completions",
                                   {"model": model, "messages": COUNT, "max_tokens": 48, "temperature": 0})
            assert all("swarm" not in c for c in chunks[:-1])
            check_split(chunks[-1]["swarm"]["timing"], ["fellow-0", "fellow-1"], "relay")

            response = await swarm.http.post("/v1/completions", json={
                "model": model, "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 40, "temperature": 0,
                "ignore_eos": True}, timeout=120)
            assert response.status_code == 200, response.text
            check_split(response.json()["swarm"]["timing"], ["fellow-0", "fellow-1"], "relay")

            assert (await swarm.http.post(f"/api/v1/models/{model}/unload")).status_code in (200, 202)
            response = await swarm.http.post(f"/api/v1/models/{model}/load", json={"num_stages": 1})
            assert response.status_code == 202, response.text
            await swarm.leader.serving.loader.wait_ready(model, 120)
            fellow = swarm.leader.serving.models[model].stages[0].plan.fellow_name
            data = await swarm.chat(model, COUNT, max_tokens=48)
            check_split(data["swarm"]["timing"], [fellow], None)
