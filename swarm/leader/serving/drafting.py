"""Which requests the leader sends with drafting ahead on (SWARM_SERVE_SPECULATIVE; the guessing itself is the last
stage's, swarm.stage.drafting): a model loaded while the setting was on, served by fellows that all support it (an
older fellow's stage 0 would not run the guessed tokens), of a model without sliding-window layers (such a layer
keeps only its window, so the guesses it rejected could not be taken back out of its cache once it is full)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from swarm import messages


def sliding(config: Mapping[str, Any]) -> bool:
    """Whether a model (its config.json) has layers that attend within a sliding window."""
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list):
        return "sliding_attention" in layer_types
    return config.get("sliding_window") is not None and config.get("use_sliding_window", True) is not False


def tokens_ahead(serving, online: Mapping[int, Any]) -> int:
    """How many tokens the ring serving a model (swarm.leader.serving.models.ModelServing) may guess per pass: its
    load's setting, or 0 where a stage's fellow is offline or does not support drafting, or the model slides."""
    if serving.speculative <= 0 or sliding(serving.config):
        return 0
    conns = [online.get(stage.plan.fellow_id) for stage in serving.stages]
    if not all(conn is not None and conn.drafting for conn in conns):
        return 0
    return serving.speculative


def with_drafting(message: Any, serving, online: Mapping[int, Any]) -> Any:
    """``message`` for stage 0, a Generate with drafting on where the ring allows it."""
    if not isinstance(message, messages.Generate):
        return message
    n = tokens_ahead(serving, online)
    return dataclasses.replace(message, draft=n) if n else message
