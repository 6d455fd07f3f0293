"""The OpenAI API as clients use it, with the official ``openai`` package against a real leader and real fellows:
stop strings, refused parameters, logprobs, penalties, several choices.

The model is tests/scripted.py's tiny Qwen3, whose greedy reply is a fixed script, token by token: a stop string
that spans tokens has an exact expected reply."""

from __future__ import annotations

import functools

import openai
import pytest
import trio

from harness import running_swarm, wait_until
from scripted import build
from swarm.store.importer import import_model

pytestmark = pytest.mark.e2e

SCRIPT = ["One", " two", " thr", "ee", " four", " five", " six"]
ASK = [{"role": "user", "content": "Count"}]


@pytest.fixture(scope="module")
def scripted_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("scripted")
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
                await call(client.chat.completions.create, **base, logit_bias={"5": 10})
            assert "'logit_bias'" in str(info.value)
            # what clients send anyway is fine, and max_completion_tokens is max_tokens
            reply = await call(client.chat.completions.create, model=name, messages=ASK, temperature=0,
                               max_completion_tokens=2, user="someone", metadata={"run": "1"}, store=False,
                               stream_options=None)
            assert reply.choices[0].message.content == "One two" and reply.choices[0].finish_reason == "length"
