"""The requests one stage holds and the round-robin queue of their work: what to compute next, as one pass.

:class:`swarm.stage.protocol.StageProtocol` builds on it; messages and computed results add work and requests here.
"""

from __future__ import annotations

import collections
import math

from swarm.stage.protocol_records import Release, StageRequest, Work

# Requests one pass takes at most. Measured on the built-in model (2-core CPU): a pass of 8 decode rows costs ~1.7x
# one row, of 16 ~2.6x; past that the rows' own arithmetic dominates and a bigger pass only adds latency.
MAX_BATCH = 16


class StageQueue:
    def __init__(self, *, num_stages: int, is_last: bool, max_batch: int = MAX_BATCH):
        self.num_stages = num_stages
        self.is_last = is_last
        self.max_batch = max_batch
        self.requests: dict[str, StageRequest] = {}
        self._ready: collections.deque[str] = collections.deque()  # rids with work, round-robin

    def next_batch(self) -> list[Work]:
        """What to compute next, as one pass: the next piece of each request whose turn it is, taken round-robin
        -- every ready decode step, but at most one prompt chunk (so a long prompt holds the others back by one
        chunk at most) -- up to :meth:`batch_limit` requests. [] when idle."""
        limit = self.batch_limit()
        batch: list[Work] = []
        skipped: list[str] = []
        again: list[str] = []
        prefill = False
        while self._ready and len(batch) < limit:
            rid = self._ready.popleft()
            request = self.requests.get(rid)
            if request is None or not request.queue:
                continue
            work = request.queue[0]
            if work.prefill and prefill:
                skipped.append(rid)
                continue
            request.queue.popleft()
            prefill = prefill or work.prefill
            batch.append(work)
            if request.queue:
                again.append(rid)
        self._ready.extendleft(reversed(skipped))
        self._ready.extend(again)
        if self.is_last:  # the draft model guesses in the compute, only while drafting is on (swarm.stage.drafting)
            crowded = len(self.requests) > self.num_stages
            for work in batch:
                work.request.crowded = crowded
        return batch

    def batch_limit(self) -> int:
        """How many requests one pass takes. With several stages the requests are split into as many groups as
        there are stages, so that while one stage computes one group the next stage works on another (the ring is a
        pipeline); within a group, one pass reads each weight once for all its requests."""
        if self.max_batch <= 1:
            return 1
        return max(1, min(self.max_batch, math.ceil(len(self.requests) / self.num_stages)))

    def _release(self, rid: str, end: int = 0) -> Release | None:
        """Forget ``rid`` here: the Release that drops its cache (None if it was not here). ``end``: it ended with its
        last token at that position, and the stage keeps its reply's blocks if its plan says so."""
        request = self.requests.pop(rid, None)
        if request is None:
            return None
        return Release(rid, request.start, end) if end else Release(rid)

    def _forget(self, rid: str) -> bool:
        return self.requests.pop(rid, None) is not None

    def _enqueue(self, work: Work) -> None:
        request = work.request
        if not request.queue:
            self._ready.append(request.rid)
        request.queue.append(work)

    # --- views ------------------------------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return bool(self.requests)
