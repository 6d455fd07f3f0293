"""Taking requests in: refusing those their model, quota, context or queue cannot take, submitting the others to the
ring (or its queue), and waiting until they start."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from swarm.errors import ModelNotLoaded, PoolBusy, QueueTimeout, counted
from swarm.leader.serving.models import (
    ModelStatus,
)
from swarm.leader.serving.request import Request, RequestState

if TYPE_CHECKING:
    from swarm.leader.serving.serving import Serving

log = logging.getLogger(__name__)


class Intake:
    """Admits requests to the rings of one leader (its :class:`~swarm.leader.serving.serving.Serving`)."""

    def __init__(self, serving: Serving):
        self.serving = serving

    async def submit(self, request: Request) -> Request:
        """Send ``request`` to its model's ring, or let it wait while the model loads or recovers; a model that went
        idle is loaded again for it."""
        await self.check(request)
        self.serving.perform(self.serving.book.submit(request))  # runs now, or waits for the ring or for room
        return request

    async def submit_group(self, requests: list[Request]) -> list[Request]:
        """Sampled choices of one prompt, as :meth:`submit`, started together so that the ring prefills the prompt
        once (RequestBook.submit_group)."""
        for i, request in enumerate(requests):
            await self.check(request, group=len(requests) if i == 0 else 0)  # the quotas count the group once
        self.serving.perform(self.serving.book.submit_group(requests))
        return requests

    async def check(self, request: Request, group: int = 1) -> None:
        """Refuses ``request`` when its model is not served, it is longer than the pool, its user or API token is
        over a quota (counting ``group`` requests of its kind), or the queue is full."""
        serving = self.serving.models.get(request.model)
        if serving is None:  # it went idle, or auto-load is on: loaded for this request (it waits meanwhile)
            serving = await self.serving.auto_load.ensure(request.model)
        else:
            self.serving.auto_load.touch(request.model)
        if serving is None or serving.status == ModelStatus.FAILED:
            state = "not loaded" if serving is None else f"failed to load ({serving.error})"
            off = ", and auto-load is off (the admin page)" if serving is None else ""
            raise ModelNotLoaded(
                f"model {request.model} is {state}{off}. Load it first (swarm model-load {request.model}, or Load on "
                f"the chat page), then send the request again."
            )
        self.serving.contexts.check_context(request.model, request.need, len(request.prompt), request.max_tokens)
        if self.serving.quotas is not None:
            self.serving.quotas.check(request, serving.pool_id, group)
        limit = self.serving.settings.serve_queue_limit
        if self.serving.book.queued(request.model) >= limit:
            wait = self.serving.book.retry_after(request.model)
            raise PoolBusy(f"the pool serving {request.model} is busy: its queue is full, with "
                           f"{counted(limit, 'request')} waiting (SWARM_SERVE_QUEUE_LIMIT). Send this one again in "
                           f"about {wait} s.", wait)

    async def wait_started(self, requests: list[Request], receive=None) -> bool:
        """Until every one of ``requests`` (the replies of one API request) leaves the queue: it runs on the ring, or
        it ended. A request that waits longer than SWARM_SERVE_QUEUE_TIMEOUT_S is taken out of the queue and refused
        (QueueTimeout: a 503), and the others with it. With ``receive`` (the ASGI receive of the client's connection),
        a client that goes away meanwhile cancels every one of them at once rather than leave them to run for nobody
        (issue 32: a streamed request of 16 replies left 15 running): True then, else False."""
        gone = False

        async def watch(cancel_scope: trio.CancelScope) -> None:
            nonlocal gone
            await client_gone(receive)
            gone = True
            log.info("request %s: its client went away while it waited to start", requests[0].id)
            for request in requests:
                self.serving.cancel(request)
            cancel_scope.cancel()

        refused: QueueTimeout | None = None
        async with trio.open_nursery() as nursery:
            if receive is not None:
                nursery.start_soon(watch, nursery.cancel_scope)
            try:
                for request in requests:
                    await self._wait_one(request)
            except QueueTimeout as exc:  # raised out here, not as an exception group of the nursery
                refused = exc
            nursery.cancel_scope.cancel()
        if refused is not None:
            raise refused
        return gone

    async def _wait_one(self, request: Request) -> None:
        timeout = self.serving.settings.serve_queue_timeout_s
        with trio.move_on_after(max(0.0, request.created_at + timeout - trio.current_time())):
            while request.state in (RequestState.NEW, RequestState.WAITING):
                await request.changed.wait()
        if request.state in (RequestState.NEW, RequestState.WAITING):
            ahead = self.serving.book.queued(request.model) + len(self.serving.book.of_model(request.model))
            self.serving.cancel(request)
            status = self.serving.status(request.model)
            if status == ModelStatus.READY:
                raise QueueTimeout(
                    f"this request waited {timeout:.0f} s for room on the pool serving {request.model} and did not "
                    f"start (SWARM_SERVE_QUEUE_TIMEOUT_S), with {counted(ahead - 1, 'other request')} running or "
                    "waiting. Try again later, or serve the model on more fellows.")
            raise QueueTimeout(
                f"model {request.model} was not ready within {timeout:.0f} s (SWARM_SERVE_QUEUE_TIMEOUT_S): it is "
                f"still {status.replace('_', ' ')}. Try again later.")


async def client_gone(receive) -> None:
    """Returns once the client of an ASGI request has gone (http.disconnect). Trio's memory channels lose nothing to a
    cancelled receive, so a watch cancelled before that leaves the message for whoever reads next."""
    while (await receive())["type"] != "http.disconnect":
        pass
