"""The trio driver of one loaded stage: the ring protocol (swarm.stage.protocol) fed with what arrives, compute in a
worker thread, and the protocol's actions carried out -- messages to the next stage over the hop, failures and
tokens to the leader, caches dropped.

One task works through the stage: it takes every message waiting, computes the next batch the protocol names
(forward pass, sampling, the copy off the device and the wire encoding, all in the thread), then acts on the result.

The stage serves one ring generation at a time (``ring_id``, set when the leader links the stage). Relinking starts a
fresh protocol: the requests of the old generation are dropped with their caches, and messages that still arrive for
it -- or computations that finish for it -- are ignored.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from swarm import messages, wire
from swarm.errors import ProtocolError, SwarmError
from swarm.fellow import compute
from swarm.fellow.verify import StageAudits
from swarm.mesh.hop import OutgoingHop
from swarm.stage.protocol import StageProtocol
from swarm.stage.protocol_records import PromptLogprobs, Release, Report, Send, Stream
from swarm.stage.timing import StageTimer

log = logging.getLogger(__name__)

# Messages waiting for the stage. A ring hop delivers at most a few per request in flight; far more means the stage
# cannot keep up, and the link then waits rather than the fellow's memory growing without bound.
INBOX_SIZE = 10_000


class StageDriver:
    def __init__(self, *, model: str, stage_model, send_to_leader: Callable[[Any], Awaitable[None]],
                 prefill_chunk: int, max_batch: int = 16, threads: Callable[[int], int | None] | None = None):
        self.model = model
        # Torch threads for a pass, given how many requests the stage holds (None: leave them as they are).
        self.threads = threads or (lambda requests: None)
        self.stage_model = stage_model
        self.prefill_chunk = prefill_chunk
        self.max_batch = max_batch
        self.protocol: StageProtocol | None = None  # None until the stage is linked into a ring
        self.timer: StageTimer | None = None  # where each request's time goes here, for the leader
        self.out_hop: OutgoingHop | None = None
        self.ring_id: str | None = None
        # Cancelled when the generation ends: a send stuck on a hop of the old ring (a dead peer, a relay channel the
        # leader closed) must not hold up the stage's work in the new one.
        self._acting: set[trio.CancelScope] = set()
        self._send_to_leader = send_to_leader
        self._inbox_send, self._inbox = trio.open_memory_channel[tuple[str | None, Any]](INBOX_SIZE)
        self._streamed: dict[str, messages.TokenBatch] = {}  # last stage: tokens waiting for the next post
        self._times: list[messages.StageTimes] = []  # requests' times here, posted after the tokens
        self._stream_ready = trio.Event()
        self.last_used = trio.current_time()
        self.audits = StageAudits(model, stage_model)  # the leader's spot checks of this stage (swarm.fellow.verify)

    @property
    def index(self) -> int | None:
        return self.protocol.index if self.protocol is not None else None

    @property
    def busy(self) -> bool:
        return self.protocol is not None and self.protocol.busy

    # --- ring generations ---------------------------------------------------------------------------------------

    def relink(self, ring_id: str, index: int, num_stages: int, out_hop: OutgoingHop | None) -> None:
        self.unlink()
        self.protocol = StageProtocol(model=self.model, index=index, num_stages=num_stages,
                                      prefill_chunk=self.prefill_chunk, max_batch=self.max_batch)
        self.timer = StageTimer(self.model, index, num_stages)
        self.out_hop, self.ring_id = out_hop, ring_id
        self.last_used = trio.current_time()

    def unlink(self) -> None:
        if self.protocol is not None:
            for rid in list(self.protocol.requests):
                self.stage_model.drop(rid)
        self.protocol = self.out_hop = self.ring_id = self.timer = None
        self.audits.clear()
        self._streamed.clear()
        for scope in self._acting:
            scope.cancel()

    # --- running ------------------------------------------------------------------------------------------------

    async def deliver(self, message: Any, ring_id: str | None = None) -> None:
        """A ring message for this stage: from the control link (the current generation) or from an incoming hop
        of generation ``ring_id``."""
        self.last_used = trio.current_time()
        if self.timer is not None and (ring_id or self.ring_id) == self.ring_id:
            self.timer.arrived(message, time.perf_counter())  # on arrival: a wait in the inbox is not the link's
        await self._inbox_send.send((ring_id or self.ring_id, message))

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        from swarm.stage.execute import run_batch  # torch: imported once a stage is placed here

        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._post_tokens)
            task_status.started()
            while True:
                while True:  # everything that arrived while the last batch computed
                    try:
                        ring_id, message = self._inbox.receive_nowait()
                    except trio.WouldBlock:
                        break
                    await self._receive(ring_id, message)
                protocol = self.protocol
                batch = protocol.next_batch() if protocol is not None else []
                if not batch:
                    await self._receive(*await self._inbox.receive())
                    continue
                assert protocol is not None and self.timer is not None  # a batch came from the ring's protocol
                timer = self.timer
                samples: list = []
                self.audits.before(batch)
                try:
                    threads = self.threads(len(protocol.requests))
                    began = time.perf_counter()
                    output = await compute.run(run_batch, self.stage_model, batch, threads)
                    timer.computed(batch, time.perf_counter() - began)
                except Exception as exc:  # a bug in one request must not take the stage down
                    if not isinstance(exc, SwarmError):
                        log.exception("stage %s of %s failed a batch", protocol.index, self.model)
                    text = str(exc) if isinstance(exc, SwarmError) else \
                        f"stage {protocol.index} failed: {type(exc).__name__}: {exc}"
                    actions = protocol.compute_failed(batch, text)
                else:
                    actions = protocol.computed(batch, output)
                    samples = self.audits.after(batch, output, protocol.is_last)
                if self.protocol is not protocol:  # relinked while computing: that work belongs to no ring now
                    for work in batch:
                        for rid in [work.rid, *(m.rid for m in work.request.members)]:  # a group's copies too
                            self.stage_model.drop(rid)
                    continue
                await self._perform(protocol, actions)
                for sample in samples:  # after the pass's output is on its way: off the reply's path
                    nursery.start_soon(self._send_sample, sample)

    async def _send_sample(self, sample: dict) -> None:
        try:
            await self._send_to_leader(sample)
        except SwarmError as exc:
            log.warning("could not send a checked pass to the leader: %s", exc)

    async def _receive(self, ring_id: str | None, message: Any) -> None:
        protocol = self.protocol
        if protocol is None or ring_id != self.ring_id:
            return  # left behind by an earlier ring generation
        try:
            actions = protocol.receive(message)
        except ProtocolError as exc:
            log.warning("stage %s of %s ignored a message: %s", protocol.index, self.model, exc)
            return
        await self._perform(protocol, actions)

    async def _perform(self, protocol: StageProtocol, actions: list) -> None:
        scope = trio.CancelScope()
        self._acting.add(scope)
        try:
            with scope:
                await self._perform_in_generation(protocol, actions)
        finally:
            self._acting.discard(scope)
            if self._streamed or self._times:
                # Tokens (and times) go to the leader only now, once the pass's output is on its way to the next
                # stage: the post runs while the ring computes, not between this stage's pass and the next one's.
                # Measured on a 2-core VM, a 2-stage ring: 18.4 against 21 ms a token.
                self._stream_ready.set()

    async def _perform_in_generation(self, protocol: StageProtocol, actions: list) -> None:
        for action in actions:
            if self.protocol is not protocol:
                return  # relinked meanwhile: the rest belongs to the old ring
            if isinstance(action, Send):
                try:
                    await self._send_next(action.message)
                except SwarmError as exc:
                    await self._perform_in_generation(protocol, protocol.send_failed(action.message, str(exc)))
            elif isinstance(action, Stream):
                self._queue_token(action)
            elif isinstance(action, PromptLogprobs):
                self._batch(action.rid).prompt_logprobs.extend(action.entries)
            elif isinstance(action, Release):
                if action.end:  # the reply's blocks its plan keeps (copies of its rows: milliseconds)
                    from swarm.stage import prefix_cache  # torch: a stage is loaded here

                    prefix_cache.finish(self.stage_model, action)
                self.stage_model.drop(action.rid)
                self.audits.forget(action.rid)
                times = self.timer.finish(action.rid) if self.timer is not None else None
                if times is not None:
                    self._times.append(times)
            elif isinstance(action, Report):
                try:
                    await self._send_to_leader(action.message)
                except SwarmError as exc:
                    log.warning("could not tell the leader that %s failed: %s", action.message.rid, exc)

    async def _send_next(self, message: Any) -> None:
        if self.out_hop is None:
            raise SwarmError(f"stage {self.index} of {self.model} has no link to the next stage")
        ready = time.perf_counter()
        data = wire.encode(message)
        if self.timer is not None:
            self.timer.sent(message, len(data), ready)  # before the send: its token may be back before it returns
        await self.out_hop.send(data)

    # --- streaming to the leader ------------------------------------------------------------------------------------

    def _batch(self, rid: str) -> messages.TokenBatch:
        batch = self._streamed.get(rid)
        if batch is None:
            batch = self._streamed[rid] = messages.TokenBatch(rid, [])
        return batch

    def _queue_token(self, action: Stream) -> None:
        batch = self._batch(action.rid)
        batch.tokens.append(action.token)
        if action.logprob is not None:
            batch.logprobs.append(action.logprob)
        if action.finish_reason is not None:
            self._streamed[action.rid] = messages.TokenBatch(action.rid, batch.tokens, True, action.finish_reason,
                                                             batch.logprobs, batch.prompt_logprobs)

    async def _post_tokens(self) -> None:
        """Posts whatever piled up while the previous post was on its way, so the leader's round trip never limits
        how fast a reply streams."""
        while True:
            await self._stream_ready.wait()
            self._stream_ready = trio.Event()
            batches, self._streamed = list(self._streamed.values()), {}
            times, self._times = self._times, []
            try:
                if batches:
                    await self._send_to_leader(messages.Tokens(self.model, batches))
                for report in times:
                    await self._send_to_leader(report)
            except SwarmError as exc:
                log.warning("could not send tokens to the leader: %s", exc)
