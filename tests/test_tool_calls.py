"""Tool calls parsed out of a reply, whole and as it streams, in the Qwen (Hermes) and Llama 3.x formats."""

from __future__ import annotations

import json

from swarm.leader.tool_calls import ToolCallSplitter, parse

CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def test_qwen_calls_after_some_text():
    content, calls = parse(f"Let me look.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n"
                           '{"name": "now", "arguments": {}}\n</tool_call>', "hermes")
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("now", {})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


def test_text_that_is_not_a_call_stays_text():
    assert parse("<tool_call>not json</tool_call> hi", "hermes") == ("<tool_call>not json</tool_call> hi", [])
    assert parse("Use {braces} freely", "llama") == ("Use {braces} freely", [])


def test_llama_json_calls():
    content, calls = parse('<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}',
                           "llama")
    assert content == "" and [c["function"]["name"] for c in calls] == ["f", "g"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1}


def stream(splitter: ToolCallSplitter, pieces: list[str]) -> tuple[list[str], str, list]:
    out = [splitter.push(p) for p in pieces]
    rest, calls = splitter.finish()
    return out, rest, calls


def test_streamed_text_goes_out_until_a_call_may_start():
    out, rest, calls = stream(ToolCallSplitter("hermes"), ["Let me ", "look.<tool", "_call>\n", CALL, "\n</tool_call>"])
    assert out == ["Let me ", "look.", "", "", ""] and rest == "" and len(calls) == 1
    out, rest, calls = stream(ToolCallSplitter("hermes"), ["a <to", "y> b"])
    assert "".join(out) + rest == "a <toy> b" and not calls


def test_streamed_llama_reply_that_is_a_call_is_held():
    out, rest, calls = stream(ToolCallSplitter("llama"), [" ", '{"name": "f", ', '"parameters": {}}'])
    assert "".join(out) == "" and rest == "" and calls[0]["function"]["name"] == "f"
    out, rest, calls = stream(ToolCallSplitter("llama"), ["Hello", " there"])
    assert "".join(out) + rest == "Hello there" and not calls
