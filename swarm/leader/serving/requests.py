"""The life of a chat request on the leader, as plain logic.

A Request (swarm.leader.serving.request) is what a client waits on: its prompt and settings, the tokens streamed so
far, how it ended. The :class:`RequestBook` decides what happens to requests -- submitted, tokens arrived, done,
failed on a stage, a path under them broke, retried before their first token, cancelled -- and answers with actions
that swarm.leader.serving.serving carries out (a message for the fellow serving a model's stage 0). No I/O here, and
nothing ever waits on a client: a request's tokens pile up in the request, and its readers catch up at their own
pace.

Each attempt on the ring has its own ring id (``rid``); the request keeps its ``id`` across attempts (what clients
see as x-swarm-request-id and cancel by). An attempt that is cut off -- a stage failed it, a path under it broke, the
ring lost a fellow -- is sent again as the prompt plus the tokens already streamed, with the tokens it had left, so
the client's stream pauses and goes on: nothing lost, nothing repeated.

A request is ``waiting`` while its model loads or recovers (it goes out when the ring is whole again), ``running``
while an attempt is on the ring, then ended (finish_reason or error).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from collections.abc import Callable
from typing import Any

from swarm import messages
from swarm.errors import counted
from swarm.leader.serving.admission import Budget
from swarm.leader.serving.request import Request, RequestState, new_rid
from swarm.leader.serving.request import now as _now

# How often one request may be sent again before it fails for good: a stage that fails the same request every time
# (a bug, a request it cannot hold) must not loop. Failovers do not count: a whole ring rebuilt is not the request's
# fault.
MAX_RESENDS = 3
# Ended requests whose stages may still report their times (swarm.leader.serving.timing): far more than end within the
# moment those reports take.
RECENT = 512


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
    """Every request the leader holds: running ones by their attempt's ring id, waiting ones per model, first come
    first served. A model's requests run only while its ring is whole (``resume`` gives its admission budget,
    ``interrupt`` takes it away), and only as many as the budget holds; the rest wait their turn."""

    def __init__(self, max_resends: int = MAX_RESENDS):
        self.max_resends = max_resends
        self.by_rid: dict[str, Request] = {}  # running attempts
        self.waiting: dict[str, list[Request]] = {}  # model -> requests waiting, in order of arrival
        self.budgets: dict[str, Budget] = {}  # models whose ring is whole -> what they hold at once
        self.service_s: dict[str, float] = {}  # model -> how long a request ran, on average of the recent ones
        # Ring id -> request, of the last requests that ended: the stages' times come after the last token.
        self.recent: collections.OrderedDict[str, Request] = collections.OrderedDict()
        # called with each request as it ends, once (the serving history); must not block
        self.on_end: Callable[[Request], None] | None = None

    def queued(self, model: str) -> int:
        """How many requests of ``model`` wait to start."""
        return sum(not r.ended for r in self.waiting.get(model, []))

    def retry_after(self, model: str) -> int:
        """A client's fair wait, in seconds, before it sends again a request that found the queue full: the time the
        ring takes to work through the queue at its recent pace (1 s to 5 minutes)."""
        running = max(1, len(self.of_model(model)))
        each = self.service_s.get(model, 10.0)
        return int(min(300, max(1, round(self.queued(model) / running * each))))

    def find(self, request_id: str) -> Request | None:
        for request in [*self.by_rid.values(), *(r for rs in self.waiting.values() for r in rs)]:
            if request.id == request_id:
                return request
        return None

    def of_model(self, model: str) -> list[Request]:
        """The running requests of ``model``."""
        return [r for r in self.by_rid.values() if r.model == model]

    def submit(self, request: Request) -> list:
        """A new request: it runs now if its model's ring is whole and has room, else it waits its turn."""
        self.hold(request)
        return self.pump(request.model)

    def submit_group(self, requests: list[Request]) -> list:
        """Sampled choices of one prompt (same prompt and settings, their own seeds): they start together as one
        group -- the ring prefills the prompt once and copies its cache to each -- when the budget holds them all,
        else they wait together."""
        for request in requests:
            request.group = requests if len(requests) > 1 else None
            self.hold(request)
        return self.pump(requests[0].model)

    def hold(self, request: Request) -> None:
        """``request`` waits until its model's ring is whole and has room for it."""
        request.state = RequestState.WAITING
        bisect.insort(self.waiting.setdefault(request.model, []), request, key=lambda r: r.arrival)
        request.notify()

    def pump(self, model: str) -> list:
        """Start the waiting requests of ``model`` that fit, in order of arrival: the first one that does not fit
        holds the others back, so a long conversation is not passed over forever."""
        budget = self.budgets.get(model)
        queue = self.waiting.get(model, [])
        actions: list = []
        while budget is not None and queue:
            request = queue[0]
            if request.ended:
                queue.pop(0)
                continue
            running = [r.need for r in self.of_model(model)]
            group = self._group_at_head(queue)
            if group:
                if budget.fits_group(running, [r.need for r in group]):
                    queue[:] = [r for r in queue if r not in group]
                    actions += self._start_group(group)
                    continue
                if running:
                    break
                for member in group:  # alone and still too big as a whole: its choices go one by one
                    member.group = None
                continue
            if not budget.fits(running, request.need):
                if running:
                    break
                queue.pop(0)  # alone and still too big: the pool shrank under it (a failover to a smaller fellow)
                self._end(request, error=too_long(request.need, len(request.prompt), request.max_tokens,
                                                  budget.tokens))
                continue
            queue.pop(0)
            actions += self._start(request)
        return actions

    def interrupt(self, model: str) -> list:
        """The ring of ``model`` is being rebuilt: every running request waits to be sent again. The stages drop
        their state themselves when they are relinked; the cancels free them sooner where they are still alive."""
        self.budgets.pop(model, None)
        actions: list = []
        for request in self.of_model(model):
            self.by_rid.pop(request.rid, None)
            actions.append(ToStage0(model, messages.Cancel(model, request.rid)))
            request.rid = new_rid()
            self.hold(request)
        return actions

    def resume(self, model: str, budget: Budget) -> list:
        """The ring of ``model`` is whole: start what waited for it, as the budget allows."""
        self.budgets[model] = budget
        return self.pump(model)

    def on_tokens(self, message: messages.Tokens) -> list:
        ended = False
        for batch in message.batches:
            request = self.by_rid.get(batch.rid)
            if request is None or request.model != message.model:
                continue  # an attempt that was cancelled or retried: its late tokens are not the reply's
            now = _now()
            if request.first_token_at is None:
                request.first_token_at, request.first_tokens = now, len(batch.tokens)
            if batch.tokens:
                request.last_token_at = now
            request.tokens.extend(batch.tokens)
            request.logprobs.extend(batch.logprobs)
            if batch.prompt_logprobs:  # an attempt sent again repeats them: the first whole set counts
                request.prompt_logprobs = (request.prompt_logprobs + batch.prompt_logprobs)[: len(request.prompt) - 1]
            if batch.done:
                self._end(request, finish=batch.finish_reason or "stop")
                ended = True
            else:
                request.notify()
        return self.pump(message.model) if ended else []

    def on_stage_times(self, message: messages.StageTimes) -> None:
        """A stage's times of an attempt: kept with its request (running, or among the recently ended)."""
        request = self.by_rid.get(message.rid) or self.recent.get(message.rid)
        if request is not None and request.model == message.model and 0 <= message.stage < 64:
            request.stage_times[message.stage] = message
            request.notify()

    def on_failed(self, message: messages.Failed) -> list:
        request = self.by_rid.get(message.rid)
        if request is None or request.model != message.model:
            return []
        actions: list = [ToStage0(request.model, messages.Cancel(request.model, request.rid))]  # free what it left
        if message.not_loaded:
            # The fellow does not hold the model (it unloaded it, or restarted): the leader reloads the model and the
            # request waits for it, unnoticed by the user.
            self.budgets.pop(request.model, None)
            self.by_rid.pop(request.rid, None)
            request.rid = new_rid()
            self.hold(request)
            return actions + [NotLoaded(request.model, message.message)]
        return actions + self._retry_or_end(request, message.message) + self.pump(request.model)

    def on_path_lost(self, model: str) -> list:
        """A path between two stages of ``model`` broke: what it carried may be lost. Every request on it is sent
        again from where its stream stands (the hop is on another path by the time the message arrives)."""
        actions: list = []
        for request in self.of_model(model):
            actions.append(ToStage0(model, messages.Cancel(model, request.rid)))
            actions += self._retry_or_end(request, "a link between stages broke")
        return actions + self.pump(model)

    def cancel(self, request: Request) -> list:
        if request.ended:
            return []
        running = request.state is RequestState.RUNNING
        waiting = self.waiting.get(request.model, [])
        if request in waiting:
            waiting.remove(request)
        self._end(request, finish="cancelled")
        if not running:
            return []
        return [ToStage0(request.model, messages.Cancel(request.model, request.rid))] + self.pump(request.model)

    def end_model(self, model: str, text: str) -> None:
        """``model`` is gone: its running and waiting requests end with ``text``."""
        self.budgets.pop(model, None)
        for request in [*self.of_model(model), *self.waiting.pop(model, [])]:
            self._end(request, error=text)

    @staticmethod
    def _group_at_head(queue: list[Request]) -> list[Request]:
        """The group of first attempts at the head of ``queue`` (they wait side by side: one arrival after the
        other), or [] when the head is a request of its own."""
        group = queue[0].group
        if group is None or queue[0].attempts:
            return []
        members = []
        for request in queue:
            if request.group is not group or request.attempts:
                break
            if not request.ended:
                members.append(request)
        return members if len(members) > 1 else []

    def _start_group(self, group: list[Request]) -> list:
        first = group[0]
        for request in group:
            request.started_at = _now()
            request.attempts += 1
            request.state = RequestState.RUNNING
            self.by_rid[request.rid] = request
            request.notify()
        siblings = [messages.Sibling(r.rid, r.sampling.seed) for r in group]
        carrier = messages.Generate(first.model, "g" + new_rid()[1:], list(first.prompt), first.max_tokens, first.eos,
                                    first.sampling, siblings=siblings)
        return [ToStage0(first.model, carrier)]

    def _start(self, request: Request) -> list:
        if request.attempts and len(request.tokens) >= request.max_tokens:
            self._end(request, finish="length")  # cut off right after its last token: nothing left to do
            return []
        if request.attempts:
            request.rid = new_rid()
            if len(request.prompt_logprobs) < len(request.prompt) - 1:
                request.prompt_logprobs = []  # cut off before all came: the new attempt sends them from the start
        else:
            request.started_at = _now()
        request.attempts += 1
        request.state = RequestState.RUNNING
        self.by_rid[request.rid] = request
        request.notify()
        return [ToStage0(request.model, request.generate_message())]

    def _retry_or_end(self, request: Request, text: str) -> list:
        self.by_rid.pop(request.rid, None)
        if request.resends < self.max_resends and request.model in self.budgets:
            request.resends += 1
            return self._start(request)
        if request.resends < self.max_resends:  # the ring is being rebuilt: wait for it
            request.resends += 1
            self.hold(request)
            return []
        self._end(request, error=f"{text} (the request was sent {counted(request.resends + 1, 'time')})")
        return []

    def _end(self, request: Request, *, finish: str | None = None, error: str | None = None) -> None:
        self.by_rid.pop(request.rid, None)
        self.recent[request.rid] = request
        while len(self.recent) > RECENT:
            self.recent.popitem(last=False)
        if not request.ended:
            request.finish_reason, request.error = finish, error
            if finish in ("stop", "length") and request.started_at is not None:
                took = _now() - request.started_at
                last = self.service_s.get(request.model)
                self.service_s[request.model] = took if last is None else 0.8 * last + 0.2 * took
            if self.on_end is not None:
                self.on_end(request)
        request.state = RequestState.ENDED
        request.notify()


def too_long(need: int, prompt: int, reply: int, pool: int, why: str | None = None) -> str:
    """The seed's words for a conversation longer than the whole pool holds (with the words client libraries look
    for: "maximum context length"); ``why``: where the limit comes from, when it is the model's served context
    (swarm.leader.api.limits.context_reason) rather than the pool's memory."""
    text = (f"this conversation needs {need} tokens ({prompt} in the prompt and up to {reply} in the reply); the "
            f"pool serving this model holds {pool}. This model's maximum context length on this pool is {pool} tokens")
    if why is not None:
        return f"{text} ({why}). Start a new conversation, lower max_tokens, or send a shorter prompt."
    return f"{text}. Start a new conversation, lower max_tokens, or serve on fellows with more free memory."
