"""The whole model in one process, assembled from an imported model's per-layer files: the reference that the ring
is checked against (tests, benchmarks). A test helper, not part of the package: the benches put tests/ on their path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from swarm.errors import ModelError
from swarm.model_format import CONFIG_FILE, EMBED_FILE, FINAL_FILE, GENERATION_CONFIG_FILE, layer_file
from swarm.store.manifest import load_manifest


def load_reference_model(model_dir: Path, dtype: Any = None) -> Any:
    """The whole model as one transformers AutoModelForCausalLM, assembled from the per-layer files.

    The single-process reference that stages are checked against (tests, benchmarks); float32 by default.
    """
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from swarm.stage.weights import read_weights

    dtype = dtype or torch.float32
    model_dir = Path(model_dir)
    manifest = load_manifest(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    raw_config = json.loads((model_dir / CONFIG_FILE).read_text())

    def load_file(path: Path) -> dict[str, torch.Tensor]:  # a GGUF's blocks dequantized as a stage does
        return read_weights(path, raw_config)

    with torch.device("meta"):
        # gpt-oss's sinks have no sdpa path in transformers: eager, as its stages attend
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager"
                                                 if config.model_type == "gpt_oss" else "sdpa")
    state: dict[str, torch.Tensor] = {}
    state["model.embed_tokens.weight"] = load_file(model_dir / EMBED_FILE)["embed_tokens.weight"]
    for i in range(manifest.num_layers):
        for key, value in load_file(model_dir / layer_file(i)).items():
            state[f"model.layers.{i}.{key}"] = value
    for key, value in load_file(model_dir / FINAL_FILE).items():
        state[key if key == "lm_head.weight" else f"model.{key}"] = value
    if manifest.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    state = {k: v.to(dtype) for k, v in state.items()}
    if manifest.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    # Non-persistent buffers are not in the files: rebuild the rotary embeddings on the CPU, and give Gemma's scaled
    # embedding its scale from the plain value it keeps beside the buffer.
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if not any(b.is_meta for b in child.buffers(recurse=False)):
                continue
            if hasattr(child, "scalar_embed_scale"):
                child.embed_scale = torch.tensor(child.scalar_embed_scale)
            else:
                setattr(parent, child_name, type(child)(config=model.config))
    leftover = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if leftover:
        raise ModelError(f"the reference model for {model_dir} has no weights for {', '.join(leftover[:5])}")
    if (model_dir / GENERATION_CONFIG_FILE).is_file():
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    model.eval()
    return model


def gguf_reference_model(model_dir: Path) -> Any:
    """The whole model in one process at the ``gguf`` kind, as a ring's stages hold it: each decoder layer's linear
    layers built from the file's blocks (swarm.stage.gguf_linear, with the same sibling stacking and the compiled
    decode step where it applies) and the head (a tied one on the embedding's blocks); the embedding (its rows are
    the file's values either way) and the norms as the float reference has them. The reference a
    ring at gguf is checked against, as quantize_model's is for the other kinds. A MoE layer's experts are computed
    on their blocks too, per expert (swarm.stage.gguf_experts)."""
    import functools
    import json

    from swarm.stage.compiled_decode import install
    from swarm.stage.gguf_experts import is_expert_weight, place_experts
    from swarm.stage.gguf_linear import gguf_linear, is_linear_weight, place_linears
    from swarm.stage.weights import read_weights_and_blocks

    def on_blocks(layer: Any, key: str) -> bool:
        return is_linear_weight(layer, key) or is_expert_weight(layer, key)

    model = load_reference_model(model_dir)
    raw_config = json.loads((Path(model_dir) / CONFIG_FILE).read_text())
    for i, layer in enumerate(model.model.layers):
        _, kept = read_weights_and_blocks(Path(model_dir) / layer_file(i), raw_config,
                                          functools.partial(on_blocks, layer))
        expert_biases = {k: v.detach() for k, v in layer.state_dict().items()
                         if k.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias"))}  # gpt-oss's
        place_experts(layer, kept, tensors=expert_biases)  # a MoE layer's experts on their blocks, per expert
        biases = {f"{key[: -len('.weight')]}.bias": layer.get_submodule(key[: -len(".weight")]).bias
                  for key in kept}
        place_linears(layer, kept, {k: v.detach() for k, v in biases.items() if v is not None})
    install(model.model.layers, model.config)
    # the head on its blocks (a tied one on the embedding's), as a last stage holds it
    tied = bool(model.config.tie_word_embeddings)
    file, key = (EMBED_FILE, "embed_tokens.weight") if tied else (FINAL_FILE, "lm_head.weight")
    _, head = read_weights_and_blocks(Path(model_dir) / file, raw_config, lambda name: name == key)
    if key in head:
        kept = head[key]
        model.lm_head = gguf_linear(kept.blocks, kept.ggml_type, kept.shape, None)
        model.config.tie_word_embeddings = False  # generate() must not tie the embedding back onto it
        if hasattr(model, "_tied_weights_keys"):
            model._tied_weights_keys = None
    return model
