"""Constrained sampling on the last stage (the API's ``response_format``): the reply must follow a grammar -- a JSON
schema, or any JSON object -- so before each draw the tokens that cannot continue it are masked out.

The grammar engine is llguidance (Microsoft's; the one vLLM and llama.cpp use): the leader turns the request's
schema into an llguidance grammar and checks it; the last stage builds a matcher from it per request, asks it for
the allowed tokens before each draw (a bitmask over the vocabulary) and feeds it the token drawn. Once the grammar
is complete only the end-of-turn token is allowed, so the reply ends there. The stage needs the model's tokenizer to
know each token's bytes: the leader sends its files with the last stage's (a folder of them is ``tokenizer_dir``).

A reasoning model (Qwen3) thinks first: with ``think`` (the ids of <think> and </think>) the reply may open a
thinking block as its first token -- or the prompt opened one already -- and the grammar applies from its end on,
as vLLM does with a reasoning parser; a reply that does not think follows the grammar from its first token.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from swarm.errors import ModelError

_lock = threading.Lock()
# Each stage's llguidance tokenizer, dropped with its stage.
_tokenizers: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _tokenizer(stage, eos: list[int]):
    """The llguidance tokenizer of ``stage``'s model (built once per stage: ~1-2 s)."""
    cached = _tokenizers.get(stage)
    if cached is not None:
        return cached
    with _lock:
        cached = _tokenizers.get(stage)
        if cached is None:
            folder = getattr(stage, "tokenizer_dir", None)
            if folder is None:
                raise ModelError("this request asks for structured output (response_format), but the last stage has "
                                 "no tokenizer: its fellow loaded the model from a leader of an earlier version. "
                                 "Load the model again.")
            import llguidance.hf
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(str(folder))
            vocab = int(stage.config.vocab_size)
            ends = sorted({int(e) for e in eos} | ({hf.eos_token_id} if hf.eos_token_id is not None else set()))
            # llguidance takes a fast tokenizer; a slow one is refused there, in its own words
            cached = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=ends or None)  # type: ignore[arg-type]
            _tokenizers[stage] = cached
    return cached


class Constraint:
    """One request's grammar state on the last stage."""

    def __init__(self, stage, grammar: str, eos: list[int], reply: list[int], think: list[int] | None = None,
                 prompt: Sequence[int] = ()):
        import llguidance
        import llguidance.torch

        self.matcher = llguidance.LLMatcher(_tokenizer(stage, eos), grammar)
        self._check()
        self.think = think
        self.state = "grammar"
        if think is not None:
            opened, closed = think
            last_open = max((i for i, t in enumerate(prompt) if t == opened), default=-1)
            last_close = max((i for i, t in enumerate(prompt) if t == closed), default=-1)
            self.state = "thinking" if last_open > last_close else "first"
        for token in reply:  # a request sent again after a failover: the reply so far already follows the grammar
            self.consume(token)
        self.mask = llguidance.torch.allocate_token_bitmask(1, int(stage.config.vocab_size))

    def _check(self) -> None:
        if self.matcher.is_error():
            raise ModelError(f"structured output failed: {self.matcher.get_error()}")

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (vocab,) with the tokens that cannot continue the grammar at -inf (none while thinking; the
        first token may also open a thinking block)."""
        import llguidance.torch

        if self.state == "thinking":
            return logits
        llguidance.torch.fill_next_token_bitmask(self.matcher, self.mask, 0)
        self._check()
        out = logits.float().clone().reshape(1, -1)
        llguidance.torch.apply_token_bitmask_inplace(out, self.mask)
        out = out.reshape(-1)
        if self.state == "first":
            assert self.think is not None  # the state is "grammar" without it
            out[self.think[0]] = logits[self.think[0]]
        return out

    def consume(self, token: int) -> None:
        think = self.think or []  # the state is "grammar" without it
        if self.state == "first":
            self.state = "grammar"
            if token == think[0]:
                self.state = "thinking"
                return
        if self.state == "thinking":
            if token == think[1]:
                self.state = "grammar"
            return
        self.matcher.consume_token(token)
        self._check()


def constraint(stage, request: Any) -> Constraint | None:
    """The grammar state of ``request`` (a StageRequest), made on its first draw; None when it has no grammar."""
    grammar = request.sampling.grammar
    if grammar is None:
        return None
    if request.constraint is None:
        context = request.start.context or []
        drawn = request.start.drawn
        reply = context[len(context) - drawn :] if drawn else []
        prompt = context[: len(context) - drawn]
        request.constraint = Constraint(stage, grammar, request.start.eos, reply, request.sampling.think, prompt)
    return request.constraint
