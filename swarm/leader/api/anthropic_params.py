"""What a request to Anthropic's Messages API asks for, as the Chat Completions body that runs it
(swarm.leader.api.openai_params checks that one), and errors in Anthropic's shape.

As on /v1/chat/completions, every field is one we implement, one that changes nothing in a reply (``metadata``,
``service_tier``, ``cache_control`` hints...) and is accepted, or one we do not implement: a 400 that names it.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

from starlette.responses import JSONResponse

from swarm.errors import BadRequest, ContextTooLong
from swarm.leader.api.http_errors import classify

MESSAGES_FIELDS = frozenset({
    "model", "messages", "max_tokens", "system", "stop_sequences", "temperature", "top_p", "top_k", "tools",
    "tool_choice", "thinking", "stream", "output_config",
})
COUNT_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config"})
# Fields that change nothing in a reply here: who sent it and for which account, billing and capacity tiers,
# prompt-cache hints (the pool keeps no Anthropic prompt cache), where and how fast Anthropic would run it.
IGNORED = frozenset({"metadata", "service_tier", "cache_control", "inference_geo", "speed", "diagnostics",
                     "user_profile_id", "workspace_id"})
# Keys of a block or a tool that change nothing here: cache hints, citations of a text, a streaming hint.
IGNORED_KEYS = frozenset({"cache_control", "citations", "eager_input_streaming"})
TOOL_KEYS = frozenset({"name", "description", "input_schema", "type"})

# The Chat Completions checks' names for fields, as the Messages API spells them.
NAMES = {"'stop'": "'stop_sequences'", "'response_format'": "'output_config.format'"}

# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error")


def error_body(status: int, message: str, kind: str | None = None) -> dict:
    """Anthropic's error object: ``kind`` (its type) follows from the status unless given."""
    return {"type": "error", "error": {"type": kind or error_type(status), "message": message}}


def anthropic_problem(status: int, message: str, kind: str | None = None,
                      headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, kind), status_code=status, headers=headers)


def describe(exc: BaseException) -> tuple[int, str, str]:
    """(status, Anthropic error type, message) for an exception, as /v1 classifies it."""
    status, _, _, message = classify(exc)
    kind = error_type(status)
    if isinstance(exc, BadRequest):  # the Chat Completions checks name the fields they check
        for theirs, ours in NAMES.items():
            message = message.replace(theirs, ours)
    if isinstance(exc, ContextTooLong):
        # Anthropic's words for it (a conversation too long for the model), which Claude Code looks for before it
        # compacts one; the status stays the 413 of every face here
        message, kind = f"prompt is too long: {message}", "invalid_request_error"
    return status, kind, message


def anthropic_error(exc: BaseException) -> JSONResponse:
    status, kind, message = describe(exc)
    retry = getattr(exc, "retry_after", None)  # a full queue: clients wait that long and retry
    return anthropic_problem(status, message, kind, {"retry-after": str(retry)} if retry is not None else None)


def _refuse(what: str, advice: str = "Leave it out.") -> BadRequest:
    return BadRequest(f"{what} is not supported by this server, so the request was not run (it would have been "
                      f"ignored). {advice}", "unsupported_parameter")


def _check_fields(body: dict, allowed: frozenset[str]) -> dict:
    out = {}
    for key, value in body.items():
        if value is None or key in IGNORED:
            continue
        if key not in allowed:
            raise _refuse(f"the field '{key}'")
        out[key] = value
    return out


def _check_keys(block: dict, allowed: set[str] | frozenset[str], where: str) -> None:
    for key, value in block.items():
        if key not in allowed and key not in IGNORED_KEYS and value is not None:
            raise _refuse(f"'{key}' in {where}")


def _text_of(content: Any, where: str) -> str:
    """The text of a string or a list of text blocks (a system prompt, a tool's result)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of text blocks.", "invalid_messages")
    parts = []
    for block in content:
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind in ("image", "document"):
                raise BadRequest(f"{kind} blocks are not supported: the pool serves text models. Send text only.",
                                 "unsupported_content")
            raise BadRequest(f"{where} must be a string or a list of {{\"type\": \"text\", \"text\": ...}} blocks.",
                             "invalid_messages")
        _check_keys(block, {"type", "text"}, "a text block")
        parts.append(block["text"])
    return "\n\n".join(parts)


def translate_messages(messages: Any, system: Any) -> list[dict]:
    """Anthropic's ``system`` and ``messages`` as Chat Completions messages: tool_use blocks become an assistant's
    tool_calls, tool_result blocks ``role: tool`` messages (before the user's text, as Anthropic orders them), and
    thinking blocks are dropped (the chat templates drop a past turn's reasoning too)."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects.", "invalid_messages")
    out: list[dict] = []
    if system is not None:
        text = _text_of(system, "'system'")
        if text:
            out.append({"role": "system", "content": text})
    names: dict[str, str] = {}  # tool_use id -> its tool's name, for the results
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise BadRequest("each message must be {\"role\": \"user\" or \"assistant\", \"content\": ...}.",
                             "invalid_messages")
        _check_keys(message, {"role", "content"}, "a message")
        role, content = message["role"], message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise BadRequest("a message's 'content' must be a string or a list of content blocks.",
                             "invalid_messages")
        texts: list[str] = []
        calls: list[dict] = []
        results = 0
        for block in content:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(_text_of([block], "a text block"))
            elif kind == "tool_use" and role == "assistant":
                _check_keys(block, {"type", "id", "name", "input"}, "a tool_use block")
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise BadRequest("a tool_use block needs its 'id' and 'name'.", "invalid_messages")
                names[block["id"]] = block["name"]
                calls.append({"id": block["id"], "type": "function", "function": {
                    "name": block["name"], "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                _check_keys(block, {"type", "tool_use_id", "content", "is_error"}, "a tool_result block")
                result = block.get("content")
                text = "" if result is None else _text_of(result, "a tool_result's 'content'")
                if block.get("is_error") is True:
                    text = f"Error: {text}"
                call_id = block.get("tool_use_id")
                tool: dict[str, Any] = {"role": "tool", "tool_call_id": call_id, "content": text}
                if isinstance(call_id, str) and call_id in names:
                    tool["name"] = names[call_id]
                out.append(tool)
                results += 1
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue
            elif kind in ("image", "document"):
                raise BadRequest(f"{kind} blocks are not supported: the pool serves text models. Send text only.",
                                 "unsupported_content")
            else:
                raise _refuse(f"a {role} message's content block of type {kind!r}",
                              "Send text, tool_use (assistant) and tool_result (user) blocks.")
        text = "".join(texts)
        if calls:
            out.append({"role": "assistant", "content": text, "tool_calls": calls})
        elif text or not results:  # a user turn of tool results alone is those results
            out.append({"role": role, "content": text})
    if out[-1]["role"] == "assistant":
        raise BadRequest("the last message is the assistant's: prefilling a reply is not supported here. End the "
                         "conversation with a user message.", "invalid_messages")
    return out


def translate_tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list of {\"name\", \"description\", \"input_schema\"} objects.",
                         "invalid_tools")
    out = []
    for tool in tools:
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
            raise BadRequest("'tools' must be a list of {\"name\", \"description\", \"input_schema\"} objects.",
                             "invalid_tools")
        if tool.get("type") not in (None, "custom"):
            raise _refuse(f"the server tool {tool['type']!r}", "Describe it as a tool of your own (name, "
                          "description, input_schema) and run it yourself.")
        if tool.get("strict") is True:
            raise _refuse("'strict' tools", "Force a call whose input follows the schema with 'tool_choice'.")
        _check_keys({k: v for k, v in tool.items() if k != "strict"}, TOOL_KEYS, "a tool")
        function: dict[str, Any] = {"name": tool["name"], "parameters": tool.get("input_schema") or {}}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def translate_tool_choice(choice: Any) -> Any:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if kind in ("auto", "any", "none"):
        return {"auto": "auto", "any": "required", "none": "none"}[kind]
    raise BadRequest("'tool_choice' must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"none\"} or "
                     f"{{\"type\": \"tool\", \"name\": ...}}; got {json.dumps(choice)}.", "invalid_tool_choice")


def translate_thinking(thinking: Any) -> bool | None:
    """``thinking`` as the family's reasoning switch: enabled on, disabled off, adaptive the model's own default
    (as when it is left out). A model thinks within max_tokens, as Anthropic's do; there is no separate budget."""
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise BadRequest("'thinking' of type enabled needs 'budget_tokens', a positive whole number.",
                             "invalid_thinking")
        if thinking.get("display") not in (None, "summarized"):
            raise _refuse(f"'thinking.display' {thinking['display']!r}", "The thinking is always returned.")
        return True
    if kind == "disabled":
        return False
    if kind == "adaptive":
        return None
    raise BadRequest("'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": N}, {\"type\": \"disabled\"} or "
                     "{\"type\": \"adaptive\"}.", "invalid_thinking")


def translate_output_config(config: Any) -> dict | None:
    """``output_config``: its ``format`` (a JSON schema) is the structured output of Chat Completions."""
    if not isinstance(config, dict):
        raise BadRequest("'output_config' must be an object.", "invalid_output_config")
    for key, value in config.items():
        if key != "format" and value is not None:
            advice = "Turn thinking on or off with 'thinking'." if key == "effort" else "Leave it out."
            raise _refuse(f"'output_config.{key}'", advice)
    form = config.get("format")
    if form is None:
        return None
    if not isinstance(form, dict) or form.get("type") != "json_schema" or not isinstance(form.get("schema"), dict):
        raise BadRequest("'output_config.format' must be {\"type\": \"json_schema\", \"schema\": {...}}.",
                         "invalid_output_config")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": form["schema"]}}


def chat_body(body: dict, counting: bool = False) -> dict:
    """The Chat Completions body for a Messages API body (``counting``: a count_tokens body, no reply asked)."""
    body = _check_fields(body, COUNT_FIELDS if counting else MESSAGES_FIELDS)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required: one of the ids GET /v1/models lists.", "missing_model")
    out: dict[str, Any] = {"model": model, "messages": translate_messages(body.get("messages"), body.get("system"))}
    if not counting:
        if body.get("max_tokens") is None:
            raise BadRequest("'max_tokens' is required: the most tokens the reply may have.", "missing_max_tokens")
        out["max_tokens"] = body["max_tokens"]
        for key in ("temperature", "top_p", "top_k", "stream"):
            if key in body:
                out[key] = body[key]
        if "stop_sequences" in body:
            stops = body["stop_sequences"]
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise BadRequest("'stop_sequences' must be a list of strings.", "invalid_stop")
            out["stop"] = stops
    if body.get("tools"):
        out["tools"] = translate_tools(body["tools"])
    if "tool_choice" in body:
        out["tool_choice"] = translate_tool_choice(body["tool_choice"])
    if "thinking" in body:
        thinking = translate_thinking(body["thinking"])
        if thinking is not None:
            out["chat_template_kwargs"] = {"enable_thinking": thinking}
    if "output_config" in body:
        form = translate_output_config(body["output_config"])
        if form is not None:
            out["response_format"] = form
    return out


def anthropic_models(rows: list) -> dict:
    """GET /v1/models as Anthropic's clients read it (they send ``anthropic-version``): the caller's models."""
    data = [{"type": "model", "id": m.name, "display_name": m.name,
             "created_at": datetime.datetime.fromtimestamp(m.created_at, datetime.UTC).isoformat()} for m in rows]
    return {"data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}
