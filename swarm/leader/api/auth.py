"""Who is asking: an API token (programs), a session cookie (the browser, with CSRF), or a node credential (fellows)."""

from __future__ import annotations

import hmac

import trio
from starlette.requests import HTTPConnection

from swarm.errors import AuthError, Forbidden

SESSION_COOKIE = "swarm_session"
CSRF_HEADER = "x-csrf-token"
UNSAFE = {"POST", "PUT", "PATCH", "DELETE"}


def bearer(conn: HTTPConnection) -> str | None:
    header = conn.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip() or None
    return None


def api_key(conn: HTTPConnection) -> str | None:
    """An API token sent as Bearer, or as Anthropic's clients send theirs (``x-api-key``)."""
    return bearer(conn) or conn.headers.get("x-api-key", "").strip() or None


async def current_user(conn: HTTPConnection, store):
    """The signed-in user, or AuthError. Cookie-authenticated unsafe requests must carry the CSRF token."""
    token = api_key(conn)
    if token:
        user = await trio.to_thread.run_sync(store.api_token_user, token)
        if user is None:
            raise AuthError("the API token is not valid: create one under Settings > API or with the admin token.")
        return user
    session = conn.cookies.get(SESSION_COOKIE)
    if session:
        found = await trio.to_thread.run_sync(store.session_user, session)
        if found is not None:
            user, csrf = found
            method = conn.scope.get("method", "GET")
            if method in UNSAFE and not hmac.compare_digest(conn.headers.get(CSRF_HEADER, ""), csrf):
                raise AuthError("the request lacks the page's CSRF token; reload the page and try again.")
            return user
    raise AuthError("sign in, or send an API token as 'Authorization: Bearer <token>'.")


async def current_admin(conn: HTTPConnection, store, why: str = "this needs an admin account."):
    """The signed-in user if an admin, else Forbidden saying ``why``."""
    user = await current_user(conn, store)
    if not user.is_admin:
        raise Forbidden(why)
    return user


async def current_fellow(conn: HTTPConnection, store):
    token = bearer(conn)
    fellow = await trio.to_thread.run_sync(store.fellow_by_credential, token) if token else None
    if fellow is None:
        raise AuthError("the node credential was refused; restart `swarm join` so the fellow gets a fresh one.")
    return fellow
