"""One map from exceptions to HTTP responses, for both of the leader's APIs: /v1 answers in the OpenAI error shape
({"error": {"message", "type", "code"}}), /api/v1 in its own ({"error": {"message", "type": code, "code"}}).

A SwarmError is what a user can act on: its message says what happened and what to do. Anything else escaping a
route is our bug: a 500 that says so, with the details in the leader's log -- never a 4xx that blames the client.
"""

from __future__ import annotations

import json
import logging

import trio
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse

from swarm.errors import (
    AuthError,
    BadRequest,
    BodyTooLarge,
    ContextTooLong,
    DrainRefused,
    Forbidden,
    ModelNotFound,
    ModelNotLoaded,
    PlacementError,
    PoolBusy,
    PoolNotFound,
    QueueTimeout,
    QuotaExceeded,
    ResponseNotFound,
    StoreError,
    SwarmError,
    TooManyAttempts,
)
from swarm.leader.api.limits import PARSE_IN_THREAD
from swarm.store.accounts import TokenLimitReached
from swarm.store.chats import ChatLimitReached, ChatTooLarge

log = logging.getLogger(__name__)

# exception class -> (HTTP status, code, OpenAI error type); the first class that matches wins.
_TABLE: list[tuple[type, int, str, str]] = [
    (Forbidden, 403, "forbidden", "permission_error"),
    (AuthError, 401, "unauthorized", "authentication_error"),
    (TooManyAttempts, 429, "too_many_attempts", "rate_limit_error"),
    (ModelNotFound, 404, "not_found", "invalid_request_error"),
    (PoolNotFound, 404, "pool_not_found", "invalid_request_error"),
    (ResponseNotFound, 404, "response_not_found", "invalid_request_error"),
    (ContextTooLong, 413, "context_length_exceeded", "invalid_request_error"),
    (BodyTooLarge, 413, "body_too_large", "invalid_request_error"),
    (ChatTooLarge, 413, "chat_too_large", "invalid_request_error"),
    (ChatLimitReached, 409, "chat_limit_reached", "invalid_request_error"),
    (TokenLimitReached, 409, "token_limit_reached", "invalid_request_error"),
    (DrainRefused, 409, "drain_refused", "invalid_request_error"),
    (PlacementError, 409, "placement_refused", "invalid_request_error"),
    (ModelNotLoaded, 503, "model_not_loaded", "server_error"),
    (PoolBusy, 429, "pool_busy", "rate_limit_error"),
    (QuotaExceeded, 429, "quota_exceeded", "rate_limit_error"),
    (QueueTimeout, 503, "queue_timeout", "server_error"),
    (BadRequest, 400, "bad_request", "invalid_request_error"),
    (StoreError, 400, "store_refused", "invalid_request_error"),
    (SwarmError, 500, "swarm_error", "server_error"),
]
_OPENAI_CODES = {"unauthorized": "invalid_api_key", "not_found": "model_not_found"}


def classify(exc: BaseException) -> tuple[int, str, str, str]:
    """(status, code, OpenAI type, message) for an exception; logs what is our bug."""
    for cls, status, code, openai_type in _TABLE:
        if isinstance(exc, cls):
            if isinstance(exc, BadRequest):
                code = exc.code
            return status, code, openai_type, str(exc)
    if isinstance(exc, ClientDisconnect):  # not our bug: the client left while sending; nobody reads the answer
        log.info("a client went away before it had sent its whole request")
        return 400, "client_disconnected", "invalid_request_error", "the client went away while sending its request."
    log.error("unexpected error answering a request", exc_info=exc)
    return (500, "internal_error", "server_error",
            (f"internal error in the leader ({type(exc).__name__}); this is a bug in swarm, and the leader's log has "
             "the details. Try again; report it if it keeps happening."))


def api_error(exc: BaseException) -> JSONResponse:
    status, code, _, message = classify(exc)
    return problem(status, message, code, headers=_headers(exc))


def openai_error(exc: BaseException) -> JSONResponse:
    status, code, openai_type, message = classify(exc)
    return openai_problem(status, message, openai_type, _OPENAI_CODES.get(code, code), headers=_headers(exc))


def _headers(exc: BaseException) -> dict | None:
    """Retry-After for a refusal that passes (a full queue): clients such as openai's wait that long and retry."""
    if isinstance(exc, (PoolBusy, TooManyAttempts, QuotaExceeded)) and exc.retry_after is not None:
        return {"retry-after": str(exc.retry_after)}
    return None


def problem(status: int, message: str, code: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": code, "code": code}}, status_code=status,
                        headers=headers)


def openai_problem(status: int, message: str, type_: str, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "code": code}}, status_code=status,
                        headers=headers)


async def json_body(request) -> dict:
    """The request's JSON object; BadRequest for anything else. A big body is parsed in a worker thread, so the event
    loop keeps answering meanwhile (issue 32)."""
    raw = await request.body()
    try:
        body = json.loads(raw) if len(raw) <= PARSE_IN_THREAD else await trio.to_thread.run_sync(json.loads, raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}", "invalid_json") from None
    except RecursionError:  # '{"a":' x 3000: Python's parser recurses per level (a 500 before the fuzz test)
        raise BadRequest("the request body nests JSON too deeply.", "invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object.", "invalid_json")
    return body
