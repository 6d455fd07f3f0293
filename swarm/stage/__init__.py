"""One pipeline stage: a slice of a transformers model, its KV caches, and sampling. No networking here."""

from swarm.stage.architectures import SUPPORTED_ARCHITECTURES
from swarm.stage.local import LocalChain
from swarm.stage.sampling import GREEDY, SamplingParams, make_generator, sample
from swarm.stage.slice import StageModel, StageSpec, split_layers

__all__ = [
    "GREEDY",
    "SUPPORTED_ARCHITECTURES",
    "LocalChain",
    "SamplingParams",
    "StageModel",
    "StageSpec",
    "make_generator",
    "sample",
    "split_layers",
]
