"""The OpenAI-compatible API: GET /v1/models and POST /v1/chat/completions (streaming and not)."""

from __future__ import annotations

import json
import logging
import time

import trio
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, StreamingResponse

from swarm.errors import AuthError, ModelNotFound, ModelNotLoaded, SwarmError
from swarm.leader.auth import current_user
from swarm.leader.chat_format import TextStream, encode_chat, eos_ids, sampling_defaults
from swarm.leader.serving import Request
from swarm.tunnel.channel import CLEANUP_S

log = logging.getLogger(__name__)


def error(status: int, message: str, type_: str, code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "code": code}}, status_code=status)


def map_error(exc: Exception) -> JSONResponse:
    if isinstance(exc, AuthError):
        return error(401, str(exc), "authentication_error", "invalid_api_key")
    if isinstance(exc, ModelNotFound):
        return error(404, str(exc), "invalid_request_error", "model_not_found")
    if isinstance(exc, ModelNotLoaded):
        return error(503, str(exc), "server_error", "model_not_loaded")
    if isinstance(exc, SwarmError):
        return error(500, str(exc), "server_error", "swarm_error")
    log.exception("unexpected error in the API")
    return error(500, f"internal error ({type(exc).__name__}); the leader's log has the details.", "server_error")


class OpenAIRoutes:
    def __init__(self, leader):
        self.leader = leader

    async def models(self, request: HttpRequest):
        try:
            await current_user(request, self.leader.store)
        except AuthError as exc:
            return map_error(exc)
        rows = await trio.to_thread.run_sync(self.leader.store.list_models)
        data = [{"id": m.name, "object": "model", "created": int(m.created_at), "owned_by": "swarm",
                 "status": self.leader.serving.status(m.name)} for m in rows]
        return JSONResponse({"object": "list", "data": data})

    async def chat_completions(self, request: HttpRequest):
        leader = self.leader
        try:
            await current_user(request, leader.store)
        except AuthError as exc:
            return map_error(exc)
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except (ValueError, UnicodeDecodeError) as exc:
            return error(400, f"the request body is not valid JSON: {exc}", "invalid_request_error", "invalid_json")
        model = body.get("model")
        messages = body.get("messages")
        if not isinstance(model, str) or not model:
            return error(400, "'model' is required: one of the ids from GET /v1/models.", "invalid_request_error",
                         "missing_model")
        if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and m.get("role") in ("system", "user", "assistant", "tool") for m in messages
        ):
            return error(400, "'messages' must be a non-empty list of {role, content} objects.",
                         "invalid_request_error", "invalid_messages")
        try:
            manifest = await leader.serving.manifest(model)
        except ModelNotFound as exc:
            return map_error(exc)
        if leader.serving.status(model) != "ready":
            return map_error(ModelNotLoaded(
                f"model {model} is {leader.serving.status(model).replace('_', ' ')}. Load it first "
                f"(swarm model-load {model}, or Load on the chat page), then send the request again."))
        model_dir = leader.models_root / model
        kwargs = body.get("chat_template_kwargs") or {}
        thinking = kwargs.get("enable_thinking") if isinstance(kwargs, dict) else None
        try:
            prompt = await trio.to_thread.run_sync(encode_chat, model_dir, messages, thinking)
        except Exception as exc:
            return error(400, f"the messages cannot be put through the model's chat template: {exc}",
                         "invalid_request_error", "invalid_messages")
        context = leader.settings.serve_context_tokens
        requested = body.get("max_completion_tokens", body.get("max_tokens"))
        if requested is not None and (not isinstance(requested, int) or requested < 1):
            return error(400, "'max_tokens' must be a positive integer.", "invalid_request_error", "invalid_max_tokens")
        max_tokens = min(requested or leader.settings.max_tokens_limit, leader.settings.max_tokens_limit)
        if requested is None:
            max_tokens = max(1, min(max_tokens, context - len(prompt)))
        if len(prompt) + max_tokens > context:
            return error(
                413,
                f"This model's maximum context length is {context} tokens. This conversation needs "
                f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt and up to {max_tokens} in the "
                f"reply). Start a new conversation, lower max_tokens, or raise SWARM_SERVE_CONTEXT_TOKENS.",
                "invalid_request_error", "context_length_exceeded",
            )
        sampling = sampling_defaults(manifest.get("architecture", ""), thinking is not False)
        for key in ("temperature", "top_p", "top_k", "min_p", "seed"):
            value = body.get(key)
            if value is not None:
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    return error(400, f"'{key}' must be a number.", "invalid_request_error", f"invalid_{key}")
                sampling[key] = value
        if not 0 <= sampling["temperature"] <= 2:
            return error(400, "'temperature' must be between 0 and 2.", "invalid_request_error", "invalid_temperature")
        eos = await trio.to_thread.run_sync(eos_ids, model_dir, manifest)
        ring_request = Request(model=model, prompt=prompt, max_tokens=max_tokens, sampling=sampling, eos=eos)
        try:
            await leader.serving.submit(ring_request)
        except SwarmError as exc:
            return map_error(exc)
        created = int(time.time())
        text = TextStream(model_dir)
        if body.get("stream"):
            return StreamingResponse(
                self._stream(ring_request, text, created), media_type="text/event-stream",
                headers={"x-swarm-request-id": ring_request.id, "cache-control": "no-cache"},
            )
        try:
            content = await self._collect(ring_request, text)
        except SwarmError as exc:
            return error(502, str(exc), "server_error", "ring_failed")
        finally:
            with trio.move_on_after(CLEANUP_S, shield=True):
                await leader.serving.cancel(ring_request)
        choice = {"index": 0, "message": {"role": "assistant", "content": content},
                  "finish_reason": ring_request.finish_reason}
        if body.get("return_token_ids"):  # vLLM's extension: the exact tokens, for tests and tools
            choice["token_ids"] = list(ring_request.tokens)
            choice["prompt_token_ids"] = list(ring_request.prompt)
        return JSONResponse({
            "id": f"chatcmpl-{ring_request.id}", "object": "chat.completion", "created": created, "model": model,
            "choices": [choice],
            "usage": _usage(ring_request),
        }, headers={"x-swarm-request-id": ring_request.id})

    async def _collect(self, ring_request: Request, text: TextStream) -> str:
        parts = []
        while True:
            kind, value = await ring_request.next_event(self.leader.settings.request_stall_s)
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

        try:
            yield chunk({"role": "assistant", "content": ""})
            while True:
                kind, value = await ring_request.next_event(self.leader.settings.request_stall_s)
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
            with trio.move_on_after(CLEANUP_S, shield=True):
                await self.leader.serving.cancel(ring_request)


def _usage(request: Request) -> dict:
    return {"prompt_tokens": len(request.prompt), "completion_tokens": len(request.tokens),
            "total_tokens": len(request.prompt) + len(request.tokens)}
