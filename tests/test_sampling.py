"""The last stage samples exactly as transformers' generate does."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from swarm.stage.sampling import GREEDY, SamplingParams, make_generator, sample, token_generator


def logits(seed: int = 0, vocab: int = 500) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    for seed in range(5):
        x = logits(seed)
        assert sample(x, GREEDY, None) == int(x.argmax())


def test_top_k_one_is_argmax():
    params = SamplingParams(temperature=1.7, top_k=1)
    generator = make_generator(params)
    for seed in range(5):
        x = logits(seed)
        assert all(sample(x, params, generator) == int(x.argmax()) for _ in range(10))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, seed=7),
        SamplingParams(temperature=1.0, seed=8),
        SamplingParams(temperature=1.3, top_p=0.8, seed=9),
        SamplingParams(temperature=0.5, min_p=0.1, seed=10),
    ],
)
def test_seeded_sampling_matches_transformers_warpers(params):
    for seed in range(20):
        ours, theirs = token_generator(params.seed, seed), token_generator(params.seed, seed)
        x = logits(seed)
        scores = x.reshape(1, -1).clone()
        ids = torch.empty((1, 0), dtype=torch.long)
        # generate's order: temperature, top_k, top_p, min_p (transformers/generation/utils.py)
        if params.temperature != 1.0:
            scores = TemperatureLogitsWarper(params.temperature)(ids, scores)
        if params.top_k:
            scores = TopKLogitsWarper(params.top_k)(ids, scores)
        if params.top_p < 1.0:
            scores = TopPLogitsWarper(params.top_p)(ids, scores)
        if params.min_p:
            scores = MinPLogitsWarper(params.min_p)(ids, scores)
        expected = int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=theirs)[0, 0])
        assert sample(x, params, ours) == expected


def test_same_seed_same_tokens_and_filters_hold():
    params = SamplingParams(temperature=1.0, top_k=3, seed=123)
    x = logits(1)
    a, b = make_generator(params), make_generator(params)
    draws = [sample(x, params, a) for _ in range(50)]
    assert draws == [sample(x, params, b) for _ in range(50)]
    assert set(draws) <= set(x.topk(3).indices.tolist())


def test_each_token_draws_from_its_own_seeded_generator():
    """Token i of a seeded reply depends on (seed, i) alone: a reply sent again from token i draws the same."""
    params = SamplingParams(temperature=1.0, seed=99)
    x = logits(3)
    first = [sample(x, params, token_generator(99, i)) for i in range(40)]
    assert first == [sample(x, params, token_generator(99, i)) for i in range(40)]
    resumed = [sample(x, params, token_generator(99, i)) for i in range(17, 40)]
    assert resumed == first[17:]
    assert len(set(first)) > 5  # the draws really differ from token to token
    other = [sample(x, params, token_generator(100, i)) for i in range(40)]
    assert other != first
