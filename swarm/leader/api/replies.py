"""A reply's choices as they stream, shared by every chat API (OpenAI's, Anthropic's, Ollama's, Responses,
/v1/completions): each choice's ring request, its text (incremental detokenising, stop strings, the thinking split),
reading the choices together, and the streamed response that cancels them however it ends."""

from __future__ import annotations

import json
import logging
from typing import Any, TypeVar

import trio
from starlette.responses import JSONResponse, StreamingResponse

from swarm.errors import SwarmError, first_leaf
from swarm.leader.api.http_errors import classify, openai_problem
from swarm.leader.chat.chat_format import TextStream
from swarm.leader.chat.harmony import HarmonySplitter
from swarm.leader.chat.logprobs import logprob_entries
from swarm.leader.chat.reasoning import ReasoningSplitter
from swarm.leader.chat.stops import StopFinder
from swarm.leader.chat.tool_calls import ToolCallSplitter
from swarm.leader.serving.intake import client_gone
from swarm.leader.serving.request import Reader, Request

log = logging.getLogger(__name__)


class ReplyStream(StreamingResponse):
    """A streamed reply (server-sent events) whose ring requests are cancelled however the response ends: finished,
    failed, or its client gone (Starlette cancels the stream when it hears the disconnect, and the generator may be
    suspended at a send rather than inside its own try block then)."""

    def __init__(self, serving, requests: list[Request], content, headers: dict,
                 media_type: str = "text/event-stream"):
        super().__init__(content, media_type=media_type, headers=headers)
        self.serving = serving
        self.requests = requests

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for request in self.requests:
                self.serving.cancel(request)


class Choice:
    """One of a reply's n choices: its request on the ring, its text so far and how it ended."""

    def __init__(self, index: int, request: Request, text: ReplyText, reader: Reader, top: int | None):
        self.index = index
        self.request = request
        self.text = text
        self.reader = reader
        self.top = top  # None: no logprobs; else how many alternatives per token
        self.reasoning = ""
        self.content = ""
        self.finish: str | None = None
        self.sent = 0  # tokens whose logprobs went out in a stream
        self.pending: list[tuple] = []  # what its reader gave while another choice's event was being taken
        self.tools: ToolCallSplitter | None = None  # the request gave tools: the reply's calls are parsed
        self.calls: list[dict] = []

    def content_delta(self, content: str) -> str:
        """What of a content delta goes out now (a tool call is held until the reply ends)."""
        return self.tools.push(content) if self.tools is not None and content else content

    def call_deltas(self) -> list[dict]:
        """The tool calls' stream deltas since the last time (swarm.leader.chat.tool_calls)."""
        return self.tools.take() if self.tools is not None else []

    def end_content(self) -> str:
        """The end of the reply: the content held back, with the tool calls parsed out of it."""
        if self.tools is None:
            return ""
        content, self.calls = self.tools.finish()
        return content

    def finish_reason(self, finish: str) -> str:
        return "tool_calls" if self.calls and finish == "stop" else finish

    def logprobs(self, tokenizer, end: int, start: int = 0) -> list[dict]:
        """OpenAI's logprobs content for tokens [start, end) of the reply."""
        return logprob_entries(tokenizer, self.request.tokens[start:end], self.request.logprobs[start:end])


class _AllContent:
    """No thinking split (the legacy completions route): all text is content."""

    def push(self, text: str) -> tuple[str, str]:
        return "", text

    def flush(self) -> tuple[str, str]:
        return "", ""


_C = TypeVar("_C", bound="Choice")


async def next_event(choices: list[_C]) -> tuple[_C, str, Any]:
    """The next thing that happens to any of ``choices``: (choice, kind, value) as Reader.next gives it."""
    for choice in choices:
        if choice.pending:
            return (choice, *choice.pending.pop(0))
    if len(choices) == 1:
        return (choices[0], *await choices[0].reader.next())
    done: list = []
    async with trio.open_nursery() as nursery:
        async def read(choice: _C) -> None:
            result = await choice.reader.next()
            done.append((choice, *result))  # kept even if another read won the race: nothing is lost
            nursery.cancel_scope.cancel()

        for choice in choices:
            nursery.start_soon(read, choice)
    for extra in done[1:]:
        extra[0].pending.append(extra[1:])
    return done[0]


async def read_choices(serving, choices: list, collect, receive=None, fail=None) -> JSONResponse | None:
    """``collect`` every choice at once (a stop string cancels its request at once); a 502 if the ring failed one.
    With ``receive`` (the ASGI receive of the client's connection), a client that goes away cancels every choice at
    once (issue 32: they ran on for nobody). ``fail(status, message)`` answers a failed ring in another API's shape
    than OpenAI's. Afterwards the choices' ring requests are cancelled, whatever happened, so no stage keeps working
    on them."""

    async def watch() -> None:
        await client_gone(receive)
        log.info("request %s: its client went away; cancelling its replies", choices[0].request.id)
        for choice in choices:
            serving.cancel(choice.request)

    try:
        async with trio.open_nursery() as outer:
            if receive is not None:
                outer.start_soon(watch)
            async with trio.open_nursery() as nursery:
                for choice in choices:
                    nursery.start_soon(collect, choice)
            outer.cancel_scope.cancel()
    except BaseException as exc:
        failure = first_leaf(exc)
        if isinstance(failure, SwarmError):
            if fail is not None:  # another API's error shape
                return fail(502, str(failure))
            return openai_problem(502, str(failure), "server_error", "ring_failed")
        raise
    finally:
        for choice in choices:
            serving.cancel(choice.request)
    return None


class ReplyText:
    """Token ids in, (reasoning, content) text deltas out: incremental detokenising, stop strings, then the thinking
    split. ``used`` counts the tokens whose text made the reply: all of them, unless a stop string cut it short."""

    def __init__(self, tokenizer, inside: bool | str, stops: list[str] | tuple = (), reasoning: bool = True,
                 harmony: bool = False):
        self.text = TextStream(tokenizer, keep_special=harmony)  # harmony: its parser reads the channel markers
        self.stop = StopFinder(list(stops))
        self.split: ReasoningSplitter | HarmonySplitter | _AllContent = (
            HarmonySplitter() if harmony else ReasoningSplitter(inside) if reasoning else _AllContent())
        self.used = 0

    @property
    def stopped(self) -> bool:
        """A stop string was met: the reply is over."""
        return self.stop.stopped

    def push(self, tokens: list[int]) -> tuple[str, str]:
        reasoning, content = "", ""
        for token in tokens:  # one at a time: a stop string ends the reply at the token that completed it
            if self.stopped:
                break
            self.used += 1
            r, c = self.split.push(self.stop.push(self.text.push([token])))
            reasoning, content = reasoning + r, content + c
        if self.stopped:
            r, c = self.split.flush()
            reasoning, content = reasoning + r, content + c
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        if self.stopped:
            return "", ""
        r1, c1 = self.split.push(self.stop.push(self.text.flush()))
        r2, c2 = self.split.push(self.stop.flush())
        r3, c3 = self.split.flush()
        return r1 + r2 + r3, c1 + c2 + c3


async def error_events(exc: Exception):
    """The server-sent events of a stream that failed: the error as OpenAI's stream shape has it, then [DONE]."""
    status, code, openai_type, message = classify(exc)
    yield f"data: {json.dumps({'error': {'message': message, 'type': openai_type, 'code': code}})}\n\n"
    yield "data: [DONE]\n\n"
