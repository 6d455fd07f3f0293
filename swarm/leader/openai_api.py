"""The OpenAI-compatible API: GET /v1/models and POST /v1/chat/completions (streaming and not)."""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
import time

import trio
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, StreamingResponse

from swarm import messages
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
from swarm.leader.reasoning import ReasoningSplitter
from swarm.leader.requests import Reader, Request

log = logging.getLogger(__name__)

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed")


@dataclasses.dataclass
class ChatParams:
    """A validated chat completion request."""

    model: str
    messages: list[dict]
    stream: bool
    max_tokens: int | None  # None: as much as the context leaves
    thinking: bool | None
    sampling: dict
    return_token_ids: bool
    ignore_eos: bool = False  # vLLM's extension: run to max_tokens (benchmarks)


def parse_chat_body(body: dict, max_tokens_limit: int) -> ChatParams:
    model = body.get("model")
    messages = body.get("messages")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required: one of the ids from GET /v1/models.", "missing_model")
    if not isinstance(messages, list) or not messages or not all(
        isinstance(m, dict) and m.get("role") in ("system", "user", "assistant", "tool") for m in messages
    ):
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects.", "invalid_messages")
    requested = body.get("max_completion_tokens", body.get("max_tokens"))
    if requested is not None and (not isinstance(requested, int) or isinstance(requested, bool) or requested < 1):
        raise BadRequest("'max_tokens' must be a positive integer.", "invalid_max_tokens")
    if requested is not None and requested > max_tokens_limit:
        raise BadRequest(f"'max_tokens' is {requested}; a reply may have at most {max_tokens_limit} tokens. "
                         f"Ask for {max_tokens_limit} or fewer.", "invalid_max_tokens")
    kwargs = body.get("chat_template_kwargs") or {}
    thinking = kwargs.get("enable_thinking") if isinstance(kwargs, dict) else None
    sampling = {}
    for key in SAMPLING_KEYS:
        value = body.get(key)
        if value is not None:
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise BadRequest(f"'{key}' must be a number.", f"invalid_{key}")
            sampling[key] = value
    if not 0 <= sampling.get("temperature", 0) <= 2:
        raise BadRequest("'temperature' must be between 0 and 2.", "invalid_temperature")
    return ChatParams(model, messages, bool(body.get("stream")), requested, thinking, sampling,
                      bool(body.get("return_token_ids")), body.get("ignore_eos") is True)


def to_sampling(values: dict) -> messages.Sampling:
    temperature = float(values.get("temperature", 0.0))
    seed = int(values["seed"]) if values.get("seed") is not None else None
    if seed is None and temperature > 0:
        # Every sampled request gets a seed: a reply sent again after a failover goes on with the same draws.
        seed = secrets.randbits(63)
    return messages.Sampling(
        temperature=temperature,
        top_k=int(values.get("top_k") or 0),
        top_p=float(values["top_p"]) if values.get("top_p") is not None else 1.0,
        min_p=float(values.get("min_p") or 0.0),
        seed=seed,
    )


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
        except Exception as exc:
            if stream and isinstance(exc, ContextTooLong):  # the seed: context_length_exceeded in a stream
                return StreamingResponse(_error_events(exc), media_type="text/event-stream")
            return openai_error(exc)
        text = ReplyText(load_tokenizer(str(self.leader.models_root / params.model)), inside)
        created = int(time.time())
        if params.stream:
            return StreamingResponse(
                self._stream(ring_request, text, created), media_type="text/event-stream",
                headers={"x-swarm-request-id": ring_request.id, "cache-control": "no-cache"},
            )
        try:
            reasoning, content = await self._collect(ring_request, text)
        except SwarmError as exc:
            return openai_problem(502, str(exc), "server_error", "ring_failed")
        finally:
            self.leader.serving.cancel(ring_request)
        message = {"role": "assistant", "content": content}
        if reasoning:
            message["reasoning_content"] = reasoning
        choice = {"index": 0, "message": message, "finish_reason": ring_request.finish_reason}
        if params.return_token_ids:  # vLLM's extension: the exact tokens, for tests and tools
            choice["token_ids"] = list(ring_request.tokens)
            choice["prompt_token_ids"] = list(ring_request.prompt)
        return JSONResponse({
            "id": f"chatcmpl-{ring_request.id}", "object": "chat.completion", "created": created,
            "model": params.model, "choices": [choice], "usage": _usage(ring_request),
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

    async def _collect(self, ring_request: Request, text: ReplyText) -> tuple[str, str]:
        reasoning, content = [], []
        reader = self._reader(ring_request)
        while True:
            kind, value = await reader.next()
            if kind == "error":
                raise SwarmError(value)
            r, c = text.push(value) if kind == "tokens" else text.flush()
            reasoning.append(r)
            content.append(c)
            if kind != "tokens":
                return "".join(reasoning), "".join(content)

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
                elif kind == "error":
                    payload = {"error": {"message": value, "type": "server_error", "code": "ring_failed"}}
                    yield f"data: {json.dumps(payload)}\n\n"
                    break
                else:
                    for line in deltas(*text.flush()):
                        yield line
                    finish = "stop" if value == "cancelled" else value
                    yield chunk({}, finish=finish, extra={"usage": _usage(ring_request),
                                                          "swarm": {"timing": _timing(ring_request)}})
                    break
            yield "data: [DONE]\n\n"
        finally:
            # The client went away or the stream ended: make sure the fellows stop (hypercorn may never tell us of a
            # disconnect, so this also runs when a send fails).
            self.leader.serving.cancel(ring_request)


class ReplyText:
    """Token ids in, (reasoning, content) text deltas out: incremental detokenising, then the thinking split."""

    def __init__(self, tokenizer, inside: bool):
        self.text = TextStream(tokenizer)
        self.split = ReasoningSplitter(inside)

    def push(self, tokens: list[int]) -> tuple[str, str]:
        return self.split.push(self.text.push(tokens))

    def flush(self) -> tuple[str, str]:
        r1, c1 = self.split.push(self.text.flush())
        r2, c2 = self.split.flush()
        return r1 + r2, c1 + c2


async def _error_events(exc: Exception):
    status, code, openai_type, message = classify(exc)
    yield f"data: {json.dumps({'error': {'message': message, 'type': openai_type, 'code': code}})}\n\n"
    yield "data: [DONE]\n\n"


def _timing(request: Request) -> dict:
    """What the leader measured of the reply (the fellows' split of each token's time comes with issue 12's work)."""
    first = request.first_token_at
    return {"queue_ms": round(request.queue_s * 1000, 1),
            "ttft_ms": round((first - request.created_at) * 1000, 1) if first is not None else None}


def _usage(request: Request) -> dict:
    return {"prompt_tokens": len(request.prompt), "completion_tokens": len(request.tokens),
            "total_tokens": len(request.prompt) + len(request.tokens)}
