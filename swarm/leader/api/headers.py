"""Security headers on every response of the leader: what the browser may load, and that no other site may frame
the pages (clickjacking) or sniff a JSON answer into HTML.

The pages load only the leader's own scripts (vendored marked, DOMPurify, highlight.js, KaTeX), so ``script-src
'self'`` holds; inline ``style`` attributes stay allowed because the page and KaTeX set them (a style cannot run
code). Over HTTPS the browser is also told to keep to HTTPS.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
    "font-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)
HEADERS = [
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
]
HSTS = (b"strict-transport-security", b"max-age=31536000")


class SecurityHeaders:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        extra = HEADERS + ([HSTS] if scope.get("scheme") == "https" else [])

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                present = {name.lower() for name, _ in message.get("headers", [])}
                message = {**message, "headers": [*message.get("headers", []),
                                                  *(h for h in extra if h[0] not in present)]}
            await send(message)

        await self.app(scope, receive, send_with_headers)
