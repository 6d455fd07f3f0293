"""A guard around a race in hypercorn's trio server (0.18) that took the whole leader down.

When a connection closes, hypercorn's ``TCPServer._close`` shuts the write side (``send_eof``) without its send lock.
A websocket frame sent at that moment (hypercorn's own answer to the peer's close, say) then finds trio's stream
busy and raises ``trio.BusyResourceError`` out of the connection's task, and with it out of ``serve``: every chat
and every fellow link ended with it (seen when a fellow closed its link to update itself). The connection is
closing anyway, so such a send is dropped, as hypercorn drops one to a stream that is already gone.
"""

from __future__ import annotations

import logging

import trio
from hypercorn.trio.tcp_server import TCPServer

log = logging.getLogger(__name__)


def guard_close_race() -> None:
    """Patch ``TCPServer.protocol_send`` once (idempotent)."""
    send = TCPServer.protocol_send
    if hasattr(send, "__wrapped__"):
        return

    async def protocol_send(self, event) -> None:
        try:
            await send(self, event)
        except trio.BusyResourceError:
            log.debug("dropped a send to a connection that was closing")

    protocol_send.__wrapped__ = send  # type: ignore[attr-defined]  # the original, as functools.wraps keeps it
    TCPServer.protocol_send = protocol_send  # type: ignore[method-assign]  # the patch this module makes
