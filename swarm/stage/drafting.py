"""Drafting ahead by prompt lookup, as plain logic (no torch): what the last stage guesses, and when it guesses.

After sampling a token the last stage looks for the conversation's last tokens (its prompt and the reply so far)
earlier in it -- the occurrence that shares the longest run of tokens with the conversation's end, the most recent of
those -- and proposes the tokens that followed there, up to the request's ``draft`` count (SWARM_SERVE_SPECULATIVE).
The proposal travels back to stage 0 with the sampled token (SampledToken.draft); the next pass runs them all
through the ring at once, and the last stage keeps the longest prefix its model agrees with (swarm.stage.verify), so
the reply is what it would have been.

It is transformers' prompt lookup (``prompt_lookup_num_tokens``) and vLLM's n-gram proposer, with two choices of
which earlier occurrence to follow. The longest shared run first: in a copy of code, ``self.items`` occurs many
times, and ``value):\n        self.items`` says which line is being copied (a fixed 3-gram follows whichever came
last, often the wrong line). Then the most recent: in an edit of code or text, the latest occurrence is the one
being rewritten.
"""

from __future__ import annotations

from collections.abc import Sequence

from swarm import messages

# The shortest run of tokens a match must share with the conversation's end: one token alone is mostly chance in
# ordinary text (each wrong guess costs a row of compute on every stage). The longest compared: enough to tell a
# copied line from its look-alikes.
MIN_NGRAM = 2
MAX_NGRAM = 32
# How far back the lookup searches (tokens): keeps a long conversation's lookup around a millisecond.
LOOKBACK = 8192


def propose(sequence: Sequence[int], n: int, *, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM,
            lookback: int = LOOKBACK) -> list[int]:
    """Up to ``n`` tokens that followed the earlier occurrence of ``sequence``'s end that shares the most of its last
    tokens with it (at least ``min_ngram``, compared up to ``max_ngram``), the latest such; [] when none does."""
    if n <= 0:
        return []
    seq = list(sequence[-lookback:])
    length = len(seq)
    if length < 2:
        return []
    last = seq[-1]
    best, end = 0, -1
    for i in range(length - 2, -1, -1):  # the latest first; each occurrence followed by a token before the end
        if seq[i] != last:
            continue
        shared = 1
        while shared < max_ngram and shared <= i and seq[i - shared] == seq[length - 1 - shared]:
            shared += 1
        if shared > best:
            best, end = shared, i
            if shared == max_ngram:
                break
    if best < min_ngram:
        return []
    return seq[end + 1 : end + 1 + n]


def eligible(start: messages.RequestStart) -> bool:
    """Whether a request may be drafted for at all: it asked (RequestStart.draft), the last stage has its prompt
    (RequestStart.context) and nothing depends on the reply token by token (penalties, a grammar)."""
    sampling = start.sampling
    return start.draft > 0 and start.context is not None and not sampling.penalised and sampling.grammar is None


def draft_for(request, chats: int, num_stages: int, guess: list[int] | None = None) -> list[int]:
    """What the last stage proposes for ``request`` (a swarm.stage.protocol_records.StageRequest that goes on) after the
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
