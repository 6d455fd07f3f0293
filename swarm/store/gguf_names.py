"""swarm's own GGUF mapping for the families transformers' GGUF loader cannot read: GLM-4.5 (``glm4moe``), which
transformers does not know at all. Here, for those architectures only: the header keys (gguf-py's ``Keys``) -> the
transformers config, and llama.cpp's tensor names (gguf-py's ``MODEL_TENSOR`` / ``TENSOR_NAMES``, as
convert_hf_to_gguf.py writes them) -> the transformers names, from two small tables.

- GLM-4.5: ``leading_dense_block_count`` dense layers first (first_k_dense_replace), then MoE layers with shared
  experts (ffn_*_shexp) and the router's score-correction bias (exp_probs_b.bias); q/k/v biases; partial rotary
  (rope.dimension_count of the head); ``block_count`` counts the NextN (multi-token prediction) layers after the
  decoder's, whose tensors have no place in transformers' model and are left out.

gguf and transformers are imported inside the functions that need them.
"""

from __future__ import annotations

from typing import Any

from swarm.errors import ImportFailed

# GGUF architectures mapped here, and the transformers model type each becomes
OWN_ARCHITECTURES = {"glm4moe": "glm4_moe"}

# per architecture: gguf-py MODEL_TENSOR member -> the transformers name ({bid}: the layer), for .weight and .bias
_GLOBAL = {"TOKEN_EMBD": "model.embed_tokens", "OUTPUT_NORM": "model.norm", "OUTPUT": "lm_head"}
_ATTENTION = {"ATTN_NORM": "input_layernorm", "ATTN_POST_NORM": "post_attention_layernorm",
              "ATTN_Q": "self_attn.q_proj", "ATTN_K": "self_attn.k_proj", "ATTN_V": "self_attn.v_proj",
              "ATTN_OUT": "self_attn.o_proj"}
LAYER_TENSORS = {
    "glm4moe": {**_ATTENTION, "ATTN_Q_NORM": "self_attn.q_norm", "ATTN_K_NORM": "self_attn.k_norm",
                "FFN_GATE": "mlp.gate_proj", "FFN_UP": "mlp.up_proj", "FFN_DOWN": "mlp.down_proj",
                "FFN_GATE_INP": "mlp.gate", "FFN_GATE_SHEXP": "mlp.shared_experts.gate_proj",
                "FFN_UP_SHEXP": "mlp.shared_experts.up_proj", "FFN_DOWN_SHEXP": "mlp.shared_experts.down_proj",
                "FFN_DOWN_EXP": "mlp.experts.down_proj"},
}
# tensors named whole, not .weight/.bias of a module: GGUF name (after blk.{bid}.) -> transformers name
LAYER_SPECIAL = {
    "glm4moe": {"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"},
}
# the GGUF tensors that are parts of one transformers tensor, in order (swarm.store.gguf_moe.PART_ORDER's meaning)
LAYER_PARTS = {
    "glm4moe": {"mlp.experts.gate_up_proj": ("FFN_GATE_EXP", "FFN_UP_EXP")},
}

# per architecture: header key (after "<arch>.") -> config attribute
HEADER = {
    "glm4moe": {"context_length": "max_position_embeddings", "embedding_length": "hidden_size",
                "feed_forward_length": "intermediate_size", "attention.head_count": "num_attention_heads",
                "attention.head_count_kv": "num_key_value_heads", "attention.key_length": "head_dim",
                "attention.layer_norm_rms_epsilon": "rms_norm_eps", "expert_count": "n_routed_experts",
                "expert_used_count": "num_experts_per_tok", "expert_feed_forward_length": "moe_intermediate_size",
                "expert_shared_count": "n_shared_experts", "leading_dense_block_count": "first_k_dense_replace",
                "expert_weights_scale": "routed_scaling_factor", "expert_weights_norm": "norm_topk_prob",
                "expert_group_count": "n_group", "expert_group_used_count": "topk_group",
                "nextn_predict_layers": "num_nextn_predict_layers"},
}


def owned(architecture: str) -> bool:
    """Whether a GGUF of ``architecture`` (general.architecture) is mapped here rather than by transformers."""
    return architecture in OWN_ARCHITECTURES


def field(reader: Any, key: str) -> Any:
    """A scalar field of the header (int, float, bool or str), None where it has none."""
    f = reader.fields.get(key)
    if f is None or not f.data:
        return None
    from gguf import GGUFValueType

    value = f.parts[f.data[0]]
    if f.types and f.types[0] == GGUFValueType.STRING:
        return bytes(value).decode()
    return value[0].item()


def config(reader: Any, architecture: str) -> Any:
    """The transformers config of a GGUF of ``architecture`` from its header."""
    import transformers

    fields = header_fields(reader, architecture)
    blocks = field(reader, f"{architecture}.block_count")
    tensors = {t.name: t for t in reader.tensors}
    if blocks is None or "token_embd.weight" not in tensors:
        raise ImportFailed("the GGUF file has no block_count or no token_embd tensor; the file is incomplete")
    nextn = int(fields.get("num_nextn_predict_layers") or 0)
    head_dim = int(fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"])
    rotary = field(reader, f"{architecture}.rope.dimension_count") or head_dim
    fields.update(num_hidden_layers=int(blocks) - nextn, head_dim=head_dim,
                  vocab_size=int(tensors["token_embd.weight"].shape[-1]),
                  attention_bias="blk.0.attn_q.bias" in tensors, use_qk_norm="blk.0.attn_q_norm.weight" in tensors,
                  tie_word_embeddings="output.weight" not in tensors,
                  rope_parameters={"rope_type": "default", "rope_theta": float(
                      field(reader, f"{architecture}.rope.freq_base") or 10000.0),
                      "partial_rotary_factor": int(rotary) / head_dim})
    fields.update(special_tokens(reader))
    return transformers.AutoConfig.for_model(OWN_ARCHITECTURES[architecture], **fields)


def header_fields(reader: Any, architecture: str) -> dict[str, Any]:
    out = {}
    for key, attribute in HEADER[architecture].items():
        value = field(reader, f"{architecture}.{key}")
        if value is not None:
            out[attribute] = value
    return out


def special_tokens(reader: Any) -> dict[str, int]:
    out = {}
    for name in ("bos", "eos", "padding"):
        value = field(reader, f"tokenizer.ggml.{name}_token_id")
        if value is not None:
            out[{"padding": "pad"}.get(name, name) + "_token_id"] = int(value)
    return out


def weights_map(architecture: str, config: Any) -> dict[str, str]:
    """GGUF tensor name -> transformers name for a GGUF of ``architecture``, its decoder's layers only (a GLM file's
    NextN layers after them are left unnamed, so an import leaves them out). A tensor that is a part of one
    transformers tensor is named by its stem (no ".weight"), as swarm.store.gguf_moe.joined_parts reads them."""
    from gguf import MODEL_TENSOR, TENSOR_NAMES

    names: dict[str, str] = {}
    for member, hf_name in _GLOBAL.items():
        gguf_name = TENSOR_NAMES[MODEL_TENSOR[member]]
        names.update({f"{gguf_name}.weight": f"{hf_name}.weight", f"{gguf_name}.bias": f"{hf_name}.bias"})
    for bid in range(int(config.num_hidden_layers)):
        layer = f"model.layers.{bid}."
        for member, hf_name in LAYER_TENSORS[architecture].items():
            gguf_name = TENSOR_NAMES[MODEL_TENSOR[member]].format(bid=bid)
            if hf_name.startswith("mlp.experts."):  # a fused experts tensor: no .weight in transformers' name
                names[f"{gguf_name}.weight"] = layer + hf_name
                continue
            names.update({f"{gguf_name}.weight": f"{layer}{hf_name}.weight",
                          f"{gguf_name}.bias": f"{layer}{hf_name}.bias"})
        for gguf_name, hf_name in LAYER_SPECIAL[architecture].items():
            names[f"blk.{bid}.{gguf_name}"] = layer + hf_name
        for hf_name, members in LAYER_PARTS[architecture].items():
            for member in members:
                names[TENSOR_NAMES[MODEL_TENSOR[member]].format(bid=bid)] = layer + hf_name
    return names
