"""Where each request's time goes on one stage, as plain logic: a driver (swarm.fellow.ring, swarm.stage.local)
tells it what it computed and how long that took, what it sent and what came back, on its own clock; when the stage
drops a request, :meth:`StageTimer.finish` gives the request's totals as one StageTimes message for the leader.

- compute: each pass's wall time (forward, sampling on the last stage, the copy off the device and the tensor's
  encoding: all of run_batch) counts in full for every request in the pass -- each of them waited for all of it.
  Prompt chunks and decode steps are kept apart.
- the ring (stage 0 of several): from the moment a decode step's output is ready to leave (before it is encoded and
  sent) to the arrival of the token that step produced. The leader takes the other stages' compute from it to get
  the links' time (swarm.leader.serving.timing).
- bytes: a Hidden message's encoded size shared among its rows, a Sampled message's among its tokens; decode steps
  only (the prompt's chunks are not what a token costs).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from swarm import messages

# Requests whose totals a stage keeps at most: far more than it ever holds at once (a few per stage, up to the
# admission budget), so only the totals of requests that ended without being dropped go.
KEEP = 4096


@dataclasses.dataclass
class _Totals:
    prefill_s: float = 0.0
    prefill_tokens: int = 0
    decode_s: float = 0.0
    decode_steps: int = 0
    ring_s: float = 0.0
    ring_steps: int = 0
    sent_bytes: float = 0.0
    sent_tokens: int = 0
    prompt_len: int = 0
    request: Any = None  # the protocol's StageRequest: the last stage's drafting counters (StageRequest.spec)


class StageTimer:
    def __init__(self, model: str, index: int, num_stages: int):
        self.model = model
        self.index = index
        self.num_stages = num_stages
        self._totals: dict[str, _Totals] = {}
        # stage 0: rid -> (the positions its token may come back for: past the first, up to the second; when it left)
        self._out: dict[str, tuple[int, int, float]] = {}

    def _of(self, rid: str) -> _Totals:
        totals = self._totals.get(rid)
        if totals is None:
            totals = self._totals[rid] = _Totals()
            while len(self._totals) > KEEP:  # a request the stage forgot without dropping (a group's carrier)
                del self._totals[next(iter(self._totals))]
        return totals

    def computed(self, batch: list, seconds: float) -> None:
        """A pass over ``batch`` (swarm.stage.protocol_records.Work items) took ``seconds``."""
        for work in batch:
            totals = self._of(work.rid)
            totals.prompt_len = work.request.start.prompt_len
            totals.request = work.request
            if work.prefill:
                totals.prefill_s += seconds
                totals.prefill_tokens += work.n
            else:
                totals.decode_s += seconds
                totals.decode_steps += 1

    def sent(self, message: Any, nbytes: int, now: float) -> None:
        """``message`` left for the next stage as ``nbytes`` bytes; ``now`` is when it was ready to go."""
        if isinstance(message, messages.Hidden):
            rows = sum(part.n for part in message.parts) or 1
            for part in message.parts:
                totals = self._totals.get(part.rid)
                if totals is None or part.pos < totals.prompt_len:
                    continue  # a prompt chunk
                totals.sent_bytes += nbytes * part.n / rows
                totals.sent_tokens += 1
                if self.index == 0 and part.last:
                    # the token comes back for a position past pos; with drafted rows, up to pos + n
                    self._out[part.rid] = (part.pos, part.pos + part.n, now)
        elif isinstance(message, messages.Sampled) and message.tokens:
            for token in message.tokens:
                totals = self._totals.get(token.rid)
                if totals is not None and token.pos > totals.prompt_len:  # not the prompt's first token
                    totals.sent_bytes += nbytes / len(message.tokens)
                    totals.sent_tokens += 1

    def arrived(self, message: Any, now: float) -> None:
        """``message`` arrived at ``now`` (stage 0: the tokens that close a decode step's round trip)."""
        if not isinstance(message, messages.Sampled):
            return
        for token in message.tokens:
            out = self._out.pop(token.rid, None)
            totals = self._totals.get(token.rid)
            if out is not None and totals is not None and out[0] < token.pos <= out[1]:
                totals.ring_s += max(0.0, now - out[2])
                totals.ring_steps += 1

    def finish(self, rid: str) -> messages.StageTimes | None:
        """The stage dropped ``rid``: its totals for the leader (None if the stage never computed for it)."""
        self._out.pop(rid, None)
        t = self._totals.pop(rid, None)
        if t is None:
            return None
        spec = t.request.spec if self.index == self.num_stages - 1 and t.request is not None else [0, 0, 0, 0]
        return messages.StageTimes(self.model, rid, self.index, t.prefill_s, t.prefill_tokens, t.decode_s,
                                   t.decode_steps, t.ring_s, t.ring_steps, round(t.sent_bytes), t.sent_tokens, *spec)
