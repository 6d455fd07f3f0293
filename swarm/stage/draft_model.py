"""Drafting ahead with a small model (SWARM_SERVE_DRAFT_MODEL): the last stage holds a small model of the family whole
and, where prompt lookup finds nothing (swarm.stage.drafting), guesses the next tokens by running it greedily.

It runs in the stage's compute (swarm.stage.execute calls :meth:`DraftModel.guesses` after the last stage sampled),
so the guesses travel back with the sampled token as prompt lookup's do, and the same pass verifies them
(swarm.stage.verify): the reply is the one without drafting whatever the small model guesses.

The small model keeps a KV cache per request (a whole-model swarm.stage.slice.StageModel) and remembers the tokens
it holds. Each time it is asked it keeps the longest prefix those share with the conversation now -- what the ring
kept of its last guesses -- crops the rest (the cache's crop, as rejected guesses on the stages), and feeds only what
is new: the tokens the last pass gave. The prompt is fed chunk by chunk while the last stage computes the prompt's
own chunks, so the first guess does not wait for a whole prefill of the small model.
"""

from __future__ import annotations

import dataclasses

import torch

from swarm.errors import ModelError
from swarm.stage import drafting
from swarm.stage.protocol_records import Output, Work
from swarm.stage.slice import StageModel

# Prompt tokens fed to the small model per forward: the ring's own prefill chunk (SWARM_SERVE_PREFILL_CHUNK's default)
# -- the activations of one chunk, not of a whole long prompt, at once.
CHUNK = 256


class DraftModel:
    """A small model held whole, guessing greedily for the requests of the last stage it sits beside."""

    def __init__(self, model: StageModel, vocab_size: int | None = None):
        self.model = model
        # The target's vocabulary: a draft model's head may be padded past it (Qwen2.5's small ones are); a guess
        # out there is a token the target does not have, so guessing stops before it.
        self.vocab_size = vocab_size or int(model.config.vocab_size)
        self._fed: dict[str, list[int]] = {}  # rid -> the tokens its cache holds, in order
        self._last: dict[str, tuple[int, list[int]]] = {}  # rid -> where its last guesses went, and they
        self._ahead_of: dict[str, int] = {}  # rid -> how many tokens it guesses next (:meth:`_ahead`)

    def drop(self, rid: str) -> None:
        self._fed.pop(rid, None)
        self._last.pop(rid, None)
        self._ahead_of.pop(rid, None)
        self.model.drop(rid)

    def requests(self) -> list[str]:
        return list(self._fed)

    def parameter_bytes(self) -> int:
        return self.model.parameter_bytes()

    def warm_up(self) -> None:
        self.model.warm_up()

    # --- guessing ----------------------------------------------------------------------------------------------------

    def guess(self, rid: str, sequence: list[int], n: int) -> list[int]:
        """Up to ``n`` tokens the small model expects after ``sequence`` (the conversation so far), greedily -- fewer
        while its recent guesses for the request were thrown away (:meth:`_ahead`)."""
        if n <= 0 or not sequence:
            return []
        n = self._ahead(rid, sequence, n)
        logits, fed = self._feed(rid, sequence, want_logits=True)
        guesses: list[int] = []
        while True:
            token = int(torch.argmax(logits))
            if token >= self.vocab_size:
                break
            guesses.append(token)
            if len(guesses) == n:
                break
            logits = self.model.forward(rid, len(fed), input_ids=torch.tensor([[token]], dtype=torch.long))
            fed.append(token)
        self._last[rid] = (len(sequence), guesses)
        return guesses

    def _ahead(self, rid: str, sequence: list[int], n: int) -> int:
        """How many tokens to guess for ``rid`` now, at most ``n``: transformers' heuristic schedule for assisted
        generation -- two more after a pass that kept every guess, one fewer after one that did not, never under one
        -- so a draft model that guesses this conversation badly costs the ring one extra row a pass, not ``n``."""
        ahead = self._ahead_of.get(rid, n)
        last = self._last.pop(rid, None)
        if last is not None:
            start, guessed = last
            kept = guessed == sequence[start : start + len(guessed)]
            ahead = ahead + 2 if kept else ahead - 1
        ahead = self._ahead_of[rid] = max(1, min(n, ahead))
        return ahead

    def follow(self, rid: str, sequence: list[int]) -> None:
        """Feed what is new in ``sequence`` (a prompt chunk the last stage computed), guessing nothing."""
        if sequence:
            self._feed(rid, sequence, want_logits=False)

    def _feed(self, rid: str, sequence: list[int], want_logits: bool):
        """Bring request ``rid``'s cache to ``sequence``: crop it to the prefix it shares, feed the rest in chunks.
        (The logits after the last token when ``want_logits`` -- at least that token is fed again for them -- else
        None; and the tokens the cache holds.)"""
        fed = self._fed.get(rid)
        if fed is None or not self.model.has_request(rid):
            self.model.new_request(rid)
            fed = self._fed[rid] = []
        keep = _common_prefix(fed, sequence)
        if want_logits and keep == len(sequence):
            keep -= 1  # everything is fed already, but the logits after it were not kept: feed the last token again
        if keep < len(fed):
            self.model.rollback(rid, keep)
            del fed[keep:]
        logits = None
        while len(fed) < len(sequence):
            chunk = sequence[len(fed) : len(fed) + CHUNK]
            last = len(fed) + len(chunk) == len(sequence)
            logits = self.model.forward(rid, len(fed), input_ids=torch.tensor([chunk], dtype=torch.long),
                                        want_logits=want_logits and last)
            fed.extend(chunk)
        return logits, fed

    # --- beside the last stage ---------------------------------------------------------------------------------------

    def guesses(self, stage: StageModel, batch: list[Work], output: Output) -> Output:
        """The last stage (``stage``) computed ``batch`` into ``output``: for each request that will draft, what prompt
        lookup proposes, else the small model's guesses (Output.drafts; None where it did not look, and the protocol
        looks then; the protocol decides whether to draft at all, swarm.stage.drafting). Prompt chunks before the last
        are fed to it as they pass."""
        for rid in [rid for rid in list(self._fed) if not stage.has_request(rid)]:
            self.drop(rid)  # a request the stage holds no cache of any more (a group's prompt, handed on) goes here too
        tokens = output.tokens or [None] * len(batch)
        verified = output.verified or [None] * len(batch)
        drafts: list[list[int] | None] = []
        for work, token, kept in zip(batch, tokens, verified):
            drafts.append(None)
            request = work.request
            start = request.start
            if not drafting.eligible(start) or request.members:
                continue  # a group's prompt (its carrier) guesses nothing: its choices do, once they have a token
            assert start.context is not None  # eligible: the last stage has the prompt
            if work.prefill and not work.last:  # a prompt chunk: the small model reads it too, unless it is busy
                if not request.crowded:
                    self._quietly(self.follow, work.rid, start.context[: work.pos + work.n])
                continue
            new = [t for t, _ in kept] if kept is not None else [token] if token is not None else []
            if not new or request.crowded:
                continue
            if any(t in start.eos for t in new):
                continue  # the reply ends in this pass: nothing to guess
            sequence = start.context + request.reply + new
            n = min(start.draft, start.max_tokens - request.generated - len(new) - 1)
            if n <= 0:
                continue  # the reply's end is near
            # Prompt lookup goes first (it costs nothing); its proposal is handed on too, not looked up again.
            drafts[-1] = drafting.propose(sequence, n) or self._quietly(self.guess, work.rid, sequence, n)
        if not any(drafts):
            return output
        return dataclasses.replace(output, drafts=drafts)

    def _quietly(self, run, rid: str, *args):
        """``run(rid, ...)``, or None where the request's cache went meanwhile (the event loop's Release of a
        cancelled request while its pass computed): guessing is never worth failing a request for."""
        try:
            return run(rid, *args)
        except ModelError:
            self.drop(rid)
            return None


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
