"""A reasoning model's thinking comes back as reasoning_content, its answer as content; thinking off reaches the
chat template and Qwen3's /no_think; a request's unset sampling settings are the model's, per the manual's table."""

from __future__ import annotations

import json

import pytest
import trio

from harness import running_swarm
from scripted import build
from swarm.leader.chat.chat_format import sampling_defaults
from swarm.store.importer import import_model

pytestmark = pytest.mark.e2e

THINKING = ["<think>", "Two and two make four.", "</think>", "The answer is 4."]
QUESTION = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def scripted_dir(module_tmp):
    root = module_tmp("scripted")
    build(root / "src", {"assistant\n": THINKING, "\n\n": ["Just 4."]})
    import_model(str(root / "src"), root / "models", "qwen3-scripted")
    return root / "models" / "qwen3-scripted"


async def stream(swarm, body) -> tuple[str, str, list]:
    reasoning, content, chunks = [], [], []
    async with swarm.http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                data = json.loads(line[6:])
                chunks.append(data)
                delta = data["choices"][0]["delta"]
                reasoning.append(delta.get("reasoning_content") or "")
                content.append(delta.get("content") or "")
    return "".join(reasoning), "".join(content), chunks


async def test_thinking_is_reasoning_content_and_thinking_off_reaches_the_template(tmp_path, scripted_dir):
    name = scripted_dir.name
    with trio.fail_after(120):
        async with running_swarm(tmp_path, [scripted_dir], fellows=2) as swarm:
            await swarm.load(name, 2)
            body = {"model": name, "messages": QUESTION, "temperature": 0, "max_tokens": 20}
            data = await swarm.chat(name, QUESTION, max_tokens=20)
            message = data["choices"][0]["message"]
            assert message["reasoning_content"] == "Two and two make four."
            assert message["content"] == "The answer is 4."
            assert data["choices"][0]["finish_reason"] == "stop"
            assert data["usage"]["completion_tokens"] == 5  # four pieces and the end of turn
            reasoning, content, chunks = await stream(swarm, body)
            assert (reasoning, content) == ("Two and two make four.", "The answer is 4.")
            # a chunk per token that brings text: the role chunk, the thinking, the answer, the closing chunk
            assert len(chunks) == 4 and chunks[-1]["usage"]["completion_tokens"] == 5
            assert chunks[-1]["swarm"]["timing"]["queue_ms"] >= 0

            off = {**body, "chat_template_kwargs": {"enable_thinking": False}, "return_token_ids": True}
            data = (await swarm.http.post("/v1/chat/completions", json=off)).json()
            message = data["choices"][0]["message"]
            assert message["content"] == "Just 4." and "reasoning_content" not in message  # the empty block is hidden
            from swarm.leader.chat.chat_format import load_tokenizer

            prompt = load_tokenizer(str(scripted_dir)).decode(data["choices"][0]["prompt_token_ids"])
            assert "What is 2+2? /no_think" in prompt and prompt.endswith("<think>\n\n</think>\n\n")


async def test_the_leader_fills_in_the_models_own_sampling(tmp_path, scripted_dir):
    name = scripted_dir.name
    seen = []
    with trio.fail_after(120):
        async with running_swarm(tmp_path, [scripted_dir], fellows=1) as swarm:
            await swarm.load(name, 1)
            submit = swarm.leader.serving.intake.submit

            async def spy(request):
                seen.append(request.sampling)
                return await submit(request)

            swarm.leader.serving.intake.submit = spy
            for extra in ({}, {"chat_template_kwargs": {"enable_thinking": False}}, {"top_k": 0, "temperature": 0.3}):
                r = await swarm.http.post("/v1/chat/completions", json={
                    "model": name, "messages": QUESTION, "max_tokens": 8, "seed": 1, **extra})
                assert r.status_code == 200, r.text
    thinking, off, sent = seen
    assert (thinking.temperature, thinking.top_p, thinking.top_k, thinking.min_p) == (0.6, 0.95, 20, 0.0)
    assert (off.temperature, off.top_p, off.top_k) == (0.7, 0.8, 20)
    assert (sent.temperature, sent.top_k, sent.top_p) == (0.3, 0, 0.95)  # a setting sent always wins


def test_sampling_defaults_follow_the_manuals_table():
    assert sampling_defaults("qwen3", True) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}
    assert sampling_defaults("qwen3", False)["top_p"] == 0.8
    assert sampling_defaults("qwen3", True, "Qwen3-30B-A3B-Instruct-2507")["temperature"] == 0.7  # no thinking mode
    assert sampling_defaults("qwen3", True, "qwen3-coder-30b")["top_p"] == 0.8
    assert sampling_defaults("qwen2", True) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0}
    assert sampling_defaults("llama", True) == {"temperature": 0.7, "top_p": 0.95, "top_k": 0, "min_p": 0.0}
    assert sampling_defaults("llama", True, generation_top_k=50)["top_k"] == 50  # served on one fellow
