"""Ollama's API on the leader, for the many desktop and editor tools that speak it: POST /api/chat and
/api/generate (NDJSON streamed by default, one JSON object with ``"stream": false``), GET /api/tags, POST /api/show,
GET /api/ps and GET /api/version, with the same API tokens as /v1 (``Authorization: Bearer``).

A request is translated into a Chat Completions body and goes the same way as one
(swarm.leader.api.openai_api.OpenAIRoutes.open_chat: the parameter checks, admission, the queue, the context check,
history, stop strings, structured output, tools, the reasoning switch, cancel on disconnect); only the answer's
shape is Ollama's. Its durations (nanoseconds) are the request's own times (swarm.leader.serving.timing):
``load_duration`` the wait before the ring started it (a reload included), ``prompt_eval_duration`` from then to
the first token, ``eval_duration`` from the first token to the last.

Errors are Ollama's ``{"error": "..."}``, with the status the /v1 routes give (a model that is not in the caller's
pools: 404, as Ollama's "model not found").
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import trio
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from swarm import __version__
from swarm.errors import BadRequest, ModelNotFound
from swarm.leader.api.auth import current_user
from swarm.leader.api.http_errors import classify, json_body
from swarm.leader.api.ollama_params import chat_body
from swarm.leader.api.openai_api import OpenAIRoutes
from swarm.leader.api.replies import Choice, ReplyStream, next_event, read_choices
from swarm.leader.chat.chat_format import load_tokenizer
from swarm.leader.serving import timing
from swarm.leader.serving.models import ModelStatus

# The routes, for the leader's middleware: their errors' shape, and which take a conversation (the /v1 body limit).
OLLAMA_CHAT_PATHS = frozenset({"/api/chat", "/api/generate"})
OLLAMA_PATHS = OLLAMA_CHAT_PATHS | {"/api/tags", "/api/show", "/api/ps", "/api/version"}


def ollama_problem(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


# Chat Completions' names in a refusal, as the Ollama request spelled them.
OLLAMA_NAMES = {"'max_tokens'": "'num_predict'", "'response_format'": "'format'",
                "'repetition_penalty'": "'repeat_penalty'"}


def ollama_error(exc: BaseException) -> JSONResponse:
    status, _, _, message = classify(exc)
    if isinstance(exc, BadRequest):  # the Chat Completions checks name the fields they check
        for theirs, ours in OLLAMA_NAMES.items():
            message = message.replace(theirs, ours)
    return ollama_problem(status, message.replace("GET /v1/models", "GET /api/tags"))


def _now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")


def _iso(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat().replace("+00:00", "Z")


def _ns(seconds: float | None) -> int:
    return int(round(seconds * 1e9)) if seconds is not None and seconds > 0 else 0


def durations(choice: Choice) -> dict:
    """Ollama's counts and durations of a finished reply, from its request's times (swarm.leader.serving.requests)."""
    request = choice.request
    end = request.last_token_at if request.last_token_at is not None else trio.current_time()
    first, started = request.first_token_at, request.started_at
    return {
        "total_duration": _ns(trio.current_time() - request.created_at),
        "load_duration": _ns(request.queue_s),
        "prompt_eval_count": len(request.prompt),  # the whole prompt, cached tokens included, as Ollama counts it
        "prompt_eval_cached_count": min(request.cached_tokens, len(request.prompt)),  # Ollama's api.Metrics field
        "prompt_eval_duration": _ns(first - started) if first is not None and started is not None else 0,
        "eval_count": min(choice.text.used, len(request.tokens)),
        "eval_duration": _ns(end - first) if first is not None else 0,
    }


def _calls(choice: Choice) -> list[dict]:
    """The reply's tool calls in Ollama's shape: the arguments as an object."""
    out = []
    for call in choice.calls:
        function = call.get("function", {})
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except ValueError:
            arguments = {}
        out.append({"function": {"name": function.get("name"), "arguments": arguments}})
    return out


def tag_entry(row) -> dict:
    """A model as /api/tags lists it: a GGUF import shows the file's quantization ("Q4_K_M") and size label."""
    manifest = row.manifest
    family = manifest.get("architecture") or ""
    return {
        "name": row.name, "model": row.name, "modified_at": _iso(row.created_at),
        "size": int(manifest.get("total_bytes") or 0), "digest": "",
        "details": {"parent_model": "", "format": "gguf" if manifest.get("storage") == "gguf" else "safetensors",
                    "family": family, "families": [family] if family else None,
                    "parameter_size": str(manifest.get("size_label") or ""),
                    "quantization_level": str(manifest.get("file_type") or manifest.get("dtype") or "")},
    }


class OllamaRoutes:
    def __init__(self, routes: OpenAIRoutes):
        self.routes = routes
        self.leader = routes.leader

    async def chat(self, request: HttpRequest):
        return await self._reply(request, "/api/chat")

    async def generate(self, request: HttpRequest):
        return await self._reply(request, "/api/generate")

    async def _reply(self, request: HttpRequest, route: str):
        chat = route == "/api/chat"
        try:
            user = await current_user(request, self.leader.store)
            body = await json_body(request)
            stream = body.get("stream") is not False  # Ollama streams unless told not to
            model = body.get("model")
            if not isinstance(model, str) or not model:
                raise BadRequest("'model' is required: one of the names GET /api/tags lists.", "missing_model")
            body["model"] = await self.resolve(model, user)
            if not chat and body.get("prompt") in (None, "") and not body.get("system"):
                # Ollama's way to ask whether a model is ready: an empty prompt answers at once
                await self.routes.model(body["model"])
                return JSONResponse({"model": body["model"], "created_at": _now_iso(), "response": "", "done": True,
                                     "done_reason": "load"})
            translated = chat_body(body, route)
            if stream:
                translated["stream"] = True
            opened = await self.routes.open_chat(request, translated, user)
            if opened is None:
                return Response(status_code=499)  # the client left; nobody reads it
        except Exception as exc:  # the API boundary: any failure is answered in Ollama's error shape
            return ollama_error(exc)
        params, choices = opened
        choice = choices[0]
        first = choice.request
        if stream:
            return ReplyStream(self.leader.serving, [first], self._stream(choice, params.model, chat),
                               headers={"x-swarm-request-id": first.id, "cache-control": "no-cache"},
                               media_type="application/x-ndjson")
        failed = await read_choices(self.leader.serving, choices, self.routes.collect, request.receive,
                                    fail=ollama_problem)
        if failed is not None:
            return failed
        await timing.settle(self.leader.serving, first)
        out: dict[str, Any] = {"model": params.model, "created_at": _now_iso()}
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": choice.content}
            if choice.reasoning:
                message["thinking"] = choice.reasoning
            if choice.calls:
                message["tool_calls"] = _calls(choice)
            out["message"] = message
        else:
            out["response"] = choice.content
            if choice.reasoning:
                out["thinking"] = choice.reasoning
        out.update({"done": True, "done_reason": _done_reason(choice.finish), **durations(choice)})
        return JSONResponse(out, headers={"x-swarm-request-id": first.id})

    async def _stream(self, choice: Choice, model: str, chat: bool):
        def line(reasoning: str, content: str, done: bool = False) -> str:
            out: dict[str, Any] = {"model": model, "created_at": _now_iso()}
            if chat:
                message: dict[str, Any] = {"role": "assistant", "content": content}
                if reasoning:
                    message["thinking"] = reasoning
                if done and choice.calls:
                    message["tool_calls"] = _calls(choice)
                out["message"] = message
            else:
                out["response"] = content
                if reasoning:
                    out["thinking"] = reasoning
            out["done"] = done
            return json.dumps(out, ensure_ascii=False) + "\n"

        def piece(reasoning: str, content: str):
            content = choice.content_delta(content)
            if reasoning or content:
                yield line(reasoning, content)

        async def finished(finish: str):
            content = choice.end_content()
            choice.finish = choice.finish_reason(finish)
            await timing.settle(self.leader.serving, choice.request)
            last = json.loads(line("", content, done=True))
            last.update({"done_reason": _done_reason(choice.finish), **durations(choice)})
            return json.dumps(last, ensure_ascii=False) + "\n"

        try:
            while choice.finish is None:
                _, kind, value = await next_event([choice])
                text = choice.text
                if kind == "tokens":
                    for token in value:  # one token per line, however the fellows batched them
                        for out in piece(*text.push([token])):
                            yield out
                        if text.stopped:
                            break
                    if text.stopped:
                        self.leader.serving.cancel(choice.request)  # the ring stops now and frees the caches
                        yield await finished("stop")
                elif kind == "error":
                    yield json.dumps({"error": value}) + "\n"
                    return
                else:
                    for out in piece(*text.flush()):
                        yield out
                    yield await finished("stop" if value == "cancelled" else value)
        finally:
            self.leader.serving.cancel(choice.request)

    async def resolve(self, name: str, user) -> str:
        """The model ``name`` names among the caller's pools; Ollama's clients add ":latest" to a bare name."""
        try:
            return await self.routes.resolve(name, user)
        except ModelNotFound as exc:
            if not name.endswith(":latest"):
                raise
            unfound = exc
        try:
            return await self.routes.resolve(name[: -len(":latest")], user)
        except ModelNotFound:
            raise unfound from None  # the name as the client gave it

    async def _rows(self, request: HttpRequest) -> list:
        user = await current_user(request, self.leader.store)
        store = self.leader.store
        return await trio.to_thread.run_sync(lambda: store.list_models(store.visible_pool_ids(user)))

    async def tags(self, request: HttpRequest):
        """The models of the caller's pools, as GET /v1/models lists them."""
        try:
            rows = await self._rows(request)
        except Exception as exc:  # the API boundary: any failure is answered in Ollama's error shape
            return ollama_error(exc)
        return JSONResponse({"models": [tag_entry(row) for row in rows]})

    async def ps(self, request: HttpRequest):
        """The models of the caller's pools that are loaded on the ring (ready to answer)."""
        try:
            rows = await self._rows(request)
        except Exception as exc:  # the API boundary: any failure is answered in Ollama's error shape
            return ollama_error(exc)
        out = []
        for row in rows:
            serving = self.leader.serving.models.get(row.name)
            if serving is None or serving.status != ModelStatus.READY:
                continue
            entry = tag_entry(row)
            weight = int(serving.describe().get("weight_bytes") or 0)
            entry.update({"size": weight, "size_vram": weight, "expires_at": "0001-01-01T00:00:00Z",
                          "context_length": await self.leader.serving.contexts.context_of(row.name)})
            out.append(entry)
        return JSONResponse({"models": out})

    async def show(self, request: HttpRequest):
        """One model's details: its family, chat template, context length and what it can do."""
        try:
            user = await current_user(request, self.leader.store)
            body = await json_body(request)
            name = body.get("model") or body.get("name")
            if not isinstance(name, str) or not name:
                raise BadRequest("'model' is required: one of the names GET /api/tags lists.", "missing_model")
            model = await self.resolve(name, user)
            row = await self.leader.serving.model_row(model)
            tokenizer = await trio.to_thread.run_sync(load_tokenizer, str(self.leader.models_root / model))
            context = await self.leader.serving.contexts.context_of(model)
        except Exception as exc:  # the API boundary: any failure is answered in Ollama's error shape
            return ollama_error(exc)
        entry = tag_entry(row)
        manifest = row.manifest
        template = getattr(tokenizer, "chat_template", None) or ""
        capabilities = ["completion"]
        if "tools" in template:
            capabilities.append("tools")
        if "think" in template:
            capabilities.append("thinking")
        family = entry["details"]["family"]
        return JSONResponse({
            "modelfile": "", "parameters": "", "template": template if isinstance(template, str) else "",
            "details": entry["details"], "modified_at": entry["modified_at"], "capabilities": capabilities,
            "model_info": {"general.architecture": family, f"{family}.context_length": context,
                           f"{family}.block_count": manifest.get("num_layers"),
                           "general.vocab_size": manifest.get("vocab_size")},
        })

    async def version(self, request: HttpRequest):
        try:
            await current_user(request, self.leader.store)
        except Exception as exc:  # the API boundary: any failure is answered in Ollama's error shape
            return ollama_error(exc)
        return JSONResponse({"version": __version__})


def _done_reason(finish: str | None) -> str:
    return "length" if finish == "length" else "stop"
