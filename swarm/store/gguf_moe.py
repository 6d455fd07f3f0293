"""What a mixture-of-experts GGUF needs beyond transformers' GGUF code: its config's expert sizes, Mixtral (which
llama.cpp writes as a ``llama`` file with experts), and the expert tensors transformers joins from two. (GLM-4.5
and gpt-oss, which transformers' GGUF code cannot read at all, are mapped by swarm.store.gguf_names.)

- transformers' GGUF config mapping (transformers.integrations.ggml) maps ``expert_count`` and ``expert_used_count``
  but not ``expert_feed_forward_length`` nor ``expert_shared_feed_forward_length``: the config keeps the class
  defaults, which fit Qwen3-30B-A3B and Qwen1.5-MoE-A2.7B and no other shape. They are read here.
- A Mixtral GGUF is ``general.architecture = llama`` with ``llama.expert_count``; transformers builds a dense Llama
  from it and drops the experts. Here it becomes a MixtralConfig with the file's expert counts, its tensors named by
  gguf-py's llama map (which knows ffn_gate_inp and ffn_down_exps) and fixed up by transformers' Llama processor
  (the q/k row permutation llama.cpp applies to every llama file).
- llama.cpp writes a layer's gate and up experts as two tensors, ffn_gate_exps and ffn_up_exps; transformers' MoE
  layers hold one gate_up_proj. An import keeps both as the file has them, as parts of that tensor
  (:func:`joined_parts`), joined where a stage widens them.

gguf and transformers are imported inside the functions that need them.
"""

from __future__ import annotations

import contextlib
import functools
import re
from pathlib import Path
from typing import Any

from swarm.errors import ImportFailed
from swarm.model_format import GGUF_MOE_ARCHITECTURES, MOE_ARCHITECTURES
from swarm.store.gguf_header import header_field

# GGUF metadata keys (after the architecture) of MoE sizes, and the transformers config attribute each sets
MOE_SIZES = {"expert_feed_forward_length": "moe_intermediate_size",
             "expert_shared_feed_forward_length": "shared_expert_intermediate_size"}

# The order of the GGUF tensors that make one transformers tensor, along swarm.model_format.GGUF_JOIN_DIM:
# transformers' Qwen2MoeTensorProcessor (modeling_gguf_pytorch_utils, ``_set_moe_expert_tensor``) writes
# ffn_gate_exps into the first half of the rows of each expert's gate_up_proj and ffn_up_exps into the second.
PART_ORDER = ("ffn_gate_exps", "ffn_up_exps")
_GATE_UP = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj")


def check_importable(path: Path, model_type: str) -> None:
    """Refuse a GGUF of a MoE family whose GGUFs swarm does not import, by the ``model_type`` transformers (or
    swarm.store.gguf_names) read from it."""
    if model_type in MOE_ARCHITECTURES and model_type not in GGUF_MOE_ARCHITECTURES:
        raise ImportFailed(f"{path} is a {model_type} GGUF, which swarm cannot import yet (it imports the MoE GGUFs of "
                           f"{', '.join(GGUF_MOE_ARCHITECTURES)}); import the model's safetensors folder instead")


def moe_config(reader: Any, architecture: str, config: Any) -> Any:
    """``config`` (transformers' config of the GGUF) with the file's expert sizes, and a Llama with experts made the
    Mixtral it is."""
    import transformers

    experts = header_field(reader, f"{architecture}.expert_count", int)
    # transformers names a llama file "mistral" where general.name says so, as real Mixtral files' names do
    if config.model_type in ("llama", "mistral") and experts:
        fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
        fields.update(num_local_experts=experts,
                      num_experts_per_tok=header_field(reader, f"{architecture}.expert_used_count", int) or 2)
        config = transformers.MixtralConfig(**fields)
    for key, attribute in MOE_SIZES.items():
        value = header_field(reader, f"{architecture}.{key}", int)
        if value is not None and hasattr(config, attribute):
            setattr(config, attribute, value)
    return config


def weights_map(skeleton: Any, processor: Any, architecture: str) -> dict[str, str]:
    """GGUF tensor name -> transformers name for ``skeleton`` (the model on the meta device): transformers' map,
    asked under the file's own architecture where the model's type is not one gguf-py knows (Mixtral: llama), with
    each layer's gate_up_proj given its two GGUF parts where transformers' processor does not give them."""
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    model_type = architecture if skeleton.config.model_type == "mixtral" else None
    with _name_maps_cached():
        names = dict(get_gguf_hf_weights_map(skeleton, processor, model_type=model_type))
    mapped = set(names.values())
    for hf_name in skeleton.state_dict():
        if (m := _GATE_UP.fullmatch(hf_name)) and hf_name not in mapped:
            names.update({f"blk.{m.group(1)}.{kind}": hf_name for kind in PART_ORDER})
    return names


@contextlib.contextmanager
def _name_maps_cached():
    """Let transformers' map build gguf-py's name map once: it asks for it again in every submodule it recurses into,
    and a map is built for every layer (measured on Qwen3-30B-A3B's header, 48 layers of 128 experts: 679 maps,
    23 s of an import). transformers imports ``gguf.get_tensor_name_map`` at each call, so the name is pointed at a
    cached one for the duration and put back after."""
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)  # the patch
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original  # the patch undone


def stem(gguf_name: str) -> str:
    """A GGUF tensor's name as transformers' map names the expert tensors: without ".weight"."""
    return gguf_name.removesuffix(".weight")


def joined_parts(names: dict[str, str]) -> dict[str, int]:
    """GGUF tensor name (its :func:`stem`) -> its place among the GGUF tensors that ``names`` (transformers' map)
    sends to one tensor."""
    by_target: dict[str, list[str]] = {}
    for gguf_name, hf_name in names.items():
        by_target.setdefault(hf_name, []).append(stem(gguf_name))
    out: dict[str, int] = {}
    for target, parts in by_target.items():
        if len(parts) < 2:
            continue
        kinds = [p.split(".")[-1] for p in parts]
        if not set(kinds) & set(PART_ORDER):
            continue  # not a MoE layer's parts (a map may name one tensor twice)
        if sorted(kinds) != sorted(PART_ORDER):
            raise ImportFailed(f"transformers maps the GGUF tensors {', '.join(parts)} to one tensor {target}, in a "
                               "way swarm does not know how to join; import the model's safetensors folder instead")
        out.update({p: PART_ORDER.index(k) for p, k in zip(parts, kinds, strict=True)})
    return out
