"""How much a client may send (issue 10, finding 5; issue 32, findings 1 to 3): request bodies per route, prompts
before they are tokenised, conversations against the model's served context, and replies per request.

A 150 MB login body used to cost the leader 710 MB, and a 24 MB prompt was tokenised whole (11 s, 3 GB) before the
context check refused it. Now each route has a body limit, refused from Content-Length before a byte is read (or as
soon as a chunked body passes it), and a prompt whose text alone could not fit in the model's context is refused by
its byte count, before the tokenizer sees it.

Every limit follows the model's *served context* -- its own context (``max_position_embeddings`` in its config),
capped by SWARM_SERVE_CONTEXT_TOKENS and by its load's ``context_tokens`` where they are set -- never the pool's KV
budget: a pool with room for a million tokens used to accept a 6,000-token conversation on a model of 4,096 (it
answered 200), and its /v1 body limit came out at 248 MB, its prompt byte check at 164 MB (a 40 MB prompt then held
the leader for 71 s).

A token stands for at most as many bytes of text as the longest entry of the tokenizer's vocabulary (for byte-level
BPE each character of an entry is one byte; SentencePiece's "▁" is 3 bytes for 1, an overestimate, which is the safe
side). So a text of B bytes is at least B / longest tokens, and a text over ``context tokens x longest`` bytes cannot
fit: refusing it is never wrong.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from swarm.errors import BadRequest, BodyTooLarge, ContextTooLong

KIB, MIB = 1024, 1024 * 1024

# When a model's tokenizer cannot be read, assume tokens this long: longer than any entry of the vocabularies swarm
# serves (the longest are runs of spaces or dashes in code-heavy vocabularies, well under 256 bytes).
FALLBACK_TOKEN_BYTES = 256

SIGN_IN_BODY = 16 * KIB  # a name and a password (passwords are capped at 1024 characters)
DEFAULT_BODY = 1 * MIB  # every other /api/v1 and page route: settings, tokens, users, loads
CHAT_BODY_MARGIN = 1 * MIB  # tools, sampling fields, JSON escapes beyond the text itself
# JSON bytes one token of a prompt may take in a /v1 body. The longest vocabulary entries (runs of spaces, dashes or
# letters, under FALLBACK_TOKEN_BYTES) are text JSON leaves as it is; what JSON escapes (quotes, backslashes, control
# characters as \u00XX, non-ASCII as \uXXXX: at most 6 bytes for 1 to 3 of text) is held by short entries, a few
# bytes each; a token id of /v1/completions is at most 7 digits and a separator. So a prompt that fits the served
# context is at most ``context x BODY_BYTES_PER_TOKEN`` bytes of JSON, and CHAT_BODY_MARGIN holds the rest of the body:
# 2 MiB for a context of 4,096 tokens, 9 MiB for 32,768.
BODY_BYTES_PER_TOKEN = FALLBACK_TOKEN_BYTES
# Big bodies are parsed in a worker thread (issue 32): ~10 ms of the event loop per MiB of JSON otherwise.
PARSE_IN_THREAD = 64 * KIB


def text_bytes(value: Any) -> int:
    """UTF-8 bytes of every string inside ``value`` (a message list, a prompt, a content part list)."""
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, dict):
        return sum(text_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(text_bytes(v) for v in value)
    return 0


_longest: dict[str, int] = {}  # model folder -> bytes of its longest vocabulary entry, once its tokenizer is loaded


def longest_token_bytes(model_dir: str) -> int:
    """Bytes of the longest vocabulary entry of the model's tokenizer (see the module's note), or the fallback while
    the tokenizer is not loaded yet.

    It never loads the tokenizer itself: it runs on the leader's event loop, and loading there (importing
    transformers, or waiting for the load-time warm-up that holds the loading lock while it imports them) blocked the
    whole leader for 4-12 s at a model's first chat on a busy machine -- no heartbeat went out or was read, so every
    fellow of the ring dropped the leader and rejoined (seen in the network lab). The fallback only makes this early
    check looser; the tokenizer's count after encoding is exact. ``swarm.leader.chat.chat_format.warm_up`` fills it in
    from a worker thread."""
    found = _longest.get(model_dir)
    if found is not None:
        return found
    from swarm.leader.chat.chat_format import loaded_tokenizer

    tokenizer = loaded_tokenizer(model_dir)
    if tokenizer is None:
        return FALLBACK_TOKEN_BYTES
    try:
        vocab = tokenizer.get_vocab()
        found = max((len(entry.encode("utf-8", "surrogatepass")) for entry in vocab), default=FALLBACK_TOKEN_BYTES)
    except Exception:  # noqa: BLE001 - an unreadable vocabulary: the safe upper bound
        found = FALLBACK_TOKEN_BYTES
    _longest[model_dir] = found
    return found


def model_context(config: dict) -> int | None:
    """The context a model was made for (its config's ``max_position_embeddings``, or a multimodal model's text
    config's), or None when the config does not say."""
    for source in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
            value = source.get(key) if isinstance(source, dict) else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


# A model whose config names no context length is served at this many tokens (SWARM_SERVE_CONTEXT_TOKENS's old
# default, which every model was capped at before issue 36).
FALLBACK_CONTEXT = 4096


def served_context(own: int | None, cap: int | None, model_cap: int | None = None) -> int:
    """The longest conversation (prompt and reply) a model serves: its own context (FALLBACK_CONTEXT where its config
    names none), capped by the admin's SWARM_SERVE_CONTEXT_TOKENS (``cap``) and by its load's ``context_tokens``
    (``model_cap``), where they are set."""
    return min([own if own is not None else FALLBACK_CONTEXT, *(c for c in (cap, model_cap) if c is not None)])


def context_reason(own: int | None, cap: int | None, model_cap: int | None = None) -> str:
    """Where a served context comes from, in the words of an error message."""
    served = served_context(own, cap, model_cap)
    own_words = f"; the model's own is {own}" if own is not None else ""
    if own is not None and own == served:
        return "the model's own context"
    if model_cap is not None and model_cap == served:
        return f"the context its load asked for (context_tokens){own_words}"
    if cap is not None and cap == served:
        return f"SWARM_SERVE_CONTEXT_TOKENS on the leader{own_words}"
    return f"{FALLBACK_CONTEXT} tokens: the model's config names no context length"


def check_prompt_bytes(text: Any, model_dir: Path | str, context_tokens: int) -> None:
    """ContextTooLong when ``text`` cannot fit in ``context_tokens`` tokens by its byte count alone. It walks the whole
    text: call it in a worker thread for a big body."""
    size = text_bytes(text)
    limit = context_tokens * longest_token_bytes(str(model_dir))
    if size > limit:
        raise ContextTooLong(
            f"the prompt has {size} bytes of text, more than the {context_tokens} tokens this model serves could "
            f"carry (at most {limit} bytes). This model's maximum context length on this pool is {context_tokens} "
            "tokens. Start a new conversation or send a shorter prompt."
        )


def check_replies(prompts: int, n: int, limit: int) -> None:
    """BadRequest (too_many_replies) when one request asks for more than ``limit`` replies (prompts x n): every reply is
    a request of its own on the ring, and a client that leaves must not leave more queued than that."""
    if prompts * n > limit:
        asked = f"{prompts} prompts x n {n}" if prompts > 1 else f"n {n}"
        raise BadRequest(
            f"this request asks for {prompts * n} replies ({asked}); one request may ask for at most {limit} "
            f"(SWARM_SERVE_REQUEST_REPLIES). Split it into requests of at most {limit} replies each: fewer prompts "
            "per request, or a smaller n.", "too_many_replies")


def chat_body_limit(context_tokens: int) -> int:
    """The largest /v1 body worth reading: a prompt as long as the largest served context, plus room for the rest
    (BODY_BYTES_PER_TOKEN says why)."""
    return context_tokens * BODY_BYTES_PER_TOKEN + CHAT_BODY_MARGIN


class BodyLimit:
    """ASGI middleware: refuse an HTTP request body over its route's limit with 413, without reading the rest.

    ``limit_for(path) -> bytes`` picks the limit. A Content-Length over it is refused at once; a chunked body is
    counted as it arrives and raises BodyTooLarge (mapped to 413) in whoever reads it. The paths of ``flat_errors``
    (Ollama's API) answer ``{"error": message}``, those of ``anthropic_errors`` (Anthropic's Messages API) its
    ``{"type": "error", "error": {"type", "message"}}``, the others the /v1 and /api/v1 shape.
    """

    def __init__(self, app: ASGIApp, limit_for, flat_errors: frozenset[str] = frozenset(),
                 anthropic_errors: frozenset[str] = frozenset()):
        self.app = app
        self.limit_for = limit_for
        self.flat_errors = flat_errors
        self.anthropic_errors = anthropic_errors

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope["path"])
        shape = "flat" if scope["path"] in self.flat_errors else (
            "anthropic" if scope["path"] in self.anthropic_errors else "openai")
        length = dict(scope.get("headers") or []).get(b"content-length")
        try:
            declared = int(length) if length is not None else None
        except ValueError:
            declared = None
        if declared is not None and declared > limit:
            await _too_large(send, limit, shape)
            return
        received = 0
        started = False

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(too_large(limit))
            return message

        async def tracked_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge:
            if not started:
                await _too_large(send, limit, shape)


def too_large(limit: int) -> str:
    return (f"the request body is larger than the {limit} bytes this route accepts. Send less in one request (a "
            "batch of prompts split over several requests, a shorter conversation).")


async def _too_large(send: Send, limit: int, shape: str = "openai") -> None:
    message = too_large(limit)
    if shape == "anthropic":
        answer: dict = {"type": "error", "error": {"type": "request_too_large", "message": message}}
    elif shape == "flat":
        answer = {"error": message}
    else:
        answer = {"error": {"message": message, "type": "body_too_large", "code": "body_too_large"}}
    body = json.dumps(answer).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


__all__ = ["FALLBACK_CONTEXT", "BodyLimit", "chat_body_limit", "check_prompt_bytes", "check_replies", "context_reason",
           "longest_token_bytes", "model_context", "served_context", "text_bytes"]
