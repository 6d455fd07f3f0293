"""Tool calls in a model's reply, for the API's ``tools``: the model writes them as text in its family's format, and
the API returns them as ``message.tool_calls`` (and stream deltas) with finish_reason ``tool_calls``.

Formats (the ones the chat templates of the families we serve teach their models, as vLLM's parsers read them):

- Qwen2.5 / Qwen3 (and Hermes-style templates, the default): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n
  </tool_call>``, any number of them, after some text or none.
- GLM-4.5 (``glm4_moe``): ``<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>...</tool_call>``, a
  string value as it is and any other as JSON (the template's ``tojson``); the tool's parameter schema says which.
  Such a call comes whole when its block closes.
- gpt-oss (harmony): swarm.leader.chat.harmony turns each call into the ``<tool_call>`` JSON format above.
- Llama 3.x: the whole reply is a JSON object ``{"name": ..., "parameters": {...}}`` (or several separated by
  ``;``), sometimes after ``<|python_tag|>``.

While a reply streams, text goes out as it comes until it could be the start of a tool call; from there the
splitter holds the text back. Each call streams as OpenAI and vLLM stream it: once its name is known, a delta with
its index, id, type and name (and empty arguments), then deltas with pieces of its arguments as the model writes
them. The pieces are the arguments in the form the whole reply gives them (``json.dumps`` of the parsed object:
swarm.leader.chat.json_stream rewrites the model's JSON as it comes), so they add up to the non-streamed arguments; what
could not stream (a call whose name comes after its arguments, a rewritten number still being written) goes out
when the reply ends.
"""

from __future__ import annotations

import json
import re
import secrets

from swarm.leader.chat.json_stream import JsonRewriter

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


# a name (not JSON: a hermes call starts with "{"), then its arguments, up to the block's end
_GLM_CALL = re.compile(r"<tool_call>\s*([^\s<{][^\n<]*?)\s*(?:\n|(?=<arg_key>)|(?=</tool_call>))(.*?)</tool_call>",
                       re.S)
_GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _glm_value(text: str, schema: dict | None):
    """An argument's value as GLM's template writes it: a string as it is, anything else as JSON."""
    if (schema or {}).get("type") == "string":
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_glm(text: str, tools: list[dict] | None = None) -> tuple[str, list[dict]]:
    """(content, calls) of a GLM-4.5 reply; ``tools`` (the request's) give each argument's type."""
    schemas = {t["function"]["name"]: (t["function"].get("parameters") or {}).get("properties") or {}
               for t in tools or [] if isinstance(t, dict) and isinstance(t.get("function"), dict)}
    calls = []
    for match in _GLM_CALL.finditer(text):
        name = match.group(1).strip()
        properties = schemas.get(name, {})
        arguments = {k.strip(): _glm_value(v.strip("\n"), properties.get(k.strip()))
                     for k, v in _GLM_ARGUMENT.findall(match.group(2))}
        call = as_call({"name": name, "arguments": arguments})
        if call is not None:
            calls.append(call)
    if not calls:
        return parse_hermes(text)  # a grammar-forced call, or a model that writes JSON
    return _GLM_CALL.sub("", text).strip(), calls


def parse(text: str, family: str, tools: list[dict] | None = None) -> tuple[str, list[dict]]:
    if family == "glm":
        return parse_glm(text, tools)
    if family == "llama":
        content, calls = parse_llama(text)
        if calls:
            return content, calls
    return parse_hermes(text)


# A call's opening as the families' templates teach it: its name first, then its arguments (or Llama's parameters).
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class _Streamed:
    """A call whose deltas went out: its id and name, and the arguments sent so far."""

    def __init__(self, name: str):
        self.id = new_call_id()
        self.name = name
        self.arguments = ""
        self.rewriter: JsonRewriter | None = None  # None until its arguments' JSON starts (or when they cannot stream)
        self.done = False


class ToolCallSplitter:
    """Feed content deltas; get the content that can stream now, and (:meth:`take`) the calls' stream deltas.
    :meth:`finish` gives the rest of the content and the calls."""

    def __init__(self, family: str, tools: list[dict] | None = None):
        self.family = family
        self.tools = tools  # the request's: GLM's argument values are typed by their schema
        self.text = ""  # the whole reply's content
        self.sent = 0  # how much of it went out
        self.holding = False  # a call may have started: everything from ``sent`` on waits for the end
        self.streamed: list[_Streamed] = []
        self._deltas: list[dict] = []  # call deltas not taken yet
        self._scan = 0  # where the search for the next call goes on, in ``text``
        self._current: _Streamed | None = None  # the call whose arguments are streaming
        self._args_at = 0  # where the unread part of its arguments begins, in ``text``

    def push(self, delta: str) -> str:
        self.text += delta
        out = self._push_text()
        if self.holding:
            self._stream_calls()
        return out

    def _push_text(self) -> str:
        if self.holding:
            return ""
        if self.family == "llama" and not self.text[self.sent:].strip():
            return ""  # the reply may still turn out to be a JSON call
        if self.family == "llama" and self.sent == 0 and PYTHON_TAG.startswith(self.text.lstrip()):
            return ""  # the start of <|python_tag|>, which a call may begin with
        if self.family == "llama" and self.sent == 0 and self.text.lstrip().startswith(("{", PYTHON_TAG)):
            self.holding = True
            self._scan = 0
            return ""
        at = self.text.find(OPEN, self.sent)
        if at >= 0:
            self.holding = True
            self._scan = at
            # the line break the templates put between the text and a call is no part of the text (as whole)
            out, self.sent = self.text[self.sent:at].rstrip(), at
            return out
        # held back: a call's possible start, and the whitespace before it (which goes out if no call follows)
        end = len(self.text[: len(self.text) - _partial(self.text, OPEN)].rstrip())
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def take(self) -> list[dict]:
        """The stream deltas of the calls (``choices[].delta.tool_calls`` items) since the last take."""
        deltas, self._deltas = self._deltas, []
        return deltas

    # --- streaming the calls ------------------------------------------------------------------------------------

    def _stream_calls(self) -> None:
        while True:
            if self._current is not None:
                if not self._stream_arguments(self._current):
                    return
                self._current = None
            if not self._next_call():
                return

    def _next_call(self) -> bool:
        """Finds the next call's name from ``_scan`` on: its first delta goes out. False until one is known."""
        if self.family == "llama":
            rest = self.text[self._scan:]
            skipped = len(rest) - len(rest.lstrip(" \n\t;"))
            if rest[skipped:].startswith(PYTHON_TAG):
                skipped += len(PYTHON_TAG)
            start = self._scan + skipped
            if start >= len(self.text) or self.text[start] != "{":
                return False
        else:
            start = self.text.find(OPEN, self._scan)
            if start < 0:
                return False
            start += len(OPEN)
            close = self.text.find(CLOSE, start)
            head = _HEAD.match(self.text, start)
            if head is None:
                if close >= 0:  # a block that did not open as name-then-arguments: it comes whole at the end
                    self._scan = close + len(CLOSE)
                    return True
                return False
        head = _HEAD.match(self.text, start)
        if head is None:
            return False
        try:
            name = json.loads(f'"{head.group(1)}"')
        except ValueError:
            name = head.group(1)
        call = _Streamed(name)
        self._deltas.append({"index": len(self.streamed), "id": call.id, "type": "function",
                             "function": {"name": name, "arguments": ""}})
        self.streamed.append(call)
        self._current, self._args_at = call, head.end()
        return True

    def _stream_arguments(self, call: _Streamed) -> bool:
        """Streams what came of ``call``'s arguments; True once they are complete (the search moves past them)."""
        if call.rewriter is None:
            while self._args_at < len(self.text) and self.text[self._args_at] in " \t\r\n":
                self._args_at += 1
            if self._args_at >= len(self.text):
                return False
            if self.text[self._args_at] not in "{[":  # a string or a number: it comes whole at the end
                call.done = True
                self._scan = self._args_at
                return True
            call.rewriter = JsonRewriter()
        piece, used = call.rewriter.feed(self.text[self._args_at:])
        self._args_at += used
        if piece:
            call.arguments += piece
            self._deltas.append({"index": self.streamed.index(call), "function": {"arguments": piece}})
        if not call.rewriter.complete:
            return False
        call.done = True
        end = self.text.find("}", self._args_at)  # the call object's own end
        if end < 0:
            return False  # the call's closing brace is still to come
        self._scan = end + 1
        return True

    def finish(self) -> tuple[str, list[dict]]:
        """(content not sent yet, calls) at the end of the reply. The calls that streamed keep their ids; what of
        them did not stream yet, and every call that did not stream at all, is in :meth:`take` afterwards."""
        rest = self.text[self.sent:]
        if not self.holding and self.family != "llama":
            return rest, []
        content, calls = parse(rest, self.family, self.tools)
        if not calls:
            return rest, []
        streamed: list[_Streamed | None] = list(self.streamed)
        whole = len(streamed)
        for call in calls:
            function = call["function"]
            match = next((i for i, s in enumerate(streamed) if s is not None and s.name == function["name"]
                          and function["arguments"].startswith(s.arguments)), None)
            if match is None:  # it never streamed: it goes out whole
                self._deltas.append({"index": whole, **call})
                call["_index"] = whole
                whole += 1
                continue
            sent = streamed[match]
            assert sent is not None  # matched above
            streamed[: match + 1] = [None] * (match + 1)  # in order: later calls match later streams
            call["id"] = sent.id
            call["_index"] = self.streamed.index(sent)
            left = function["arguments"][len(sent.arguments):]
            if left:
                self._deltas.append({"index": call["_index"], "function": {"arguments": left}})
        for call in calls:
            call.pop("_index")
        return content, calls


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
