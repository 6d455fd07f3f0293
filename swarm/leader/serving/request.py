"""One chat request on the leader: what a client waits on -- its prompt and settings, the tokens streamed so far,
how it ended -- and the :class:`Reader` a reply streams from. What happens to requests is decided by
swarm.leader.serving.requests.RequestBook.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import secrets
from typing import Any

import trio

from swarm import messages

_arrivals = itertools.count()


def now() -> float:
    try:
        return trio.current_time()
    except RuntimeError:  # outside trio (plain-logic tests)
        return 0.0


def new_rid() -> str:
    return "r" + secrets.token_hex(8)


class RequestState(enum.StrEnum):
    """Where a request is: NEW until submitted, WAITING for the ring or for room, RUNNING on the ring, ENDED."""
    NEW = "new"
    WAITING = "waiting"
    RUNNING = "running"
    ENDED = "ended"


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
    token_id: int | None = None  # the API token it came with (quotas and usage count per token); None: a session
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[messages.TokenLogprob] = dataclasses.field(default_factory=list)  # one per token, when asked
    prompt_logprobs: list[messages.TokenLogprob] = dataclasses.field(default_factory=list)  # prompt tokens 1, 2...
    finish_reason: str | None = None  # "stop", "length" or "cancelled"
    error: str | None = None
    attempts: int = 0
    resends: int = 0  # attempts that were sent again after a failure or a broken path
    state: RequestState = RequestState.NEW
    arrival: int = dataclasses.field(default_factory=lambda: next(_arrivals))  # first come, first served
    created_at: float = dataclasses.field(default_factory=lambda: now())
    started_at: float | None = None  # when it first went to the ring: the wait before is its queue time
    first_token_at: float | None = None
    first_tokens: int = 0  # tokens that came with the first one (the steady rate is counted after them)
    last_token_at: float | None = None
    stage_times: dict[int, messages.StageTimes] = dataclasses.field(default_factory=dict)  # swarm.leader.serving.timing
    cached_tokens: int = 0  # prompt tokens the first attempt took from the prefix cache (serving.prefix_index)
    changed: trio.Event = dataclasses.field(default_factory=trio.Event)
    # Sampled choices of one prompt, started as one group (one prefill on the ring): the same list in each of them.
    group: list[Request] | None = None

    def __post_init__(self) -> None:
        self.rid = self.rid or new_rid()
        self.id = self.id or self.rid

    @property
    def need(self) -> int:
        """KV tokens the request may take on every stage: its prompt and the longest reply it may get."""
        return len(self.prompt) + self.max_tokens

    @property
    def queue_s(self) -> float:
        return (self.started_at if self.started_at is not None else now()) - self.created_at

    @property
    def ended(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def generate_message(self) -> messages.Generate:
        """This attempt's message to stage 0: the prompt plus what was streamed already, with the tokens left. A first
        attempt's message holds the request's own prompt, not a copy (a long prompt is held once per request)."""
        prompt = self.prompt + self.tokens if self.tokens else self.prompt
        return messages.Generate(self.model, self.rid, prompt, self.max_tokens - len(self.tokens),
                                 self.eos, self.sampling, drawn=len(self.tokens))


class Reader:
    """One client's view of a request: the tokens it has not seen yet, then how the request ended."""

    def __init__(self, request: Request, stall_s: float = 120.0, wait_s: float = 900.0):
        self.request = request
        self.seen = 0
        self.stall_s = stall_s  # a running attempt with no new token for this long has failed
        self.wait_s = wait_s  # a request waiting for its model to load or recover gives up after this long
        self._waiting_since: float | None = None

    async def next(self, stall_s: float | None = None) -> tuple[str, Any]:
        """("tokens", ids) / ("done", finish reason) / ("error", text); an error when the ring goes silent or the
        model does not come back in time."""
        stall_s = self.stall_s if stall_s is None else stall_s
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
            if request.state is RequestState.RUNNING:
                self._waiting_since = None
                timeout = stall_s
            else:
                self._waiting_since = self._waiting_since or trio.current_time()
                timeout = self._waiting_since + self.wait_s - trio.current_time()
            with trio.move_on_after(max(0.0, timeout)):
                await changed.wait()
                continue
            if request.state is RequestState.RUNNING:
                return "error", (f"the ring stopped answering: no token for {stall_s:.0f} s (SWARM_REQUEST_STALL_S). "
                                 "A fellow may have gone away; send the message again.")
            return "error", (f"model {request.model} was not ready within {self.wait_s:.0f} s "
                             "(SWARM_SERVE_QUEUE_TIMEOUT_S): it is still loading or recovering. Try again later.")


# --- actions ---------------------------------------------------------------------------------------------------------
