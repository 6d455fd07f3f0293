"""One command adds a PC: the leader serves its install scripts with the join details filled in.

    curl -fsSL "http://SERVER:8000/install.sh?token=swj1…" | sh                 (Linux, macOS)
    irm "http://SERVER:8000/install.ps1?token=swj1…" | iex                      (Windows PowerShell)

The scripts (swarm/web/install/) install swarm from this leader: the wheel its fellows update to
(swarm.leader.fleet.updates), downloaded with the join token and checked against the sha256 written into the script. The
join token is checked here but not used up: the script's `swarm join --check` takes its use when the PC enrols.

A refusal (no token, a bad or spent one) is answered as a script that prints the reason and exits 1, with status 200:
`curl -f` would swallow a 4xx body and show only its own "error: 403", which tells the user nothing.
"""

from __future__ import annotations

import re
from pathlib import Path

import trio
from starlette.requests import Request
from starlette.responses import PlainTextResponse

from swarm.errors import AuthError, SwarmError
from swarm.tunnel.join_token import parse_join_token

SCRIPTS = Path(__file__).resolve().parent.parent.parent / "web" / "install"
_SAFE_URL = re.compile(r"^https?://[A-Za-z0-9.\-\[\]:]+$")  # goes into a single-quoted shell string
_SAFE_TOKEN = re.compile(r"^[A-Za-z0-9_.\-]+$")


def fill(template: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        template = template.replace(f"@@{key}@@", value)
    return template


def refusal(kind: str, message: str) -> PlainTextResponse:
    text = message.replace("'", "’")
    if kind == "sh":
        body = f"#!/bin/sh\nprintf '%s\\n' 'error: {text}' >&2\nexit 1\n"
    else:
        body = f"Write-Host 'error: {text}' -ForegroundColor Red\nexit 1\n"
    return PlainTextResponse(body, media_type="text/plain; charset=utf-8")


async def join_token_pool(store, token: str) -> int:
    """The pool a join token admits to, checked without taking a use (AuthError when it cannot join)."""
    _, secret = parse_join_token(token)
    return await trio.to_thread.run_sync(store.check_join_token, secret)


class InstallRoutes:
    def __init__(self, leader):
        self.leader = leader

    async def script(self, request: Request):
        kind = "sh" if request.url.path.endswith(".sh") else "ps1"
        token = request.query_params.get("token", "").strip()
        url = f"{request.url.scheme}://{request.url.netloc}"
        if not token:
            return refusal(kind, "this install command needs a join token: copy the whole command from the leader's "
                                 "admin page (Admin > Join tokens > New join token).")
        if not _SAFE_TOKEN.match(token) or not _SAFE_URL.match(url):
            return refusal(kind, "the install command is garbled; copy it again from the leader's admin page.")
        try:
            await join_token_pool(self.leader.store, token)
            offer = await self.leader.hub.updates.offer()
        except SwarmError as exc:
            return refusal(kind, str(exc))
        template = await trio.to_thread.run_sync((SCRIPTS / f"install.{kind}").read_text)
        body = fill(template, {"LEADER_URL": url, "JOIN_TOKEN": token, "WHEEL_FILE": offer["file"],
                               "WHEEL_SHA256": offer["sha256"]})
        return PlainTextResponse(body, media_type="text/plain; charset=utf-8", headers={"cache-control": "no-store"})


async def wheel_reader(request: Request, store) -> None:
    """Who may download the leader's wheel: a fellow (node credential) or a PC installing (a valid join token)."""
    from swarm.leader.api.auth import bearer, current_fellow

    try:
        await current_fellow(request, store)
    except AuthError:
        token = bearer(request) or ""
        if not token.startswith("swj1."):
            raise
        await join_token_pool(store, token)
