"""The Responses API's request and answer shapes, as pure functions (swarm.leader.api.responses_api serves them): a
request body translated into a Chat Completions body (swarm.leader.api.openai_params checks it as it checks its own),
the input items normalised (each with an id, as they are listed back), and a reply's output items.
"""

from __future__ import annotations

import secrets
from typing import Any

from swarm.errors import BadRequest

# Fields that change nothing here: what to keep and bill, hints for caching, how OpenAI's own servers schedule.
IGNORED = frozenset({
    "metadata", "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "service_tier",
    "parallel_tool_calls", "store", "stream_options",
})
# Fields we implement (store, previous_response_id and stream by swarm.leader.api.responses_api).
FIELDS = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice", "text",
    "reasoning", "stream", "previous_response_id", "top_logprobs",
})
# Fields we do not implement, accepted at the value that means "off" (what clients such as the Agents SDK send).
OFF_VALUES: dict[str, tuple] = {"truncation": ("disabled",), "background": (False,)}
# What ``include`` may ask for: the reply's logprobs; encrypted reasoning (Codex asks with "store": false) is none here,
# so nothing to add for it.
LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = frozenset({"reasoning.encrypted_content", LOGPROBS})
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def _unsupported(key: str) -> BadRequest:
    return BadRequest(f"the parameter '{key}' is not supported by this server, so the request was not run (it would "
                      "have been ignored). Leave it out, or set it to null.", "unsupported_parameter")


def check_fields(body: dict) -> None:
    for key, value in body.items():
        if value is None or key in IGNORED or key in FIELDS:
            continue
        if value in OFF_VALUES.get(key, ()):
            continue
        if key == "include" and isinstance(value, list):
            extra = [v for v in value if not (isinstance(v, str) and v in INCLUDABLE)]
            if not extra:
                continue
            raise BadRequest(f"'include' asks for {extra[0]!r}, which this server does not return, so the request "
                             "was not run. Leave it out of 'include'.", "unsupported_parameter")
        raise _unsupported(key)


def _text(content: Any, where: str) -> str:
    """The text of a message's content: a string, or parts of type input_text / output_text / text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(f"{where} has a content part of type '{kind}': this server takes text only "
                                 "(input_text parts).", "invalid_input")
            if not isinstance(part.get("text"), str):
                raise BadRequest(f"{where} has a text part without a 'text' string.", "invalid_input")
            out.append(part["text"])
        return "".join(out)
    raise BadRequest(f"{where} must have 'content': a string or a list of input_text parts.", "invalid_input")


def input_items(value: Any) -> list[dict]:
    """``input`` as a list of items, each with an id (a string is one user message)."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}]
    if not isinstance(value, list) or not all(isinstance(i, dict) for i in value):
        raise BadRequest("'input' must be a string or a list of items (messages, function_call and "
                         "function_call_output objects).", "invalid_input")
    out = []
    for item in value:
        kind = item.get("type", "message")
        if not isinstance(kind, str):
            raise BadRequest("an 'input' item's 'type' must be a string such as \"message\".", "invalid_input")
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}.get(kind)
        if prefix is None:
            raise BadRequest(f"'input' has an item of type '{kind}': this server takes message, function_call, "
                             "function_call_output and reasoning items.", "invalid_input")
        entry = {"id": item.get("id") or new_id(prefix), **{k: v for k, v in item.items() if k != "id"}}
        entry["type"] = kind
        if kind == "message" and isinstance(entry.get("content"), str):
            part = "output_text" if entry.get("role") == "assistant" else "input_text"
            entry["content"] = [{"type": part, "text": entry["content"]}]
        out.append(entry)
    return out


def chat_messages(items: list[dict]) -> list[dict]:
    """Input items as Chat Completions messages: function calls join one assistant message, outputs are tool
    messages named after their call, reasoning items are dropped (the template shows no past reasoning)."""
    messages: list[dict] = []
    names: dict[str, str] = {}
    for n, item in enumerate(items):
        kind, where = item["type"], f"input item {n}"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise BadRequest(f"{where} has role {role!r}; a message's role is user, system, developer or "
                                 "assistant.", "invalid_input")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            name, arguments, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(arguments, str) or not isinstance(call_id, str):
                raise BadRequest(f"{where} (a function_call) needs 'call_id', 'name' and 'arguments' strings.",
                                 "invalid_input")
            names[call_id] = name
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise BadRequest(f"{where} (a function_call_output) needs the 'call_id' of its call.", "invalid_input")
            message = {"role": "tool", "tool_call_id": call_id, "content": _text(output, where)}
            if call_id in names:
                message["name"] = names[call_id]
            messages.append(message)
    return messages


def output_messages(output: list[dict]) -> list[dict]:
    """A response's output items as the chat messages that continue its conversation."""
    return chat_messages([i for i in output if i.get("type") in ("message", "function_call")])


def chat_tools(tools: Any) -> list[dict] | None:
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRequest("'tools' must be a list of {\"type\": \"function\", \"name\", \"description\", "
                         "\"parameters\"} objects.", "invalid_tools")
    out = []
    for tool in tools:
        if tool.get("type") != "function":
            raise BadRequest(f"'tools' has a tool of type {tool.get('type')!r}; this server runs function tools only "
                             "(the client calls them).", "unsupported_tool")
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise BadRequest("'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"name\": "
                     "...} naming one of the tools.", "invalid_tool_choice")


def response_format(text: Any) -> dict | None:
    """``text.format`` as Chat Completions' ``response_format``."""
    if text is None:
        return None
    if not isinstance(text, dict) or any(k not in ("format", "verbosity") for k in text):
        raise BadRequest("'text' must be {\"format\": {...}}.", "invalid_text")
    fmt = text.get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "format",
                                                       "schema": fmt.get("schema")}}
    raise BadRequest("'text.format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": "
                     "\"json_schema\", \"name\": ..., \"schema\": {...}}.", "invalid_text")


def thinking(reasoning: Any) -> bool | None:
    """``reasoning.effort`` as the family's reasoning switch: "none" and "minimal" turn it off, any other effort on
    (gpt-oss takes the level itself: swarm.leader.chat.chat_format.reasoning_kwargs); no effort leaves the model's
    default."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict) or reasoning.get("effort") not in (None, *EFFORTS):
        raise BadRequest(f"'reasoning' must be {{\"effort\": ...}} with one of {', '.join(EFFORTS)}.",
                         "invalid_reasoning")
    effort = reasoning.get("effort")
    return None if effort is None else effort not in ("none", "minimal")


def chat_body(body: dict, history: list[dict], items: list[dict]) -> dict:
    """The Chat Completions body for a Responses request: ``history`` (the previous response's conversation) and
    ``items`` (this request's input) after the instructions."""
    check_fields(body)
    messages = chat_messages(items)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("'instructions' must be a string.", "invalid_instructions")
    system = [{"role": "system", "content": instructions}] if instructions else []
    out: dict[str, Any] = {"model": body.get("model"), "messages": system + history + messages}
    for theirs, ours in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p")):
        if body.get(theirs) is not None:
            out[ours] = body[theirs]
    tools = chat_tools(body.get("tools"))
    if tools:
        out["tools"] = tools
        if body.get("tool_choice") is not None:
            out["tool_choice"] = chat_tool_choice(body["tool_choice"])
    fmt = response_format(body.get("text"))
    if fmt is not None:
        out["response_format"] = fmt
    if thinking(body.get("reasoning")) is not None:  # checked there; the level reaches gpt-oss's template as it is
        out["reasoning_effort"] = body["reasoning"]["effort"]
    if wants_logprobs(body):  # Chat Completions' checks apply (top_logprobs 0-20)
        out["logprobs"] = True
        out["top_logprobs"] = body.get("top_logprobs") or 0
    return out


def wants_logprobs(body: dict) -> bool:
    """Whether the reply's output_text carries its tokens' logprobs: asked with ``include`` (top_logprobs alone, as
    OpenAI's API has it, asks too)."""
    include = body.get("include")
    return (isinstance(include, list) and LOGPROBS in include) or bool(body.get("top_logprobs"))


def message_item(item_id: str, text: str, status: str = "completed", logprobs: list | None = None) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]
            if status == "completed" else []}


def reasoning_item(item_id: str, text: str) -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def call_item(item_id: str, call: dict, status: str = "completed") -> dict:
    function = call.get("function", {})
    return {"id": item_id, "type": "function_call", "call_id": call.get("id") or new_id("call"),
            "name": function.get("name") or "", "arguments": function.get("arguments") or "", "status": status}


def response_object(response_id: str, created: int, body: dict, model: str, status: str, output: list[dict],
                    usage: dict | None = None, finish: str | None = None, error: dict | None = None) -> dict:
    fmt = (body.get("text") or {}).get("format") or {"type": "text"}
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "model": model, "output": output, "parallel_tool_calls": True,
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": {"effort": (body.get("reasoning") or {}).get("effort"), "summary": None},
        "store": body.get("store") is not False, "temperature": body.get("temperature"),
        "text": {"format": fmt}, "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [], "top_p": body.get("top_p"), "truncation": "disabled",
        "usage": usage, "metadata": body.get("metadata") or {}, "user": body.get("user"),
    }
