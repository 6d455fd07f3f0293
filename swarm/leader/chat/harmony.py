"""gpt-oss's replies in OpenAI's harmony format, split as they stream into thinking, answer and tool calls.

A harmony reply is a run of messages, each a header and a body: the generation prompt ends with ``<|start|>assistant``,
so the first header starts right away; later ones follow ``<|start|>assistant``. A header names the message's
channel (``<|channel|>analysis``) and, for a tool call, its recipient (`` to=functions.get_weather``, before or after
the channel) and content type (``<|constrain|>json`` or `` json``); ``<|message|>`` ends it. A body ends with
``<|end|>``, ``<|return|>`` (the reply is over) or ``<|call|>`` (a tool call: the reply stops for its result)::

    <|channel|>analysis<|message|>The user asks ...<|end|><|start|>assistant<|channel|>final<|message|>Paris.<|return|>
    <|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary
    json<|message|>{"city": "Paris"}<|call|>

The analysis channel is the model's thinking (``reasoning_content``, the page's Reasoning block); the final channel,
and commentary without a recipient (a preamble to the user), are the answer (``content``); a message to
``functions.NAME`` is a tool call, handed on as the answer text in the ``<tool_call>`` format every other family's
calls take (swarm.leader.chat.tool_calls), so the API returns it as ``tool_calls``. Parsed from the reply's text decoded
with its special tokens kept (the markers above are special tokens of gpt-oss's tokenizer): the text the family's
template renders. Text before any header (a model that does not write harmony) is the answer, as it is.
"""

from __future__ import annotations

import json
import re

from swarm.leader.chat.reasoning import Splitter

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>", "<|endoftext|>")
ANALYSIS = "analysis"
FUNCTIONS = "functions."
_HEADER_LIMIT = 512  # a header is a channel, a recipient and a content type: longer text is no header
_RECIPIENT = re.compile(r"to=(\S+?)(?=<\||\s|$)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


class HarmonySplitter(Splitter):
    """Feed text deltas (special tokens kept); get (reasoning, content) deltas, as swarm.leader.chat.reasoning's
    ReasoningSplitter gives them. Holds back only what is undecided: a header, the start of a marker, a tool call's
    arguments until its message ends."""

    def __init__(self) -> None:
        self._buf = ""
        self._in_header = True  # the generation prompt ended with <|start|>assistant: a header comes first
        self._plain = False  # the reply is not harmony: all of it is the answer
        self._channel = ""
        self._recipient = ""
        self._call = ""  # a tool call's arguments so far

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while self._buf:
            if self._plain:
                content.append(self._buf)
                self._buf = ""
                break
            if self._in_header:
                if not self._header(final):
                    break
                continue
            at, marker = _first_end(self._buf)
            if at < 0:  # the body goes on: all of it but a marker's possible start
                keep = 0 if final else _partial_marker(self._buf)
                body, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                self._body(body, reasoning, content)
                break
            self._body(self._buf[:at], reasoning, content)
            self._buf = self._buf[at + len(marker):]
            self._end_message(content)
        if final:
            if self._buf:  # a header never finished: it is text
                content.append(self._buf)
                self._buf = ""
            if self._recipient:  # a call cut short (max_tokens): its arguments as they came
                self._end_message(content)
        return "".join(reasoning), "".join(content)

    def _header(self, final: bool) -> bool:
        """Reads a header when it is whole; False while it is not (or the text turned out to be no header)."""
        buf = self._buf
        head = buf.removeprefix(START).removeprefix("assistant")
        at = head.find(MESSAGE)
        if at < 0:
            if not final and _could_be_header(buf) and len(buf) < _HEADER_LIMIT:
                return False
            self._plain = not self._channel  # never a header at all: plain text; else the rest is text
            self._in_header = False
            self._channel = self._channel or "final"
            return True
        header = head[:at]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        if channel is None and recipient is None and not self._channel:
            self._plain = True
            return True
        self._channel = channel.group(1) if channel else "commentary"
        self._recipient = recipient.group(1) if recipient else ""
        self._in_header = False
        self._buf = head[at + len(MESSAGE):]
        return True

    def _body(self, text: str, reasoning: list[str], content: list[str]) -> None:
        if self._recipient:
            self._call += text
        elif self._channel == ANALYSIS:
            reasoning.append(text)
        else:
            content.append(text)

    def _end_message(self, content: list[str]) -> None:
        if self._recipient:
            name = self._recipient.removeprefix(FUNCTIONS)
            arguments = self._call.strip() or "{}"
            try:
                json.loads(arguments)
            except ValueError:
                arguments = json.dumps(arguments)  # not JSON: the text as a string, nothing lost
            content.append(f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n</tool_call>')
        self._in_header = True
        self._channel = self._recipient = self._call = ""


def _could_be_header(text: str) -> bool:
    """Whether ``text`` is, or may grow into, a header's start: ``<|start|>assistant``, a channel or a recipient."""
    for opening in (START + "assistant", ""):
        if opening and not text.startswith(opening):
            if opening.startswith(text):
                return True
            continue
        rest = text[len(opening):]
        if not rest or rest.startswith(("<|", " to=", "to=")) or any(p.startswith(rest) for p in ("<|", " to=")):
            return True
    return False


def _first_end(text: str) -> tuple[int, str]:
    found = [(text.find(m), m) for m in ENDS if m in text]
    return min(found) if found else (-1, "")


def _partial_marker(text: str) -> int:
    """How many characters at the end of ``text`` could be the start of a marker (``<|...|>``)."""
    at = text.rfind("<|")
    if at >= 0 and "|>" not in text[at:]:
        return len(text) - at
    return 1 if text.endswith("<") else 0


def split(text: str) -> tuple[str, str]:
    """(reasoning, content) of a whole reply."""
    splitter = HarmonySplitter()
    r1, c1 = splitter.push(text)
    r2, c2 = splitter.flush()
    return r1 + r2, c1 + c2
