"""The trio driver of one loaded stage: the ring protocol (swarm.stage.protocol) fed with what arrives, compute in a
worker thread, and the protocol's actions carried out -- messages to the next stage over the hop, failures and
tokens to the leader, caches dropped.

One task works through the stage: it takes every message waiting, computes the next batch the protocol names
(forward pass, sampling, the copy off the device and the wire encoding, all in the thread), then acts on the result.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from swarm import messages, wire
from swarm.errors import ProtocolError, SwarmError
from swarm.mesh.hop import OutgoingHop
from swarm.stage.protocol import Release, Report, Send, StageProtocol, Stream

log = logging.getLogger(__name__)

# Messages waiting for the stage. A ring hop delivers at most a few per request in flight; far more means the stage
# cannot keep up, and the link then waits rather than the fellow's memory growing without bound.
INBOX_SIZE = 10_000


class StageDriver:
    def __init__(
        self,
        *,
        model: str,
        index: int,
        num_stages: int,
        stage_model,
        out_hop: OutgoingHop | None,
        send_to_leader: Callable[[Any], Awaitable[None]],
        prefill_chunk: int,
    ):
        self.model = model
        self.index = index
        self.num_stages = num_stages
        self.protocol = StageProtocol(model=model, index=index, num_stages=num_stages, prefill_chunk=prefill_chunk)
        self.stage_model = stage_model
        self.out_hop = out_hop
        self._send_to_leader = send_to_leader
        self._inbox_send, self._inbox = trio.open_memory_channel[Any](INBOX_SIZE)
        self._streamed: dict[str, messages.TokenBatch] = {}  # last stage: tokens waiting for the next post to the leader
        self._stream_ready = trio.Event()
        self.last_used = trio.current_time()

    async def deliver(self, message: Any) -> None:
        """A ring message for this stage (from the control link or an incoming hop)."""
        self.last_used = trio.current_time()
        await self._inbox_send.send(message)

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        from swarm.stage.execute import run_batch  # torch: imported once a stage is placed here

        async with trio.open_nursery() as nursery:
            if self.protocol.is_last:
                nursery.start_soon(self._post_tokens)
            task_status.started()
            while True:
                while True:  # everything that arrived while the last batch computed
                    try:
                        message = self._inbox.receive_nowait()
                    except trio.WouldBlock:
                        break
                    await self._receive(message)
                batch = self.protocol.next_batch()
                if not batch:
                    await self._receive(await self._inbox.receive())
                    continue
                try:
                    output = await trio.to_thread.run_sync(run_batch, self.stage_model, batch)
                except Exception as exc:  # a bug in one request must not take the stage down
                    if not isinstance(exc, SwarmError):
                        log.exception("stage %s of %s failed a batch", self.index, self.model)
                    actions = self.protocol.compute_failed(
                        batch, str(exc) if isinstance(exc, SwarmError)
                        else f"stage {self.index} failed: {type(exc).__name__}: {exc}")
                else:
                    actions = self.protocol.computed(batch, output)
                await self._perform(actions)

    async def _receive(self, message: Any) -> None:
        try:
            actions = self.protocol.receive(message)
        except ProtocolError as exc:
            log.warning("stage %s of %s ignored a message: %s", self.index, self.model, exc)
            return
        await self._perform(actions)

    async def _perform(self, actions: list) -> None:
        for action in actions:
            if isinstance(action, Send):
                try:
                    await self._send_next(action.message)
                except SwarmError as exc:
                    await self._perform(self.protocol.send_failed(action.message, str(exc)))
            elif isinstance(action, Stream):
                self._queue_token(action)
            elif isinstance(action, Release):
                self.stage_model.drop(action.rid)
            elif isinstance(action, Report):
                try:
                    await self._send_to_leader(action.message)
                except SwarmError as exc:
                    log.warning("could not tell the leader that %s failed: %s", action.message.rid, exc)

    async def _send_next(self, message: Any) -> None:
        if self.out_hop is None:
            raise SwarmError(f"stage {self.index} of {self.model} has no link to the next stage")
        await self.out_hop.send(wire.encode(message))

    # --- streaming to the leader ------------------------------------------------------------------------------------

    def _queue_token(self, action: Stream) -> None:
        batch = self._streamed.get(action.rid)
        if batch is None:
            batch = self._streamed[action.rid] = messages.TokenBatch(action.rid, [])
        batch.tokens.append(action.token)
        if action.finish_reason is not None:
            self._streamed[action.rid] = messages.TokenBatch(action.rid, batch.tokens, True, action.finish_reason)
        self._stream_ready.set()

    async def _post_tokens(self) -> None:
        """Posts whatever piled up while the previous post was on its way, so the leader's round trip never limits
        how fast a reply streams."""
        while True:
            await self._stream_ready.wait()
            self._stream_ready = trio.Event()
            batches, self._streamed = list(self._streamed.values()), {}
            if batches:
                try:
                    await self._send_to_leader(messages.Tokens(self.model, batches))
                except SwarmError as exc:
                    log.warning("could not send tokens to the leader: %s", exc)
