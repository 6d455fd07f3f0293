"""The ring protocol of one stage, as plain logic: messages and finished computations in, actions out.

No sockets, no threads, no torch: a driver (swarm.fellow.ring for a fellow, swarm.stage.local for a ring in one
process) feeds :meth:`StageProtocol.receive` with what arrives, asks :meth:`StageProtocol.next_batch` what to
compute, runs it (swarm.stage.execute), gives the result to :meth:`StageProtocol.computed`, and performs the
actions that come back, in order:

  Send(message)       to the next stage (the last stage's Sampled goes to stage 0)
  Report(message)     to the leader (Failed)
  Stream(rid, ...)    the last stage's token for the leader, which streams it (the driver batches these)
  Release(rid)        drop the request's KV cache on this stage

How a request goes round (see the messages in swarm.wire):

  stage 0   Generate: the prompt is cut into chunks of ``prefill_chunk`` tokens, computed one by one; each chunk's
            hidden states go on in a Hidden message (the first one carries the request's RequestStart).
  middle    Hidden: compute, pass on.
  last      Hidden: compute; after the prompt's last chunk or a decode step, sample. The token goes to the leader
            (Stream) and back to stage 0 (Sampled); the eos/length rule ends the request here (Release).
  stage 0   Sampled: the token's decode step goes round, unless the token ended the request: then stage 0
            releases it and tells the stages in between to (Free).

Requests are independent: each has its own KV cache on each stage, its own queue of work here, and its own
failure (a compute that raises fails only the requests it computed). Work is taken round-robin over requests, one
piece each, so a long prompt holds the others up by at most one chunk.

A group (a Generate with siblings: sampled choices of one prompt) is prefilled once: the Generate's rid is a
*carrier* that computes the prompt's chunks on every stage; with its last chunk each stage hands the prompt's KV
cache to the siblings still alive (a copy each, the last one takes the carrier's own: see execute.fan_out) and
forgets the carrier; the last stage samples every sibling's first token from the carrier's logits, each with its own
seed. From there the siblings are ordinary requests. Stage 0 knows the siblings from the start: a cancel of one
before the copy only takes it off the list the last chunk carries (Part.siblings), and the carrier ends with its last
sibling. A carrier's failure is reported as each sibling's (RequestStart.group): the leader knows only those.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from swarm import messages
from swarm.errors import ProtocolError
from swarm.stage import drafting
from swarm.stage.protocol_records import (
    Action,
    Output,
    PromptLogprobs,
    Release,
    Report,
    Rows,
    RowSource,
    Send,
    StageRequest,
    Stream,
    Work,
)
from swarm.stage.stage_queue import MAX_BATCH, StageQueue

# --- the protocol ----------------------------------------------------------------------------------------------------


class StageProtocol(StageQueue):
    def __init__(self, *, model: str, index: int, num_stages: int, prefill_chunk: int = 256,
                 max_batch: int = MAX_BATCH):
        if not 0 <= index < num_stages:
            raise ValueError(f"stage {index} of {num_stages}")
        super().__init__(num_stages=num_stages, is_last=index == num_stages - 1, max_batch=max_batch)
        self.model = model
        self.index = index
        self.is_first = index == 0
        self.prefill_chunk = prefill_chunk
        self.prefill_tokens = 0  # prompt positions this stage computed (a group's prompt counts once)

    # --- messages in ----------------------------------------------------------------------------------------------

    def receive(self, message: Any) -> list[Action]:
        if isinstance(message, messages.Generate) and self.is_first:
            return self._generate(message)
        if isinstance(message, messages.Cancel) and self.is_first:
            return self._cancel(message.rid)
        if isinstance(message, messages.Hidden) and not self.is_first:
            return self._hidden(message)
        if isinstance(message, messages.Sampled) and self.is_first:
            actions: list[Action] = []
            for sampled in message.tokens:
                actions += self._sampled(sampled)
            return actions
        if isinstance(message, messages.Free):
            return self._free(message)
        raise ProtocolError(f"stage {self.index} of {self.num_stages} does not take a {type(message).__name__}")

    def _generate(self, message: messages.Generate) -> list[Action]:
        rids = message.rids
        if not message.prompt:
            return self._fail_new(rids, "the prompt is empty")
        taken = [rid for rid in dict.fromkeys([message.rid, *rids]) if rid in self.requests]
        if taken or len(set(rids)) != len(rids) or (message.siblings and message.rid in rids):
            return self._fail_new(rids, f"request {(taken or rids)[0]} is already on stage 0")
        # penalties, prompt logprobs, drafting ahead (the lookup searches the prompt)
        context = list(message.prompt) if message.sampling.needs_context or message.draft > 0 else None
        start = messages.RequestStart(len(message.prompt), message.max_tokens, message.eos, message.sampling,
                                      message.drawn, context, [s.rid for s in message.siblings], message.draft,
                                      None if message.siblings else message.prefix)
        if not 0 <= start.cached < len(message.prompt):
            return self._fail_new(rids, f"the prefix cache's plan covers {start.cached} of {len(message.prompt)} "
                                        "prompt tokens: at least the last one must be computed")
        request = StageRequest(message.rid, list(message.prompt), start, next_chunk=start.cached)
        self.requests[request.rid] = request
        for sibling in message.siblings:
            member = request.sibling(sibling)
            member.carrier = request
            request.members.append(member)
            self.requests[member.rid] = member
        self._queue_next_chunk(request)
        return []

    def _cancel(self, rid: str) -> list[Action]:
        request = self.requests.get(rid)
        if request is None:
            return []
        carrier = request.carrier
        if carrier is not None:  # a sibling whose cache does not exist yet: the group's copy leaves it out
            carrier.members.remove(request)
            self._forget(rid)
            return self._end(carrier.rid) if not carrier.members else []
        for member in request.members:  # a carrier cancelled as such: its siblings go with it
            self._forget(member.rid)
        return self._end(rid)

    def _queue_next_chunk(self, request: StageRequest) -> None:
        assert request.prompt is not None  # the first stage holds its requests' prompts
        pos = request.next_chunk
        ids = request.prompt[pos : pos + self.prefill_chunk]
        request.next_chunk = pos + len(ids)
        last = request.next_chunk == len(request.prompt)
        self._enqueue(Work(request, pos, len(ids), last, ids=ids))

    def _hidden(self, message: messages.Hidden) -> list[Action]:
        source = RowSource(message.x)
        row = 0
        for part in message.parts:
            request = self.requests.get(part.rid)
            if request is None and part.start is not None and part.pos == part.start.cached:
                request = self.requests[part.rid] = StageRequest(part.rid, None, part.start)
            if request is not None and part.siblings:  # a group's last chunk: its siblings start here
                for sibling in part.siblings:
                    if sibling.rid not in self.requests:
                        request.members.append(self.requests.setdefault(sibling.rid, request.sibling(sibling)))
            if request is not None:  # else a late message of a request that ended here: nothing to do
                self._enqueue(Work(request, part.pos, part.n, part.last, rows=Rows(source, row, part.n)))
            row += part.n
        return []

    def _sampled(self, sampled: messages.SampledToken) -> list[Action]:
        request = self.requests.get(sampled.rid)
        if request is None:
            return []  # cancelled: the token came back after the request was dropped
        if sampled.done:
            return self._end(sampled.rid, last_dropped=True, end=sampled.pos)
        ids = [sampled.token, *sampled.draft]  # with drafted tokens: one pass runs them all (the last stage verifies)
        self._enqueue(Work(request, sampled.pos, len(ids), True, ids=ids))
        return []

    def _free(self, message: messages.Free) -> list[Action]:
        ends = message.ends if len(message.ends) == len(message.rids) else [0] * len(message.rids)
        actions: list[Action] = [r for rid, end in zip(message.rids, ends) if (r := self._release(rid, end))]
        if not self.is_first and not self.is_last:
            actions.append(Send(message))  # the stages after this one hold caches of these requests too
        return actions

    # --- computed results ------------------------------------------------------------------------------------------

    def computed(self, batch: list[Work], output: Output) -> list[Action]:
        actions: list[Action] = []
        self.prefill_tokens += sum(work.n for work in batch if work.prefill)
        if not self.is_last:
            parts = []
            for work in batch:
                start = work.request.start if work.start else None
                siblings = [messages.Sibling(m.rid, m.sampling.seed) for m in work.request.members] \
                    if work.fans_out else []
                parts.append(messages.Part(work.rid, work.pos, work.n, work.last, start, siblings))
                if self.is_first and work.ids is not None and not work.last and work.request.next_chunk > 0:
                    self._queue_next_chunk(work.request)
                if work.fans_out:
                    self._fanned_out(work.request)
                    actions.append(Release(work.rid))  # its cache is the siblings' now: nothing left to drop
            assert output.hidden is not None  # a stage before the last passes its hidden state on
            actions.append(Send(messages.Hidden(self.model, parts, output.hidden)))
            return actions
        sampled: list[messages.SampledToken] = []
        logprobs = output.logprobs or [None] * len(batch)
        for work, entries in zip(batch, output.prompt_logprobs or []):
            if entries:
                actions.append(PromptLogprobs(work.rid, entries))
        fanned = output.fanned or [None] * len(batch)
        verified = output.verified or [None] * len(batch)
        drafts = output.drafts or [None] * len(batch)
        for work, token, logprob, group, kept, guess in zip(batch, output.tokens or [None] * len(batch), logprobs,
                                                            fanned, verified, drafts):
            if self.is_first and not work.last:
                self._queue_next_chunk(work.request)  # one stage: the next prompt chunk
            if kept is not None:
                actions += self._took_several(work, kept, sampled, guess)
                continue
            if work.fans_out:
                for member, (token, logprob) in zip(work.request.members, group or []):
                    actions += self._took(member, work.pos + work.n, token, logprob, sampled)
                self._fanned_out(work.request)
                continue
            if not work.last or token is None:
                continue
            actions += self._took(work.request, work.pos + work.n, token, logprob, sampled)
            self._draft(work.request, sampled, guess)
        if not sampled:
            return actions
        if self.is_first:  # one stage: the token goes straight into the next decode step
            for token in sampled:
                if not token.done:
                    actions += self._sampled(token)
        else:
            actions.append(Send(messages.Sampled(self.model, sampled)))
        return actions

    def _took(self, request: StageRequest, pos: int, token: int, logprob, sampled: list) -> list[Action]:
        """The last stage sampled ``token`` for ``request``: it streams, and ends the request by the eos/length rule;
        its SampledToken for stage 0 joins ``sampled``."""
        request.generated += 1
        if request.start.context is not None:
            request.reply.append(token)
        finish = None
        if token in request.start.eos:
            finish = "stop"
        elif request.generated >= request.start.max_tokens:
            finish = "length"
        actions: list[Action] = [Stream(request.rid, token, finish, logprob)]
        if finish is not None:
            release = self._release(request.rid, pos)
            if release is not None:
                actions.append(release)
        sampled.append(messages.SampledToken(request.rid, pos, token, finish is not None))
        return actions

    def _took_several(self, work: Work, kept: list, sampled: list, guess: list[int] | None = None) -> list[Action]:
        """A pass that verified drafted tokens gave ``kept`` (the drafted tokens its model agreed with, then its own
        next one): each streams, up to the eos/length rule; one SampledToken goes back, for the last of them."""
        request = work.request
        actions: list[Action] = []
        drafted, request.draft = len(request.draft), []
        taken: list[messages.SampledToken] = []
        for i, (token, logprob) in enumerate(kept):
            actions += self._took(request, work.pos + i + 1, token, logprob, taken)
            if taken[-1].done:
                break
        request.spec[2] += drafted
        request.spec[3] += min(len(taken), len(kept) - 1)  # kept ends with the model's own token, never drafted
        sampled.append(taken[-1])
        self._draft(request, sampled, guess)
        return actions

    def _draft(self, request: StageRequest, sampled: list, guess: list[int] | None = None) -> None:
        """The last stage sampled ``sampled[-1]`` for ``request``: count the pass, and guess what follows
        (swarm.stage.drafting: prompt lookup, else ``guess``, the draft model's) while the model has no more chats
        than stages."""
        token = sampled[-1]
        if request.start.draft <= 0:
            return
        request.spec[0] += 1
        request.spec[1] = request.generated
        if token.done:
            return
        draft = drafting.draft_for(request, len(self.requests), self.num_stages, guess)
        if draft:
            request.draft = draft
            sampled[-1] = dataclasses.replace(token, draft=draft)

    def _fanned_out(self, carrier: StageRequest) -> None:
        """A group's last chunk is computed: the siblings hold the prompt's cache now, the carrier is done here."""
        self._forget(carrier.rid)
        for member in carrier.members:
            member.carrier = None

    # --- failures and endings ---------------------------------------------------------------------------------------

    def compute_failed(self, batch: list[Work], text: str) -> list[Action]:
        """The compute of ``batch`` raised: those requests fail, the others go on."""
        actions: list[Action] = []
        for rid in dict.fromkeys(work.rid for work in batch):
            actions += self.fail(rid, text)
        return actions

    def send_failed(self, message: Any, text: str) -> list[Action]:
        """Sending ``message`` to the next stage failed: the requests it carried fail."""
        if isinstance(message, messages.Hidden):
            # a group's last chunk: its siblings hold caches here already, and only they are the leader's to hear of
            rids = [part.rid for part in message.parts] + [s.rid for part in message.parts for s in part.siblings]
        elif isinstance(message, messages.Sampled):
            rids = [token.rid for token in message.tokens if not token.done]
        else:
            return []  # a Free that did not arrive: the caches after it go when the model is unloaded
        actions: list[Action] = []
        for rid in dict.fromkeys(rids):
            actions += self.fail(rid, text, tell_next=False)
        return actions

    def fail(self, rid: str, text: str, *, tell_next: bool = True) -> list[Action]:
        """End ``rid`` on this stage with an error the leader hears; the stages after this one drop it too. A group's
        carrier fails as its siblings (the leader knows only them), which end with it."""
        actions: list[Action] = []
        request = self.requests.get(rid)
        rids = [rid]
        if request is not None and request.start.group:
            rids += [m.rid for m in request.members]
        for each in rids:
            if self._forget(each):
                actions.append(Release(each))
        if tell_next and not self.is_last:
            actions.append(Send(messages.Free(self.model, rids)))
        told = request.start.group if request is not None and request.start.group else [rid]
        actions += self._fail_new(told, text)
        return actions

    def _fail_new(self, rids: list[str], text: str) -> list[Action]:
        return [Report(messages.Failed(self.model, rid, text, stage=self.index)) for rid in rids]

    def _end(self, rid: str, last_dropped: bool = False, end: int = 0) -> list[Action]:
        """Stage 0 ends a request (its last token came back at position ``end``, or it was cancelled): drop its cache
        here and on the stages after this one (the last stage dropped it already when it sampled the final token)."""
        actions: list[Action] = []
        release = self._release(rid, end)
        if release is not None:
            actions.append(release)
        if self.num_stages > 1 and not (last_dropped and self.num_stages == 2):
            actions.append(Send(messages.Free(self.model, [rid], [end] if end else [])))
        return actions
