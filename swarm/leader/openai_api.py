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
from swarm.leader.chat_format import TextStream, encode_chat, eos_ids, load_tokenizer, sampling_defaults
from swarm.leader.http_errors import json_body, openai_error, openai_problem
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
    if requested is not None:
        requested = min(requested, max_tokens_limit)
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
                      bool(body.get("return_token_ids")))


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
        try:
            user = await current_user(request, self.leader.store)
            params = parse_chat_body(await json_body(request), self.leader.settings.max_tokens_limit)
            ring_request = await self._submit(params, user.id)
        except Exception as exc:
            return openai_error(exc)
        model_dir = self.leader.models_root / params.model
        text = TextStream(load_tokenizer(str(model_dir)))  # loaded already: the prompt went through it
        created = int(time.time())
        if params.stream:
            return StreamingResponse(
                self._stream(ring_request, text, created), media_type="text/event-stream",
                headers={"x-swarm-request-id": ring_request.id, "cache-control": "no-cache"},
            )
        try:
            content = await self._collect(ring_request, text)
        except SwarmError as exc:
            return openai_problem(502, str(exc), "server_error", "ring_failed")
        finally:
            self.leader.serving.cancel(ring_request)
        choice = {"index": 0, "message": {"role": "assistant", "content": content},
                  "finish_reason": ring_request.finish_reason}
        if params.return_token_ids:  # vLLM's extension: the exact tokens, for tests and tools
            choice["token_ids"] = list(ring_request.tokens)
            choice["prompt_token_ids"] = list(ring_request.prompt)
        return JSONResponse({
            "id": f"chatcmpl-{ring_request.id}", "object": "chat.completion", "created": created,
            "model": params.model, "choices": [choice], "usage": _usage(ring_request),
        }, headers={"x-swarm-request-id": ring_request.id})

    async def _submit(self, params: ChatParams, owner: int) -> Request:
        leader = self.leader
        manifest = await leader.serving.manifest(params.model)
        if leader.serving.status(params.model) == "not_loaded" and params.model not in leader.serving.reload_on_request:
            raise ModelNotLoaded(
                f"model {params.model} is not loaded. Load it first (swarm model-load {params.model}, or Load on "
                "the chat page), then send the request again.")
        model_dir = leader.models_root / params.model
        try:
            prompt = await trio.to_thread.run_sync(encode_chat, model_dir, params.messages, params.thinking)
        except Exception as exc:
            from jinja2 import TemplateError

            if isinstance(exc, TemplateError):  # the template refused these messages (roles out of order, say)
                raise BadRequest(f"the messages cannot be put through the model's chat template: {exc}",
                                 "invalid_messages") from None
            raise
        context = leader.settings.serve_context_tokens
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = max(1, min(leader.settings.max_tokens_limit, context - len(prompt)))
        if len(prompt) + max_tokens > context:
            raise ContextTooLong(
                f"This model's maximum context length is {context} tokens. This conversation needs "
                f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt and up to {max_tokens} in the "
                f"reply). Start a new conversation, lower max_tokens, or raise SWARM_SERVE_CONTEXT_TOKENS.")
        sampling = sampling_defaults(manifest.get("architecture", ""), params.thinking is not False)
        sampling.update(params.sampling)
        eos = await trio.to_thread.run_sync(eos_ids, model_dir, manifest)
        request = Request(model=params.model, prompt=prompt, max_tokens=max_tokens, sampling=to_sampling(sampling),
                          eos=eos, owner=owner)
        return await leader.serving.submit(request)

    def _reader(self, ring_request: Request) -> Reader:
        settings = self.leader.settings
        return Reader(ring_request, settings.request_stall_s, settings.serve_queue_timeout_s)

    async def _collect(self, ring_request: Request, text: TextStream) -> str:
        parts = []
        reader = self._reader(ring_request)
        while True:
            kind, value = await reader.next()
            if kind == "tokens":
                parts.append(text.push(value))
            elif kind == "error":
                raise SwarmError(value)
            else:
                break
        parts.append(text.flush())
        return "".join(parts)

    async def _stream(self, ring_request: Request, text: TextStream, created: int):
        base = {"id": f"chatcmpl-{ring_request.id}", "object": "chat.completion.chunk", "created": created,
                "model": ring_request.model}

        def chunk(delta: dict, finish=None, usage=None) -> str:
            data = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            if usage is not None:
                data["usage"] = usage
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        reader = self._reader(ring_request)
        try:
            yield chunk({"role": "assistant", "content": ""})
            while True:
                kind, value = await reader.next()
                if kind == "tokens":
                    delta = text.push(value)
                    if delta:
                        yield chunk({"content": delta})
                elif kind == "error":
                    payload = {"error": {"message": value, "type": "server_error", "code": "ring_failed"}}
                    yield f"data: {json.dumps(payload)}\n\n"
                    break
                else:
                    rest = text.flush()
                    if rest:
                        yield chunk({"content": rest})
                    finish = "stop" if value == "cancelled" else value
                    yield chunk({}, finish=finish, usage=_usage(ring_request))
                    break
            yield "data: [DONE]\n\n"
        finally:
            # The client went away or the stream ended: make sure the fellows stop (hypercorn may never tell us of a
            # disconnect, so this also runs when a send fails).
            self.leader.serving.cancel(ring_request)


def _usage(request: Request) -> dict:
    return {"prompt_tokens": len(request.prompt), "completion_tokens": len(request.tokens),
            "total_tokens": len(request.prompt) + len(request.tokens)}
