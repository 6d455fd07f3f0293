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
from swarm.leader.api.openai_api import Choice, OpenAIRoutes, ReplyStream, next_event, read_choices
from swarm.leader.chat.chat_format import load_tokenizer
from swarm.leader.serving import timing
from swarm.leader.serving.models import ModelStatus

# The routes, for the leader's middleware: their errors' shape, and which take a conversation (the /v1 body limit).
OLLAMA_CHAT_PATHS = frozenset({"/api/chat", "/api/generate"})
OLLAMA_PATHS = OLLAMA_CHAT_PATHS | {"/api/tags", "/api/show", "/api/ps", "/api/version"}
# Options that tune how Ollama's own runner loads and batches a model: the pool decides those, so they are ignored.
RUNTIME_OPTIONS = frozenset({
    "num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "use_mmap", "use_mlock", "numa", "low_vram",
    "vocab_only", "num_keep", "f16_kv", "logits_all", "embedding_only",
})
# Options with a Chat Completions counterpart: Ollama's name -> the body's.
SAMPLING_OPTIONS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
    "num_predict": "max_tokens", "stop": "stop", "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
}
# Samplers we do not have, accepted at the value that turns them off (what clients send by default).
OFF_OPTIONS: dict[str, tuple] = {"mirostat": (0,), "typical_p": (1, 1.0), "tfs_z": (1, 1.0),
                                 "repeat_last_n": (64,), "penalize_newline": (True, False)}
# Request fields that change nothing here: how long Ollama keeps a model loaded (the pool's idle unload decides).
IGNORED_FIELDS = frozenset({"keep_alive"})
CHAT_FIELDS = frozenset({"model", "messages", "stream", "options", "format", "think", "tools"})
GENERATE_FIELDS = frozenset({"model", "prompt", "system", "stream", "options", "format", "think"})


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


def _check_fields(body: dict, allowed: frozenset[str], route: str) -> None:
    for key, value in body.items():
        if value is None or key in IGNORED_FIELDS or key in allowed:
            continue
        if key == "images" and not value:
            continue
        raise BadRequest(f"the field '{key}' of {route} is not supported by this server, so the request was not "
                         "run. Leave it out.", "unsupported_parameter")


def translate_options(options: Any) -> dict:
    """Ollama's ``options`` as Chat Completions fields; BadRequest naming one we cannot honour."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise BadRequest("'options' must be an object, such as {\"temperature\": 0, \"num_predict\": 64}.",
                         "invalid_options")
    out: dict[str, Any] = {}
    for key, value in options.items():
        if value is None or key in RUNTIME_OPTIONS:
            continue
        if key in SAMPLING_OPTIONS:
            if key == "num_predict" and isinstance(value, int) and value < 0:
                continue  # -1 (no limit) and -2 (fill the context): as long as the context leaves room for
            out[SAMPLING_OPTIONS[key]] = value
            continue
        if key in OFF_OPTIONS and value in OFF_OPTIONS[key]:
            continue
        raise BadRequest(f"the option '{key}' is not supported by this server, so the request was not run. Leave "
                         "it out of 'options'.", "unsupported_option")
    return out


def translate_format(value: Any) -> dict | None:
    """``format``: "json" (any JSON object) or a JSON schema, as the structured output of Chat Completions."""
    if value is None or value == "":
        return None
    if value == "json":
        return {"type": "json_object"}
    if isinstance(value, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": value}}
    raise BadRequest("'format' must be \"json\" or a JSON schema object.", "invalid_format")


def translate_message(message: Any) -> Any:
    """An Ollama chat message as a Chat Completions one: tool calls get their type, a tool's reply its name, and a
    message with images is refused (no model of the pool reads them)."""
    if not isinstance(message, dict):
        return message  # parse_chat_body says what a message must be
    if message.get("images"):
        raise BadRequest("messages with 'images' are not supported: the pool serves text models. Send text only.",
                         "unsupported_images")
    out = {k: v for k, v in message.items() if k not in ("images", "thinking", "tool_name")}
    if message.get("tool_name") and "name" not in out:
        out["name"] = message["tool_name"]
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [
            {"type": "function", **c} if isinstance(c, dict) else c for c in calls
        ]
    return out


def chat_body(body: dict, route: str) -> dict:
    """The Chat Completions body for an Ollama /api/chat or /api/generate body."""
    if route == "/api/chat":
        _check_fields(body, CHAT_FIELDS, route)
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise BadRequest("'messages' must be a non-empty list of {role, content} objects.", "invalid_messages")
        messages = [translate_message(m) for m in messages]
    else:
        if body.get("raw"):
            raise BadRequest("'raw' prompts are not supported here: send the prompt without raw, or use "
                             "POST /v1/completions for a prompt without the chat template.", "unsupported_raw")
        body = {k: v for k, v in body.items() if k != "raw"}
        _check_fields(body, GENERATE_FIELDS, route)
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise BadRequest("'prompt' must be a string.", "invalid_prompt")
        system = body.get("system")
        if system is not None and not isinstance(system, str):
            raise BadRequest("'system' must be a string.", "invalid_system")
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    out: dict[str, Any] = {"model": body.get("model"), "messages": messages,
                           **translate_options(body.get("options"))}
    response_format = translate_format(body.get("format"))
    if response_format is not None:
        out["response_format"] = response_format
    think = body.get("think")
    if think is not None:
        if not isinstance(think, bool) and think not in ("low", "medium", "high"):
            raise BadRequest("'think' must be true or false (or \"low\", \"medium\", \"high\").", "invalid_think")
        # "low"/"medium"/"high" (gpt-oss's levels): the families here have an on/off switch only
        out["chat_template_kwargs"] = {"enable_thinking": bool(think)}
    if body.get("tools"):
        out["tools"] = body["tools"]
    return out


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
        except Exception as exc:
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
        except Exception as exc:
            return ollama_error(exc)
        return JSONResponse({"models": [tag_entry(row) for row in rows]})

    async def ps(self, request: HttpRequest):
        """The models of the caller's pools that are loaded on the ring (ready to answer)."""
        try:
            rows = await self._rows(request)
        except Exception as exc:
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
        except Exception as exc:
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
        except Exception as exc:
            return ollama_error(exc)
        return JSONResponse({"version": __version__})


def _done_reason(finish: str | None) -> str:
    return "length" if finish == "length" else "stop"
