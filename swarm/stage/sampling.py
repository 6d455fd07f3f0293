"""Turning the last stage's logits into a token, exactly as transformers' generate samples.

Penalties come first, on the raw logits: transformers' repetition penalty (over the prompt and the reply, as
generate applies it) and OpenAI's presence and frequency penalties (over the reply only, as OpenAI and vLLM apply
them). Then greedy (temperature 0) is argmax. Otherwise the logits warpers run in the order generate applies them --
temperature, top_k, top_p, min_p -- and a token is drawn with torch.multinomial. Each token draws from a generator
seeded by the request's seed and the token's number in the reply, so a seeded reply is reproducible, and a reply that
is sent again after a failover (prompt plus the tokens already streamed) goes on with the same random draws.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

# The log-probability reported for a token the filters ruled out (JSON has no -inf); OpenAI's API uses the same.
IMPOSSIBLE = -9999.0


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0: off
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def warpers(self) -> LogitsProcessorList:
        """transformers' warpers for these settings, in generate's order; a filter that is off is left out."""
        out = LogitsProcessorList()
        if self.temperature != 1.0:
            out.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k > 0:
            out.append(TopKLogitsWarper(top_k=self.top_k))
        if self.top_p < 1.0:
            out.append(TopPLogitsWarper(top_p=self.top_p))
        if self.min_p > 0.0:
            out.append(MinPLogitsWarper(min_p=self.min_p))
        return out


GREEDY = SamplingParams(temperature=0.0)


def make_generator(params: SamplingParams, device: str | torch.device = "cpu") -> torch.Generator:
    """A generator for one request: seeded when the request gives a seed, from fresh entropy otherwise."""
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


# splitmix64's increment: consecutive tokens of one seed get well-spread generator seeds.
_GOLDEN = 0x9E3779B97F4A7C15


def token_generator(seed: int | None, index: int) -> torch.Generator:
    """The generator token ``index`` of a reply draws from: a function of (seed, index) alone; fresh entropy for a
    request without a seed."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed((seed * _GOLDEN + index) % (1 << 63))
    return generator


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """One token id from the logits (vocab,) of the last position."""
    if params.greedy:
        return int(torch.argmax(logits))
    scores = logits.float().reshape(1, -1)
    scores = params.warpers()(no_input_ids(scores.device), scores)
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, num_samples=1, generator=generator)[0, 0])


def no_input_ids(device: torch.device) -> torch.LongTensor:
    """The warpers ignore input_ids; an empty (1, 0) tensor of them keeps their signature happy."""
    return cast(torch.LongTensor, torch.empty((1, 0), dtype=torch.long, device=device))


def penalise(logits: torch.Tensor, *, presence: float = 0.0, frequency: float = 0.0, repetition: float = 1.0,
             context: Sequence[int] = (), reply: Sequence[int] = ()) -> torch.Tensor:
    """The logits (vocab,) with the penalties applied: transformers' RepetitionPenaltyLogitsProcessor over
    ``context`` (the prompt and the reply so far, as generate gives it), then OpenAI's presence penalty (once for
    every token the reply holds) and frequency penalty (once per occurrence) over ``reply``."""
    scores = logits.float().reshape(1, -1)
    if repetition != 1.0 and context:
        ids = torch.tensor([list(context)], dtype=torch.long)
        scores = RepetitionPenaltyLogitsProcessor(penalty=repetition)(ids, scores)
    if (presence or frequency) and reply:
        counts = torch.bincount(torch.tensor(list(reply), dtype=torch.long), minlength=scores.shape[-1])
        counts = counts[: scores.shape[-1]].to(scores.dtype)
        scores = scores - frequency * counts - presence * (counts > 0).to(scores.dtype)
    return scores.reshape(-1)


def sample_with_logprobs(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                         top: int) -> tuple[int, float, list[int], list[float]]:
    """One token id, like :func:`sample`, with its log-probability and the ``top`` most likely tokens' ids and
    log-probabilities -- in the distribution the token was drawn from: after the temperature and the filters (and
    the penalties given to :func:`penalise`); for greedy, the model's own. Ruled-out tokens are IMPOSSIBLE."""
    scores = logits.float().reshape(1, -1)
    if not params.greedy:
        scores = params.warpers()(no_input_ids(scores.device), scores)
    logprobs = torch.log_softmax(scores, dim=-1)[0]
    if params.greedy:
        token = int(torch.argmax(scores))
    else:
        # the same draw as sample(): asking for logprobs does not change a seeded reply
        token = int(torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1, generator=generator)[0, 0])
    values, ids = torch.topk(logprobs, top) if top > 0 else (logprobs[:0], logprobs[:0].long())
    return (token, _finite(logprobs[token]), [int(i) for i in ids], [_finite(v) for v in values])


def _finite(value: torch.Tensor) -> float:
    number = float(value)
    return number if number > IMPOSSIBLE else IMPOSSIBLE


def accept_drafted(probs: torch.Tensor, drafted: int, generator: torch.Generator | None = None) -> int:
    """Speculative sampling's acceptance rule for a deterministic guess (prompt lookup proposes one token for sure):
    keep ``drafted`` with probability p(drafted); otherwise draw from ``probs`` (vocab,) without it, renormalised.
    The token returned is then distributed exactly as ``probs`` (Leviathan et al. 2023, with the guess's own
    distribution all on ``drafted``): p(drafted) * 1 for drafted, (1 - p(drafted)) * p(x) / (1 - p(drafted)) else."""
    p = float(probs[drafted])
    if float(torch.rand((), generator=generator)) < p:
        return drafted
    rest = probs.clone().reshape(-1)
    rest[drafted] = 0.0
    total = float(rest.sum())
    if total <= 0.0:  # only a rounding away from p == 1
        return drafted
    return int(torch.multinomial(rest / total, num_samples=1, generator=generator)[0])
