"""What a request to the OpenAI-compatible API may ask for, checked before anything reaches the ring.

Every field of a request body is one of three kinds: one we implement; one that changes nothing in a reply and that
clients send anyway (``user``, ``metadata``, ``stream_options``...), accepted and ignored; or one we do not implement,
refused with a 400 that names it -- a server that silently ignores ``response_format`` or ``tools`` gives wrong
answers that look right. A field we do not implement is still accepted at the value that means "off" (``n: 1``,
``logit_bias: {}``, ``response_format: {"type": "text"}``), and a null is the same as leaving a field out, as in
OpenAI's API.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from typing import Any

from swarm import messages
from swarm.errors import BadRequest
from swarm.leader.chat.chat_format import EFFORTS, thinking_of

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed")
PENALTY_KEYS = ("presence_penalty", "frequency_penalty", "repetition_penalty")
MAX_STOPS = 4  # OpenAI's limit
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
MAX_CHOICES = 8  # n: each choice is a request of its own on the ring

# Fields that change nothing in a reply: who sent it, what to store, how to bill it, caching hints.
IGNORED = frozenset({
    "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
    "prompt_cache_options", "stream_options",  # usage comes in the last chunk of every stream anyway
    "parallel_tool_calls",  # the reply's calls are all returned, one or several
})

# Fields we do not implement, accepted only at the value that means "off".
_OFF_VALUES = {
    "functions": ([],),
    "function_call": ("none", "auto"),
    "modalities": (["text"],),
    "best_of": (1,),
    "suffix": ("",),
}

CHAT_FIELDS = frozenset({
    "model", "messages", "stream", "max_tokens", "max_completion_tokens", "chat_template_kwargs", "return_token_ids",
    "ignore_eos", "stop", "n", "logprobs", "top_logprobs", "tools", "tool_choice", "response_format", "logit_bias",
    "reasoning_effort",
    *SAMPLING_KEYS, *PENALTY_KEYS,
})

# What to tell a client that asks for something we do not do, where there is more to say than "not supported".
_ADVICE = {
    "functions": "Send them as \"tools\" (the current form of the same thing).",
}


def check_fields(body: dict, implemented: frozenset[str]) -> dict:
    """``body`` without its nulls and ignored fields; BadRequest naming the first field we do not implement."""
    out = {}
    for key, value in body.items():
        if value is None or key in IGNORED:
            continue
        if key in implemented:
            out[key] = value
            continue
        if value in _OFF_VALUES.get(key, ()):
            continue
        advice = _ADVICE.get(key, "Leave it out, or set it to null.")
        raise BadRequest(f"the parameter '{key}' is not supported by this server, so the request was not run "
                         f"(it would have been ignored). {advice}", "unsupported_parameter")
    return out


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
    stop: list[str] = dataclasses.field(default_factory=list)
    n: int = 1
    logprobs: int | None = None  # None: off; else how many alternatives each token comes with (0 to 20)
    tools: list[dict] | None = None  # function tools for the chat template (None: none, or tool_choice "none")
    grammar: str | None = None  # response_format as an llguidance grammar; None: free text
    forced_tool: str | None = None  # tool_choice: "*" (required: some tool) or a tool's name; None: the model decides
    effort: str | None = None  # reasoning_effort (swarm.leader.chat.chat_format.reasoning_kwargs); None: the model's


def _number(body: dict, key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise BadRequest(f"'{key}' must be a number.", f"invalid_{key}")
    if not low <= value <= high:
        raise BadRequest(f"'{key}' is {value}; it must be between {low:g} and {high:g}.", f"invalid_{key}")
    return value


def parse_integer(body: dict, key: str, low: int, high: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise BadRequest(f"'{key}' is {value!r}; it must be a whole number from {low} to {high}.", f"invalid_{key}")
    return value


def parse_flag(body: dict, key: str) -> bool:
    """A true/false field: "false" is a string, and a truthy one, so anything but a JSON boolean is a 400."""
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise BadRequest(f"'{key}' must be true or false.", f"invalid_{key}")
    return value is True


def _sampling_ranges(sampling: dict) -> None:
    """Out-of-range values never reach a fellow (issue 10): NaN fails every comparison, so it is refused too."""
    for key in ("top_p", "min_p"):
        if key in sampling and not 0 <= sampling[key] <= 1:
            raise BadRequest(f"'{key}' is {sampling[key]}; it must be between 0 and 1.", f"invalid_{key}")
    if "top_k" in sampling and (not isinstance(sampling["top_k"], int) or not 0 <= sampling["top_k"] < 1 << 31):
        raise BadRequest("'top_k' must be a whole number, 0 (off) or more.", "invalid_top_k")
    if "seed" in sampling and (not isinstance(sampling["seed"], int) or not -(1 << 63) <= sampling["seed"] < 1 << 63):
        raise BadRequest("'seed' must be a whole number that fits in 64 bits.", "invalid_seed")


def parse_stop(value) -> list[str]:
    """``stop``: a string or a list of up to four non-empty strings."""
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOPS:
        raise BadRequest(f"'stop' must be a string or a list of up to {MAX_STOPS} strings.", "invalid_stop")
    return [s for s in dict.fromkeys(stops) if s]


def parse_logprobs(body: dict) -> int | None:
    """Chat's ``logprobs`` (true/false) and ``top_logprobs`` (0 to 20, only with logprobs) as one number."""
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise BadRequest("'logprobs' must be true or false.", "invalid_logprobs")
    top = parse_integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and top > 0 and not logprobs:
        raise BadRequest("'top_logprobs' needs \"logprobs\": true.", "invalid_top_logprobs")
    return (top or 0) if logprobs else None


def parse_sampling(body: dict) -> dict:
    """The sampling settings a request gives (the model's defaults fill in the rest)."""
    sampling: dict[str, Any] = {}
    for key in SAMPLING_KEYS:
        value = body.get(key)
        if value is not None:
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise BadRequest(f"'{key}' must be a number.", f"invalid_{key}")
            sampling[key] = value
    if not 0 <= sampling.get("temperature", 0) <= 2:
        raise BadRequest("'temperature' must be between 0 and 2.", "invalid_temperature")
    _sampling_ranges(sampling)
    for key in ("presence_penalty", "frequency_penalty"):  # OpenAI's range
        value = _number(body, key, -2.0, 2.0)
        if value:
            sampling[key] = value
    value = _number(body, "repetition_penalty", 0.01, 10.0)  # transformers' and vLLM's: > 0, 1 is off
    if value is not None and value != 1.0:
        sampling["repetition_penalty"] = value
    bias = body.get("logit_bias")
    if bias:
        sampling["logit_bias"] = parse_logit_bias(bias)
    return sampling


MAX_BIASED = 300  # OpenAI's limit on logit_bias entries


def parse_logit_bias(value) -> dict[int, float]:
    """``logit_bias``: token ids (as JSON keys) to a number from -100 to 100, added to their logits."""
    if not isinstance(value, dict) or len(value) > MAX_BIASED:
        raise BadRequest(f"'logit_bias' must map up to {MAX_BIASED} token ids to numbers from -100 to 100.",
                         "invalid_logit_bias")
    out = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            token = -1
        if token < 0 or isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise BadRequest(f"'logit_bias' maps token ids to numbers from -100 to 100; {key!r}: {bias!r} is not "
                             "one.", "invalid_logit_bias")
        out[token] = float(bias)
    return out


def parse_max_tokens(body: dict, max_tokens_limit: int) -> int | None:
    requested = body.get("max_completion_tokens", body.get("max_tokens"))
    if requested is not None and (not isinstance(requested, int) or isinstance(requested, bool) or requested < 1):
        raise BadRequest("'max_tokens' must be a positive integer.", "invalid_max_tokens")
    if requested is not None and requested > max_tokens_limit:
        raise BadRequest(f"'max_tokens' is {requested}; a reply may have at most {max_tokens_limit} tokens. "
                         f"Ask for {max_tokens_limit} or fewer.", "invalid_max_tokens")
    return requested


def parse_chat_body(body: dict, max_tokens_limit: int) -> ChatParams:
    body = check_fields(body, CHAT_FIELDS)
    model = body.get("model")
    chat = body.get("messages")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required: one of the ids from GET /v1/models.", "missing_model")
    if not isinstance(chat, list) or not chat or not all(
        isinstance(m, dict) and m.get("role") in ("system", "user", "assistant", "tool") for m in chat
    ):
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects.", "invalid_messages")
    requested = parse_max_tokens(body, max_tokens_limit)
    kwargs = body.get("chat_template_kwargs") or {}
    kwargs = kwargs if isinstance(kwargs, dict) else {}
    effort = parse_effort(body.get("reasoning_effort", kwargs.get("reasoning_effort")))
    thinking = thinking_of(kwargs.get("enable_thinking"), effort)
    n = parse_integer(body, "n", 1, MAX_CHOICES) or 1
    return ChatParams(model, chat, parse_flag(body, "stream"), requested, thinking, parse_sampling(body),
                      parse_flag(body, "return_token_ids"), parse_flag(body, "ignore_eos"),
                      parse_stop(body.get("stop")), n, parse_logprobs(body), parse_tools(body),
                      parse_response_format(body.get("response_format")), forced_tool(body), effort)


def parse_effort(value) -> str | None:
    """``reasoning_effort`` (OpenAI's levels): gpt-oss's template takes low, medium and high as they are; the families
    with an on/off switch think at any level but none and minimal."""
    if value is None:
        return None
    if value not in EFFORTS:
        raise BadRequest(f"'reasoning_effort' is {value!r}; it must be one of {', '.join(EFFORTS)}.",
                         "invalid_reasoning_effort")
    return value


def parse_response_format(value) -> str | None:
    """``response_format`` as the grammar the last stage constrains the reply with: {"type": "text"} (none),
    {"type": "json_object"} (any JSON object) or {"type": "json_schema", "json_schema": {"schema": {...}}}. The JSON
    is written compactly (no free whitespace: a small model could otherwise pad it with blank lines forever)."""
    if value is None or value == {"type": "text"}:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    schema: Any
    if kind == "json_object":
        schema = {"type": "object"}
    elif kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise BadRequest("'response_format' of type json_schema needs {\"json_schema\": {\"name\": ..., "
                             "\"schema\": {...}}}.", "invalid_response_format")
    else:
        raise BadRequest("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                         "{\"type\": \"json_schema\", \"json_schema\": {...}}.", "invalid_response_format")
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        # llguidance serialises the schema first: a bound such as "minimum": -10**300 is beyond what it reads
        # ("Value is not JSON serializable"), and was a 500
        raise BadRequest(f"'response_format' has a JSON schema this server cannot read: {str(exc)[:200]}. Numbers "
                         "in it must fit in 64 bits.", "invalid_response_format") from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise BadRequest(f"'response_format' has a JSON schema this server cannot follow: {error}",
                         "invalid_response_format")
    return grammar


def parse_tools(body: dict) -> list[dict] | None:
    """``tools`` (function tools) as the chat template takes them, unless ``tool_choice`` is "none". The model
    decides whether to call one ("auto"); forcing a call ("required", or a named function) is not supported."""
    tools = body.get("tools")
    choice = body.get("tool_choice", "auto")
    if tools is None or tools == []:
        if choice not in ("auto", "none"):
            raise BadRequest("'tool_choice' names a tool, but the request has no 'tools'.", "invalid_tool_choice")
        return None
    if not isinstance(tools, list) or not all(
        isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str) and t["function"]["name"] for t in tools
    ):
        raise BadRequest("'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\", "
                         "\"description\", \"parameters\"}} objects.", "invalid_tools")
    if choice == "none":
        return None
    forced_tool(body)  # checked here, used once the model's tool-call format is known
    return [{"type": "function", "function": t["function"]} for t in tools]


def forced_tool(body: dict) -> str | None:
    """``tool_choice`` that forces a call: "*" for "required" (one of the tools), or the name of the one to call;
    None when the model decides ("auto") or is given no tools ("none"). The call is forced with a grammar, so it
    cannot be combined with response_format."""
    choice = body.get("tool_choice", "auto")
    if choice in ("auto", "none") or not body.get("tools"):
        return None
    names = [t["function"]["name"] for t in body["tools"]]
    if choice == "required":
        forced = "*"
    elif (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
          and choice["function"].get("name") in names):
        forced = choice["function"]["name"]
    else:
        raise BadRequest(f"'tool_choice' must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", "
                         f"\"function\": {{\"name\": ...}}}} naming one of the tools ({', '.join(names)}); got "
                         f"{json.dumps(choice)}.", "invalid_tool_choice")
    if body.get("response_format") not in (None, {"type": "text"}):
        raise BadRequest("'tool_choice' that forces a call cannot be combined with 'response_format': the reply is "
                         "the call.", "invalid_tool_choice")
    return forced


def to_sampling(values: dict, logprobs: int | None = None, prompt_logprobs: int | None = None,
                grammar: str | None = None, think: list[int] | None = None) -> messages.Sampling:
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
        presence_penalty=float(values.get("presence_penalty", 0.0)),
        frequency_penalty=float(values.get("frequency_penalty", 0.0)),
        repetition_penalty=float(values.get("repetition_penalty", 1.0)),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        grammar=grammar,
        think=think if grammar is not None else None,
        bias_ids=list(values.get("logit_bias", {})),
        bias_values=list(values.get("logit_bias", {}).values()),
    )


# splitmix64's increment, as the stage's per-token generators use it: well-spread seeds for consecutive choices.
_GOLDEN = 0x9E3779B97F4A7C15


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` (1 and up) of a request seeded with ``seed``."""
    return (seed + index * _GOLDEN) % (1 << 63)
