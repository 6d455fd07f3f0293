"""OpenAI's Responses API on the leader (swarm.leader.api.responses_api) as OpenAI's own clients use it: the ``openai``
package's ``client.responses`` and the ``openai-agents`` package against a real leader and fellow, one fleet for the
module.

The models are tests/scripted.py's (as tests/test_ollama_api.py's): a tiny Qwen3 with a tools template whose greedy
first turn is a tool call, and which answers "It is sunny in Paris." with thinking off; and one that thinks first.
So every reply has an exact expected text."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import httpx
import openai
import pytest
import trio

from api_faces import ANSWER, call, streamed, thinking_model, weather_model
from harness import running_swarm, wait_until
from scripted import hold_compute
from test_openai_compat import WEATHER

pytestmark = pytest.mark.e2e

ASK = "Weather in Paris?"
GREEDY = {"temperature": 0, "max_output_tokens": 12}
NO_THINKING = {"effort": "none"}
TOOL = {"type": "function", **WEATHER["function"]}  # the Responses API's flat function tool


@pytest.fixture(scope="module")
def model_dir(module_tmp):
    return weather_model(module_tmp, "responses")


@pytest.fixture(scope="module")
def thinking_dir(module_tmp):
    return thinking_model(module_tmp, "responses")


def run_agent(url: str, token: str, model: str) -> tuple[str, list]:
    """One agent with one function tool, run by the Agents SDK against the leader (in its own asyncio loop)."""
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    asked: list = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        asked.append(city)
        return f"sunny in {city}"

    async def main() -> str:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=token)
        agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                      model=OpenAIResponsesModel(model=model, openai_client=client),
                      tool_use_behavior="stop_on_first_tool")
        result = await Runner.run(agent, ASK, max_turns=3)
        await client.close()
        return result.final_output

    return asyncio.run(main()), asked


async def test_the_openai_responses_client_against_the_pool(tmp_path, model_dir, thinking_dir, smollm_model_dir,
                                                            monkeypatch):
    name = model_dir.name
    gate = hold_compute(monkeypatch)  # open but for the last part: a client leaving while its reply is computed
    gate.set()
    with trio.fail_after(280):
        async with running_swarm(tmp_path, [model_dir, thinking_dir, smollm_model_dir], fellows=1) as swarm:
            client = openai.OpenAI(base_url=f"{swarm.url}/v1", api_key=swarm.token, timeout=60, max_retries=0)
            await swarm.load(name, 1)

            # plain: a string input; the reply, its usage, and exactly the reply Chat Completions gives
            reply = await call(client.responses.create, model=name, input=ASK, reasoning=NO_THINKING, **GREEDY)
            assert reply.status == "completed" and reply.output_text == ANSWER and reply.model == name
            (message,) = reply.output
            assert message.type == "message" and message.role == "assistant"
            chat = (await swarm.http.post("/v1/chat/completions", json={
                "model": name, "messages": [{"role": "user", "content": ASK}], "temperature": 0, "max_tokens": 12,
                "chat_template_kwargs": {"enable_thinking": False}})).json()
            assert chat["choices"][0]["message"]["content"] == reply.output_text
            assert reply.usage.input_tokens == chat["usage"]["prompt_tokens"]
            assert reply.usage.output_tokens == chat["usage"]["completion_tokens"] == 2
            assert reply.usage.output_tokens_details.reasoning_tokens == 0

            # stored: read back, its input items listed, continued with previous_response_id
            assert (await call(client.responses.retrieve, reply.id)).output_text == ANSWER
            items = await call(client.responses.input_items.list, reply.id)
            assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", ASK)]
            more = await call(client.responses.create, model=name, input="And tomorrow?",
                              previous_response_id=reply.id, instructions="Be brief.", reasoning=NO_THINKING,
                              **GREEDY)
            conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK},
                            {"role": "assistant", "content": ANSWER}, {"role": "user", "content": "And tomorrow?"}]
            chat = (await swarm.http.post("/v1/chat/completions", json={
                "model": name, "messages": conversation, "temperature": 0, "max_tokens": 12,
                "chat_template_kwargs": {"enable_thinking": False}})).json()
            assert more.output_text == chat["choices"][0]["message"]["content"] == ANSWER
            assert more.usage.input_tokens == chat["usage"]["prompt_tokens"] > reply.usage.input_tokens
            assert more.previous_response_id == reply.id

            # streamed: the typed events in order, the text in the deltas, the stored response at the end
            events = await streamed(client.responses.create, model=name, input=ASK, reasoning=NO_THINKING, **GREEDY)
            kinds = [e.type for e in events]
            deltas = kinds.count("response.output_text.delta")
            assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added", *["response.output_text.delta"] * deltas,
                             "response.output_text.done", "response.content_part.done", "response.output_item.done",
                             "response.completed"]
            assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER
            assert [e.sequence_number for e in events] == list(range(len(events)))
            done = events[-1].response
            assert done.output_text == ANSWER and done.usage.output_tokens == 2
            assert (await call(client.responses.retrieve, done.id)).output_text == ANSWER

            # a tool round trip: the function call, then its output with previous_response_id
            called = await call(client.responses.create, model=name, input=ASK, tools=[TOOL], **GREEDY)
            (function_call,) = called.output
            assert function_call.type == "function_call" and function_call.name == "get_weather"
            assert json.loads(function_call.arguments) == {"city": "Paris"}
            answer = await call(client.responses.create, model=name, previous_response_id=called.id, tools=[TOOL],
                                input=[{"type": "function_call_output", "call_id": function_call.call_id,
                                        "output": "sunny, 24 C"}], reasoning=NO_THINKING, **GREEDY)
            assert answer.output_text == ANSWER
            # the same with the whole conversation as input, forced by tool_choice, streamed
            events = await streamed(client.responses.create, model=name, input=ASK, tools=[TOOL],
                                    tool_choice={"type": "function", "name": "get_weather"}, **GREEDY)
            kinds = [e.type for e in events]
            assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
            (args_done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
            pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
            assert json.loads(args_done.arguments) == json.loads(pieces) == {"city": "Paris"}
            (item,) = events[-1].response.output
            whole = await call(client.responses.create, model=name, tools=[TOOL], reasoning=NO_THINKING, input=[
                {"role": "user", "content": ASK},
                {"type": "function_call", "call_id": item.call_id, "name": item.name, "arguments": item.arguments},
                {"type": "function_call_output", "call_id": item.call_id, "output": "sunny, 24 C"}], **GREEDY)
            assert whole.output_text == ANSWER

            # text.format json_schema: the structured output of Chat Completions
            schema = {"type": "object", "properties": {"answer": {"enum": [4]}}, "required": ["answer"],
                      "additionalProperties": False}
            shaped = await call(client.responses.create, model=name, input=ASK, reasoning=NO_THINKING, text={
                "format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}, **GREEDY)
            assert json.loads(shaped.output_text) == {"answer": 4}

            # the input items of a stored response, oldest first on request
            listed = await call(client.responses.input_items.list, whole.id, order="asc")
            assert [i.type for i in listed.data] == ["message", "function_call", "function_call_output"]
            assert listed.data[1].call_id == item.call_id and listed.data[2].output == "sunny, 24 C"
            newest = await call(client.responses.input_items.list, whole.id, limit=1)
            assert [i.type for i in newest.data] == ["function_call_output"] and newest.has_more

            # reasoning: the effort turns the family's switch; the reasoning comes back as a reasoning item
            thinks = thinking_dir.name
            await swarm.load(thinks, 1)
            thought = await call(client.responses.create, model=thinks, input="What is 2+2?",
                                 reasoning={"effort": "high"}, **GREEDY)
            reasoning, message = thought.output
            assert reasoning.type == "reasoning" and reasoning.content[0].text == "Two and two make four."
            assert thought.output_text == "The answer is 4."
            assert 0 < thought.usage.output_tokens_details.reasoning_tokens < thought.usage.output_tokens
            plain = await call(client.responses.create, model=thinks, input="What is 2+2?", reasoning=NO_THINKING,
                               **GREEDY)
            assert plain.output_text == "Just 4." and [o.type for o in plain.output] == ["message"]

            # a response too large to keep: streamed, it still comes, after an error event that says so
            with monkeypatch.context() as small:
                small.setattr(swarm.leader.store, "max_chat_bytes", 300)
                events = await streamed(client.responses.create, model=name, input=ASK, reasoning=NO_THINKING,
                                        **GREEDY)
                assert [e.type for e in events[-2:]] == ["error", "response.completed"]
                assert events[-2].code == "store_refused" and "\"store\": false" in events[-2].message
                assert events[-1].response.output_text == ANSWER and events[-1].response.store is False
                assert [e.sequence_number for e in events] == list(range(len(events)))
                with pytest.raises(openai.NotFoundError):
                    await call(client.responses.retrieve, events[-1].response.id)
                with pytest.raises(openai.APIStatusError) as too_large:
                    await call(client.responses.create, model=name, input=ASK, reasoning=NO_THINKING, **GREEDY)
                assert too_large.value.status_code == 413

            # delete; not stored; another user's: all a 404
            deleted = await call(client.responses.delete, reply.id)
            assert deleted is None or getattr(deleted, "deleted", True)
            with pytest.raises(openai.NotFoundError):
                await call(client.responses.retrieve, reply.id)
            unstored = await call(client.responses.create, model=name, input=ASK, store=False,
                                  include=["reasoning.encrypted_content"], reasoning=NO_THINKING, **GREEDY)
            assert unstored.output_text == ANSWER
            with pytest.raises(openai.NotFoundError):
                await call(client.responses.retrieve, unstored.id)
            store = swarm.leader.store
            eve = await trio.to_thread.run_sync(store.create_user, "eve", "correct horse battery")
            eve_token, _ = await trio.to_thread.run_sync(store.create_api_token, eve.id, "eve")
            eve_client = openai.OpenAI(base_url=f"{swarm.url}/v1", api_key=eve_token, max_retries=0)
            eves = eve_client.responses
            for fn in (eves.retrieve, eves.delete, eves.input_items.list):
                with pytest.raises(openai.NotFoundError) as info:
                    await call(fn, more.id)
                assert more.id in info.value.message
            with pytest.raises(openai.NotFoundError):
                await call(eve_client.responses.create, model=name, input="hi", previous_response_id=more.id)
            assert (await call(client.responses.retrieve, more.id)).output_text == ANSWER  # still there for its user

            # the same API tokens: no token, a 401 in OpenAI's shape on every route
            async with httpx.AsyncClient(base_url=swarm.url) as anonymous:
                for method, path in (("POST", "/v1/responses"), ("GET", f"/v1/responses/{more.id}"),
                                     ("DELETE", f"/v1/responses/{more.id}"),
                                     ("GET", f"/v1/responses/{more.id}/input_items")):
                    response = await anonymous.request(method, path, json={"model": name, "input": ASK})
                    assert response.status_code == 401, path
                    assert response.json()["error"]["code"] == "invalid_api_key", path

            # a field this server does not implement: a 400 that names it
            with pytest.raises(openai.BadRequestError) as info:
                await call(client.responses.create, model=name, input=ASK, background=True)
            assert "'background'" in info.value.message
            with pytest.raises(openai.BadRequestError) as info:
                await call(client.responses.create, model=name, input=ASK, include=["file_search_call.results"])
            assert "'file_search_call.results'" in info.value.message

            # logprobs, asked with include: the output text's tokens, each with Chat Completions' numbers; streamed,
            # each delta carries its own tokens'
            wanted = {"include": ["message.output_text.logprobs"], "top_logprobs": 2}
            reply = await call(client.responses.create, model=name, input=ASK, reasoning=NO_THINKING, **GREEDY,
                               **wanted)
            logprobs = reply.output[0].content[0].logprobs
            chat = (await swarm.http.post("/v1/chat/completions", json={
                "model": name, "messages": [{"role": "user", "content": ASK}], "temperature": 0, "max_tokens": 12,
                "chat_template_kwargs": {"enable_thinking": False}, "logprobs": True, "top_logprobs": 2})).json()
            assert "".join(p.token for p in logprobs) == ANSWER and all(len(p.top_logprobs) == 2 for p in logprobs)
            entries = chat["choices"][0]["logprobs"]["content"]  # Chat Completions' adds the end token's
            assert [(p.token, p.logprob) for p in logprobs] == [(p["token"], p["logprob"]) for p in entries][:-1]
            events = await streamed(client.responses.create, model=name, input=ASK, reasoning=NO_THINKING, **GREEDY,
                                    **wanted)
            pieces = [p for e in events if e.type == "response.output_text.delta" for p in e.logprobs]
            assert [(p.token, p.logprob) for p in pieces] == [(p.token, p.logprob) for p in logprobs]
            assert events[-1].response.output[0].content[0].logprobs == logprobs
            with pytest.raises(openai.BadRequestError) as info:
                await call(client.responses.create, model=name, input=ASK, tools=[{"type": "web_search"}])
            assert "web_search" in info.value.message

            # the real built-in model: a greedy reply, streamed or not, is token for token Chat Completions' one
            smol = smollm_model_dir.name
            await swarm.load(smol, 1)
            question = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
            chat = (await swarm.http.post("/v1/chat/completions", json={
                "model": smol, "messages": question, "temperature": 0, "max_tokens": 16})).json()
            expected = chat["choices"][0]["message"]["content"]
            real = await call(client.responses.create, model=smol, instructions="You are terse.",
                              input=[{"role": "user", "content": [{"type": "input_text", "text": "Name a color."}]}],
                              temperature=0, max_output_tokens=16)
            assert expected and real.output_text == expected
            assert real.usage.output_tokens == chat["usage"]["completion_tokens"]
            assert real.status == ("incomplete" if chat["choices"][0]["finish_reason"] == "length" else "completed")
            events = await streamed(client.responses.create, model=smol, instructions="You are terse.",
                                    input="Name a color.", temperature=0, max_output_tokens=16)
            assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected

            # the Agents SDK: one agent, one function tool, run to the tool's result
            final, asked = await trio.to_thread.run_sync(run_agent, swarm.url, swarm.token, name)
            assert asked == ["Paris"] and final == "sunny in Paris"

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
                        await swarm.http.post("/v1/responses", json={"model": name, "input": ASK, "stream": stream})
                await wait_until(lambda: not book.of_model(name), 10)
                gate.set()

            # a ring that stops answering: the stream ends with response.failed, which says what happened
            with monkeypatch.context() as stalled:
                stalled.setattr(swarm.leader, "settings", dataclasses.replace(swarm.leader.settings,
                                                                              request_stall_s=1.0))
                gate.clear()
                events = await streamed(client.responses.create, model=name, input=ASK, **GREEDY)
                gate.set()
            assert [e.type for e in events] == ["response.created", "response.in_progress", "response.failed"]
            failed = events[-1].response
            assert failed.status == "failed" and "stopped answering" in failed.error.message
            await wait_until(lambda: not book.of_model(name), 10)


def test_malformed_responses_bodies_are_a_400_never_a_crash():
    """Junk in every field of a /v1/responses body: translated and checked as Chat Completions' are, it is refused
    with a BadRequest (a 400 that says what to fix), never another exception (a 500)."""
    import random

    from swarm.errors import BadRequest
    from swarm.leader.api.openai_params import parse_chat_body
    from swarm.leader.api.responses_format import chat_body, input_items
    from test_fuzz import _json_junk

    rng = random.Random(38)
    keys = ["model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
            "text", "reasoning", "truncation", "include"]
    valid = {"model": "m", "input": ASK, "tools": [TOOL], "reasoning": NO_THINKING, **GREEDY}
    refused = 0
    for i in range(3000):
        body = dict(valid)
        for key in rng.sample(keys, rng.randrange(1, 4)):
            body[key] = _json_junk(rng)
        if i % 3 == 0:  # junk inside the items too
            body["input"] = [{"type": rng.choice(["message", "function_call", "function_call_output"]),
                              "role": "user", "call_id": "c", "name": "f", "arguments": "{}",
                              rng.choice(["content", "output", "arguments"]): _json_junk(rng)}]
        try:
            parse_chat_body(chat_body(body, [], input_items(body.get("input"))), 64)
        except BadRequest:
            refused += 1
    assert refused > 1000  # most of it is junk, and said so
