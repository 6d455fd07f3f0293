"""The prefix cache on a real ring: the built-in model over two `swarm join` processes. A conversation sent again
hits the cache (usage.prompt_tokens_details.cached_tokens, swarm.timing.cached_tokens, streamed or not; Anthropic's
cache_read_input_tokens, Ollama's prompt_eval_cached_count) with the same reply; the next turn hits through the
reply too (the built-in model's template renders it as it was generated, its end of turn included); a failover
clears the cache of the ring, the next turn misses, and the one after hits again."""

from __future__ import annotations

import json

import pytest
import trio

from fleet import fellow_fleet
from harness import running_swarm, wait_until
from swarm.leader.serving.prefix_index import BLOCK_TOKENS

pytestmark = pytest.mark.e2e

# A system prompt long enough for a few blocks, and a short reply.
CHAT = [{"role": "system", "content": "You are a terse assistant. " * 15},
        {"role": "user", "content": "What is the capital of France?"}]
TOKENS = 12


async def chat(swarm, name: str, stream: bool) -> tuple[str, dict, dict]:
    """(reply text, usage, swarm.timing) of one greedy chat completion."""
    body = {"model": name, "messages": CHAT, "temperature": 0, "max_tokens": TOKENS, "return_token_ids": True,
            "stream": stream}
    if not stream:
        response = await swarm.http.post("/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        data = response.json()
        return data["choices"][0]["message"]["content"], data["usage"], data["swarm"]["timing"]
    text: list[str] = []
    usage, timing = None, None
    async with swarm.http.stream("POST", "/v1/chat/completions", json=body, timeout=120) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                data = json.loads(line[6:])
                assert "error" not in data, data
                text.append(data["choices"][0]["delta"].get("content") or "")
                usage = data.get("usage") or usage
                timing = (data.get("swarm") or {}).get("timing") or timing
    assert usage is not None and timing is not None
    return "".join(text), usage, timing


async def next_turn(swarm, name: str, reply: str) -> tuple[list[int], dict]:
    """(token ids, usage) of the conversation's next turn: CHAT, ``reply``, and a new question."""
    body = {"model": name, "temperature": 0, "max_tokens": TOKENS, "return_token_ids": True,
            "messages": [*CHAT, {"role": "assistant", "content": reply}, {"role": "user", "content": "And of Spain?"}]}
    response = await swarm.http.post("/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    data = response.json()
    return data["choices"][0]["token_ids"], data["usage"]


async def test_a_hit_reports_cached_tokens_keeps_the_reply_and_a_failover_clears_then_rebuilds(
        tmp_path, smollm_model_dir):
    name = smollm_model_dir.name
    with trio.fail_after(280):
        async with running_swarm(tmp_path, [smollm_model_dir], fellows=0) as swarm, \
                fellow_fleet(swarm, tmp_path, 3, standby={2}) as fellows:
            placed = [s["fellow"] for s in (await swarm.load(name, 2))["stages"]]
            want, usage, timing = await chat(swarm, name, stream=False)
            prompt, replied = usage["prompt_tokens"], usage["completion_tokens"]
            assert prompt > 3 * BLOCK_TOKENS
            assert usage["prompt_tokens_details"] == {"cached_tokens": 0} and timing["cached_tokens"] == 0
            # the same conversation again: every full block but the one holding the last prompt token is reused
            hit = (prompt - 1) // BLOCK_TOKENS * BLOCK_TOKENS
            for stream in (True, False):
                ids, usage, timing = await chat(swarm, name, stream)
                assert ids == want
                assert usage["prompt_tokens_details"]["cached_tokens"] == hit == timing["cached_tokens"]
            # Anthropic's face: input_tokens is what was computed, cache_read_input_tokens what the cache held
            response = await swarm.http.post("/v1/messages", timeout=120, json={
                "model": name, "max_tokens": TOKENS, "temperature": 0, "system": CHAT[0]["content"],
                "messages": CHAT[1:]})
            assert response.status_code == 200, response.text
            assert response.json()["content"][0]["text"] == want
            assert response.json()["usage"] == {"input_tokens": prompt - hit, "cache_creation_input_tokens": 0,
                                                "cache_read_input_tokens": hit, "output_tokens": replied}
            # Ollama's: prompt_eval_count the whole prompt, prompt_eval_cached_count the cached part (its api.Metrics)
            response = await swarm.http.post("/api/chat", timeout=120, json={
                "model": name, "messages": CHAT, "stream": False, "options": {"temperature": 0, "num_predict": TOKENS}})
            assert response.status_code == 200, response.text
            assert (response.json()["prompt_eval_count"], response.json()["prompt_eval_cached_count"]) == (prompt, hit)
            # the next turn: the reply's blocks were kept, so the hit goes through the reply up to its last
            # computed row (the reply's last token is never computed), block by block
            _, usage = await next_turn(swarm, name, want)
            through = (prompt + replied - 1) // BLOCK_TOKENS * BLOCK_TOKENS
            assert usage["prompt_tokens_details"]["cached_tokens"] == through > hit
            # a failover: stage 1's fellow dies, the standby takes it over, the ring's cache starts over
            victim = next(f for f in fellows if f.name == placed[1])
            await trio.to_thread.run_sync(victim.kill)
            await wait_until(lambda: swarm.leader.serving.status(name) == "recovering", 60)
            await swarm.leader.serving.loader.wait_ready(name, 120)
            stages = (await swarm.http.get(f"/api/v1/models/{name}")).json()["stages"]
            assert stages[1]["fellow"] == "fellow-2"
            ids, usage, _ = await chat(swarm, name, stream=False)
            assert ids == want and usage["prompt_tokens_details"]["cached_tokens"] == 0  # cleared
            ids, usage, _ = await chat(swarm, name, stream=True)
            assert ids == want and usage["prompt_tokens_details"]["cached_tokens"] == hit  # rebuilt
