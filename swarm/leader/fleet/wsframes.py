"""Noise frames over a Starlette (server-side) websocket: one binary message per frame."""

from __future__ import annotations

from starlette.websockets import WebSocket, WebSocketDisconnect

from swarm.errors import LinkClosed, ProtocolError


class ServerWebSocketFrameTransport:
    def __init__(self, ws: WebSocket):
        self.ws = ws

    async def send_frame(self, data: bytes) -> None:
        try:
            await self.ws.send_bytes(data)
        except (WebSocketDisconnect, RuntimeError, OSError) as exc:
            raise LinkClosed(f"the websocket closed while sending ({exc})") from None

    async def receive_frame(self) -> bytes:
        try:
            message = await self.ws.receive()
        except (WebSocketDisconnect, RuntimeError, OSError) as exc:
            raise LinkClosed(f"the websocket closed ({exc})") from None
        if message["type"] == "websocket.disconnect":
            raise LinkClosed("the websocket closed")
        data = message.get("bytes")
        if data is None:
            raise ProtocolError("expected a binary websocket message, got text")
        return data

    async def aclose(self) -> None:
        try:
            await self.ws.close()
        except (RuntimeError, OSError):  # already closed or broken: nothing left to close
            pass
