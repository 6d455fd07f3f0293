"""A whole ring in one process: every stage's protocol and model, messages passed by function calls.

The same :class:`~swarm.stage.protocol.StageProtocol` the fellows run, without sockets: the reference for what the
networked ring must do, and the fastest way to test the protocol (chunked prefill, endings, cancels, failures,
requests interleaved). ``execute`` computes a batch; tests may pass one that fails on purpose.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from swarm import messages, wire
from swarm.errors import ModelError
from swarm.stage import prefix_cache
from swarm.stage.protocol import StageProtocol
from swarm.stage.protocol_records import Output, PromptLogprobs, Release, Report, Send, Stream, Work
from swarm.stage.timing import StageTimer


@dataclasses.dataclass
class LocalReply:
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[messages.TokenLogprob] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[messages.TokenLogprob] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ended(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class LocalRing:
    def __init__(
        self,
        stages: Sequence[Any],
        *,
        prefill_chunk: int = 256,
        model: str = "local",
        execute: Callable[[Any, list[Work]], Output] | None = None,
    ):
        if not stages:
            raise ModelError("a ring needs at least one stage")
        if execute is None:
            from swarm.stage.execute import run_batch

            execute = run_batch
        self.stages = list(stages)
        self.execute = execute
        n = len(self.stages)
        self.protocols = [StageProtocol(model=model, index=i, num_stages=n, prefill_chunk=prefill_chunk)
                          for i in range(n)]
        self.inboxes: list[collections.deque] = [collections.deque() for _ in range(n)]
        self.timers = [StageTimer(model, i, n) for i in range(n)]
        self.times: dict[str, dict[int, messages.StageTimes]] = {}  # rid -> each stage's times, once it dropped it
        self.replies: dict[str, LocalReply] = {}
        self.model = model
        self.batches = 0  # computed batches, all stages together

    # --- requests -----------------------------------------------------------------------------------------------

    def submit(self, rid: str, prompt: Sequence[int], max_tokens: int,
               sampling: messages.Sampling = messages.Sampling(), eos: Iterable[int] = (),
               draft: int = 0, prefix: messages.PrefixPlan | None = None) -> LocalReply:
        """Start a request; ``draft``: drafting ahead, up to this many guessed tokens per pass
        (swarm.stage.drafting); ``prefix``: the prefix cache's plan for it (swarm.leader.serving.prefix_index)."""
        self.replies[rid] = LocalReply()
        self.inboxes[0].append(messages.Generate(self.model, rid, list(prompt), max_tokens, sorted(set(eos)), sampling,
                                                 draft=draft, prefix=prefix))
        return self.replies[rid]

    def submit_group(self, carrier: str, siblings: Sequence[tuple[str, int | None]], prompt: Sequence[int],
                     max_tokens: int, sampling: messages.Sampling = messages.Sampling(),
                     eos: Iterable[int] = ()) -> dict[str, LocalReply]:
        """Sampled choices of one prompt as one group: the prompt prefills once (as ``carrier``), then each sibling
        ``(rid, seed)`` samples and decodes on its own. The replies by sibling rid."""
        for rid, _ in siblings:
            self.replies[rid] = LocalReply()
        self.inboxes[0].append(messages.Generate(self.model, carrier, list(prompt), max_tokens, sorted(set(eos)),
                                                 sampling, siblings=[messages.Sibling(r, s) for r, s in siblings]))
        return {rid: self.replies[rid] for rid, _ in siblings}

    def cancel(self, rid: str) -> None:
        self.inboxes[0].append(messages.Cancel(self.model, rid))
        reply = self.replies.get(rid)
        if reply is not None and not reply.ended:
            reply.finish_reason = "cancelled"

    # --- running ------------------------------------------------------------------------------------------------

    def step(self) -> bool:
        """Deliver every waiting message, then compute one batch on each stage that has work; False when idle."""
        busy = False
        for i, protocol in enumerate(self.protocols):
            inbox = self.inboxes[i]
            while inbox:
                busy = True
                self._perform(i, protocol.receive(inbox.popleft()))
            batch = protocol.next_batch()
            if not batch:
                continue
            busy = True
            self.batches += 1
            try:
                began = time.perf_counter()
                output = self.execute(self.stages[i], batch)
                self.timers[i].computed(batch, time.perf_counter() - began)
            except Exception as exc:  # a failing compute fails its requests, as on a fellow
                self._perform(i, protocol.compute_failed(batch, f"stage {i} failed: {type(exc).__name__}: {exc}"))
            else:
                self._perform(i, protocol.computed(batch, output))
        return busy

    def run(self, max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if not self.step():
                return
        raise ModelError(f"the local ring did not settle within {max_steps} steps")

    def _perform(self, index: int, actions: list) -> None:
        n = len(self.protocols)
        for action in actions:
            if isinstance(action, Send):
                now = time.perf_counter()
                self.timers[index].sent(action.message, len(wire.encode(action.message)), now)
                self.timers[(index + 1) % n].arrived(action.message, now)
                self.inboxes[(index + 1) % n].append(action.message)
            elif isinstance(action, Stream):
                reply = self.replies.get(action.rid)
                if reply is not None and not reply.ended:
                    reply.tokens.append(action.token)
                    if action.logprob is not None:
                        reply.logprobs.append(action.logprob)
                    reply.finish_reason = action.finish_reason
            elif isinstance(action, PromptLogprobs):
                reply = self.replies.get(action.rid)
                if reply is not None:
                    reply.prompt_logprobs.extend(action.entries)
            elif isinstance(action, Report):
                reply = self.replies.get(action.message.rid)
                if reply is not None and not reply.ended:
                    reply.error = action.message.message
                # What the leader does with a failure: cancel the request on stage 0, which frees it everywhere.
                self.inboxes[0].append(messages.Cancel(self.model, action.message.rid))
            elif isinstance(action, Release):
                prefix_cache.finish(self.stages[index], action)  # a reply's blocks, when its plan keeps them
                self.stages[index].drop(action.rid)
                times = self.timers[index].finish(action.rid)
                if times is not None:
                    self.times.setdefault(action.rid, {})[index] = times

    # --- one request, like generate -----------------------------------------------------------------------------

    def generate(self, prompt: Sequence[int], max_new_tokens: int, *, sampling: messages.Sampling = messages.Sampling(),
                 eos_token_ids: Iterable[int] = (), rid: str = "local", draft: int = 0) -> list[int]:
        """New tokens of one request, ending after an end-of-sequence token (included) or ``max_new_tokens``."""
        reply = self.submit(rid, prompt, max_new_tokens, sampling, eos_token_ids, draft)
        self.run()
        if reply.error is not None:
            raise ModelError(reply.error)
        return reply.tokens

    def holding(self) -> list[list[str]]:
        """The requests each stage still holds state for (protocol) -- empty lists once everything ended."""
        return [sorted(p.requests) for p in self.protocols]


def forward_through(stages: Sequence[Any], rid: str, position: int, ids: Sequence[int], want_logits: bool = True):
    """One chunk of token ids through every stage's model, without the protocol: the last stage's logits (or None).
    For checking caches, chunking and rollback against the library's own forward."""
    import torch

    out = stages[0].forward(rid, position, input_ids=torch.tensor([list(ids)], dtype=torch.long),
                            want_logits=want_logits)
    for stage in stages[1:]:
        out = stage.forward(rid, position, hidden=out, want_logits=want_logits)
    return out
