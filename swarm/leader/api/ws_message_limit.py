"""Close the connection when a websocket message passes hypercorn's size limit (issue 32, finding 1).

hypercorn (0.18) answers a message over ``websocket_max_message_size`` with a close frame (1009) but keeps the TCP
connection and keeps appending what follows to the message it refused: one frame header announcing 2^40 bytes, then
zeros, made the leader buffer ~1 GB before the fellow link's 10 s hello deadline ended it. The connection is useless
once its message was refused (the peer cannot say anything else on it), so it is closed there and then, as hypercorn
closes one whose peer sent a close frame: nothing more is read.
"""

from __future__ import annotations

import functools

from hypercorn.protocol.events import StreamClosed
from hypercorn.protocol.ws_stream import WSStream


def close_on_oversize() -> None:
    """Patch ``WSStream._handle_events`` once (idempotent)."""
    handle = WSStream._handle_events
    if hasattr(handle, "__wrapped__"):
        return

    async def _handle_events(self) -> None:
        await handle(self)
        # The refused message stays in the buffer, counted past the limit: that is the sign hypercorn sent 1009.
        if self.buffer.length > self.buffer.max_length and not self.closed:
            await self.send(StreamClosed(stream_id=self.stream_id))

    functools.update_wrapper(_handle_events, handle)  # sets __wrapped__: patched once
    WSStream._handle_events = _handle_events  # type: ignore[method-assign]  # hypercorn has no hook for this
