"""Drafting ahead by prompt lookup, as plain logic (no torch): what the last stage guesses, and when it guesses.

After sampling a token the last stage looks for the conversation's last few tokens (its prompt and the reply so far)
earlier in it -- the longest n-gram first, its most recent earlier occurrence first -- and proposes the tokens that
followed there, up to the request's ``draft`` count (SWARM_SERVE_SPECULATIVE). The proposal travels back to stage 0
with the sampled token (SampledToken.draft); the next pass runs them all through the ring at once, and the last stage
keeps the longest prefix its model agrees with (swarm.stage.verify), so the reply is what it would have been.

It is transformers' prompt lookup (``prompt_lookup_num_tokens``) and vLLM's n-gram proposer, with the most recent
match preferred: in an edit of code or text the latest occurrence is the one being rewritten.
"""

from __future__ import annotations

from collections.abc import Sequence

from swarm import messages

# n-gram sizes looked up, longest first. A 1-gram match is mostly chance in ordinary text (each wrong guess costs a
# row of compute on every stage), so two tokens must match.
MAX_NGRAM = 3
MIN_NGRAM = 2
# How far back the lookup searches (tokens): keeps a long conversation's lookup well under a millisecond.
LOOKBACK = 8192


def propose(sequence: Sequence[int], n: int, *, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM,
            lookback: int = LOOKBACK) -> list[int]:
    """Up to ``n`` tokens that followed the latest earlier occurrence of ``sequence``'s last ``max_ngram`` tokens (or
    fewer, down to ``min_ngram``); [] when none occurs."""
    if n <= 0:
        return []
    seq = list(sequence[-lookback:])
    length = len(seq)
    for size in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        tail = seq[length - size :]
        first = tail[0]
        # a match starting at i is followed by seq[i + size]: it must end before the tail itself starts
        for i in range(length - size - 1, -1, -1):
            if seq[i] == first and seq[i : i + size] == tail:
                return seq[i + size : i + size + n]
    return []


def eligible(start: messages.RequestStart) -> bool:
    """Whether a request may be drafted for at all: it asked (RequestStart.draft), the last stage has its prompt
    (RequestStart.context) and nothing depends on the reply token by token (penalties, a grammar)."""
    sampling = start.sampling
    return start.draft > 0 and start.context is not None and not sampling.penalised and sampling.grammar is None


def draft_for(request, chats: int, num_stages: int, guess: list[int] | None = None) -> list[int]:
    """What the last stage proposes for ``request`` (a swarm.stage.protocol.StageRequest that goes on) after the
    token it just sampled: nothing while the model has more chats than stages (every stage has work already;
    guessing would only slow the others down) or when one token is all the reply has left; else ``guess`` where the
    draft model's side (swarm.stage.draft_model) already proposed -- prompt lookup's tokens or its own -- or what
    prompt lookup finds."""
    start = request.start
    if not eligible(start) or chats > num_stages:
        return []
    left = start.max_tokens - request.generated - 1  # the next pass gives its drafted tokens and one more
    if left <= 0:
        return []
    n = min(start.draft, left)
    if guess is not None:
        return list(guess)[:n]
    return propose(start.context + request.reply, n)
