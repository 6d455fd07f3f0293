"""The leader's serving history: every request that ends (done, failed or cancelled) becomes a ServedRequest.

``record`` is called by the RequestBook as a request ends and only appends to memory, so a reply never waits on the
database: a background task writes the new records in one transaction a second (``FLUSH_S``) and prunes what is older
than SWARM_SERVING_HISTORY_DAYS every hour. The last 15 minutes stay in memory (the live view); longer ranges read
the database, plus whatever is not written yet. A restarted leader reads its last 15 minutes back.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import functools
import logging
import time
from collections.abc import Callable

import trio

from swarm.store.history import ServedRequest

log = logging.getLogger(__name__)

MEMORY_S = 15 * 60.0  # the seed's live range: "15m (live, from the leader's memory)"
FLUSH_S = 1.0  # how often finished requests are written
SETTLE_S = 2.0  # a finished request is written this long after its end: its stages' times come in meanwhile
PRUNE_S = 3600.0  # pruning more often buys nothing: ranges read at most SWARM_SERVING_HISTORY_DAYS anyway
MAX_PENDING = 20_000  # records kept while the database refuses writes; past it the oldest are dropped (and logged)
# Longer ranges: how long the database's part is reused, and how far before now it stops (the rest is in memory;
# well past SETTLE_S + FLUSH_S, well within MEMORY_S). Measured here: a week of 50,000 requests reads in about 1 s
# on this shared 2-core VM without the timing maps, 2 s with them.
CACHE_S = 30.0
SETTLED_BY_S = 30.0
MAX_CACHED = 8  # (model, range) pairs


def _trio_now() -> float | None:
    try:
        return trio.current_time()
    except RuntimeError:  # outside trio (plain-logic tests)
        return None


def served_from(request, wall_now: float, trio_now: float | None, timing: dict | None = None) -> ServedRequest:
    """What to keep of a request that just ended. The request's times are trio's clock; they become wall-clock times
    counted back from now."""
    loop_now = trio_now if trio_now is not None else request.created_at

    def wall(t: float) -> float:
        return wall_now - (loop_now - t)

    started = request.started_at
    queue_ms = ((started if started is not None else loop_now) - request.created_at) * 1000
    # as swarm.timing counts it: from the request's arrival, its queue wait included
    ttft_ms = (request.first_token_at - request.created_at) * 1000 if request.first_token_at is not None else None
    tokens = len(request.tokens)
    tokens_per_s = None
    if request.first_token_at is not None and tokens >= 2 and loop_now > request.first_token_at:
        tokens_per_s = (tokens - 1) / (loop_now - request.first_token_at)
    if request.error is not None:
        outcome = "failed"
    elif request.finish_reason == "cancelled":
        outcome = "cancelled"
    else:
        outcome = "done"
    record = ServedRequest(
        id=request.id, model=request.model, started_at=wall(request.created_at), ended_at=wall_now, outcome=outcome,
        prompt_tokens=len(request.prompt), reply_tokens=tokens, ttft_ms=_round(ttft_ms),
        tokens_per_s=_round(tokens_per_s), queue_ms=_round(queue_ms), user_id=request.owner, error=request.error,
        token_id=getattr(request, "token_id", None))
    return with_timing(record, timing)


def timing_of(request) -> dict | None:
    """A request's own ``timing`` map, if it carries one (how tests hand one in); the leader passes
    swarm.leader.serving.timing.of_request instead (ServingHistory's ``timing``)."""
    timing = getattr(request, "timing", None)
    return dict(timing) if isinstance(timing, dict) and timing else None


def with_timing(record: ServedRequest, timing: dict | None) -> ServedRequest:
    """``record`` with the reply's timing: the fellows' own figures win over the leader's, which sees tokens arrive in
    batches."""
    if not timing:
        return record
    return dataclasses.replace(
        record, timing=timing, ttft_ms=_round(_number(timing.get("ttft_ms"), record.ttft_ms)),
        tokens_per_s=_round(_number(timing.get("tokens_per_s"), record.tokens_per_s)),
        queue_ms=_round(_number(timing.get("queue_ms"), record.queue_ms)))


def _number(value, fallback):
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else fallback


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


class _Entry:
    """A finished request in memory: its record, and the request itself until the record is written (the fellows'
    time split may arrive just after the request ends)."""

    __slots__ = ("counted", "record", "request", "timing")

    def __init__(self, record: ServedRequest, request=None, timing: Callable = timing_of):
        self.record, self.request, self.timing = record, request, timing
        self.counted = False  # handed to ``on_settled`` (once, even when the database write is retried)

    def settled(self) -> ServedRequest:
        if self.request is not None:
            try:
                timing = self.timing(self.request)
            except Exception:  # the record keeps the leader's own figures
                log.exception("could not read the timing of request %s", self.request.id)
                timing = None
            if timing is not None and timing != self.record.timing:
                self.record = with_timing(self.record, timing)
        return self.record


class ServingHistory:
    """Finished requests: the last 15 minutes in memory, every one written to the store in batches."""

    def __init__(self, store, keep_days: float, clock: Callable[[], float] = time.time,
                 timing: Callable = timing_of, on_settled: Callable[[ServedRequest], None] | None = None):
        self.store = store
        self.on_settled = on_settled  # each finished request's final record, once (swarm.leader.api.metrics)
        self.timing = timing  # request -> its swarm.timing (swarm.leader.serving.timing.of_request on the leader)
        self.keep_s = keep_days * 86400
        self.clock = clock
        self.recent: collections.deque[_Entry] = collections.deque()
        self._pending: list[_Entry] = []
        self._older: dict[tuple[str, float], tuple[float, float, list[ServedRequest]]] = {}  # see over()

    # --- the request path: memory only ------------------------------------------------------------------------------

    def record(self, request) -> None:
        """A request ended (RequestBook.on_end): keep it. Never blocks and never raises into the book."""
        try:
            self.add(served_from(request, self.clock(), _trio_now()), request)  # timing: once it has settled
        except Exception:  # a bug here must not cost the reply
            log.exception("could not record request %s in the serving history", getattr(request, "id", "?"))

    def add(self, record: ServedRequest, request=None) -> None:
        entry = _Entry(record, request, self.timing)
        self.recent.append(entry)
        self._pending.append(entry)
        if len(self._pending) > MAX_PENDING:
            del self._pending[: len(self._pending) - MAX_PENDING]
            log.warning("the serving history is %d requests behind the database; dropping the oldest", MAX_PENDING)
        self._forget_old()

    def _forget_old(self) -> None:
        horizon = self.clock() - MEMORY_S
        while self.recent and self.recent[0].record.ended_at < horizon:
            self.recent.popleft()

    # --- reading --------------------------------------------------------------------------------------------------

    def in_memory(self, model: str, since: float) -> list[ServedRequest]:
        self._forget_old()
        return [e.settled() for e in self.recent if e.record.model == model and e.record.ended_at >= since]

    async def over(self, model: str, span: float) -> list[ServedRequest]:
        """The requests of ``model`` that ended in the last ``span`` seconds, oldest first. The last 15 minutes come
        from memory; a longer range reads the database for what ended before a minute or so ago -- without the
        timing maps, and at most every ``CACHE_S`` per model and range, since the column asks every 2 s and a busy
        week is tens of thousands of rows -- and memory for the rest."""
        now = self.clock()
        if span <= MEMORY_S:
            return self.in_memory(model, now - span)
        key = (model, span)
        cached = self._older.get(key)
        if cached is None or not 0 <= now - cached[0] <= CACHE_S:
            cut = now - SETTLED_BY_S  # what ended before this is in the database (written 2-3 s after its end)
            rows = await trio.to_thread.run_sync(
                functools.partial(self.store.served_requests, model, now - span, cut, timing=False))
            self._older.pop(key, None)
            while len(self._older) >= MAX_CACHED:
                self._older.pop(next(iter(self._older)))
            cached = self._older[key] = (now, cut, rows)
        _, cut, rows = cached
        first = bisect.bisect_left(rows, now - span, key=lambda r: r.ended_at)
        return rows[first:] + self.in_memory(model, cut)

    # --- the background task --------------------------------------------------------------------------------------

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Read the last 15 minutes back, then write and prune on a timer until cancelled (what is pending then is
        written on the way out)."""
        try:
            kept = await trio.to_thread.run_sync(self.store.served_requests, None, self.clock() - MEMORY_S)
            self.recent.extendleft(_Entry(r) for r in reversed(kept))
        except Exception as exc:  # a database that cannot be read: the live view starts empty
            log.warning("could not read the serving history back: %s", exc)
        task_status.started()
        next_prune = 0.0
        try:
            while True:
                await self.flush()
                if trio.current_time() >= next_prune:
                    await self.prune()
                    next_prune = trio.current_time() + PRUNE_S
                await trio.sleep(FLUSH_S)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await self.flush(everything=True)

    async def flush(self, everything: bool = False) -> None:
        """Write the records that have settled (all of them with ``everything``)."""
        horizon = self.clock() - SETTLE_S
        due = [e for e in self._pending if everything or e.record.ended_at <= horizon]
        if not due:
            return
        batch = [e.settled() for e in due]
        for entry in due:
            if not entry.counted and self.on_settled is not None:
                entry.counted = True
                self.on_settled(entry.record)
        try:
            await trio.to_thread.run_sync(self.store.add_served_requests, batch)
        except Exception as exc:  # the store failed: kept in memory, written on the next round
            log.warning("could not write %d finished requests to the serving history (%s); trying again",
                        len(batch), exc)
            return
        written = set(map(id, due))
        self._pending = [e for e in self._pending if id(e) not in written]
        for entry in due:
            entry.request = None  # its record is final: the request (tokens, logprobs) may go

    async def prune(self) -> None:
        try:
            gone = await trio.to_thread.run_sync(self.store.prune_served_requests, self.clock() - self.keep_s)
        except Exception as exc:  # the store failed: pruned on the next round
            log.warning("could not prune the serving history: %s", exc)
            return
        if gone:
            log.info("pruned %d requests older than %g days from the serving history", gone, self.keep_s / 86400)
