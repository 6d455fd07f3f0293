"""The life of a chat request on the leader, as plain logic.

A :class:`Request` is what a client waits on: its prompt and settings, the tokens streamed so far, how it ended. The
:class:`RequestBook` decides what happens to requests -- submitted, tokens arrived, done, failed on a stage, a path
under them broke, retried before their first token, cancelled -- and answers with actions that
swarm.leader.serving carries out (a message for the fellow serving a model's stage 0). No I/O here, and nothing ever
waits on a client: a request's tokens pile up in the request, and its readers catch up at their own pace.

Each attempt on the ring has its own ring id (``rid``); the request keeps its ``id`` across attempts (what clients
see as x-swarm-request-id and cancel by). A request that fails before its first token is sent again once, unnoticed
by the user -- the hop whose direct link broke is on the relay by then.
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any

import trio

from swarm import messages

RETRIES_BEFORE_FIRST_TOKEN = 1


def new_rid() -> str:
    return "r" + secrets.token_hex(8)


@dataclasses.dataclass(eq=False)
class Request:
    model: str
    prompt: list[int]
    max_tokens: int
    sampling: messages.Sampling
    eos: list[int]
    id: str = ""  # stable across attempts
    rid: str = ""  # this attempt, on the ring
    owner: int | None = None  # the user who sent it
    tokens: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length" or "cancelled"
    error: str | None = None
    attempts: int = 0
    changed: trio.Event = dataclasses.field(default_factory=trio.Event)

    def __post_init__(self) -> None:
        self.rid = self.rid or new_rid()
        self.id = self.id or self.rid

    @property
    def ended(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def generate_message(self) -> messages.Generate:
        return messages.Generate(self.model, self.rid, self.prompt, self.max_tokens, self.eos, self.sampling)


class Reader:
    """One client's view of a request: the tokens it has not seen yet, then how the request ended."""

    def __init__(self, request: Request):
        self.request = request
        self.seen = 0

    async def next(self, stall_s: float) -> tuple[str, Any]:
        """("tokens", ids) / ("done", finish reason) / ("error", text); an error when the ring goes silent."""
        request = self.request
        while True:
            if len(request.tokens) > self.seen:
                new = request.tokens[self.seen :]
                self.seen = len(request.tokens)
                return "tokens", new
            if request.error is not None:
                return "error", request.error
            if request.finish_reason is not None:
                return "done", request.finish_reason
            changed = request.changed
            with trio.move_on_after(stall_s):
                await changed.wait()
                continue
            return "error", (f"the ring stopped answering: no token for {stall_s:.0f} s (SWARM_REQUEST_STALL_S). "
                             "A fellow may have gone away; send the message again.")


# --- actions ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ToStage0:
    """Send ``message`` (Generate or Cancel) to the fellow serving stage 0 of ``model``."""

    model: str
    message: Any


@dataclasses.dataclass(frozen=True)
class NotLoaded:
    """A fellow said it does not hold ``model``: the model is not served any more, whatever the leader thought."""

    model: str
    text: str


# --- the book --------------------------------------------------------------------------------------------------------


class RequestBook:
    def __init__(self, retries_before_first_token: int = RETRIES_BEFORE_FIRST_TOKEN):
        self.retries = retries_before_first_token
        self.by_rid: dict[str, Request] = {}

    def find(self, request_id: str) -> Request | None:
        return next((r for r in self.by_rid.values() if r.id == request_id), None)

    def of_model(self, model: str) -> list[Request]:
        return [r for r in self.by_rid.values() if r.model == model]

    def submit(self, request: Request) -> list:
        request.attempts += 1
        self.by_rid[request.rid] = request
        return [ToStage0(request.model, request.generate_message())]

    def on_tokens(self, message: messages.Tokens) -> None:
        for batch in message.batches:
            request = self.by_rid.get(batch.rid)
            if request is None or request.model != message.model:
                continue  # an attempt that was cancelled or retried: its late tokens are not the reply's
            request.tokens.extend(batch.tokens)
            if batch.done:
                self._end(request, finish=batch.finish_reason or "stop")
            else:
                request.notify()

    def on_failed(self, message: messages.Failed) -> list:
        request = self.by_rid.get(message.rid)
        if request is None or request.model != message.model:
            return []
        actions: list = [ToStage0(request.model, messages.Cancel(request.model, request.rid))]  # free what it left
        if message.not_loaded:
            self._end(request, error=message.message)
            return actions + [NotLoaded(request.model, message.message)]
        return actions + self._retry_or_end(request, message.message)

    def on_path_lost(self, model: str) -> list:
        """A path between two stages of ``model`` broke: what it carried may be lost. Requests with nothing streamed
        yet are sent again; the others end with an error rather than hang."""
        actions: list = []
        for request in self.of_model(model):
            actions.append(ToStage0(model, messages.Cancel(model, request.rid)))
            actions += self._retry_or_end(request, "a link between stages broke")
        return actions

    def cancel(self, request: Request) -> list:
        if request.ended:
            return []
        self._end(request, finish="cancelled")
        return [ToStage0(request.model, messages.Cancel(request.model, request.rid))]

    def end_model(self, model: str, text: str) -> None:
        for request in self.of_model(model):
            self._end(request, error=text)

    def _retry_or_end(self, request: Request, text: str) -> list:
        self.by_rid.pop(request.rid, None)
        if not request.tokens and request.attempts <= self.retries:
            request.rid = new_rid()
            return self.submit(request)
        self._end(request, error=text)
        return []

    def _end(self, request: Request, *, finish: str | None = None, error: str | None = None) -> None:
        self.by_rid.pop(request.rid, None)
        if not request.ended:
            request.finish_reason, request.error = finish, error
        request.notify()
