"""Tool calls parsed out of a reply, whole and as it streams, in the Qwen (Hermes) and Llama 3.x formats."""

from __future__ import annotations

import json

from swarm.leader.chat.tool_calls import ToolCallSplitter, parse

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
    assert out == ["Let me", " look.", "", "", ""] and rest == "" and len(calls) == 1
    out, rest, calls = stream(ToolCallSplitter("hermes"), ["a <to", "y> b"])
    assert "".join(out) + rest == "a <toy> b" and not calls
    # the line break a template puts before a call is not the text's; without a call, whitespace is kept
    out, rest, calls = stream(ToolCallSplitter("glm"), ["Let me check.\n", "<tool_call>now", "\n</tool_call>"])
    assert out == ["Let me check.", "", ""] and rest == "" and calls[0]["function"]["name"] == "now"
    out, rest, calls = stream(ToolCallSplitter("hermes"), ["Hi \n", "there\n\n"])
    assert out == ["Hi", " \nthere"] and rest == "\n\n" and not calls


def test_streamed_llama_reply_that_is_a_call_is_held():
    out, rest, calls = stream(ToolCallSplitter("llama"), [" ", '{"name": "f", ', '"parameters": {}}'])
    assert "".join(out) == "" and rest == "" and calls[0]["function"]["name"] == "f"
    out, rest, calls = stream(ToolCallSplitter("llama"), ["Hello", " there"])
    assert "".join(out) + rest == "Hello there" and not calls


def stream_calls(family: str, text: str, seed: int) -> tuple[str, list, list[dict]]:
    """``text`` pushed in random pieces of 1 to 6 characters: (content, calls, every call delta in order)."""
    import random

    rnd = random.Random(seed)
    splitter = ToolCallSplitter(family)
    content, deltas, at = "", [], 0
    while at < len(text):
        end = min(len(text), at + rnd.randint(1, 6))
        content += splitter.push(text[at:end])
        deltas += splitter.take()
        at = end
    rest, calls = splitter.finish()
    return content + rest, calls, deltas + splitter.take()


def check_streamed(calls: list, deltas: list[dict]) -> None:
    """OpenAI's shape: each call's first delta has its index, id, type and name; later ones only argument pieces,
    which add up to the arguments of the whole reply."""
    firsts: dict[int, dict] = {}
    arguments: dict[int, str] = {}
    for delta in deltas:
        i = delta["index"]
        if i not in firsts:
            firsts[i] = delta
            assert delta["type"] == "function" and delta["id"].startswith("call_") and delta["function"]["name"]
        else:
            assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
        arguments[i] = arguments.get(i, "") + delta["function"].get("arguments", "")
    assert sorted(firsts) == list(range(len(calls)))
    assert [firsts[i]["id"] for i in range(len(calls))] == [c["id"] for c in calls]
    assert [firsts[i]["function"]["name"] for i in range(len(calls))] == [c["function"]["name"] for c in calls]
    assert [arguments[i] for i in range(len(calls))] == [c["function"]["arguments"] for c in calls]


def test_qwen_call_arguments_stream_piece_by_piece_and_add_up_to_the_whole():
    args = ('{ "city":"Paris",\n "days" : 3, "hours": [1.50, 2e1], '
            '"note": "caf\\u00e9 \\"ok\\" \\ud83d\\ude00", "x": null}')
    text = (f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>\n'
            '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    whole_content, whole = parse(text, "hermes")
    for seed in range(30):
        content, calls, deltas = stream_calls("hermes", text, seed)
        assert content.strip() == whole_content and [c["function"] for c in calls] == [c["function"] for c in whole]
        check_streamed(calls, deltas)
        pieces = [d for d in deltas if d["index"] == 0 and "id" not in d]
        assert len(pieces) > 5  # piece by piece, not at the end
    assert json.loads(whole[0]["function"]["arguments"])["note"] == 'café "ok" 😀'


def test_llama_call_arguments_stream_piece_by_piece():
    text = '<|python_tag|>{"name": "f", "parameters": {"x": 1, "y": "two"}}; {"name": "g", "parameters": {}}'
    for seed in range(30):
        content, calls, deltas = stream_calls("llama", text, seed)
        assert content == "" and [c["function"]["name"] for c in calls] == ["f", "g"]
        check_streamed(calls, deltas)
    content, calls, deltas = stream_calls("llama", '{"name": "f", "parameters": {"q": "a b c d e f g"}}', 1)
    check_streamed(calls, deltas)
    assert len(deltas) > 3


def test_a_call_that_cannot_stream_comes_whole_at_the_end():
    # arguments before the name: nothing is known until the block closes
    text = '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>'
    content, calls, deltas = stream_calls("hermes", text, 0)
    assert content == "" and len(deltas) == 1 and deltas[0]["function"] == calls[0]["function"]
    check_streamed(calls, deltas)
    # a block that is no call stays text, and the next call still streams
    text = '<tool_call>oops</tool_call> <tool_call>\n{"name": "now", "arguments": {"tz": "UTC"}}\n</tool_call>'
    content, calls, deltas = stream_calls("hermes", text, 2)
    assert content == "<tool_call>oops</tool_call>" and [c["function"]["name"] for c in calls] == ["now"]
    check_streamed(calls, deltas)
