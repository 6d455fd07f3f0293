"""The decoder families the stage code can slice, and where their building blocks live in transformers.

Each supported family is a stack of identical decoder layers between an embedding and a final norm + head, with a
rotary embedding shared by all layers -- the shape that splits into contiguous stages. Where a family departs from
the Llama shape, its Blocks say how:

- Gemma 3 (``gemma3_text``) scales its embedding by sqrt(hidden) (its own embedding class), keeps one rotary
  embedding per layer type (local layers use another base than global ones: StageModel.rotary_per_type), and may
  soft-cap its logits (``final_logit_softcapping``, applied by the last stage as Gemma3ForCausalLM applies it).
- Phi-3 and Mistral use one attention kind for every layer, sliding when the config has a window.
- The mixture-of-experts families (qwen3_moe, qwen2_moe, mixtral, olmoe, glm4_moe, gpt_oss) are the Llama shape with
  a routed MLP: their layers hold the experts fused (swarm.store.moe_layout), and route in transformers' own code.
- GLM-4.5 (``glm4_moe``) has dense MLPs in its first ``first_k_dense_replace`` layers (a stage's config counts them
  from its own first layer), grouped sigmoid routing with a score-correction bias, shared experts, partial rotary.
- gpt-oss (``gpt_oss``) adds a learnt attention sink per head (an extra softmax column) and alternates sliding and
  full layers (``layer_types``); transformers computes sinks in its eager attention only, so its stages attend
  eagerly (``Blocks.attention``), batched passes too (swarm.stage.ragged). Neither the lean nor the compiled decode
  step takes it (they are for dense families without windows).
- The DeepSeek-R1 distills are Qwen2 and Llama models (model_type qwen2 / llama): nothing of their own.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from swarm.errors import UnsupportedArchitecture
from swarm.model_format import SUPPORTED_ARCHITECTURES, check_sliceable, module_names_pattern  # noqa: F401

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedConfig

# model_type -> (transformers.models.<module>, class-name prefix, config class name), for every family in
# swarm.model_format.SUPPORTED_ARCHITECTURES (a test checks none is missing).
_FAMILIES = {
    "llama": ("llama", "Llama", "LlamaConfig"),
    "mistral": ("mistral", "Mistral", "MistralConfig"),
    "qwen2": ("qwen2", "Qwen2", "Qwen2Config"),
    "qwen3": ("qwen3", "Qwen3", "Qwen3Config"),
    "phi3": ("phi3", "Phi3", "Phi3Config"),
    "gemma3_text": ("gemma3", "Gemma3", "Gemma3TextConfig"),
    "qwen3_moe": ("qwen3_moe", "Qwen3Moe", "Qwen3MoeConfig"),
    "qwen2_moe": ("qwen2_moe", "Qwen2Moe", "Qwen2MoeConfig"),
    "mixtral": ("mixtral", "Mixtral", "MixtralConfig"),
    "olmoe": ("olmoe", "Olmoe", "OlmoeConfig"),
    "glm4_moe": ("glm4_moe", "Glm4Moe", "Glm4MoeConfig"),
    "gpt_oss": ("gpt_oss", "GptOss", "GptOssConfig"),
}


@dataclass(frozen=True)
class Blocks:
    config_class: type[PreTrainedConfig]
    decoder_layer: type[nn.Module]
    norm: type[nn.Module]
    rotary_embedding: type[nn.Module]
    embedding: Any = None  # a class taking (config) -> nn.Embedding; None: a plain nn.Embedding
    # The attention the stage computes with, as transformers picks it for the family: SDPA, or eager where the family
    # cannot take SDPA (gpt-oss: its attention sinks are an extra softmax column only its eager function adds).
    attention: str = "sdpa"
    # Module names the family keeps in float32 when it loads in 16 bits, as transformers' from_pretrained does:
    # ``_keep_in_fp32_modules_strict`` in float16 and bfloat16 (GLM-4.5's router weight and correction bias),
    # ``_keep_in_fp32_modules`` in float16 only (gpt-oss's norms).
    keep_float32_strict: tuple[str, ...] = ()
    keep_float32_half: tuple[str, ...] = ()

    def keep_float32(self, dtype: Any) -> re.Pattern | None:
        """Which tensor names a stage computing in ``dtype`` holds in float32 (None: none)."""
        import torch

        names = list(self.keep_float32_strict) if dtype in (torch.float16, torch.bfloat16) else []
        if dtype == torch.float16:
            names += self.keep_float32_half
        return module_names_pattern(names)


def blocks_for(model_type: str) -> Blocks:
    family = _FAMILIES.get(model_type)
    if family is None:
        raise UnsupportedArchitecture(
            f"a {model_type} model cannot be split into stages; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    module, prefix, config_name = family
    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    configuration = importlib.import_module(f"transformers.models.{module}.configuration_{module}")
    embedding = None
    scaled = getattr(modeling, f"{prefix}TextScaledWordEmbedding", None)
    if scaled is not None:
        def embedding(config, scaled=scaled):
            return scaled(config.vocab_size, config.hidden_size, config.pad_token_id,
                          embed_scale=config.hidden_size**0.5)
    pretrained = getattr(modeling, f"{prefix}PreTrainedModel", None)
    return Blocks(
        config_class=getattr(configuration, config_name),
        decoder_layer=getattr(modeling, f"{prefix}DecoderLayer"),
        norm=getattr(modeling, f"{prefix}RMSNorm"),
        rotary_embedding=getattr(modeling, f"{prefix}RotaryEmbedding"),
        embedding=embedding,
        attention="sdpa" if getattr(pretrained, "_supports_sdpa", True) else "eager",
        keep_float32_strict=tuple(getattr(pretrained, "_keep_in_fp32_modules_strict", None) or ()),
        keep_float32_half=tuple(getattr(pretrained, "_keep_in_fp32_modules", None) or ()),
    )


def config_from_dict(config: dict[str, Any]) -> Any:
    """A transformers config object from the contents of config.json."""
    blocks = blocks_for(config.get("model_type", "unknown"))
    return blocks.config_class.from_dict(dict(config))

