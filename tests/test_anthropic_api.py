"""Anthropic's Messages API on the leader (swarm.leader.api.anthropic_api) as Anthropic's own client uses it: the real
``anthropic`` package against a real leader and fellow, one fleet for the module.

The models are tests/scripted.py's tiny Qwen3 with a tools template (tests/test_openai_compat.py's: its greedy first
turn is a tool call, and with thinking off it answers "It is sunny in Paris."), a scripted one that thinks, and the
built-in SmolLM2 for a reply nobody scripted, compared with the one Chat Completions gives."""

from __future__ import annotations

import contextlib
import json

import anthropic
import httpx
import pytest
import trio

from api_faces import ANSWER, call, thinking_model, weather_model
from harness import running_swarm, wait_until
from scripted import hold_compute
from swarm.leader.api.limits import chat_body_limit
from test_openai_compat import CALL_PIECES, WEATHER

pytestmark = pytest.mark.e2e

# the test sees the refusal of a model that is not loaded (auto-load, on by default, would load it)
NO_AUTO_LOAD = {"SWARM_SERVE_AUTO_LOAD": "0"}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
NO_THINKING = {"type": "disabled"}
# The client's own arguments no longer include the sampling fields; the API still takes them
GREEDY = {"extra_body": {"temperature": 0}}
TOOL = {"name": "get_weather", "description": WEATHER["function"]["description"],
        "input_schema": WEATHER["function"]["parameters"]}


@pytest.fixture(scope="module")
def model_dir(module_tmp):
    return weather_model(module_tmp, "anthropic")


@pytest.fixture(scope="module")
def thinking_dir(module_tmp):
    return thinking_model(module_tmp, "anthropic")


async def events(client, **kwargs) -> list:
    """A streamed reply's events, as the client parses them."""
    return await trio.to_thread.run_sync(lambda: list(client.messages.create(stream=True, **kwargs)))


async def final_message(client, **kwargs):
    """The message the client's stream helper puts together from the events."""
    def run():
        with client.messages.stream(**kwargs) as stream:
            return stream.get_final_message()

    return await trio.to_thread.run_sync(run)


async def raw_events(swarm, body: dict, headers: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a streamed reply, read off the wire (the client drops the pings)."""
    out = []
    async with swarm.http.stream("POST", "/v1/messages", json={**body, "stream": True}, headers=headers) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        name = None
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name
                out.append((name, data))
    return out


def prompt_tokens(reply) -> int:
    """The whole prompt of a reply: what was computed and what the prefix cache held."""
    return reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0)


def texts(reply) -> list[tuple[str, str]]:
    return [(b.type, b.text if b.type == "text" else getattr(b, "thinking", b.type)) for b in reply.content]


async def test_the_anthropic_client_against_the_pool(tmp_path, model_dir, thinking_dir, smollm_model_dir,
                                                     monkeypatch):
    name = model_dir.name
    gate = hold_compute(monkeypatch)  # open but for the last part: a client leaving while its reply is computed
    gate.set()
    with trio.fail_after(270), contextlib.ExitStack() as clients:
        async with running_swarm(tmp_path, [model_dir, thinking_dir, smollm_model_dir], fellows=1,
                                 leader_env=NO_AUTO_LOAD) as swarm:
            client = anthropic.Anthropic(base_url=swarm.url, api_key=swarm.token, max_retries=0, timeout=60)
            clients.enter_context(client)

            # the models of the caller's pools, in Anthropic's shape (its clients send anthropic-version)
            listed = await call(lambda: [(m.id, m.type) for m in client.models.list()])
            assert sorted(listed) == sorted((d.name, "model") for d in (model_dir, thinking_dir, smollm_model_dir))
            assert (await swarm.http.get("/v1/models")).json()["object"] == "list"  # OpenAI's clients: theirs

            # a model that is not loaded: Anthropic's error shape, saying what to do
            with pytest.raises(anthropic.APIStatusError) as info:
                await call(client.messages.create, model=name, max_tokens=12, messages=ASK)
            assert info.value.status_code == 503 and info.value.body["error"]["type"] == "overloaded_error"
            assert "Load it first" in info.value.body["error"]["message"]

            await swarm.load(name, 1)
            # plain: one message, Anthropic's fields
            reply = await call(client.messages.create, model=name, max_tokens=12, messages=ASK, **GREEDY,
                               thinking=NO_THINKING)
            assert texts(reply) == [("text", ANSWER)] and reply.role == "assistant" and reply.model == name
            assert reply.stop_reason == "end_turn" and reply.stop_sequence is None
            assert reply.usage.output_tokens == 2  # the answer's token and the end of turn
            assert reply.id.startswith("msg_")

            # exactly the reply Chat Completions gives for the same conversation, counted the same
            openai = (await swarm.http.post("/v1/chat/completions", json={
                "model": name, "messages": ASK, "temperature": 0, "max_tokens": 12,
                "chat_template_kwargs": {"enable_thinking": False}})).json()
            assert openai["choices"][0]["message"]["content"] == ANSWER
            # the prompt: input_tokens computed and cache_read_input_tokens the prefix cache held, as Anthropic counts
            assert openai["usage"]["prompt_tokens"] == prompt_tokens(reply)
            assert openai["usage"]["prompt_tokens_details"]["cached_tokens"] >= reply.usage.cache_read_input_tokens
            assert openai["usage"]["completion_tokens"] == reply.usage.output_tokens
            # count_tokens: the same count as the reply's usage, tools and a system prompt included
            counted = await call(client.messages.count_tokens, model=name, messages=ASK, thinking=NO_THINKING)
            assert counted.input_tokens == prompt_tokens(reply)
            system = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Answer in English."}]
            counted = await call(client.messages.count_tokens, model=name, messages=ASK, tools=[TOOL], system=system)
            called = await call(client.messages.create, model=name, max_tokens=12, messages=ASK, tools=[TOOL],
                                system=system, **GREEDY)
            assert counted.input_tokens == prompt_tokens(called) > prompt_tokens(reply)

            # streamed: Anthropic's event sequence, off the wire, with x-api-key as Claude Code sends it
            body = {"model": name, "max_tokens": 12, "messages": ASK, "thinking": NO_THINKING, **GREEDY["extra_body"]}
            wire = await raw_events(swarm, body, {"x-api-key": swarm.token, "authorization": "",
                                                  "anthropic-version": "2023-06-01"})
            names = [n for n, _ in wire]
            assert names == ["message_start", "ping", "content_block_start", "content_block_delta",
                             "content_block_stop", "message_delta", "message_stop"]
            started = wire[0][1]["message"]["usage"]
            assert started["output_tokens"] == 0 and started["cache_creation_input_tokens"] == 0
            assert started["input_tokens"] + started["cache_read_input_tokens"] == prompt_tokens(reply)
            assert wire[2][1]["content_block"] == {"type": "text", "text": ""}
            assert wire[3][1]["delta"] == {"type": "text_delta", "text": ANSWER}
            assert wire[5][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
            assert wire[5][1]["usage"]["output_tokens"] == 2
            # and through the client's stream helper: the final message is the one a plain call gives
            final = await final_message(client, model=name, max_tokens=12, messages=ASK, **GREEDY,
                                        thinking=NO_THINKING)
            assert texts(final) == texts(reply) and final.usage.output_tokens == 2

            # max_tokens and stop_sequences: the reply is the tool call's text here (no tools given)
            short = await call(client.messages.create, model=name, max_tokens=2, messages=ASK, **GREEDY)
            assert texts(short) == [("text", "<tool_call>\n" + CALL_PIECES[0])]
            assert short.stop_reason == "max_tokens"
            cut = await call(client.messages.create, model=name, max_tokens=12, messages=ASK, **GREEDY,
                             stop_sequences=["nothing", '"Par'])
            assert texts(cut) == [("text", "<tool_call>\n" + "".join(CALL_PIECES[:2]))]
            assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == '"Par'
            streamed = await events(client, model=name, max_tokens=12, messages=ASK, **GREEDY,
                                    stop_sequences=['"Par'])
            assert (streamed[-2].delta.stop_reason, streamed[-2].delta.stop_sequence) == ("stop_sequence", '"Par')

            # a tool call (stop_reason tool_use), streamed as input_json_delta pieces, and its round trip
            (use,) = called.content
            assert (use.type, use.name, use.input) == ("tool_use", "get_weather", {"city": "Paris"})
            assert called.stop_reason == "tool_use" and use.id.startswith("toolu_")
            streamed = await events(client, model=name, max_tokens=12, messages=ASK, tools=[TOOL], **GREEDY)
            assert [e.type for e in streamed] == ["message_start", "content_block_start"] + [
                "content_block_delta"] * (len(streamed) - 5) + ["content_block_stop", "message_delta", "message_stop"]
            assert streamed[1].content_block.type == "tool_use" and streamed[1].content_block.name == "get_weather"
            pieces = [e.delta.partial_json for e in streamed if e.type == "content_block_delta"]
            assert len(pieces) > 1 and json.loads("".join(pieces)) == {"city": "Paris"}
            assert streamed[-2].delta.stop_reason == "tool_use"
            back = [*ASK, {"role": "assistant", "content": called.content},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                  "content": [{"type": "text", "text": "sunny, 24 C"}]}]}]
            answer = await call(client.messages.create, model=name, max_tokens=12, messages=back, tools=[TOOL],
                                thinking=NO_THINKING, **GREEDY)
            assert texts(answer) == [("text", ANSWER)] and answer.stop_reason == "end_turn"
            # tool_choice none: no tools reach the template, and the model's call is text; a forced call (a grammar
            # on the last stage) is a tool_use even where the model would answer in words (thinking off)
            plain = await call(client.messages.create, model=name, max_tokens=12, messages=ASK, tools=[TOOL],
                               tool_choice={"type": "none"}, **GREEDY)
            assert plain.stop_reason == "end_turn" and plain.content[0].text.startswith("<tool_call>")
            forced = await call(client.messages.create, model=name, max_tokens=40, messages=ASK, tools=[TOOL],
                                tool_choice={"type": "tool", "name": "get_weather"}, thinking=NO_THINKING,
                                **GREEDY)
            assert forced.stop_reason == "tool_use"
            assert [(b.type, b.name, sorted(b.input)) for b in forced.content] == [("tool_use", "get_weather",
                                                                                    ["city"])]

            # output_config.format: a JSON schema is the structured output of Chat Completions
            schema = {"type": "object", "properties": {"answer": {"enum": [4]}}, "required": ["answer"],
                      "additionalProperties": False}
            shaped = await call(client.messages.create, model=name, max_tokens=12, messages=ASK, **GREEDY,
                                thinking=NO_THINKING,
                                output_config={"format": {"type": "json_schema", "schema": schema}})
            assert json.loads(shaped.content[0].text) == {"answer": 4}

            # thinking: the family's reasoning switch; the reasoning comes back as a thinking block
            thinks = thinking_dir.name
            await swarm.load(thinks, 1)
            question = [{"role": "user", "content": "What is 2+2?"}]
            thought = await call(client.messages.create, model=thinks, max_tokens=12, messages=question,
                                 **GREEDY, thinking={"type": "enabled", "budget_tokens": 1024})
            assert texts(thought) == [("thinking", "Two and two make four."), ("text", "The answer is 4.")]
            streamed = await events(client, model=thinks, max_tokens=12, messages=question, **GREEDY,
                                    thinking={"type": "enabled", "budget_tokens": 1024})
            deltas = [(e.index, e.delta.type) for e in streamed if e.type == "content_block_delta"]
            assert deltas[0] == (0, "thinking_delta") and deltas[-1] == (1, "text_delta")
            assert "".join(e.delta.thinking for e in streamed if e.type == "content_block_delta"
                           and e.delta.type == "thinking_delta") == "Two and two make four."
            plain = await call(client.messages.create, model=thinks, max_tokens=12, messages=question,
                               **GREEDY, thinking=NO_THINKING)
            assert texts(plain) == [("text", "Just 4.")]

            # the built-in model: a greedy reply nobody scripted is the one Chat Completions gives, a system prompt
            # and earlier turns included, plain and streamed
            smol = smollm_model_dir.name
            await swarm.load(smol, 1)
            turns = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
                     {"role": "user", "content": "Tell me about apples."}]
            own = await call(client.messages.create, model=smol, max_tokens=16, **GREEDY, messages=turns,
                             system="You are a helpful assistant.")
            openai = (await swarm.http.post("/v1/chat/completions", json={
                "model": smol, "max_tokens": 16, "temperature": 0, "messages": [
                    {"role": "system", "content": "You are a helpful assistant."}, *turns]})).json()
            assert texts(own) == [("text", openai["choices"][0]["message"]["content"])]
            assert (prompt_tokens(own), own.usage.output_tokens) == (
                openai["usage"]["prompt_tokens"], openai["usage"]["completion_tokens"])
            assert own.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[
                openai["choices"][0]["finish_reason"]]
            final = await final_message(client, model=smol, max_tokens=16, **GREEDY, messages=turns,
                                        system="You are a helpful assistant.")
            assert texts(final) == texts(own)

            # errors in Anthropic's shape, with the statuses the /v1 routes give
            wrong = clients.enter_context(anthropic.Anthropic(base_url=swarm.url, api_key="swt_wrong", max_retries=0))
            with pytest.raises(anthropic.AuthenticationError) as info:
                await call(wrong.messages.create, model=name, max_tokens=12, messages=ASK)
            assert info.value.body["error"]["type"] == "authentication_error"
            with pytest.raises(anthropic.NotFoundError) as info:
                await call(client.messages.create, model="no-such-model", max_tokens=12, messages=ASK)
            assert info.value.body == {"type": "error", "error": {"type": "not_found_error",
                                                                  "message": info.value.body["error"]["message"]}}
            assert "'no-such-model'" in info.value.body["error"]["message"]
            with pytest.raises(anthropic.BadRequestError) as info:
                await call(client.messages.create, model=name, max_tokens=12, messages=ASK,
                           extra_body={"frequency_penalty": 1})
            assert info.value.body["error"]["type"] == "invalid_request_error"
            assert "'frequency_penalty'" in info.value.body["error"]["message"]
            async with httpx.AsyncClient(base_url=swarm.url) as anonymous:
                for path in ("/v1/messages", "/v1/messages/count_tokens"):
                    response = await anonymous.post(path, json={"model": name, "messages": ASK, "max_tokens": 4})
                    assert response.status_code == 401, path
                    assert response.json()["error"]["type"] == "authentication_error"
                    assert "x-api-key" in response.json()["error"]["message"]
                keyed = await anonymous.post("/v1/messages/count_tokens", json={"model": name, "messages": ASK},
                                             headers={"x-api-key": swarm.token})
                assert keyed.status_code == 200 and keyed.json()["input_tokens"] > 0
            missing = await swarm.http.post("/v1/messages", json={"model": name, "messages": ASK})
            assert missing.status_code == 400 and "'max_tokens' is required" in missing.json()["error"]["message"]
            # the context limits of every face: a conversation too long for the model, a body too large
            # the body limit follows the longest context served (swarm.leader.api.limits.chat_body_limit)
            limit = chat_body_limit(swarm.leader.serving.contexts.largest_context())
            big = await swarm.http.post("/v1/messages", json={"model": name, "max_tokens": 4, "messages": [
                {"role": "user", "content": "a" * (limit - 20_000)}]})
            assert big.status_code == 413 and big.json()["error"]["type"] == "invalid_request_error"
            assert "prompt is too long" in big.json()["error"]["message"]
            assert "maximum context length" in big.json()["error"]["message"]
            huge = await swarm.http.post("/v1/messages", json={"model": name, "max_tokens": 4, "messages": [
                {"role": "user", "content": "a" * (limit + 1000)}]})
            assert huge.status_code == 413 and huge.json()["error"]["type"] == "request_too_large"
            # a client that leaves (streamed or not) ends its reply on the ring at once
            book = swarm.leader.serving.book
            for stream in (False, True):
                gate.clear()
                with trio.CancelScope() as scope:
                    async def leave(scope=scope):
                        await wait_until(lambda: len(book.of_model(name)) == 1, 20)
                        scope.cancel()  # the client closes its connection without a word

                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(leave)
                        await swarm.http.post("/v1/messages", json={"model": name, "max_tokens": 12,
                                                                    "messages": ASK, "stream": stream})
                await wait_until(lambda: not book.of_model(name), 10)
                gate.set()


def test_malformed_messages_bodies_are_a_400_never_a_crash():
    """Junk in every field of a /v1/messages body, and inside its blocks and tools: translated and checked as Chat
    Completions' are, it is refused with a BadRequest (a 400 that says what to fix), never another exception (a
    500)."""
    import random

    from swarm.errors import BadRequest
    from swarm.leader.api.anthropic_params import chat_body
    from swarm.leader.api.openai_params import parse_chat_body
    from test_fuzz import _json_junk

    rng = random.Random(38)
    keys = ["model", "messages", "max_tokens", "system", "stop_sequences", "tools", "tool_choice", "thinking",
            "output_config", "top_k", "stream", "metadata"]
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}
    valid = {"model": "m", "max_tokens": 8, "tools": [TOOL], "messages": [
        *ASK, {"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]}
    parse_chat_body(chat_body(valid), 64)  # the body itself is fine
    refused = 0
    for i in range(3000):
        body = dict(valid)
        for key in rng.sample(keys, rng.randrange(1, 4)):
            body[key] = _json_junk(rng)
        if i % 3 == 0:  # junk inside the blocks and tools too
            block = dict(rng.choice([use, result, {"type": "text", "text": "x"}]))
            block[rng.choice(["input", "content", "text", "id", "tool_use_id", "type", "is_error"])] = _json_junk(rng)
            body["messages"] = [*ASK, {"role": rng.choice(["user", "assistant"]), "content": [block]}, *ASK]
            body["tools"] = [{**TOOL, rng.choice(["name", "input_schema", "type", "strict"]): _json_junk(rng)}]
        try:
            parse_chat_body(chat_body(body, counting=i % 5 == 0), 64)
        except BadRequest:
            refused += 1
    assert refused > 1000  # most of it is junk, and said so
