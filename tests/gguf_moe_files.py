"""Mixture-of-experts GGUF files made up for tests: a tiny random model of a family, built by transformers from its
config, written with gguf-py's writer under llama.cpp's tensor names and metadata keys -- the expert matrices as the
3-D tensors llama.cpp writes (ffn_gate_exps / ffn_up_exps / ffn_down_exps, [experts, rows, columns]) quantized by
gguf-py's quantizers (the K-quants, which gguf-py cannot quantize: random valid blocks, as tests/gguf_files.py makes
them -- then the file's values are not the source model's), every other tensor in F32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from gguf_files import quantized_blocks

# GGUF architecture and the key its metadata is written under, by transformers model type
ARCHITECTURES = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama", "glm4_moe": "glm4moe",
                 "gpt_oss": "gpt-oss"}


def _permuted(weights: np.ndarray, heads: int) -> np.ndarray:
    """The q/k row order llama.cpp's converter writes a llama file's attention in (convert_hf_to_gguf.py's
    LlamaModel.permute), which transformers' Llama processor undoes."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape)


def build_model(model_type: str, seed: int = 1234, **config: Any) -> Any:
    """A float32 random transformers model of ``model_type`` with ``config``'s values."""
    import transformers

    cfg = transformers.AutoConfig.for_model(model_type, **config)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def byte_level_vocabulary(size: int, specials: list[str]) -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types) of a small GPT-2 style byte-level BPE vocabulary of ``size`` tokens, as
    llama.cpp's files of GLM and gpt-oss carry theirs (tokenizer.ggml.model "gpt2"): the 256 byte symbols, merges of
    a space and a letter, ``specials`` as control tokens, then reserved control tokens to ``size``."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    symbols, extra = {}, 0
    for b in range(256):  # GPT-2's bytes_to_unicode
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    tokens = [symbols[b] for b in range(256)]
    merges = [f"{symbols[32]} {c}" for c in "abcdefghijklmnopqrstuvwxyz"]
    tokens += [m.replace(" ", "") for m in merges]
    types = [1] * len(tokens)
    tokens += specials
    tokens += [f"<|reserved_{i}|>" for i in range(size - len(tokens))]
    return tokens, merges, types + [3] * (size - len(types))


def write_moe_gguf(path: Path, model: Any, experts: str = "Q8_0", matrices: str = "F32", down: str = "",
                   tokenizer: tuple[list[str], list[str], list[int], str] | None = None) -> None:
    """Write ``model`` (a transformers MoE model) to ``path`` as llama.cpp lays such a model out: its expert matrices in
    ``experts`` (a type gguf-py quantizes; the down experts in ``down`` where given), its other matrices in
    ``matrices``, vectors in F32; with ``tokenizer`` (tokens, merges, types, chat template: a "gpt2" vocabulary) where
    given."""
    import gguf
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    config = model.config
    arch = ARCHITECTURES[config.model_type]
    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    nextn = int(getattr(config, "num_nextn_predict_layers", 0) or 0)  # GLM: MTP layers after the decoder's
    names = gguf.get_tensor_name_map(arch_enum, config.num_hidden_layers + nextn)
    writer = GGUFWriter(str(path), arch)
    if config.model_type == "mixtral":  # as llama.cpp names Mistral AI's files (transformers then reads "mistral")
        writer.add_name("mistralai_Mixtral-tiny-Instruct")
    writer.add_block_count(config.num_hidden_layers + nextn)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(int(head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0)))
    if arch == "glm4moe":  # as convert_hf_to_gguf.py's Glm4MoeModel writes them
        writer.add_nextn_predict_layers(nextn)
        writer.add_leading_dense_block_count(config.first_k_dense_replace)
        writer.add_expert_shared_count(config.n_shared_experts)
        writer.add_expert_weights_scale(config.routed_scaling_factor)
        writer.add_expert_weights_norm(config.norm_topk_prob)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if arch == "gpt-oss":  # as convert_hf_to_gguf.py's GptOssModel writes them
        writer.add_expert_feed_forward_length(config.intermediate_size)
        writer.add_sliding_window(config.sliding_window)
        rope = config.rope_parameters
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_expert_count(getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None)
                            or config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if getattr(config, "moe_intermediate_size", None):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if getattr(config, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    # llama.cpp's LlamaFileType
    writer.add_file_type({"Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q4_K": 15, "MXFP4": 38}[experts])
    if tokenizer is not None:
        tokens, merges, types, template = tokenizer
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_chat_template(template)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)

    rng = np.random.default_rng(0)

    def put(name: str, value: np.ndarray, kind: str) -> None:
        if kind == "F32" or value.ndim < 2:
            writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
            return
        qtype = GGMLQuantizationType[kind]
        try:
            blocks = quants.quantize(np.ascontiguousarray(value, dtype=np.float32), qtype)
        except NotImplementedError:  # no gguf-py quantizer (the K-quants): random valid blocks of the shape
            rows = int(np.prod(value.shape[:-1]))
            blocks = quantized_blocks(kind, rows, value.shape[-1], rng).reshape(*value.shape[:-1], -1)
        writer.add_tensor(name, blocks, raw_dtype=qtype)

    for hf_name, tensor in model.state_dict().items():
        value = tensor.detach().float().numpy()
        base, _, suffix = hf_name.rpartition(".")
        if base.endswith("mlp.experts") and arch == "gpt-oss":
            # transposed, gate and up interleaved in transformers (GptOssExperts); llama.cpp writes them apart, as the
            # other families' experts, biases beside them (convert_hf_to_gguf.py's GptOssModel)
            layer = hf_name.split(".")[2]
            kind = "ffn_down_exps" if suffix.startswith("down_proj") else ""
            if suffix.endswith("_bias"):
                parts = {kind: value} if kind else {"ffn_gate_exps": value[..., ::2], "ffn_up_exps": value[..., 1::2]}
                for name, part in parts.items():
                    put(f"blk.{layer}.{name}.bias", part, "F32")
                continue
            value = value.swapaxes(-1, -2)
            parts = {kind: value} if kind else {"ffn_gate_exps": value[:, ::2], "ffn_up_exps": value[:, 1::2]}
            for name, part in parts.items():
                put(f"blk.{layer}.{name}.weight", part, experts)
            continue
        if suffix == "sinks":  # convert_hf_to_gguf.py names them attn_sinks.weight
            base, suffix = hf_name, "weight"
        if base.endswith("mlp.experts"):  # the fused experts: gate and up rows apart, as llama.cpp writes them
            layer = hf_name.split(".")[2]
            if suffix == "gate_up_proj":
                half = value.shape[1] // 2
                put(f"blk.{layer}.ffn_gate_exps.weight", value[:, :half], experts)
                put(f"blk.{layer}.ffn_up_exps.weight", value[:, half:], experts)
            else:
                put(f"blk.{layer}.ffn_down_exps.weight", value, down or experts)
            continue
        if suffix == "e_score_correction_bias":  # convert_hf_to_gguf.py renames it e_score_correction.bias
            base, suffix = f"{base}.e_score_correction", "bias"
        gguf_name = names.get_name(base)
        if gguf_name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        if gguf_name.endswith("ffn_gate_inp_shexp"):  # llama.cpp keeps the shared expert's gate a vector
            value = value.reshape(-1)
        if arch == "llama" and gguf_name.endswith(("attn_q", "attn_k")):
            value = _permuted(value, config.num_attention_heads if gguf_name.endswith("attn_q")
                              else config.num_key_value_heads)
        put(f"{gguf_name}.{suffix}", value, matrices)
    for extra in range(config.num_hidden_layers, config.num_hidden_layers + nextn):  # a NextN layer: random
        for kind in ("nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight", "attn_norm.weight"):
            shape = (config.hidden_size, 2 * config.hidden_size) if "eh_proj" in kind else (config.hidden_size,)
            put(f"blk.{extra}.{kind}", rng.standard_normal(shape).astype(np.float32), matrices)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
