"""One pipeline stage: a slice of a transformers model, its KV caches, sampling, and the ring protocol as plain logic.
No networking here.

The names below are imported on first use (PEP 562): the ring protocol (swarm.stage.protocol) is plain Python, while
slices and sampling need torch and transformers -- some 1.3 s and 300 MB a fellow should spend only once a stage is
placed on it, not on joining."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from swarm.stage.local import LocalRing
    from swarm.stage.protocol import StageProtocol
    from swarm.stage.sampling import GREEDY, SamplingParams, make_generator, sample
    from swarm.stage.slice import StageModel
    from swarm.stage.slice_load import StageSpec, stage_specs

_WHERE = {
    "GREEDY": "sampling", "SamplingParams": "sampling", "make_generator": "sampling", "sample": "sampling",
    "LocalRing": "local", "StageProtocol": "protocol", "StageModel": "slice", "StageSpec": "slice_load",
    "stage_specs": "slice_load",
}

__all__ = ["GREEDY", "LocalRing", "SamplingParams", "StageModel", "StageProtocol", "StageSpec", "make_generator",
           "sample", "stage_specs"]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'swarm.stage' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"swarm.stage.{module}"), name)
    globals()[name] = value  # looked up once
    return value
