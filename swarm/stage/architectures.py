"""The decoder families the stage code can slice, and where their building blocks live in transformers.

Each supported family is a stack of identical decoder layers between an embedding and a final norm + head, with a
rotary embedding shared by all layers -- the shape that splits into contiguous stages.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from swarm.errors import UnsupportedArchitecture
from swarm.model_format import SUPPORTED_ARCHITECTURES

# model_type -> class-name prefix in transformers.models.<model_type>.modeling_<model_type>, for every family in
# swarm.model_format.SUPPORTED_ARCHITECTURES (a test checks none is missing).
_PREFIXES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}


@dataclass(frozen=True)
class Blocks:
    config_class: type
    decoder_layer: type
    norm: type
    rotary_embedding: type


def blocks_for(model_type: str) -> Blocks:
    prefix = _PREFIXES.get(model_type)
    if prefix is None:
        raise UnsupportedArchitecture(
            f"a {model_type} model cannot be split into stages; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    configuration = importlib.import_module(f"transformers.models.{model_type}.configuration_{model_type}")
    return Blocks(
        config_class=getattr(configuration, f"{prefix}Config"),
        decoder_layer=getattr(modeling, f"{prefix}DecoderLayer"),
        norm=getattr(modeling, f"{prefix}RMSNorm"),
        rotary_embedding=getattr(modeling, f"{prefix}RotaryEmbedding"),
    )


def config_from_dict(config: dict[str, Any]) -> Any:
    """A transformers config object from the contents of config.json."""
    blocks = blocks_for(config.get("model_type", "unknown"))
    return blocks.config_class.from_dict(dict(config))
