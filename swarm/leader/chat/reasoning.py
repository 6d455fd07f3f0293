"""Splitting a reasoning model's reply into its thinking and its answer, as the text streams.

Qwen3 and the DeepSeek-R1 distills write their thinking between ``<think>`` and ``</think>`` before the answer;
some chat templates open the block in the prompt already, so the reply starts inside it and only closes it. The API
returns the thinking as ``reasoning_content`` (llama.cpp's and DeepSeek's name) and the rest as ``content``; an empty
block -- what a model writes when asked not to think -- is not returned at all. Only a block at the very start of
the reply is thinking; a tag later in the answer is just text.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
BEFORE, THINKING, AFTER, ANSWER = "before", "thinking", "after", "answer"
OPENED, CLOSED = "opened", "closed"  # where the prompt left the block (swarm.leader.chat.chat_format.prompt_thinking)


class Splitter:
    """Text deltas in, (reasoning, content) deltas out: ``_advance`` takes what ``_buf`` holds that is decided."""

    _buf: str

    def push(self, text: str) -> tuple[str, str]:
        self._buf += text
        return self._advance(final=False)

    def flush(self) -> tuple[str, str]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        raise NotImplementedError


class ReasoningSplitter(Splitter):
    """Feed text deltas; get (reasoning, content) deltas. Holds back only what is still undecided: the start of a
    tag, or whitespace that may turn out to be the edge of the thinking."""

    def __init__(self, inside: bool | str = False):
        # inside: the prompt opened the block (True or OPENED), or closed it (CLOSED: the reply is the answer, after
        # the line breaks that follow a block)
        self.state = THINKING if inside in (True, OPENED) else AFTER if inside == CLOSED else BEFORE
        self._buf = ""

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning, content = "", ""
        while True:
            buf = self._buf
            if self.state == BEFORE:
                head = buf.lstrip()
                if head.startswith(OPEN):
                    self.state, self._buf = THINKING, head[len(OPEN):]
                    continue
                if (OPEN.startswith(head) and not final) or (not head and not final):
                    return reasoning, content  # still could be "<think>"
                self.state = ANSWER
                continue
            if self.state == THINKING:
                at = buf.find(CLOSE)
                if at >= 0:
                    reasoning += _keep_edges(buf[:at], started=bool(reasoning) or self._out).rstrip()
                    self.state, self._buf = AFTER, buf[at + len(CLOSE):]
                    continue
                partial = _partial(buf, CLOSE)
                before = buf[: len(buf) - partial]
                hold = partial + len(before) - len(before.rstrip())  # a tag's start, and the whitespace before it
                out = buf[: len(buf) - hold] if not final else buf.rstrip()
                text = _keep_edges(out, started=bool(reasoning) or self._out)
                reasoning += text
                self._out = self._out or bool(text)
                self._buf = buf[len(out):] if not final else ""
                return reasoning, content
            if self.state == AFTER:
                head = buf.lstrip()
                if not head and not final:
                    return reasoning, content  # the blank lines after the block are not the answer's
                self.state, self._buf = ANSWER, head
                continue
            content += buf
            self._buf = ""
            return reasoning, content

    _out = False  # some reasoning went out already


def _keep_edges(text: str, started: bool) -> str:
    """Thinking without the blank lines that open it."""
    return text if started else text.lstrip()


def _partial(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split(text: str, inside: bool | str = False) -> tuple[str, str]:
    """(reasoning, content) of a whole reply."""
    splitter = ReasoningSplitter(inside)
    r1, c1 = splitter.push(text)
    r2, c2 = splitter.flush()
    return r1 + r2, c1 + c2
