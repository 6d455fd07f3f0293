"""Anthropic's Messages API on the leader, for Claude Code and the ``anthropic`` SDK: POST /v1/messages (one JSON
message, or Anthropic's server-sent events with ``"stream": true``) and POST /v1/messages/count_tokens, with the same
API tokens as the rest of /v1 (``x-api-key`` or ``Authorization: Bearer``; ``anthropic-version`` is accepted).

A request is translated into a Chat Completions body (swarm.leader.api.anthropic_params) and goes the same way as one
(swarm.leader.api.openai_api.OpenAIRoutes.open_chat: the parameter checks, admission, the queue, quotas, the context
check, failover, history, stop strings, tools, the reasoning switch, cancel on disconnect), so a greedy reply is the
one /v1/chat/completions gives; only the answer's shape is Anthropic's. count_tokens puts the conversation through
the same chat template and tokenizer: its count is the reply's ``usage.input_tokens``.
"""

from __future__ import annotations

import json
from typing import Any

import trio
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from swarm.errors import AuthError
from swarm.leader.api.anthropic_params import anthropic_error, anthropic_problem, chat_body
from swarm.leader.api.auth import SESSION_COOKIE, api_key, current_user
from swarm.leader.api.http_errors import json_body
from swarm.leader.api.openai_api import OpenAIRoutes
from swarm.leader.api.openai_params import parse_chat_body
from swarm.leader.api.replies import Choice, ReplyStream, next_event, read_choices
from swarm.leader.serving import timing

# The routes, for the leader's middleware: their errors' shape and their body limit (a conversation's, as /v1's).
ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})


async def caller(request: HttpRequest, store):
    """The user behind an ``x-api-key`` (Anthropic's clients), a Bearer token or a browser session."""
    if api_key(request) is None and SESSION_COOKIE not in request.cookies:
        raise AuthError("sign in, or send an API token as 'x-api-key: <token>' (ANTHROPIC_API_KEY) or "
                        "'Authorization: Bearer <token>'.")
    return await current_user(request, store)


def tool_id(call_id: str) -> str:
    """A tool call's id in Anthropic's form (toolu_...)."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict:
    """A call's arguments (JSON text) as the tool_use block's input object."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {"arguments": value}


def stop_reason(choice: Choice) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished choice."""
    if choice.finish == "tool_calls":
        return "tool_use", None
    if choice.finish == "length":
        return "max_tokens", None
    if choice.text.stopped:
        return "stop_sequence", choice.text.stop.found
    return "end_turn", None


def usage(choice: Choice) -> dict:
    return {**input_usage(choice.request), "output_tokens": min(choice.text.used, len(choice.request.tokens))}


def input_usage(request) -> dict:
    """The prompt's tokens as Anthropic counts them: ``input_tokens`` those computed, ``cache_read_input_tokens`` those
    the prefix cache held (swarm.leader.serving.prefix_index); their sum is the prompt. The cache is written without
    asking (no cache_control breakpoints), so nothing counts as a cache write."""
    cached = min(request.cached_tokens, len(request.prompt))
    return {"input_tokens": len(request.prompt) - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached}


def sse(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"


class AnthropicRoutes:
    def __init__(self, routes: OpenAIRoutes):
        self.routes = routes
        self.leader = routes.leader

    async def messages(self, request: HttpRequest):
        try:
            user = await caller(request, self.leader.store)
            body = await json_body(request)
            opened = await self.routes.open_chat(request, chat_body(body), user)
            if opened is None:
                return Response(status_code=499)  # the client left; nobody reads it
        except Exception as exc:  # noqa: BLE001 - the API boundary: any failure is an error in Anthropic's shape
            return anthropic_error(exc)
        params, choices = opened
        choice = choices[0]
        first = choice.request
        headers = {"x-swarm-request-id": first.id, "request-id": first.id}
        if params.stream:
            return ReplyStream(self.leader.serving, [first], self._stream(choice, params.model),
                               headers={**headers, "cache-control": "no-cache"})
        failed = await read_choices(self.leader.serving, choices, self.routes.collect, request.receive,
                                    fail=anthropic_problem)
        if failed is not None:
            return failed
        await timing.settle(self.leader.serving, first)
        content: list[dict[str, Any]] = []
        if choice.reasoning:
            content.append({"type": "thinking", "thinking": choice.reasoning, "signature": ""})
        if choice.content:
            content.append({"type": "text", "text": choice.content})
        for call in choice.calls:
            function = call["function"]
            content.append({"type": "tool_use", "id": tool_id(call["id"]), "name": function["name"],
                            "input": tool_input(function["arguments"])})
        reason, sequence = stop_reason(choice)
        return JSONResponse({
            "id": f"msg_{first.id}", "type": "message", "role": "assistant", "model": params.model,
            "content": content, "stop_reason": reason, "stop_sequence": sequence, "usage": usage(choice),
            "swarm": {"timing": timing.of_request(self.leader.serving, first)},
        }, headers=headers)

    async def count_tokens(self, request: HttpRequest):
        """The conversation's prompt tokens: its messages, system prompt and tools through the model's chat
        template and tokenizer, as a reply to it would count them in ``usage.input_tokens``."""
        try:
            user = await caller(request, self.leader.store)
            body = await json_body(request)
            translated = chat_body(body, counting=True)
            params = await trio.to_thread.run_sync(parse_chat_body, translated, self.leader.settings.max_tokens_limit)
            params.model = await self.routes.resolve(params.model, user)
            manifest = await self.leader.serving.manifest(params.model)
            prompt = await self.routes.encode(params, manifest.get("architecture", ""))
        except Exception as exc:  # noqa: BLE001 - the API boundary: any failure is an error in Anthropic's shape
            return anthropic_error(exc)
        return JSONResponse({"input_tokens": len(prompt)})

    async def _stream(self, choice: Choice, model: str):
        """Anthropic's event sequence: message_start, ping, then each content block (thinking, text, tool_use) as
        content_block_start, its deltas and content_block_stop, then message_delta (stop_reason, usage) and
        message_stop. A failure of the ring on the way is an ``error`` event."""
        request = choice.request
        blocks = _Blocks()

        def pieces(reasoning: str, content: str):
            if reasoning:
                yield from blocks.enter("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                yield blocks.delta({"type": "thinking_delta", "thinking": reasoning})
            content = choice.content_delta(content)
            if content:
                yield from blocks.enter("text", {"type": "text", "text": ""})
                yield blocks.delta({"type": "text_delta", "text": content})
            yield from calls()

        def calls():
            for delta in choice.call_deltas():  # a call's id and name first, then its arguments piece by piece
                function = delta.get("function") or {}
                if "id" in delta:
                    yield from blocks.enter(f"tool {delta['index']}", {
                        "type": "tool_use", "id": tool_id(delta["id"]), "name": function.get("name"), "input": {}})
                if function.get("arguments"):
                    yield blocks.delta({"type": "input_json_delta", "partial_json": function["arguments"]})

        async def finished(finish: str):
            for line in pieces("", choice.end_content()):
                yield line
            choice.finish = choice.finish_reason(finish)
            for line in blocks.close():
                yield line
            await timing.settle(self.leader.serving, request)
            reason, sequence = stop_reason(choice)
            yield sse("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                        "usage": usage(choice),
                                        "swarm": {"timing": timing.of_request(self.leader.serving, request)}})
            yield sse("message_stop", {})

        try:
            yield sse("message_start", {"message": {
                "id": f"msg_{request.id}", "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {**input_usage(request), "output_tokens": 0}}})
            yield sse("ping", {})
            while choice.finish is None:
                _, kind, value = await next_event([choice])
                text = choice.text
                if kind == "tokens":
                    for token in value:  # one token per delta, however the fellows batched them
                        for line in pieces(*text.push([token])):
                            yield line
                        if text.stopped:
                            break
                    if text.stopped:
                        self.leader.serving.cancel(request)  # the ring stops now and frees the caches
                        async for line in finished("stop"):
                            yield line
                elif kind == "error":
                    yield sse("error", {"error": {"type": "api_error", "message": value}})  # the ring failed it
                    return
                else:
                    for line in pieces(*text.flush()):
                        yield line
                    async for line in finished("stop" if value == "cancelled" else value):
                        yield line
        finally:
            self.leader.serving.cancel(request)


class _Blocks:
    """The reply's content blocks as they stream: one is open at a time, and a new kind closes it."""

    def __init__(self):
        self.index = -1
        self.open: str | None = None

    def enter(self, kind: str, block: dict) -> list[str]:
        if self.open == kind:
            return []
        out = self.close()
        self.index += 1
        self.open = kind
        out.append(sse("content_block_start", {"index": self.index, "content_block": block}))
        return out

    def delta(self, delta: dict) -> str:
        return sse("content_block_delta", {"index": self.index, "delta": delta})

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [sse("content_block_stop", {"index": self.index})]
