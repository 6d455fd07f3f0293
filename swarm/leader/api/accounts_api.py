"""The leader's REST API for accounts under /api/v1: signing in and out (a password, a login link), one's own
password, who is signed in, and one's API tokens."""

from __future__ import annotations

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response

from swarm.errors import AuthError, BadRequest, Forbidden
from swarm.leader.api.auth import SESSION_COOKIE, current_user
from swarm.leader.api.http_errors import json_body, problem
from swarm.leader.api.rest import as_dict, handles_errors
from swarm.leader.api.signin import MAX_PASSWORD_CHARS, check_password_rule


class AccountRoutes:
    def __init__(self, leader):
        self.leader = leader
        self.store = leader.store

    async def _json(self, request: Request) -> dict:
        return await json_body(request)

    # --- sign-in --------------------------------------------------------------------------------------------------

    @handles_errors
    async def login(self, request: Request):
        # Login CSRF: another site's form can POST text/plain here with no preflight and sign the browser into the
        # attacker's account. JSON only (a cross-site JSON POST needs a CORS preflight, which the leader never
        # grants), and a browser's Origin, when it sends one, must be this leader.
        if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            raise BadRequest("sign in with a JSON body (Content-Type: application/json).", "json_required")
        origin = request.headers.get("origin")
        # (the host only: behind a TLS-terminating proxy the page is https and the leader sees http)
        if origin is not None and origin.rstrip("/").split("://")[-1] != request.headers.get("host", ""):
            raise Forbidden("sign-in from another site's page is refused; open the leader's own sign-in page.")
        body = await self._json(request)
        name, password = body.get("name"), body.get("password")
        if not isinstance(name, str) or not isinstance(password, str):
            raise BadRequest('send {"name": "...", "password": "..."} (both strings).', "invalid_credentials")
        user = await self.check_password(request, name, password)
        return await self._signed_in(request, user, JSONResponse({"user": as_dict(user)}))

    async def check_password(self, request: Request, name: str, password: str):
        """The user, if ``password`` is theirs -- throttled per account and address, hashed in its own pool."""
        address = request.client.host if request.client else "unknown"
        self.leader.signin.check(name, address)
        try:
            if len(password) > MAX_PASSWORD_CHARS:
                raise AuthError("wrong user name or password; check both and try again.")
            user = await self.leader.hashing.run(self.store.verify_password, name, password)
        except AuthError:
            self.leader.signin.failed(name, address)
            raise
        self.leader.signin.succeeded(name, address)
        return user

    @handles_errors
    async def password(self, request: Request):
        """Change one's own password: the current one, then the new one; other browsers are signed out."""
        user = await current_user(request, self.store)
        body = await self._json(request)
        current = body.get("current_password")
        if not isinstance(current, str):
            raise BadRequest("send current_password and new_password.", "invalid_password")
        new = check_password_rule(body.get("new_password"))
        await self.check_password(request, user.name, current)
        await self.leader.hashing.run(self.store.set_password, user.id, new)
        if request.cookies.get(SESSION_COOKIE) and not request.headers.get("authorization"):
            # Every session ended with the old password; this browser gets a new one (and the page its CSRF token).
            session, csrf = await trio.to_thread.run_sync(self.store.create_session, user.id)
            response = JSONResponse({"changed": True, "csrf": csrf})
            self._set_session_cookie(request, response, session)
            return response
        return JSONResponse({"changed": True})

    async def _signed_in(self, request: Request, user, response: Response) -> Response:
        session, _ = await trio.to_thread.run_sync(self.store.create_session, user.id)
        self._set_session_cookie(request, response, session)
        return response

    @staticmethod
    def _set_session_cookie(request: Request, response: Response, session: str) -> None:
        response.set_cookie(SESSION_COOKIE, session, httponly=True, samesite="lax", max_age=30 * 86400,
                            secure=request.url.scheme == "https")

    async def login_link(self, request: Request):
        token = request.query_params.get("token", "")
        user = await trio.to_thread.run_sync(self.store.use_login_link, token) if token else None
        if user is None:
            return RedirectResponse("/login?expired=1", status_code=303)
        home = await self.leader.home_path(user)
        return await self._signed_in(request, user, RedirectResponse(home, status_code=303))

    @handles_errors
    async def logout(self, request: Request):
        session = request.cookies.get(SESSION_COOKIE)
        if session and await trio.to_thread.run_sync(self.store.session_user, session) is not None:
            # A live session signs out with the page's CSRF token, as every cookie-authenticated POST: without it
            # any site could sign its visitors out of the leader.
            await current_user(request, self.store)
            await trio.to_thread.run_sync(self.store.delete_session, session)
        response = JSONResponse({"ok": True})
        response.delete_cookie(SESSION_COOKIE)
        return response

    @handles_errors
    async def me(self, request: Request):
        user = await current_user(request, self.store)
        csrf = None
        session = request.cookies.get(SESSION_COOKIE)
        if session and not request.headers.get("authorization"):
            found = await trio.to_thread.run_sync(self.store.session_user, session)
            csrf = found[1] if found else None
        return JSONResponse({"user": as_dict(user), "csrf": csrf, "home": await self.leader.home_path(user)})

    # --- API tokens -----------------------------------------------------------------------------------------------

    @handles_errors
    async def tokens(self, request: Request):
        user = await current_user(request, self.store)
        if request.method == "POST":
            body = await self._json(request)
            name = str(body.get("name") or "token")[:64]
            plaintext, token = await trio.to_thread.run_sync(self.store.create_api_token, user.id, name,
                                                             self.leader.settings.api_tokens_per_user)
            return JSONResponse({"token": plaintext, **as_dict(token)}, status_code=201)
        tokens = await trio.to_thread.run_sync(self.store.list_api_tokens, user.id)
        return JSONResponse({"tokens": [as_dict(t) for t in tokens]})

    @handles_errors
    async def token_delete(self, request: Request):
        user = await current_user(request, self.store)
        ok = await trio.to_thread.run_sync(self.store.delete_api_token, user.id, int(request.path_params["token_id"]))
        if not ok:
            return problem(404, "no such token", "not_found")
        return JSONResponse({"deleted": True})
