"""Noise frames over a trio-websocket connection: one binary websocket message per frame."""

from __future__ import annotations

import trio_websocket

from swarm.errors import LinkClosed, ProtocolError


class WebSocketFrameTransport:
    """A FrameTransport (see swarm.tunnel.channel) over a client-side trio-websocket connection."""

    def __init__(self, ws: trio_websocket.WebSocketConnection):
        self.ws = ws

    async def send_frame(self, data: bytes) -> None:
        try:
            await self.ws.send_message(data)
        except trio_websocket.ConnectionClosed as exc:
            raise LinkClosed(f"the websocket closed while sending ({exc.reason})") from None

    async def receive_frame(self) -> bytes:
        try:
            message = await self.ws.get_message()
        except trio_websocket.ConnectionClosed as exc:
            raise LinkClosed(f"the websocket closed ({exc.reason})") from None
        if isinstance(message, str):
            raise ProtocolError("expected a binary websocket message, got text")
        return message

    async def aclose(self) -> None:
        await self.ws.aclose()


def ws_url(http_url: str, path: str) -> str:
    """``http://host:port`` + ``/x`` -> ``ws://host:port/x`` (https -> wss)."""
    base = http_url.rstrip("/")
    if base.startswith("https://"):
        base = "wss://" + base[len("https://") :]
    elif base.startswith("http://"):
        base = "ws://" + base[len("http://") :]
    return base + path
