"""The OpenAI API as clients use it, with the official ``openai`` package against a real leader and real fellows:
stop strings, refused parameters, logprobs, penalties, several choices.

The model is tests/scripted.py's tiny Qwen3, whose greedy reply is a fixed script, token by token: a stop string
that spans tokens has an exact expected reply."""

from __future__ import annotations

import functools
import json

import openai
import pytest
import trio

from harness import running_swarm, wait_until
from scripted import build
from swarm.leader.api.openai_params import choice_seed
from swarm.store.importer import import_model

pytestmark = pytest.mark.e2e

SCRIPT = ["One", " two", " thr", "ee", " four", " five", " six"]
ASK = [{"role": "user", "content": "Count"}]


@pytest.fixture(scope="module")
def scripted_dir(module_tmp):
    root = module_tmp("scripted")
    build(root / "src", {"assistant\n": SCRIPT})
    import_model(str(root / "src"), root / "models", "counter")
    return root / "models" / "counter"


def client_of(swarm) -> openai.OpenAI:
    return openai.OpenAI(base_url=swarm.url + "/v1", api_key=swarm.token, max_retries=0, timeout=60)


async def call(fn, **kwargs):
    """An openai call in a worker thread (the client is synchronous; the leader runs in this trio loop)."""
    return await trio.to_thread.run_sync(functools.partial(fn, **kwargs))


async def stream_text(client, **kwargs) -> tuple[str, list]:
    def run():
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks

    return await trio.to_thread.run_sync(run)


async def idle(swarm, name):
    """Every stage has dropped every request (a stop string cancelled the request on the ring)."""
    await wait_until(lambda: not any(f.stages[name].driver.stage_model.requests() for f in swarm.fellows), 10,
                     message=lambda: {f.name: f.stages[name].driver.stage_model.requests() for f in swarm.fellows})


async def test_stop_strings_across_tokens_and_chunks_and_refused_parameters(tmp_path, scripted_dir):
    name = scripted_dir.name
    with trio.fail_after(180):
        async with running_swarm(tmp_path, [scripted_dir], fellows=2) as swarm:
            await swarm.load(name, 2)
            client = client_of(swarm)
            base = dict(model=name, messages=ASK, temperature=0, max_tokens=20)
            whole = await call(client.chat.completions.create, **base)
            assert whole.choices[0].message.content == "".join(SCRIPT)
            assert whole.choices[0].finish_reason == "stop"

            # "hree f" spans three tokens (" thr", "ee", " four"): the reply ends just before it
            reply = await call(client.chat.completions.create, **base, stop=["hree f", "zzz"])
            assert reply.choices[0].message.content == "One two t"
            assert reply.choices[0].finish_reason == "stop"
            assert reply.usage.completion_tokens == 5  # up to the token that completed the stop string
            text, chunks = await stream_text(client, **base, stop="hree f")
            assert text == "One two t"
            assert chunks[-1].choices[0].finish_reason == "stop"
            assert chunks[-1].usage.completion_tokens == 5
            # a stop string that is one token's text, and one that never comes
            reply = await call(client.chat.completions.create, **base, stop=" two")
            assert reply.choices[0].message.content == "One"
            text, _ = await stream_text(client, **base, stop=["One two three!"])
            assert text == "".join(SCRIPT)
            await idle(swarm, name)

            # what we do not implement is a 400 that names it, never ignored
            with pytest.raises(openai.BadRequestError) as info:
                await call(client.chat.completions.create, **base, audio={"voice": "alloy", "format": "wav"})
            assert "'audio'" in str(info.value)
            with pytest.raises(openai.BadRequestError, match="logit_bias"):  # a token the model does not have
                await call(client.chat.completions.create, **base, logit_bias={"999999": 1})
            # what clients send anyway is fine, and max_completion_tokens is max_tokens
            reply = await call(client.chat.completions.create, model=name, messages=ASK, temperature=0,
                               max_completion_tokens=2, user="someone", metadata={"run": "1"}, store=False,
                               stream_options=None)
            assert reply.choices[0].message.content == "One two" and reply.choices[0].finish_reason == "length"


async def test_logprobs_several_choices_and_penalties(tmp_path, scripted_dir):
    import torch

    from reference_model import load_reference_model
    from swarm.leader.chat.chat_format import load_tokenizer

    name = scripted_dir.name
    seen = []
    with trio.fail_after(240):
        async with running_swarm(tmp_path, [scripted_dir], fellows=2) as swarm:
            await swarm.load(name, 2)
            client = client_of(swarm)
            base = dict(model=name, messages=ASK, temperature=0, max_tokens=20)

            # logprobs: transformers' log_softmax of the same model's logits, token by token
            reply = await call(client.chat.completions.create, **base, logprobs=True, top_logprobs=3,
                               extra_body={"return_token_ids": True})
            choice = reply.choices[0]
            content = choice.logprobs.content
            assert "".join(e.token for e in content) == choice.message.content + "<|im_end|>"
            model = load_reference_model(scripted_dir)
            ids = choice.model_extra["prompt_token_ids"]
            tokens = choice.model_extra["token_ids"]
            tokenizer = load_tokenizer(str(scripted_dir))
            for token, entry in zip(tokens, content):
                with torch.no_grad():
                    want = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
                assert entry.logprob == pytest.approx(float(want[token]), abs=1e-4)
                values, top = torch.topk(want, 3)
                assert [e.token for e in entry.top_logprobs] == [tokenizer.decode([t]) for t in top.tolist()]
                assert [e.logprob for e in entry.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
                ids = ids + [token]
            # streamed: the same entries, spread over the chunks
            _, chunks = await stream_text(client, **base, logprobs=True, top_logprobs=3, stop=" four")
            streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
            assert [e.token for e in streamed] == [e.token for e in content[:5]]  # up to the stop string's token
            assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content[:5]])

            # n: greedy choices are the same reply, run once on the ring; usage counts them all
            submitted = []
            submit = swarm.leader.serving.intake.submit

            async def count(request):
                submitted.append(request)
                return await submit(request)

            swarm.leader.serving.intake.submit = count
            reply = await call(client.chat.completions.create, **base, n=3)
            swarm.leader.serving.intake.submit = submit
            assert len(submitted) == 1
            assert [c.index for c in reply.choices] == [0, 1, 2]
            assert {c.message.content for c in reply.choices} == {"".join(SCRIPT)}
            assert reply.usage.completion_tokens == 3 * (len(SCRIPT) + 1)  # the script and the end of turn, thrice
            # sampled with a seed: reproducible, and each choice draws on its own
            hot = dict(model=name, messages=ASK, temperature=2.0, top_p=1.0, max_tokens=6, seed=11, n=4)
            first = await call(client.chat.completions.create, **hot, extra_body={"return_token_ids": True})
            prefilled = [f.stages[name].driver.protocol.prefill_tokens for f in swarm.fellows]
            again = await call(client.chat.completions.create, **hot, extra_body={"return_token_ids": True})
            prompt_len = len(again.choices[0].model_extra["prompt_token_ids"])
            # the four choices are one group on the ring: each stage computed the prompt once, not four times
            assert [f.stages[name].driver.protocol.prefill_tokens - p for f, p in zip(swarm.fellows, prefilled)] == \
                [prompt_len] * len(swarm.fellows)
            drawn = [c.model_extra["token_ids"] for c in first.choices]
            assert drawn == [c.model_extra["token_ids"] for c in again.choices]
            alone = await call(client.chat.completions.create, **{**hot, "n": 1}, extra_body={"return_token_ids": True})
            assert alone.choices[0].model_extra["token_ids"] == drawn[0]  # choice 0 is the n=1 reply
            for i in (1, 2, 3):  # and choice i is a request of its own with choice i's seed
                own = await call(client.chat.completions.create, **{**hot, "n": 1, "seed": choice_seed(11, i)},
                                 extra_body={"return_token_ids": True})
                assert own.choices[0].model_extra["token_ids"] == drawn[i]
            # streamed: each chunk says whose it is; every choice ends once
            chunks = await trio.to_thread.run_sync(lambda: list(client.chat.completions.create(
                stream=True, **{**base, "n": 2, "stop": "ee"})))
            texts = {0: "", 1: ""}
            ends = []
            for c in chunks:
                for item in c.choices:
                    texts[item.index] += item.delta.content or ""
                    if item.finish_reason:
                        ends.append((item.index, item.finish_reason))
            assert texts == {0: "One two thr", 1: "One two thr"} and sorted(ends) == [(0, "stop"), (1, "stop")]
            assert chunks[-1].usage.completion_tokens == 8
            await idle(swarm, name)

            # penalties reach the ring
            submit = swarm.leader.serving.intake.submit

            async def spy(request):
                seen.append(request.sampling)
                return await submit(request)

            swarm.leader.serving.intake.submit = spy
            reply = await call(client.chat.completions.create, **base, presence_penalty=0.5, frequency_penalty=0.25,
                               logit_bias={"3": -5}, extra_body={"repetition_penalty": 1.3})
            assert reply.choices[0].message.content == "".join(SCRIPT)  # a script that never repeats a token
    (sampling,) = seen
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty) == (0.5, 0.25, 1.3)
    assert (sampling.bias_ids, sampling.bias_values) == ([3], [-5.0])


async def test_the_built_in_model_sampled_choices_and_filtered_logprobs(tmp_path, smollm_model_dir):
    """SmolLM2 over two stages: n sampled choices differ and come back the same with the same seed; logprobs of a
    sampled reply are transformers' log_softmax after its warpers; a frequency penalty changes a greedy reply."""
    import torch

    from reference_model import load_reference_model
    from swarm.stage.sampling import SamplingParams

    name = smollm_model_dir.name
    ask = [{"role": "user", "content": "Write a list of fruits."}]
    with trio.fail_after(300):
        async with running_swarm(tmp_path, [smollm_model_dir], fellows=2) as swarm:
            await swarm.load(name, 2)
            client = client_of(swarm)
            body = dict(model=name, messages=ask, temperature=0.8, top_p=0.9, max_tokens=8, seed=5, n=3,
                        extra_body={"top_k": 40, "return_token_ids": True})
            first = await call(client.chat.completions.create, **body, logprobs=True, top_logprobs=2)
            again = await call(client.chat.completions.create, **body)
            drawn = [c.model_extra["token_ids"] for c in first.choices]
            assert drawn == [c.model_extra["token_ids"] for c in again.choices]
            assert len({tuple(d) for d in drawn}) > 1
            greedy = dict(model=name, messages=ask, temperature=0, max_tokens=24, extra_body={"return_token_ids": True})
            plain = await call(client.chat.completions.create, **greedy, n=2)
            assert plain.choices[0].model_extra["token_ids"] == plain.choices[1].model_extra["token_ids"]
            penalised = await call(client.chat.completions.create, **greedy, frequency_penalty=2.0)
            assert penalised.choices[0].model_extra["token_ids"] != plain.choices[0].model_extra["token_ids"]
            completions = await legacy_completions(client, name)
            # structured output through the fellows' own loading (the last stage gets the tokenizer's files)
            from test_structured import SCHEMA, check

            person = await call(client.chat.completions.create, model=name, temperature=0, max_tokens=80,
                                messages=[{"role": "user", "content": "Tell me about a person."}],
                                response_format={"type": "json_schema",
                                                 "json_schema": {"name": "person", "schema": SCHEMA}})
            check(json.loads(person.choices[0].message.content))
            assert person.choices[0].finish_reason == "stop"
            await idle(swarm, name)

    model = load_reference_model(smollm_model_dir)
    check_legacy_completions(completions, model, smollm_model_dir)
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9)
    for choice in first.choices:
        ids = choice.model_extra["prompt_token_ids"]
        for token, entry in zip(choice.model_extra["token_ids"], choice.logprobs.content):
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1:].float()
            want = torch.log_softmax(params.warpers()(torch.empty((1, 0), dtype=torch.long), logits), dim=-1)[0]
            want = want.clamp(min=-9999.0)  # a token the filters ruled out: OpenAI's -9999.0 (JSON has no -inf)
            assert entry.logprob == pytest.approx(float(want[token]), abs=1e-4)
            assert [e.logprob for e in entry.top_logprobs] == pytest.approx(torch.topk(want, 2).values.tolist(),
                                                                            abs=1e-4)
            ids = ids + [token]


PROMPT = "The capital of France is"


async def legacy_completions(client, name) -> dict:
    """/v1/completions as evaluation harnesses and older tools call it; what came back, to check offline."""
    got = {}
    # a prompt's log-likelihood, as lm-evaluation-harness asks for it: echo, logprobs, nothing generated
    got["echo"] = await call(client.completions.create, model=name, prompt=PROMPT, echo=True, logprobs=1,
                             max_tokens=0, temperature=0)
    got["greedy"] = await call(client.completions.create, model=name, prompt=PROMPT, max_tokens=8, temperature=0,
                               logprobs=2, extra_body={"return_token_ids": True})
    ids = got["greedy"].choices[0].model_extra["prompt_token_ids"]
    # the same prompt as token ids, with echo: the prompt's text, then the same reply
    got["ids"] = await call(client.completions.create, model=name, prompt=ids, max_tokens=8, temperature=0,
                            echo=True, n=2)
    # a stop string inside the greedy reply, streamed, two choices
    text = got["greedy"].choices[0].text
    stop = text.strip()[2:5]
    chunks = await trio.to_thread.run_sync(lambda: list(client.completions.create(
        model=name, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop], n=2, stream=True, logprobs=0)))
    got["stream"] = (stop, chunks)
    # several prompts in one request (harnesses batch theirs), each with its choices, in order
    got["batch"] = await call(client.completions.create, model=name, prompt=[PROMPT, "Paris is"], max_tokens=2,
                              temperature=0, echo=True, n=2)
    with pytest.raises(openai.BadRequestError, match="'prompt' holds token 1000000"):
        await call(client.completions.create, model=name, prompt=[1, 10**6], max_tokens=1)
    return got


def check_legacy_completions(got: dict, model, model_dir) -> None:
    import torch

    from swarm.leader.chat.chat_format import load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))
    ids = got["greedy"].choices[0].model_extra["prompt_token_ids"]
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    echo = got["echo"].choices[0]
    assert echo.text == PROMPT and echo.finish_reason == "length"
    assert got["echo"].usage.completion_tokens == 0 and got["echo"].usage.prompt_tokens == len(ids)
    lp = echo.logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in ids] and lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([float(want[k - 1, ids[k]]) for k in range(1, len(ids))], abs=1e-4)
    assert lp.top_logprobs[0] is None and all(len(top) == 1 for top in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

    greedy = got["greedy"].choices[0]
    reply = greedy.model_extra["token_ids"]
    assert len(greedy.logprobs.tokens) == len(reply) == 8 and greedy.finish_reason == "length"
    assert greedy.logprobs.token_logprobs[0] == pytest.approx(float(want[-1, reply[0]]), abs=1e-4)
    assert greedy.text == tokenizer.decode(reply)

    same = got["ids"]
    assert [c.text for c in same.choices] == [PROMPT + greedy.text] * 2
    assert same.usage.prompt_tokens == len(ids) and same.usage.completion_tokens == 16

    batch = got["batch"]
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text.startswith(p) for c, p in zip(batch.choices, [PROMPT, PROMPT, "Paris is", "Paris is"])] == [True] * 4
    assert batch.choices[0].text == batch.choices[1].text == PROMPT + tokenizer.decode(reply[:2])
    paris = len(tokenizer("Paris is")["input_ids"])
    assert batch.usage.prompt_tokens == len(ids) + paris and batch.usage.completion_tokens == 8

    stop, chunks = got["stream"]
    texts, ends = {0: "", 1: ""}, []
    for chunk in chunks:
        for item in chunk.choices:
            texts[item.index] += item.text
            if item.finish_reason:
                ends.append((item.index, item.finish_reason))
    cut = greedy.text[: greedy.text.index(stop)]
    assert texts == {0: cut, 1: cut} and sorted(ends) == [(0, "stop"), (1, "stop")]
    assert chunks[-1].usage is not None


# A Qwen3-style template that takes tools, renders an assistant's tool calls and the tool's results.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{% elif message.tool_calls %}<|im_start|>assistant\n{{ message.content }}{% for call in message.tool_calls %}"
    "<tool_call>\n{\"name\": \"{{ call.function.name }}\", \"arguments\": {{ call.function.arguments | tojson }}}"
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
CALL_PIECES = ['{"name": "get_weather", ', '"arguments": {"city": ', '"Par', 'is"}}']
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def tool_model_dir(module_tmp):
    root = module_tmp("tools")
    # the first turn calls the tool; after its result (and thinking off, so the prompt ends otherwise) it answers
    # (the call in pieces, as a model writes it: its arguments stream piece by piece)
    build(root / "src", {"assistant\n": ["<tool_call>\n", *CALL_PIECES, "\n</tool_call>"],
                         "\n\n": ["It is sunny in Paris."]}, TOOLS_TEMPLATE)
    import_model(str(root / "src"), root / "models", "qwen3-tools")
    return root / "models" / "qwen3-tools"


async def test_a_tool_call_round_trip(tmp_path, tool_model_dir, scripted_dir):

    from swarm.leader.chat.chat_format import load_tokenizer

    name = tool_model_dir.name
    tokenizer = load_tokenizer(str(tool_model_dir))
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    with trio.fail_after(180):
        async with running_swarm(tmp_path, [tool_model_dir, scripted_dir], fellows=2) as swarm:
            await swarm.load(name, 2)
            client = client_of(swarm)
            reply = await call(client.chat.completions.create, model=name, messages=ask, tools=[WEATHER],
                               temperature=0, max_tokens=10, extra_body={"return_token_ids": True})
            choice = reply.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            (tool_call,) = choice.message.tool_calls
            assert tool_call.function.name == "get_weather"
            assert json.loads(tool_call.function.arguments) == {"city": "Paris"}
            prompt = tokenizer.decode(choice.model_extra["prompt_token_ids"])
            assert "<tools>" in prompt and '"name": "get_weather"' in prompt  # the tools reached the template

            # streamed: no text; the call's id and name once known, then its arguments as the model writes them
            chunks = await trio.to_thread.run_sync(lambda: list(client.chat.completions.create(
                model=name, messages=ask, tools=[WEATHER], temperature=0, max_tokens=10, stream=True)))
            deltas = [c.choices[0].delta for c in chunks if c.choices]
            assert "".join(d.content or "" for d in deltas) == ""
            calls = [t for d in deltas for t in d.tool_calls or []]
            first, pieces = calls[0], calls[1:]
            assert (first.index, first.type, first.function.name, first.function.arguments) == \
                (0, "function", "get_weather", "") and first.id.startswith("call_")
            assert [(t.index, t.id, t.type, t.function.name) for t in pieces] == [(0, None, None, None)] * len(pieces)
            assert [t.function.arguments for t in pieces] == ['{"city": ', '"Par', 'is"}']  # token by token
            assert "".join(t.function.arguments for t in pieces) == tool_call.function.arguments  # the whole reply's
            assert chunks[-1].choices[0].finish_reason == "tool_calls"

            # the call and its result go back into the template; the model answers
            history = ask + [choice.message.model_dump(exclude_none=True),
                             {"role": "tool", "tool_call_id": tool_call.id, "content": "sunny, 24 C"}]
            answer = await call(client.chat.completions.create, model=name, messages=history, tools=[WEATHER],
                                temperature=0, max_tokens=10,
                                extra_body={"return_token_ids": True,
                                            "chat_template_kwargs": {"enable_thinking": False}})
            assert answer.choices[0].message.content == "It is sunny in Paris."
            assert answer.choices[0].finish_reason == "stop" and not answer.choices[0].message.tool_calls
            prompt = tokenizer.decode(answer.choices[0].model_extra["prompt_token_ids"])
            assert f"<tool_call>\n{CALL}\n</tool_call>" in prompt
            assert "<tool_response>\nsunny, 24 C\n</tool_response>" in prompt

            # tool_choice none: no tools reach the template, and what the model writes is text
            plain = await call(client.chat.completions.create, model=name, messages=ask, tools=[WEATHER],
                               tool_choice="none", temperature=0, max_tokens=10,
                               extra_body={"return_token_ids": True})
            assert "<tools>" not in tokenizer.decode(plain.choices[0].model_extra["prompt_token_ids"])
            assert plain.choices[0].message.content == f"<tool_call>\n{CALL}\n</tool_call>"
            assert plain.choices[0].finish_reason == "stop"
            # a forced call (a grammar on the last stage) is the same call here
            forced = await call(client.chat.completions.create, model=name, messages=ask, tools=[WEATHER],
                                temperature=0, max_tokens=10,
                                tool_choice={"type": "function", "function": {"name": "get_weather"}})
            assert forced.choices[0].finish_reason == "tool_calls"
            assert json.loads(forced.choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris"}
            with pytest.raises(openai.BadRequestError, match="tool_choice"):
                await call(client.chat.completions.create, model=name, messages=ask, tools=[WEATHER],
                           tool_choice={"type": "function", "function": {"name": "get_time"}})
            # a model whose template takes no tools says so instead of ignoring them
            await swarm.load(scripted_dir.name, 1)
            with pytest.raises(openai.BadRequestError, match="does not take tools"):
                await call(client.chat.completions.create, model=scripted_dir.name, messages=ask, tools=[WEATHER])


async def test_langchain_drives_the_api(tmp_path, tool_model_dir, scripted_dir):
    """LangChain's ChatOpenAI (what LangChain-style agents use) against the leader: a plain reply, a stop string, a
    stream, and a tool call that comes back as LangChain's own tool_calls."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    with trio.fail_after(180):
        async with running_swarm(tmp_path, [scripted_dir, tool_model_dir], fellows=2) as swarm:
            await swarm.load(scripted_dir.name, 2)

            def chat(name, **kwargs):
                return ChatOpenAI(base_url=swarm.url + "/v1", api_key=swarm.token, model=name, temperature=0,
                                  max_tokens=20, max_retries=0, timeout=60, **kwargs)

            counter = chat(scripted_dir.name)
            reply = await trio.to_thread.run_sync(counter.invoke, "Count")
            assert reply.content == "".join(SCRIPT)
            assert reply.response_metadata["finish_reason"] == "stop"
            stopped = await trio.to_thread.run_sync(lambda: chat(scripted_dir.name, stop=["hree f"]).invoke("Count"))
            assert stopped.content == "One two t"
            pieces = await trio.to_thread.run_sync(lambda: [c.content for c in counter.stream("Count")])
            assert "".join(pieces) == "".join(SCRIPT) and len(pieces) > 3

            await swarm.load(tool_model_dir.name, 2)
            weather = chat(tool_model_dir.name).bind_tools([WEATHER])
            ask = [HumanMessage("Weather in Paris?")]
            called = await trio.to_thread.run_sync(weather.invoke, ask)
            assert [(c["name"], c["args"]) for c in called.tool_calls] == [("get_weather", {"city": "Paris"})]
            history = ask + [called, ToolMessage("sunny, 24 C", tool_call_id=called.tool_calls[0]["id"])]
            answer = await trio.to_thread.run_sync(lambda: chat(
                tool_model_dir.name, extra_body={"chat_template_kwargs": {"enable_thinking": False}},
            ).bind_tools([WEATHER]).invoke(history))
            assert answer.content == "It is sunny in Paris." and not answer.tool_calls
