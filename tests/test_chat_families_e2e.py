"""The chat formats of the mixture-of-experts families end to end: gpt-oss's harmony, GLM-4.5's tags and Qwen3's
<think> and hermes <tool_call>, through a real leader and two fellows, as the OpenAI, Anthropic and Ollama clients see
them: thinking as reasoning, the answer as text, tool calls as calls; the families' thinking switches reaching their
templates; a tool's result rendered by each family's template.

The models are tests/scripted.py's, built as each family (its transformers config, experts included, its markers and
its own chat template: tests/templates), so the manifest names the family as a real checkpoint's does and each reply
is exact: with thinking on, each thinks "Need the weather tool.", says "Let me check." and calls get_weather for
Paris; GLM and Qwen3 with thinking off answer "Just 4.". A fourth, gpt-oss answering in the final channel, is the
browser page's: its analysis in the Reasoning block. One fleet serves the module, each model over 2 stages."""

from __future__ import annotations

import json

import anthropic
import httpx
import ollama
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
# for the page: a harmony reply that reasons, then answers in the final channel
FINAL = ["<|channel|>", "analysis", "<|message|>", "Two and two make four.", "<|end|>", "<|start|>",
         "assistant<|channel|>final<|message|>", "The answer is 4."]
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
    build(root / "src" / "final", {"assistant": FINAL}, family="gpt_oss")
    import_model(str(root / "src" / "final"), root / "models", "gpt-oss-final")
    dirs.append(root / "models" / "gpt-oss-final")
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


@pytest.fixture
def prompts(monkeypatch) -> list[str]:
    """The prompts the leader renders while the test runs (decoded with their special tokens), whatever the API."""
    from swarm.leader.api import openai_api

    seen: list[str] = []
    encode = openai_api.encode_chat

    def spy(model_dir, *args, **kwargs):
        ids = encode(model_dir, *args, **kwargs)
        seen.append(load_tokenizer(str(model_dir)).decode(ids, skip_special_tokens=False))
        return ids

    monkeypatch.setattr(openai_api, "encode_chat", spy)
    return seen


def level(prompt: str) -> str:
    return next(line for line in prompt.splitlines() if line.startswith("Reasoning: "))


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


def test_thinking_switches_reach_each_familys_template(bg, prompts):
    # gpt-oss always reasons; its template's switch is how much: "Reasoning: ..." in the system message
    levels = {}
    for extra in ({}, {"reasoning_effort": "high"}, {"reasoning_effort": "low"},
                  {"chat_template_kwargs": {"enable_thinking": False}}):
        prompt, data = prompt_text(bg, "gpt_oss", {"messages": ASK, **extra})
        levels[json.dumps(extra)] = level(prompt)
        assert data["choices"][0]["message"]["reasoning_content"] == REASONING  # the script reasons at every level
    assert list(levels.values()) == ["Reasoning: medium", "Reasoning: high", "Reasoning: low", "Reasoning: low"]
    # the Responses API's reasoning.effort is the same level
    prompts.clear()
    openai_client(bg).responses.create(model="gpt-oss", input="Weather in Paris?", reasoning={"effort": "high"},
                                       max_output_tokens=30, temperature=0)
    assert level(prompts[-1]) == "Reasoning: high"

    # GLM and Qwen3: enable_thinking (or a reasoning_effort of none) off -- GLM's /nothink and empty block, Qwen's
    # /no_think and empty block -- and the answer comes without thinking
    for family, switch, ending in (("glm4_moe", "/nothink", "<|assistant|>\n<think></think>"),
                                   ("qwen3_moe", "/no_think", "<|im_start|>assistant\n<think>\n\n</think>\n\n")):
        for off in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
            prompt, data = prompt_text(bg, family, {"messages": ASK, **off})
            assert f"Weather in Paris?{switch}" in prompt.replace(f" {switch}", switch) and prompt.endswith(ending)
            message = data["choices"][0]["message"]
            assert message["content"] == ANSWER and "reasoning_content" not in message, (family, off, message)
        prompt, _ = prompt_text(bg, family, {"messages": ASK, "reasoning_effort": "high"})
        assert switch not in prompt and not prompt.endswith(ending)


# the family's rendering of the assistant's call and of the tool's result, in the next turn's prompt
RENDERED = {
    "gpt_oss": [(f"<|start|>assistant<|channel|>analysis<|message|>{REASONING}<|end|>"
                '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
                "<|call|>"), ('<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>'
                '"Sunny, 22 C"<|end|><|start|>assistant')],
    "glm4_moe": [(f"<|assistant|>\n<think>{REASONING}</think>\n{PREAMBLE}\n<tool_call>get_weather<arg_key>city"
                 "</arg_key>\n<arg_value>Paris</arg_value></tool_call>"),
                 "<|observation|>\n<tool_response>\nSunny, 22 C\n</tool_response><|assistant|>"],
    "qwen3_moe": [(f'<|im_start|>assistant\n{PREAMBLE}\n<tool_call>\n{{"name": "get_weather", "arguments": '
                  '{"city": "Paris"}}\n</tool_call><|im_end|>'),
                  ("<|im_start|>user\n<tool_response>\nSunny, 22 C\n</tool_response><|im_end|>\n"
                  "<|im_start|>assistant\n")],
}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tool_result_sent_back_renders_in_the_familys_template(bg, family):
    first = post(bg, "/v1/chat/completions", {"model": name(family), "messages": ASK, "tools": [WEATHER], **GREEDY})
    message = first["choices"][0]["message"]  # sent back as the client got it: reasoning, preamble, the call
    result = {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "Sunny, 22 C"}
    prompt, _ = prompt_text(bg, family, {"messages": [*ASK, message, result], "tools": [WEATHER]})
    for part in RENDERED[family]:
        assert part in prompt, (part, prompt)


@pytest.mark.parametrize("family", FAMILIES)
def test_anthropic_thinking_text_and_tool_use(bg, family, prompts):
    client = anthropic.Anthropic(base_url=bg.swarm.url, api_key=bg.swarm.token, max_retries=0, timeout=60)
    body = dict(model=name(family), max_tokens=30, messages=ASK, extra_body={"temperature": 0}, tools=[{
        "name": "get_weather", "description": "The weather in a city now",
        "input_schema": WEATHER["function"]["parameters"]}])
    reply = client.messages.create(**body)
    assert [b.type for b in reply.content] == ["thinking", "text", "tool_use"]
    thinking, text, use = reply.content
    assert (thinking.thinking, text.text) == (REASONING, PREAMBLE)
    assert (use.name, use.input, reply.stop_reason) == ("get_weather", {"city": "Paris"}, "tool_use")
    with client.messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None) or b.input) for b in final.content] == [
        ("thinking", REASONING), ("text", PREAMBLE), ("tool_use", {"city": "Paris"})]
    assert final.stop_reason == "tool_use"
    prompts.clear()
    off = client.messages.create(**{**body, "tools": []}, thinking={"type": "disabled"})
    if family == "gpt_oss":  # it always reasons: disabled asks for little
        assert level(prompts[-1]) == "Reasoning: low"
    else:  # the answer without thinking
        assert [(b.type, b.text) for b in off.content] == [("text", ANSWER)]


@pytest.mark.parametrize("family", FAMILIES)
def test_ollama_thinking_and_tool_calls(bg, family, prompts):
    client = ollama.Client(host=bg.swarm.url, headers={"Authorization": f"Bearer {bg.swarm.token}"}, timeout=60)
    options = {"temperature": 0, "num_predict": 30}
    reply = client.chat(model=name(family), messages=ASK, tools=[WEATHER], think=True, options=options)
    assert (reply.message.thinking, reply.message.content) == (REASONING, PREAMBLE)
    (call,) = reply.message.tool_calls
    assert (call.function.name, dict(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    parts = list(client.chat(model=name(family), messages=ASK, tools=[WEATHER], think=True, options=options,
                             stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == REASONING
    assert "".join(p.message.content or "" for p in parts) == PREAMBLE
    assert [c.function.name for p in parts for c in p.message.tool_calls or []] == ["get_weather"]
    if family == "gpt_oss":  # Ollama's levels are gpt-oss's, and false asks it to reason little
        prompts.clear()
        for think in ("high", "low", False):
            client.chat(model=name(family), messages=ASK, think=think, options=options)
        assert [level(p) for p in prompts] == ["Reasoning: high", "Reasoning: low", "Reasoning: low"]
    else:
        off = client.chat(model=name(family), messages=ASK, think=False, options=options)
        assert off.message.content == ANSWER and not off.message.thinking


@pytest.mark.browser
def test_the_page_shows_a_harmony_replys_analysis_as_its_reasoning(bg):
    playwright_sync = pytest.importorskip("playwright.sync_api")
    from web_helpers import ARTIFACTS, CHROMIUM_ARGS, chromium_path

    if chromium_path() is None:
        pytest.skip("Chromium is not installed (apt-get install chromium)")
    expect = playwright_sync.expect
    with playwright_sync.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS, headless=True)
        context = browser.new_context(viewport={"width": 1280, "height": 860})
        context.add_init_script("""
            localStorage.setItem('swarm.model', '"gpt-oss-final"');
            localStorage.setItem('swarm.temperature', '0');
            localStorage.setItem('swarm.maxTokens', '30');
        """)
        page = context.new_page()
        page.set_default_timeout(30_000)
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(f"{bg.swarm.url}/auth/link?token={bg.sync(bg.swarm.leader.store.create_login_link, 1)}")
        expect(page.locator("#status-pill")).to_have_text("Model ready")
        page.locator("#composer-input").fill("What is 2+2?")
        page.locator("#composer-input").press("Enter")
        reply = page.locator(".msg.assistant").last
        expect(reply.locator(".speed")).to_contain_text("tokens/s")  # the reply is over
        expect(reply.locator(".answer")).to_have_text("The answer is 4.")  # no channel markers in it
        reasoning = reply.locator("details.reasoning")
        expect(reasoning).to_be_visible()
        reasoning.locator("summary").click()
        expect(reasoning.locator(".md")).to_have_text("Two and two make four.")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "harmony-reasoning.png"))
        assert not errors, errors
        browser.close()
