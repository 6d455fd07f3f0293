"""What the tests of the leader's API faces (Ollama's, OpenAI's Responses, Anthropic's Messages) share: the two
scripted models they serve and a way to call a synchronous vendor client from a trio test.

The weather model is tests/scripted.py's tiny Qwen3 with a tools template (tests/test_openai_compat.py's): its greedy
first turn is a tool call, and with thinking off (the prompt then ends in an empty thinking block) it answers ANSWER.
The thinking model thinks, then answers "The answer is 4." ("Just 4." with thinking off)."""

from __future__ import annotations

import functools

import trio

from scripted import build
from swarm.store.importer import import_model
from test_openai_compat import CALL_PIECES, TOOLS_TEMPLATE

ANSWER = "It is sunny in Paris."


def weather_model(module_tmp, prefix: str):
    root = module_tmp(prefix)
    build(root / "src", {"assistant\n": ["<tool_call>\n", *CALL_PIECES, "\n</tool_call>"], "\n\n": [ANSWER]},
          TOOLS_TEMPLATE)
    import_model(str(root / "src"), root / "models", "weather")
    return root / "models" / "weather"


def thinking_model(module_tmp, prefix: str):
    root = module_tmp(f"{prefix}-thinks")
    build(root / "src", {"assistant\n": ["<think>", "Two and two make four.", "</think>", "The answer is 4."],
                         "\n\n": ["Just 4."]})
    import_model(str(root / "src"), root / "models", "thinks")
    return root / "models" / "thinks"


async def call(fn, *args, **kwargs):
    """A synchronous client's call in a worker thread (the leader runs in the test's trio loop)."""
    return await trio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))


async def streamed(fn, **kwargs) -> list:
    """A streamed call's chunks or events, as the client parses them."""
    return await trio.to_thread.run_sync(lambda: list(fn(stream=True, **kwargs)))
