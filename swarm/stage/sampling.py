"""Turning the last stage's logits into a token, exactly as transformers' generate samples.

Greedy (temperature 0) is argmax. Otherwise the logits warpers run in the order generate applies them --
temperature, top_k, top_p, min_p -- and a token is drawn with torch.multinomial. Each token draws from a generator
seeded by the request's seed and the token's number in the reply, so a seeded reply is reproducible, and a reply that
is sent again after a failover (prompt plus the tokens already streamed) goes on with the same random draws.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


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
    # The warpers ignore input_ids; an empty tensor keeps their signature happy.
    scores = params.warpers()(torch.empty((1, 0), dtype=torch.long, device=scores.device), scores)
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, num_samples=1, generator=generator)[0, 0])
