"""Ollama's request bodies as Chat Completions bodies (swarm.leader.api.ollama_api takes them from there): its
``options``, ``format``, ``think`` and messages translated, and the fields and options that cannot be honoured
refused by name."""

from __future__ import annotations

from typing import Any

from swarm.errors import BadRequest

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


def check_fields(body: dict, allowed: frozenset[str], route: str) -> None:
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
        check_fields(body, CHAT_FIELDS, route)
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise BadRequest("'messages' must be a non-empty list of {role, content} objects.", "invalid_messages")
        messages = [translate_message(m) for m in messages]
    else:
        if body.get("raw"):
            raise BadRequest("'raw' prompts are not supported here: send the prompt without raw, or use "
                             "POST /v1/completions for a prompt without the chat template.", "unsupported_raw")
        body = {k: v for k, v in body.items() if k != "raw"}
        check_fields(body, GENERATE_FIELDS, route)
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
        # "low"/"medium"/"high": gpt-oss's levels (its template's reasoning_effort); on for the other families
        if isinstance(think, str):
            out["reasoning_effort"] = think
        else:
            out["chat_template_kwargs"] = {"enable_thinking": think}
    if body.get("tools"):
        out["tools"] = body["tools"]
    return out
