"""The chat formats of the mixture-of-experts families end to end: gpt-oss's harmony, GLM-4.5's tags and Qwen3's
<think> and hermes <tool_call>, through a real leader and two fellows, as the OpenAI, Anthropic and Ollama clients see
them: thinking as reasoning, the answer as text, tool calls as calls; the families' thinking switches reaching their
templates; a tool's result rendered by each family's template.

The models are tests/scripted.py's, built as each family (its transformers config, experts included, its markers and
its own chat template: tests/templates), so the manifest names the family as a real checkpoint's does and each reply
is exact: with thinking on, each thinks "Need the weather tool.", says "Let me check." and calls get_weather for
Paris; GLM and Qwen3 with thinking off answer "Just 4.". One fleet serves the module, each model over 2 stages."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from scripted import build
from swarm.leader.chat.chat_format import load_tokenizer
from swarm.store.importer import import_model
from web_helpers import BackgroundSwarm

pytestmark = pytest.mark.e2e

REASONING, PREAMBLE, ANSWER = "Need the weather tool.", "Let me check.", "Just 4."
SCRIPTS = {
    # gpt-oss: analysis, a commentary preamble, a call in the commentary channel; the reply ends at <|call|>
    "gpt_oss": {"assistant": [
        "<|channel|>", "analysis", "<|message|>", REASONING, "<|end|>", "<|start|>",
        "assistant<|channel|>commentary<|message|>", PREAMBLE, "<|end|><|start|>assistant to=functions.get_weather",
        "<|channel|>commentary", " <|constrain|>json", "<|message|>{", '"city": "Par', 'is"}', "<|call|>"]},
    # GLM-4.5: thinking in tags, the call as name and argument tags; <|observation|> ends the turn for the result
    "glm4_moe": {"<|assistant|>": ["\n<think>", REASONING, "</think>\n" + PREAMBLE, "\n<tool_call>get_weather",
                                   "\n<arg_key>city</arg_key>", "\n<arg_value>Paris</arg_value>", "\n</tool_call>",
                                   "<|observation|>"],
                 "</think>": ["\n" + ANSWER]},
    # Qwen3: thinking in tags, then hermes JSON calls
    "qwen3_moe": {"assistant\n": ["<think>", f"\n{REASONING}\n", "</think>", f"\n\n{PREAMBLE}\n", "<tool_call>",
                                  '\n{"name": "get_weather", ', '"arguments": {"city": ', '"Par', 'is"}}',
                                  "\n</tool_call>"],
                  "\n\n": [ANSWER]},
}
FAMILIES = list(SCRIPTS)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
GREEDY = {"temperature": 0, "max_tokens": 30}


@pytest.fixture(scope="module")
def bg(module_tmp):
    root = module_tmp("families")
    dirs = []
    for family, scripts in SCRIPTS.items():
        build(root / "src" / family, scripts, family=family)
        import_model(str(root / "src" / family), root / "models", family.replace("_", "-"))
        dirs.append(root / "models" / family.replace("_", "-"))
    swarm = BackgroundSwarm(module_tmp("families-swarm"), dirs).start()
    try:
        for model_dir in dirs:
            swarm.call(swarm.swarm.load, model_dir.name, 2)
        yield swarm
    finally:
        swarm.stop()


def name(family: str) -> str:
    return family.replace("_", "-")


def openai_client(bg) -> openai.OpenAI:
    return openai.OpenAI(base_url=bg.swarm.url + "/v1", api_key=bg.swarm.token, max_retries=0, timeout=60)


def post(bg, path: str, body: dict) -> dict:
    with httpx.Client(base_url=bg.swarm.url, headers={"authorization": f"Bearer {bg.swarm.token}"}, timeout=60) as c:
        response = c.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def prompt_text(bg, family: str, body: dict) -> tuple[str, dict]:
    """The prompt the leader rendered for ``body`` (decoded with its special tokens), and the reply."""
    data = post(bg, "/v1/chat/completions", {"model": name(family), **GREEDY, "return_token_ids": True, **body})
    tokenizer = load_tokenizer(str(bg.swarm.leader.models_root / name(family)))
    return tokenizer.decode(data["choices"][0]["prompt_token_ids"], skip_special_tokens=False), data


@pytest.mark.parametrize("family", FAMILIES)
def test_openai_reasoning_answer_and_tool_call_whole_and_streamed(bg, family):
    client = openai_client(bg)
    reply = client.chat.completions.create(model=name(family), messages=ASK, tools=[WEATHER], **GREEDY)
    choice = reply.choices[0]
    assert choice.message.reasoning_content == REASONING
    assert choice.message.content == PREAMBLE
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    chunks = list(client.chat.completions.create(model=name(family), messages=ASK, tools=[WEATHER], stream=True,
                                                 **GREEDY))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == REASONING
    assert "".join(d.content or "" for d in deltas) == PREAMBLE
    pieces = [t for d in deltas for t in d.tool_calls or []]
    assert pieces[0].index == 0 and pieces[0].id.startswith("call_") and pieces[0].function.name == "get_weather"
    assert all(p.index == 0 and p.id is None for p in pieces[1:])
    # the streamed arguments add up to the whole reply's, as JSON text
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
