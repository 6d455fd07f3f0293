"""The ring protocol's records: the actions it hands its driver, the requests it keeps, the work it asks to compute
and what computing it gave (swarm.stage.protocol uses them; swarm.stage.execute computes Work into an Output).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING, Any

from swarm import messages, wire

if TYPE_CHECKING:
    import torch

# --- actions ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Send:
    message: Any


@dataclasses.dataclass(frozen=True)
class Report:
    message: Any


@dataclasses.dataclass(frozen=True)
class Stream:
    rid: str
    token: int
    finish_reason: str | None  # "stop" (end of turn), "length" (max_tokens) or None while it goes on
    logprob: messages.TokenLogprob | None = None  # when the request asked for logprobs


@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    """The last stage's logprobs of prompt tokens, for the leader (a request that asked for them), in order."""

    rid: str
    entries: list


@dataclasses.dataclass(frozen=True)
class Release:
    rid: str
    # a request that ended with its last token, at position ``end``: the stage keeps its reply's blocks first, as its
    # prefix cache plan says (swarm.stage.prefix_cache.finish)
    start: messages.RequestStart | None = None
    end: int = 0


Action = Send | Report | Stream | Release | PromptLogprobs


# --- state -----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class StageRequest:
    """One request as this stage sees it."""

    rid: str
    prompt: list[int] | None  # stage 0 only
    start: messages.RequestStart
    generated: int = 0  # last stage: tokens sampled so far
    reply: list[int] = dataclasses.field(default_factory=list)  # last stage, with penalties: the tokens sampled
    constraint: Any = None  # last stage, with a grammar: its state (swarm.stage.grammar), made on the first draw
    members: list = dataclasses.field(default_factory=list)  # a group's carrier: the siblings it prefills for
    carrier: Any = None  # stage 0: the carrier of a sibling whose cache is not there yet
    next_chunk: int = 0  # stage 0: the prompt position of the next chunk to compute
    draft: list[int] = dataclasses.field(default_factory=list)  # last stage: the tokens guessed for the pass in flight
    spec: list[int] = dataclasses.field(default_factory=lambda: [0, 0, 0, 0])  # last stage: passes, tokens, drafted,
    # accepted (swarm.stage.drafting), for its StageTimes
    crowded: bool = False  # last stage: the model had more chats than stages when its pass was taken (no guessing)
    queue: collections.deque = dataclasses.field(default_factory=collections.deque)  # ready Work, in order

    @property
    def sampling(self) -> messages.Sampling:
        return self.start.sampling

    def sibling(self, sibling: messages.Sibling) -> StageRequest:
        """A sibling of this carrier, as its own request: the carrier's start with the sibling's seed."""
        start = dataclasses.replace(self.start, sampling=dataclasses.replace(self.sampling, seed=sibling.seed),
                                    group=[])
        return StageRequest(sibling.rid, None, start)


@dataclasses.dataclass(frozen=True)
class Rows:
    """Rows [row, row + n) of a received tensor (a Hidden message's ``x``), decoded once for all its parts."""

    source: Any  # RowSource
    row: int
    n: int


class RowSource:
    def __init__(self, x: dict):
        self.x = x
        self._tensor: torch.Tensor | None = None

    def tensor(self):
        if self._tensor is None:
            self._tensor = wire.tensor_from_wire(self.x)
        return self._tensor


@dataclasses.dataclass(frozen=True)
class Work:
    """One piece of compute for one request: a prompt chunk or a decode step."""

    request: StageRequest
    pos: int
    n: int
    last: bool  # the last stage samples after it
    ids: list[int] | None = None  # stage 0's input
    rows: Rows | None = None  # the other stages' input

    @property
    def rid(self) -> str:
        return self.request.rid

    @property
    def start(self) -> bool:
        """The request's first computed chunk: at 0, or where its cached prompt blocks end (stage.prefix_cache)."""
        return self.pos == self.request.start.cached

    @property
    def prefill(self) -> bool:
        """A piece of the prompt (not a decode step)."""
        return self.pos < self.request.start.prompt_len

    @property
    def fans_out(self) -> bool:
        """A group's last prompt chunk: its cache goes to the siblings (``request.members``) once computed."""
        return self.last and bool(self.request.members) and self.pos < self.request.start.prompt_len


@dataclasses.dataclass(frozen=True)
class Output:
    """What computing a batch gave: the stage's hidden states for every row (not on the last stage, as a wire
    tensor), or the sampled token of each Work (last stage; None where it did not sample)."""

    hidden: dict | None = None
    tokens: list[int | None] | None = None
    logprobs: list[messages.TokenLogprob | None] | None = None  # with tokens, for requests that asked for them
    prompt_logprobs: list[list[messages.TokenLogprob] | None] | None = None  # prompt tokens' (prompt chunks)
    # last stage, a group's last prompt chunk: each sibling's (token, logprob), in request.members' order
    fanned: list[list[tuple[int, messages.TokenLogprob | None]] | None] | None = None
    # last stage, a pass that verified drafted tokens (swarm.stage.verify): the (token, logprob) it gives, in order --
    # the drafted tokens kept, then the model's own next one
    verified: list[list[tuple[int, messages.TokenLogprob | None]] | None] | None = None
    # last stage with a draft model (swarm.stage.draft_model): what it proposes after each Work's token(s) -- prompt
    # lookup's tokens, else its own guesses; None where it did not look
    drafts: list[list[int] | None] | None = None
