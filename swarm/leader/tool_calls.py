"""Tool calls in a model's reply, for the API's ``tools``: the model writes them as text in its family's format, and
the API returns them as ``message.tool_calls`` (and stream deltas) with finish_reason ``tool_calls``.

Formats (the ones the chat templates of the families we serve teach their models, as vLLM's parsers read them):

- Qwen2.5 / Qwen3 (and Hermes-style templates, the default): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n
  </tool_call>``, any number of them, after some text or none.
- Llama 3.x: the whole reply is a JSON object ``{"name": ..., "parameters": {...}}`` (or several separated by
  ``;``), sometimes after ``<|python_tag|>``.

While a reply streams, text goes out as it comes until it could be the start of a tool call; from there the
splitter holds the text back and the calls go out whole when the reply ends.
"""

from __future__ import annotations

import json
import secrets

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def as_call(obj) -> dict | None:
    """An OpenAI tool call from a parsed ``{"name", "arguments" | "parameters"}`` object, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": obj["name"], "arguments": arguments}}


def parse_hermes(text: str) -> tuple[str, list[dict]]:
    """(content, calls) of a reply in the ``<tool_call>`` format; a block that is not a call stays content."""
    content, calls = [], []
    rest = text
    while True:
        at = rest.find(OPEN)
        if at < 0:
            content.append(rest)
            break
        end = rest.find(CLOSE, at)
        body = rest[at + len(OPEN): end if end >= 0 else len(rest)]
        try:
            call = as_call(json.loads(body))
        except ValueError:
            call = None
        if call is None:
            content.append(rest[: end + len(CLOSE)] if end >= 0 else rest)
        else:
            content.append(rest[:at])
            calls.append(call)
        if end < 0:
            break
        rest = rest[end + len(CLOSE):]
    return "".join(content).strip() if calls else text, calls


def parse_llama(text: str) -> tuple[str, list[dict]]:
    """(content, calls) of a Llama 3.x reply: JSON call objects, ``;``-separated, and nothing else."""
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    decoder = json.JSONDecoder()
    at = 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except ValueError:
            return text, []
        call = as_call(obj)
        if call is None:
            return text, []
        calls.append(call)
        at = end
        while at < len(body) and body[at] in " \n\t;":
            at += 1
    return "", calls


def parse(text: str, family: str) -> tuple[str, list[dict]]:
    if family == "llama":
        content, calls = parse_llama(text)
        if calls:
            return content, calls
    return parse_hermes(text)


class ToolCallSplitter:
    """Feed content deltas; get the content that can stream now. :meth:`finish` gives the rest of the content and
    the calls."""

    def __init__(self, family: str):
        self.family = family
        self.text = ""  # the whole reply's content
        self.sent = 0  # how much of it went out
        self.holding = False  # a call may have started: everything from ``sent`` on waits for the end

    def push(self, delta: str) -> str:
        self.text += delta
        if self.holding:
            return ""
        if self.family == "llama" and not self.text[self.sent:].strip():
            return ""  # the reply may still turn out to be a JSON call
        if self.family == "llama" and self.sent == 0 and self.text.lstrip().startswith(("{", PYTHON_TAG)):
            self.holding = True
            return ""
        at = self.text.find(OPEN, self.sent)
        if at >= 0:
            self.holding = True
            out, self.sent = self.text[self.sent:at], at
            return out
        keep = _partial(self.text, OPEN)
        end = len(self.text) - keep
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """(content not sent yet, calls) at the end of the reply."""
        rest = self.text[self.sent:]
        if not self.holding and self.family != "llama":
            return rest, []
        content, calls = parse(rest, self.family)
        return (content if calls else rest), calls


def _partial(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def forced_grammar(tools: list[dict], family: str, name: str | None = None) -> str:
    """The llguidance grammar of a reply that is one call of ``name`` (or of any of ``tools``: tool_choice
    "required"), in the family's format, with arguments that follow the tool's parameters schema. The JSON's
    whitespace is free (llguidance's default): with fixed separators llguidance 1.9's masks inside a lark grammar
    leave out tokens that span several JSON pieces, which the model may well prefer."""
    from llguidance import grammar_from

    key = "parameters" if family == "llama" else "arguments"
    options = []
    for tool in tools:
        function = tool["function"]
        if name is not None and function["name"] != name:
            continue
        parameters = function.get("parameters") or {"type": "object"}
        options.append({"type": "object", "properties": {"name": {"const": function["name"]}, key: parameters},
                        "required": ["name", key], "additionalProperties": False})
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    call = "%json " + json.dumps(schema)
    if family == "llama":
        return grammar_from("lark", f"start: call\ncall: {call}\n")
    return grammar_from("lark", f'start: "{OPEN}\\n" call "\\n{CLOSE}"\ncall: {call}\n')
