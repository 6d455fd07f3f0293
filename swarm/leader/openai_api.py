"""The OpenAI-compatible API: GET /v1/models and POST /v1/chat/completions (streaming and not)."""

from __future__ import annotations

import json
import logging
import time

import trio
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, StreamingResponse

from swarm.errors import BadRequest, ContextTooLong, ModelNotLoaded, SwarmError
from swarm.leader.auth import current_user
from swarm.leader.chat_format import (
    TextStream,
    encode_chat,
    eos_ids,
    generation_top_k,
    load_tokenizer,
    prompt_opens_thinking,
    sampling_defaults,
)
from swarm.leader.http_errors import classify, json_body, openai_error, openai_problem
from swarm.leader.openai_params import ChatParams, parse_chat_body, to_sampling
from swarm.leader.reasoning import ReasoningSplitter
from swarm.leader.requests import Reader, Request
from swarm.leader.stops import StopFinder

log = logging.getLogger(__name__)

class OpenAIRoutes:
    def __init__(self, leader):
        self.leader = leader

    async def models(self, request: HttpRequest):
        try:
            await current_user(request, self.leader.store)
            rows = await trio.to_thread.run_sync(self.leader.store.list_models)
        except Exception as exc:
            return openai_error(exc)
        data = [{"id": m.name, "object": "model", "created": int(m.created_at), "owned_by": "swarm",
                 "status": self.leader.serving.status(m.name)} for m in rows]
        return JSONResponse({"object": "list", "data": data})

    async def chat_completions(self, request: HttpRequest):
        stream = False
        try:
            user = await current_user(request, self.leader.store)
            body = await json_body(request)
            stream = body.get("stream") is True
            params = parse_chat_body(body, self.leader.settings.max_tokens_limit)
            ring_request, inside = await self._submit(params, user.id)
            await self.leader.serving.wait_started(ring_request, request.receive)  # 503 if it waits too long
        except Exception as exc:
            if stream and isinstance(exc, ContextTooLong):  # the seed: context_length_exceeded in a stream
                return StreamingResponse(_error_events(exc), media_type="text/event-stream")
            return openai_error(exc)
        text = ReplyText(load_tokenizer(str(self.leader.models_root / params.model)), inside, params.stop)
        created = int(time.time())
        if params.stream:
            return StreamingResponse(
                self._stream(ring_request, text, created), media_type="text/event-stream",
                headers={"x-swarm-request-id": ring_request.id, "cache-control": "no-cache"},
            )
        try:
            reasoning, content, finish = await self._collect(ring_request, text)
        except SwarmError as exc:
            return openai_problem(502, str(exc), "server_error", "ring_failed")
        finally:
            self.leader.serving.cancel(ring_request)
        message = {"role": "assistant", "content": content}
        if reasoning:
            message["reasoning_content"] = reasoning
        choice = {"index": 0, "message": message, "finish_reason": finish}
        if params.return_token_ids:  # vLLM's extension: the exact tokens, for tests and tools
            choice["token_ids"] = list(ring_request.tokens[: text.used])
            choice["prompt_token_ids"] = list(ring_request.prompt)
        return JSONResponse({
            "id": f"chatcmpl-{ring_request.id}", "object": "chat.completion", "created": created,
            "model": params.model, "choices": [choice], "usage": _usage(ring_request, text.used),
            "swarm": {"timing": _timing(ring_request)},
        }, headers={"x-swarm-request-id": ring_request.id})

    async def _submit(self, params: ChatParams, owner: int) -> tuple[Request, bool]:
        """The request on its way to the ring, and whether its prompt opened a thinking block."""
        leader = self.leader
        manifest = await leader.serving.manifest(params.model)
        if leader.serving.status(params.model) == "not_loaded" and params.model not in leader.serving.reload_on_request:
            raise ModelNotLoaded(
                f"model {params.model} is not loaded. Load it first (swarm model-load {params.model}, or Load on "
                "the chat page), then send the request again.")
        model_dir = leader.models_root / params.model
        architecture = manifest.get("architecture", "")
        try:
            prompt = await trio.to_thread.run_sync(encode_chat, model_dir, params.messages, params.thinking,
                                                   architecture)
        except Exception as exc:
            from jinja2 import TemplateError

            if isinstance(exc, TemplateError):  # the template refused these messages (roles out of order, say)
                raise BadRequest(f"the messages cannot be put through the model's chat template: {exc}",
                                 "invalid_messages") from None
            raise
        max_tokens = params.max_tokens
        if max_tokens is None:  # as long a reply as the pool leaves room for
            max_tokens = max(1, min(leader.settings.max_tokens_limit,
                                    leader.serving.pool_tokens(params.model) - len(prompt)))
        serving = leader.serving.models.get(params.model)
        own_top_k = generation_top_k(model_dir) if serving is not None and len(serving.stages) == 1 else None
        sampling = sampling_defaults(architecture, params.thinking is not False, params.model, own_top_k)
        sampling.update(params.sampling)
        eos = [] if params.ignore_eos else await trio.to_thread.run_sync(eos_ids, model_dir, manifest)
        inside = await trio.to_thread.run_sync(prompt_opens_thinking, model_dir, prompt)
        request = Request(model=params.model, prompt=prompt, max_tokens=max_tokens, sampling=to_sampling(sampling),
                          eos=eos, owner=owner)
        return await leader.serving.submit(request), inside

    def _reader(self, ring_request: Request) -> Reader:
        settings = self.leader.settings
        return Reader(ring_request, settings.request_stall_s, settings.serve_queue_timeout_s)

    async def _collect(self, ring_request: Request, text: ReplyText) -> tuple[str, str, str]:
        """(reasoning, content, finish reason) of the whole reply."""
        reasoning, content = [], []
        reader = self._reader(ring_request)
        while True:
            kind, value = await reader.next()
            if kind == "error":
                raise SwarmError(value)
            r, c = text.push(value) if kind == "tokens" else text.flush()
            reasoning.append(r)
            content.append(c)
            if text.stopped:
                self.leader.serving.cancel(ring_request)  # the ring stops now and frees the request's caches
                return "".join(reasoning), "".join(content), "stop"
            if kind != "tokens":
                return "".join(reasoning), "".join(content), "stop" if value == "cancelled" else value

    async def _stream(self, ring_request: Request, text: ReplyText, created: int):
        base = {"id": f"chatcmpl-{ring_request.id}", "object": "chat.completion.chunk", "created": created,
                "model": ring_request.model}

        def chunk(delta: dict, finish=None, extra=None) -> str:
            data = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **(extra or {})}
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        def deltas(reasoning: str, content: str):
            if reasoning:
                yield chunk({"reasoning_content": reasoning})
            if content:
                yield chunk({"content": content})

        reader = self._reader(ring_request)
        try:
            yield chunk({"role": "assistant", "content": ""})
            while True:
                kind, value = await reader.next()
                if kind == "tokens":
                    for token in value:  # one token per chunk, however the fellows batched them
                        for line in deltas(*text.push([token])):
                            yield line
                        if text.stopped:
                            break
                    if text.stopped:
                        self.leader.serving.cancel(ring_request)  # the ring stops now and frees the caches
                        yield chunk({}, finish="stop", extra={"usage": _usage(ring_request, text.used),
                                                              "swarm": {"timing": _timing(ring_request)}})
                        break
                elif kind == "error":
                    payload = {"error": {"message": value, "type": "server_error", "code": "ring_failed"}}
                    yield f"data: {json.dumps(payload)}\n\n"
                    break
                else:
                    for line in deltas(*text.flush()):
                        yield line
                    finish = "stop" if value == "cancelled" else value
                    yield chunk({}, finish=finish, extra={"usage": _usage(ring_request, text.used),
                                                          "swarm": {"timing": _timing(ring_request)}})
                    break
            yield "data: [DONE]\n\n"
        finally:
            # The client went away or the stream ended: make sure the fellows stop (hypercorn may never tell us of a
            # disconnect, so this also runs when a send fails).
            self.leader.serving.cancel(ring_request)


class ReplyText:
    """Token ids in, (reasoning, content) text deltas out: incremental detokenising, stop strings, then the thinking
    split. ``used`` counts the tokens whose text made the reply: all of them, unless a stop string cut it short."""

    def __init__(self, tokenizer, inside: bool, stops: list[str] | tuple = ()):
        self.text = TextStream(tokenizer)
        self.stop = StopFinder(list(stops))
        self.split = ReasoningSplitter(inside)
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


async def _error_events(exc: Exception):
    status, code, openai_type, message = classify(exc)
    yield f"data: {json.dumps({'error': {'message': message, 'type': openai_type, 'code': code}})}\n\n"
    yield "data: [DONE]\n\n"


def _timing(request: Request) -> dict:
    """What the leader measured of the reply (the fellows' split of each token's time comes with issue 12's work)."""
    first = request.first_token_at
    return {"queue_ms": round(request.queue_s * 1000, 1),
            "ttft_ms": round((first - request.created_at) * 1000, 1) if first is not None else None}


def _usage(request: Request, used: int | None = None) -> dict:
    """Token counts; ``used``: the reply's tokens up to the one that completed a stop string."""
    reply = len(request.tokens) if used is None else min(used, len(request.tokens))
    return {"prompt_tokens": len(request.prompt), "completion_tokens": reply,
            "total_tokens": len(request.prompt) + reply}
