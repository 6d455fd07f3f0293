"""Building a stage from its weight files: modules made on the meta device and materialised with this stage's weights
only (the other layers are never allocated), quantized as they are read.

The slice's layers are numbered 0..n-1 inside the stage (the config given to them says n layers, with
``layer_types`` sliced to match), so a plain per-request DynamicCache built from that config indexes them, and
sliding-window layers (Qwen2/Mistral) get sliding cache layers.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from swarm.errors import ModelError
from swarm.model_format import CONFIG_FILE, EMBED_FILE, FINAL_FILE, layer_file, split_layers, stage_file_paths
from swarm.stage.architectures import blocks_for, check_sliceable, config_from_dict
from swarm.stage.compiled_decode import install as install_compiled_step
from swarm.stage.devices import return_freed_memory
from swarm.stage.gguf_experts import is_expert_weight, place_experts
from swarm.stage.gguf_linear import GGUFBlocks, GGUFEmbedding, gguf_linear, is_linear_weight, place_linears
from swarm.stage.moe_experts import ROUTED as ROUTED_EXPERTS
from swarm.stage.moe_experts import register as register_routed_experts
from swarm.stage.quantize import quantize_head, quantize_linears
from swarm.stage.weights import read_weights, read_weights_and_blocks

if TYPE_CHECKING:
    from swarm.stage.slice import StageModel


@dataclass(frozen=True)
class StageSpec:
    first_layer: int
    end_layer: int  # exclusive
    is_first: bool
    is_last: bool

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.first_layer

    def files(self, tie_word_embeddings: bool) -> list[str]:
        """The model files (relative paths) this stage reads."""
        return stage_file_paths(self.first_layer, self.end_layer, self.is_first, self.is_last, tie_word_embeddings)


def stage_specs(num_layers: int, stages: int) -> list[StageSpec]:
    """An even contiguous split of ``num_layers`` layers over ``stages`` stages."""
    slices = split_layers(num_layers, [1.0] * stages)
    return [StageSpec(first, end, i == 0, i == stages - 1) for i, (first, end) in enumerate(slices)]


def _slice_config(config: Any, spec: StageSpec) -> Any:
    """The model's config, saying this stage's layer count, with per-layer settings sliced to match."""
    sliced = copy.deepcopy(config)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        sliced.layer_types = list(layer_types[spec.first_layer : spec.end_layer])
    dense = getattr(config, "first_k_dense_replace", None)
    if dense is not None:  # GLM-4.5: the model's first k layers have a dense MLP; counted from this stage's first
        sliced.first_k_dense_replace = max(int(dense) - spec.first_layer, 0)
    sliced.num_hidden_layers = spec.num_layers
    return sliced


def load_stage(
    cls: type[StageModel],
    config: Mapping[str, Any],
    files: Mapping[str, Path],
    spec: StageSpec,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    layer_devices: list[str] | None = None,
    quantization: str = "none",
) -> StageModel:
    """Build the stage from config.json's contents and its weight files.

    ``files`` maps each relative model path this stage needs (see StageSpec.files) to a local file -- which may be
    a cache entry named by its hash. ``layer_devices`` spreads the layers over several cards of one PC
    (swarm.stage.devices); by default every layer is on ``device``. ``quantization`` (swarm.stage.quantize.KINDS)
    quantizes each layer's linear layers right after its weights are read, and the head after it.
    """
    wanted: list[str | torch.device] = list(layer_devices) if layer_devices else [device] * spec.num_layers
    devices = [torch.device(d) for d in wanted]
    if len(devices) != spec.num_layers:
        raise ModelError(f"{len(devices)} devices given for a stage of {spec.num_layers} layers")
    device = devices[0]
    full_config = config_from_dict(dict(config))
    total = full_config.num_hidden_layers
    if not 0 <= spec.first_layer < spec.end_layer <= total:
        raise ModelError(
            f"a stage of layers {spec.first_layer}..{spec.end_layer - 1} does not fit a model of {total} layers"
        )
    tied = bool(getattr(full_config, "tie_word_embeddings", False))
    missing = [p for p in spec.files(tied) if p != CONFIG_FILE and p not in files]
    if missing:
        raise ModelError(f"the stage lacks model files: {', '.join(missing)}; fetch them before loading")

    blocks = blocks_for(full_config.model_type)
    check_sliceable(full_config)
    stage_config = _slice_config(full_config, spec)
    # sdpa is what from_pretrained picks on CPU and GPU (eager for a family that cannot take it: gpt-oss's sinks);
    # the masks below follow this setting.
    stage_config._attn_implementation = blocks.attention
    # MoE layers: only the experts the router hit, each once for its rows, as views (swarm.stage.moe_experts)
    register_routed_experts()
    stage_config._experts_implementation = ROUTED_EXPERTS

    keep_float32 = blocks.keep_float32(dtype)  # GLM's router in float32, as from_pretrained keeps it

    def read(rel: str, on: torch.device = device) -> dict[str, torch.Tensor]:
        # a GGUF's blocks are dequantized here, one tensor at a time (swarm.stage.weights)
        return read_weights(files[rel], config, dtype, on, what=f"{rel} from {files[rel]}",
                            keep_float32=keep_float32)

    with torch.device("meta"):
        layers = nn.ModuleList(blocks.decoder_layer(stage_config, i) for i in range(spec.num_layers))
    for local, index in enumerate(range(spec.first_layer, spec.end_layer)):
        if quantization == "gguf":  # the linear layers on the file's blocks (swarm.stage.gguf_linear)
            rel = layer_file(index)
            layer = layers[local]
            tensors, kept = read_weights_and_blocks(
                files[rel], config, functools.partial(_on_blocks, layer), dtype, devices[local],
                what=f"{rel} from {files[rel]}", keep_float32=keep_float32)
            place_experts(layer, kept, devices[local], dtype or torch.float32, tensors)  # a MoE layer's, per expert
            place_linears(layer, kept, tensors, devices[local], dtype or torch.float32)
            _assign(layer, tensors, f"layer {index}", partial=True)
            continue
        _assign(layers[local], read(layer_file(index), devices[local]), f"layer {index}")
        quantize_linears(layers[local], quantization)

    # int4-fast on CPU: single-row passes through the C step (swarm.stage.compiled_decode) where it takes them
    install_compiled_step(layers, stage_config)
    def read_blocks(rel: str, key: str, on: torch.device) -> tuple[dict[str, torch.Tensor], GGUFBlocks | None]:
        # at gguf on CPU: the embedding and an untied head as their blocks (swarm.stage.gguf_linear)
        tensors, kept = read_weights_and_blocks(files[rel], config, lambda k: k == key, dtype, on,
                                                what=f"{rel} from {files[rel]}")
        return tensors, kept.get(key)

    embed, norm, lm_head = _ends(full_config, spec, blocks, tied, read, devices[0], devices[-1],
                                 read_blocks if quantization == "gguf" else None)
    if lm_head is not None:
        lm_head = quantize_head(lm_head, quantization)
    with device:
        rotary = blocks.rotary_embedding(config=stage_config)
    stage = cls(stage_config, spec, embed, layers, norm, lm_head, rotary, dtype, device)
    stage.layer_devices = devices
    stage.quantization = quantization
    for module in stage.modules():
        module.eval()
    return_freed_memory()
    return stage


def _on_blocks(layer: nn.Module, key: str) -> bool:
    """Whether the gguf kind computes weight ``key`` of ``layer`` on the file's blocks: a linear layer's weight, or a
    MoE layer's expert matrices (swarm.stage.gguf_experts)."""
    return is_linear_weight(layer, key) or is_expert_weight(layer, key)


def _ends(config: Any, spec: StageSpec, blocks, tied: bool, read, first: torch.device, last: torch.device,
          read_blocks=None) -> tuple:
    """The embedding (first stage, with the first layer) and the final norm and head (last stage, with the last
    layer), or None where this stage has none. ``read_blocks`` (the gguf kind): the embedding and the head -- tied or
    not -- are kept as the file's blocks where they are quantized and on CPU (the head a gguf_linear on them)."""
    embed: nn.Module | None = None
    norm: nn.Module | None = None
    lm_head: nn.Module | None = None
    embed_weight: torch.Tensor | None = None
    tied_blocks: GGUFBlocks | None = None
    if read_blocks is not None and (spec.is_first or (spec.is_last and tied)) \
            and (first if spec.is_first else last).type == "cpu" and last.type == "cpu":
        tensors, tied_blocks = read_blocks(EMBED_FILE, "embed_tokens.weight", first if spec.is_first else last)
        if tied_blocks is None:
            embed_weight = tensors["embed_tokens.weight"]
        elif spec.is_first:
            embed = GGUFEmbedding(tied_blocks, config.pad_token_id, _embed_scale(blocks, config))
        if not tied:
            tied_blocks = None
    elif spec.is_first or (spec.is_last and tied):
        embed_weight = read(EMBED_FILE, first if spec.is_first else last)["embed_tokens.weight"]
    if spec.is_first and embed is None:
        with torch.device("meta"):
            if blocks.embedding is not None:
                embed = blocks.embedding(config)
            else:
                embed = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        assert embed_weight is not None  # read above for a first stage
        _assign(embed, {"weight": embed_weight}, "embedding")
        _materialise_buffers(embed, first)
    if spec.is_last:
        head_blocks = tied_blocks
        if read_blocks is not None and not tied and last.type == "cpu":
            final, head_blocks = read_blocks(FINAL_FILE, "lm_head.weight", last)
        else:
            final = read(FINAL_FILE, last)
        with torch.device("meta"):
            norm = blocks.norm(config.hidden_size, eps=config.rms_norm_eps)
            lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        _assign(norm, {"weight": final["norm.weight"]}, "final norm")
        if head_blocks is not None:  # the gguf kind: the head on the file's blocks
            head = gguf_linear(head_blocks.blocks, head_blocks.ggml_type, head_blocks.shape, None, last)
            if tied and isinstance(embed, GGUFEmbedding):
                embed.share(head)  # one copy of the tied matrix: the embedding looks rows up in the head's bytes
            return embed, norm, head
        if tied:  # the head is the embedding matrix: share the stage's one copy (on the last card when it differs)
            head_weight: Any = embed.weight if embed is not None else embed_weight
            assert head_weight is not None  # the embedding was read above for a tied last stage
            head_weight = head_weight if head_weight.device == last else head_weight.to(last)
        else:
            head_weight = final.get("lm_head.weight")
        if head_weight is None:
            raise ModelError("final.safetensors has no lm_head.weight and the model's embeddings are not tied")
        _assign(lm_head, {"weight": head_weight}, "lm_head")
    return embed, norm, lm_head


def _embed_scale(blocks, config: Any) -> float | None:
    """The factor the family's embedding multiplies rows by (Gemma's sqrt(hidden)), None where it has none."""
    if blocks.embedding is None:
        return None
    with torch.device("meta"):
        module = blocks.embedding(config)
    scale = getattr(module, "scalar_embed_scale", None)
    if scale is None and hasattr(module, "embed_scale"):
        raise ModelError(f"this transformers version's {type(module).__name__} keeps its scale only as a tensor, "
                         "which the gguf kind cannot read; load the model at another quantization, or install the "
                         "transformers version swarm pins")
    return None if scale is None else float(scale)


def _materialise_buffers(module: nn.Module, device: torch.device) -> None:
    """Non-persistent buffers built on the meta device (Gemma's embedding scale) are not in the files: make them
    real, from the plain value the module keeps beside them."""
    for name, buffer in list(module.named_buffers(recurse=False)):
        if buffer.is_meta:
            value = getattr(module, f"scalar_{name}", None)
            if value is None:
                raise ModelError(f"{type(module).__name__} has a buffer {name!r} that no file holds")
            setattr(module, name, torch.tensor(value, device=device))


def _assign(module: nn.Module, tensors: Mapping[str, torch.Tensor], what: str, partial: bool = False) -> None:
    """Give a meta-device module its real weights (no copy), refusing missing or unexpected tensors. ``partial``:
    some of its weights are in place already (the gguf kind's linear layers): those may be missing from ``tensors``,
    none may stay on the meta device."""
    try:
        result = module.load_state_dict(dict(tensors), strict=not partial, assign=True)
        if partial:
            left = [n for n, t in module.state_dict(keep_vars=True).items() if t.is_meta]
            if result.unexpected_keys or left:
                raise RuntimeError(f"unexpected {result.unexpected_keys}, missing {left}")
    except RuntimeError as exc:
        raise ModelError(f"the weights of the {what} do not fit this model's config: {exc}") from exc
