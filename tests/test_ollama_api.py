"""Ollama's API on the leader (swarm.leader.api.ollama_api) as Ollama's own clients use it: the real ``ollama`` package
against a real leader and fellow, one fleet for the module.

The model is tests/scripted.py's tiny Qwen3 with a tools template (tests/test_openai_compat.py's): its greedy first
turn is a tool call, and with thinking off (the prompt then ends in an empty thinking block) it answers "It is sunny
in Paris.", so every reply has an exact expected text."""

from __future__ import annotations

import json

import httpx
import ollama
import pytest
import trio

from api_faces import ANSWER, call, streamed, thinking_model, weather_model
from harness import running_swarm, wait_until
from scripted import hold_compute
from swarm import __version__
from swarm.leader.api.limits import chat_body_limit
from test_openai_compat import CALL, CALL_PIECES, WEATHER

pytestmark = pytest.mark.e2e

# the test sees the refusal of a model that is not loaded (auto-load, on by default, would load it)
NO_AUTO_LOAD = {"SWARM_SERVE_AUTO_LOAD": "0"}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture(scope="module")
def model_dir(module_tmp):
    return weather_model(module_tmp, "ollama")


@pytest.fixture(scope="module")
def thinking_dir(module_tmp):
    return thinking_model(module_tmp, "ollama")


async def test_the_ollama_client_against_the_pool(tmp_path, model_dir, thinking_dir, monkeypatch):
    name = model_dir.name
    gate = hold_compute(monkeypatch)  # open but for the last part: a client leaving while its reply is computed
    gate.set()
    with trio.fail_after(240):
        async with running_swarm(tmp_path, [model_dir, thinking_dir], fellows=1,
                                 leader_env=NO_AUTO_LOAD) as swarm:
            client = ollama.Client(host=swarm.url, headers={"Authorization": f"Bearer {swarm.token}"}, timeout=60)

            # the catalogue as the pool lists it; nothing loaded yet
            listed = await call(client.list)
            assert [m.model for m in listed.models] == [thinking_dir.name, name]
            assert listed.models[1].details.family == "qwen3"
            assert (await call(client.ps)).models == []
            shown = await call(client.show, name)
            assert "tools" in shown.capabilities and "<tool_call>" in shown.template
            assert (await swarm.http.get("/api/version")).json() == {"version": __version__}

            # a model that is not loaded: Ollama's error shape, with what to do
            with pytest.raises(ollama.ResponseError) as info:
                await call(client.chat, model=name, messages=ASK, options=GREEDY)
            assert info.value.status_code == 503 and "Load it first" in info.value.error

            await swarm.load(name, 1)
            (loaded,) = (await call(client.ps)).models
            assert loaded.model == name and loaded.context_length > 0
            ready = await call(client.generate, model=name)  # no prompt: Ollama's "is it loaded"
            assert ready.done and ready.done_reason == "load" and ready.response == ""

            # one JSON object (stream false), with Ollama's fields and durations; ":latest" names the same model
            reply = await call(client.chat, model=f"{name}:latest", messages=ASK, think=False, options=GREEDY)
            assert reply.message.role == "assistant" and reply.message.content == ANSWER
            assert reply.done and reply.done_reason == "stop" and reply.model == name
            assert reply.eval_count == 2  # the answer's token and the end of turn
            assert reply.eval_duration > 0 and reply.prompt_eval_duration > 0
            assert reply.total_duration >= reply.eval_duration + reply.prompt_eval_duration

            # exactly the reply Chat Completions gives for the same conversation
            openai = (await swarm.http.post("/v1/chat/completions", json={
                "model": name, "messages": ASK, "temperature": 0, "max_tokens": 12,
                "chat_template_kwargs": {"enable_thinking": False}})).json()
            assert openai["choices"][0]["message"]["content"] == reply.message.content
            assert openai["usage"]["prompt_tokens"] == reply.prompt_eval_count
            assert openai["usage"]["completion_tokens"] == reply.eval_count

            # streamed (the default): one line per token, then the last one with the counts
            parts = await streamed(client.chat, model=name, messages=ASK, think=False, options=GREEDY)
            assert "".join(p.message.content for p in parts) == ANSWER
            assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
            assert parts[-1].done_reason == "stop" and parts[-1].eval_count == 2

            # num_predict and stop: the reply is the tool call's text here (no tools given)
            short = await call(client.chat, model=name, messages=ASK, options={"temperature": 0, "num_predict": 2})
            assert short.message.content == "<tool_call>\n" + CALL_PIECES[0] and short.done_reason == "length"
            cut = await call(client.chat, model=name, messages=ASK, options={**GREEDY, "stop": ['"Par']})
            assert cut.message.content == "<tool_call>\n" + "".join(CALL_PIECES[:2]) and cut.done_reason == "stop"

            # a tool call, and its round trip with the tool's answer
            called = await call(client.chat, model=name, messages=ASK, tools=[WEATHER], options=GREEDY)
            (tool_call,) = called.message.tool_calls
            assert tool_call.function.name == "get_weather" and tool_call.function.arguments == {"city": "Paris"}
            assert called.message.content == ""
            parts = await streamed(client.chat, model=name, messages=ASK, tools=[WEATHER], options=GREEDY)
            assert [c.function.name for p in parts for c in p.message.tool_calls or []] == ["get_weather"]
            back = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "sunny, 24 C", "tool_name": "get_weather"}]
            answer = await call(client.chat, model=name, messages=back, tools=[WEATHER], think=False, options=GREEDY)
            assert answer.message.content == ANSWER and not answer.message.tool_calls

            # /api/generate: a prompt (and a system message) through the chat template
            generated = await call(client.generate, model=name, prompt="Weather in Paris?", system="Be brief.",
                                   think=False, options=GREEDY)
            assert generated.response == ANSWER and generated.done_reason == "stop" and generated.eval_count == 2
            parts = await streamed(client.generate, model=name, prompt="Weather in Paris?", options=GREEDY)
            assert "".join(p.response for p in parts) == f"<tool_call>\n{CALL}\n</tool_call>"

            # format: a JSON schema is the structured output of Chat Completions (this one allows one reply only)
            schema = {"type": "object", "properties": {"answer": {"enum": [4]}}, "required": ["answer"],
                      "additionalProperties": False}
            shaped = await call(client.chat, model=name, messages=ASK, format=schema, think=False, options=GREEDY)
            assert json.loads(shaped.message.content) == {"answer": 4}

            # think: the family's reasoning switch; the reasoning comes back as thinking
            thinks = thinking_dir.name
            await swarm.load(thinks, 1)
            question = [{"role": "user", "content": "What is 2+2?"}]
            thought = await call(client.chat, model=thinks, messages=question, think=True, options=GREEDY)
            assert thought.message.thinking == "Two and two make four."
            assert thought.message.content == "The answer is 4."
            parts = await streamed(client.chat, model=thinks, messages=question, think=True, options=GREEDY)
            assert "".join(p.message.thinking or "" for p in parts) == "Two and two make four."
            assert "".join(p.message.content for p in parts) == "The answer is 4."
            plain = await call(client.generate, model=thinks, prompt="What is 2+2?", think=False, options=GREEDY)
            assert plain.response == "Just 4." and not plain.thinking

            # errors in Ollama's shape: an unknown model (404, as Ollama's), an option we do not have, no token
            with pytest.raises(ollama.ResponseError) as info:
                await call(client.chat, model="no-such-model", messages=ASK)
            assert info.value.status_code == 404 and "no-such-model" in info.value.error
            assert "GET /api/tags lists yours" in info.value.error
            with pytest.raises(ollama.ResponseError) as info:
                await call(client.chat, model="no-such-model:latest", messages=ASK)
            assert info.value.status_code == 404 and "'no-such-model:latest'" in info.value.error
            with pytest.raises(ollama.ResponseError) as info:
                await call(client.chat, model=name, messages=ASK, options={"mirostat": 2})
            assert info.value.status_code == 400 and "'mirostat'" in info.value.error
            with pytest.raises(ollama.ResponseError) as info:  # the check is Chat Completions', in Ollama's words
                await call(client.chat, model=name, messages=ASK, options={"num_predict": 10**9})
            assert info.value.status_code == 400 and "'num_predict'" in info.value.error
            # a chat body has the /v1 routes' size limit (it follows the longest context served), not the 1 MiB of
            # other routes: a prompt just under it is read, then refused by the context check
            limit = chat_body_limit(swarm.leader.serving.contexts.largest_context())
            assert limit > 1 << 20
            big = await swarm.http.post("/api/chat", json={"model": name, "messages": [
                {"role": "user", "content": "a" * (limit - 20_000)}]})
            assert big.status_code == 413 and "maximum context length" in big.json()["error"]
            huge = await swarm.http.post("/api/chat", json={"model": name, "messages": [
                {"role": "user", "content": "a" * (limit + 1000)}]})
            assert huge.status_code == 413 and "larger than the" in huge.json()["error"]  # Ollama's shape here too
            async with httpx.AsyncClient(base_url=swarm.url) as anonymous:
                for method, path in (("POST", "/api/chat"), ("POST", "/api/generate"), ("GET", "/api/tags"),
                                     ("POST", "/api/show"), ("GET", "/api/ps"), ("GET", "/api/version")):
                    response = await anonymous.request(method, path, json={"model": name, "messages": ASK})
                    assert response.status_code == 401, path
                    error = response.json()["error"]
                    assert isinstance(error, str) and "Bearer" in error, path
            # a browser's session works as on /api/v1: reading is fine, a reply needs the page's CSRF token (so no
            # other site can make a signed-in browser run one)
            async with httpx.AsyncClient(base_url=swarm.url) as browser:
                signed_in = await browser.post("/api/v1/auth/login", json={
                    "name": "admin", "password": swarm.leader.first_start.admin_password})
                assert signed_in.status_code == 200
                assert [m["model"] for m in (await browser.get("/api/tags")).json()["models"]] == [thinks, name]
                forged = await browser.post("/api/chat", json={"model": name, "messages": ASK, "stream": False})
                assert forged.status_code == 401 and "CSRF" in forged.json()["error"]
            assert json.loads((await swarm.http.post("/api/chat", json={"model": name, "messages": "hi"})).text) == {
                "error": "'messages' must be a non-empty list of {role, content} objects."}

            # a client that leaves (streamed or not) ends its reply on the ring at once
            book = swarm.leader.serving.book
            for stream in (False, True):
                gate.clear()
                with trio.CancelScope() as scope:
                    async def leave(stream=stream, scope=scope):
                        await wait_until(lambda: len(book.of_model(name)) == 1, 20)
                        scope.cancel()  # the client closes its connection without a word

                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(leave)
                        await swarm.http.post("/api/chat", json={"model": name, "messages": ASK, "stream": stream})
                await wait_until(lambda: not book.of_model(name), 10)
                gate.set()



def test_malformed_ollama_bodies_are_a_400_never_a_crash():
    """Junk in every field of /api/chat and /api/generate bodies: translated and checked as Chat Completions' are,
    it is refused with a BadRequest (a 400 that says what to fix), never another exception (a 500)."""
    import random

    from swarm.errors import BadRequest
    from swarm.leader.api.ollama_params import chat_body
    from swarm.leader.api.openai_params import parse_chat_body
    from test_fuzz import _json_junk

    rng = random.Random(38)
    keys = ["model", "messages", "prompt", "system", "options", "format", "think", "tools", "raw", "images",
            "stream", "keep_alive"]
    valid = {"model": "m", "messages": ASK, "prompt": "hi", "options": GREEDY}
    refused = 0
    for i in range(3000):
        body = dict(valid)
        for key in rng.sample(keys, rng.randrange(1, 4)):
            body[key] = _json_junk(rng)
        if i % 3 == 0:  # junk inside the options and messages too
            body["options"] = {rng.choice([*GREEDY, "stop", "mirostat", "num_ctx", "repeat_penalty"]): _json_junk(rng)}
            body["messages"] = [{"role": rng.choice(["user", "tool", "assistant"]), "content": "x",
                                 rng.choice(["tool_calls", "images", "tool_name"]): _json_junk(rng)}]
        try:
            parse_chat_body(chat_body(body, rng.choice(["/api/chat", "/api/generate"])), 64)
        except BadRequest:
            refused += 1
    assert refused > 1000  # most of it is junk, and said so
