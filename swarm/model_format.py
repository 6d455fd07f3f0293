"""What an imported model looks like on disk, as every part of swarm sees it: the files of one model, the decoder
families that split into stages, element sizes, and how layers split into contiguous stages.

The store writes these files (swarm.store), the leader places and budgets them (swarm.leader), a fellow fetches and
builds them (swarm.fellow, swarm.stage): all of them read the names and rules from here.

Layout of one imported model::

    manifest.json                 names, sizes and sha256 of every file below (swarm.store.manifest)
    config.json                   the transformers config
    generation_config.json        when the source has one
    tokenizer.json, ...           whatever the tokenizer's save_pretrained writes (chat template included)
    weights/embed.safetensors     embed_tokens.weight
    weights/layer_000.safetensors one decoder layer, tensor names relative to it ("self_attn.q_proj.weight")
    weights/final.safetensors     norm.weight (and lm_head.weight when embeddings are not tied)

A model imported from a GGUF keeps the file's tensors as the file has them (``Manifest.storage == "gguf"``): each
weight file carries, in its safetensors metadata under GGUF_TENSORS_KEY, a JSON map of every tensor it holds to its
GGUF type, its logical (transformers) shape, its GGUF name and whether transformers' per-family fix-up
(``TENSOR_PROCESSORS``: Llama's q/k row permutation, Gemma's norm offset) is still to be applied; and under
GGUF_ARCHITECTURE_KEY the file's ``general.architecture``, which picks that fix-up. A quantized tensor is a uint8
tensor of its block bytes, (rows, bytes per row); an F32/F16/BF16 one is the safetensors tensor of that dtype. Stages
dequantize them with gguf-py at load (swarm.stage.weights). Files without that metadata (safetensors folders, and
every model imported before) hold their tensors in the manifest's ``dtype``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from swarm.errors import ModelError, PlacementError, UnsupportedArchitecture, counted

MANIFEST_FILE = "manifest.json"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_DIR = "weights"
EMBED_FILE = f"{WEIGHTS_DIR}/embed.safetensors"
FINAL_FILE = f"{WEIGHTS_DIR}/final.safetensors"

# The transformers model types whose decoder stack the stage code can slice (swarm.stage.architectures maps each to
# its building blocks).
# The DeepSeek-R1 distills are qwen2 and llama models; Gemma 3's text model is gemma3_text.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text",
                           "qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "gpt_oss")
# Mixture-of-experts families: their layers route each token to a few experts (fused 3D expert tensors, imported by
# swarm.store.moe_layout); they take the generic decode step, never the lean or compiled one.
MOE_ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "gpt_oss")
# The MoE families a GGUF of imports (swarm.store.gguf_moe): those transformers' GGUF loader knows (qwen2moe,
# qwen3moe), Mixtral (a llama file with experts), and GLM-4.5 and gpt-oss, which transformers' loader cannot read and
# swarm.store.gguf_names maps.
GGUF_MOE_ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "gpt_oss")
# The families whose decode steps take the lean step (swarm.stage.lean_decode) when they have no sliding window; the
# planner (swarm.leader.planning.planner) counts their calibrated lean speed.
LEAN_DECODE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

# The GGUF tensor types an import keeps as they are: the plain floats, and the quantized types of the common
# downloads (Q*_0/1, the K-quants, IQ4, MXFP4 for gpt-oss), which gguf-py's ``gguf.quants.dequantize`` reads and
# which the block kernels are to compute on. A file with any other type is refused before anything is written.
GGUF_FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
GGUF_BLOCK_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
                    "MXFP4")
GGUF_TYPES = (*GGUF_FLOAT_TYPES, *GGUF_BLOCK_TYPES)
GGUF_TENSORS_KEY = "swarm.gguf_tensors"
GGUF_ARCHITECTURE_KEY = "swarm.gguf_architecture"
GGUF_STORAGE = "gguf"  # Manifest.storage of a model whose files keep a GGUF's tensors
# The axis along which the parts of a tensor a GGUF holds in several (a MoE layer's ffn_gate_exps and ffn_up_exps: its
# experts' gate_up_proj, [experts, rows, columns]) are joined, in the order of their ``part`` (swarm.store.gguf_source)
GGUF_JOIN_DIM = 1

# Bytes of one element, by the dtype names torch prints without the "torch." prefix.
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def layer_file(index: int) -> str:
    """Path, relative to the model dir, of decoder layer ``index``'s file."""
    return f"{WEIGHTS_DIR}/layer_{index:03d}.safetensors"


def stage_file_paths(first_layer: int, end_layer: int, is_first: bool, is_last: bool, tied: bool) -> list[str]:
    """The files a stage holding layers [first_layer, end_layer) reads: config, its weights, nothing else.

    The last stage needs the embedding too when embeddings are tied: its head *is* the embedding matrix.
    """
    wanted = [CONFIG_FILE]
    if is_first or (is_last and tied):
        wanted.append(EMBED_FILE)
    wanted += [layer_file(i) for i in range(first_layer, end_layer)]
    if is_last:
        wanted.append(FINAL_FILE)
    return wanted


def split_layers(num_layers: int, weights: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous [first, end) slices of ``num_layers`` layers, sized in proportion to ``weights`` (e.g. each
    fellow's free memory; equal weights split evenly), each holding at least one layer."""
    n = len(weights)
    if n < 1 or num_layers < n:
        raise PlacementError(f"cannot split {counted(num_layers, 'layer')} over {counted(n, 'stage')}; use at most "
                             f"{counted(num_layers, 'stage')}.")
    weights = [max(float(w), 0.0) for w in weights]
    if not sum(weights):
        weights = [1.0] * n
    total = sum(weights)
    bounds = [0]
    acc = 0.0
    for k, w in enumerate(weights[:-1]):
        acc += w
        b = round(num_layers * acc / total)
        b = max(b, bounds[-1] + 1)  # at least one layer for this stage ...
        b = min(b, num_layers - (n - k - 1))  # ... and for every stage after it
        bounds.append(b)
    bounds.append(num_layers)
    return list(zip(bounds[:-1], bounds[1:]))


def module_names_pattern(names: Sequence[str]) -> re.Pattern | None:
    """A regex finding any of transformers' module names (``_keep_in_fp32_modules`` entries: "gate.weight",
    "e_score_correction_bias", "model.layers.*.norm") in a tensor's dotted name, whole parts only; None for none."""
    if not names:
        return None
    parts = (r"(?:^|\.)" + re.escape(n).replace(r"\*", r"[^.]+") + r"(?:\.|$)" for n in names)
    return re.compile("|".join(parts))


def dtype_bytes(name: str) -> int:
    try:
        return DTYPE_BYTES[name.removeprefix("torch.")]
    except KeyError:
        raise ModelError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPE_BYTES)}") from None


def check_sliceable(config: Any) -> None:
    """Refuse a config (a transformers config object) whose model the stages would compute differently from
    transformers: attention-score soft-capping needs eager attention, and stages attend through SDPA. None of the
    supported checkpoints sets it (Gemma 2 does). Checked at import, before anything is written, and at load."""
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise UnsupportedArchitecture(
            f"this {config.model_type} model soft-caps attention scores (attn_logit_softcapping="
            f"{config.attn_logit_softcapping}), which swarm's stages do not compute; pick a model without it"
        )
