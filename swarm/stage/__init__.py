"""One pipeline stage: a slice of a transformers model, its KV caches, sampling, and the ring protocol as plain logic.
No networking here."""

from swarm.stage.local import LocalRing
from swarm.stage.protocol import StageProtocol
from swarm.stage.sampling import GREEDY, SamplingParams, make_generator, sample
from swarm.stage.slice import StageModel, StageSpec, stage_specs

__all__ = [
    "GREEDY",
    "LocalRing",
    "SamplingParams",
    "StageModel",
    "StageProtocol",
    "StageSpec",
    "make_generator",
    "sample",
    "stage_specs",
]
