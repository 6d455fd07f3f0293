"""swarm's own GGUF mapping for the families transformers' GGUF loader cannot read: GLM-4.5 (``glm4moe``), which
transformers does not know at all, and gpt-oss (``gpt-oss``), for which its tensor processor expects names llama.cpp
does not write. Here, for those architectures only: the header keys (gguf-py's ``Keys``) -> the
transformers config, and llama.cpp's tensor names (gguf-py's ``MODEL_TENSOR`` / ``TENSOR_NAMES``, as
convert_hf_to_gguf.py writes them) -> the transformers names, from two small tables.

- GLM-4.5: ``leading_dense_block_count`` dense layers first (first_k_dense_replace), then MoE layers with shared
  experts (ffn_*_shexp) and the router's score-correction bias (exp_probs_b.bias); q/k/v biases; partial rotary
  (rope.dimension_count of the head); ``block_count`` counts the NextN (multi-token prediction) layers after the
  decoder's, whose tensors have no place in transformers' model and are left out.
- gpt-oss: attention sinks (attn_sinks), q/k/v/o biases, the router with its bias (ffn_gate_inp), experts with biases
  laid out otherwise than transformers' (swarm.gguf_layout: transposed, gate and up interleaved), usually MXFP4;
  sliding-window attention in every other layer, YaRN rope from the header.

gguf and transformers are imported inside the functions that need them.
"""

from __future__ import annotations

from typing import Any

from swarm.errors import ImportFailed
from swarm.gguf_layout import OWN_ARCHITECTURES
from swarm.store.gguf_header import header_value

# per architecture: gguf-py MODEL_TENSOR member -> the transformers name ({bid}: the layer), for .weight and .bias
_GLOBAL = {"TOKEN_EMBD": "model.embed_tokens", "OUTPUT_NORM": "model.norm", "OUTPUT": "lm_head"}
_ATTENTION = {"ATTN_NORM": "input_layernorm", "ATTN_POST_NORM": "post_attention_layernorm",
              "ATTN_Q": "self_attn.q_proj", "ATTN_K": "self_attn.k_proj", "ATTN_V": "self_attn.v_proj",
              "ATTN_OUT": "self_attn.o_proj"}
LAYER_TENSORS = {
    "glm4moe": {**_ATTENTION, "ATTN_Q_NORM": "self_attn.q_norm", "ATTN_K_NORM": "self_attn.k_norm",
                "FFN_GATE": "mlp.gate_proj", "FFN_UP": "mlp.up_proj", "FFN_DOWN": "mlp.down_proj",
                "FFN_GATE_INP": "mlp.gate", "FFN_GATE_SHEXP": "mlp.shared_experts.gate_proj",
                "FFN_UP_SHEXP": "mlp.shared_experts.up_proj", "FFN_DOWN_SHEXP": "mlp.shared_experts.down_proj"},
    "gpt-oss": {**_ATTENTION, "FFN_GATE_INP": "mlp.router"},
}
# tensors named whole, not as .weight/.bias of a module: (MODEL_TENSOR member, suffix) -> transformers name
LAYER_SPECIAL = {
    "glm4moe": {("FFN_EXP_PROBS_B", "bias"): "mlp.gate.e_score_correction_bias",
                ("FFN_DOWN_EXP", "weight"): "mlp.experts.down_proj"},
    "gpt-oss": {("ATTN_SINKS", "weight"): "self_attn.sinks", ("FFN_DOWN_EXP", "weight"): "mlp.experts.down_proj",
                ("FFN_DOWN_EXP", "bias"): "mlp.experts.down_proj_bias"},
}
# transformers tensors a GGUF holds in parts: name -> its parts (MODEL_TENSOR member, suffix) in order, joined as
# swarm.gguf_layout.JOINS says (GLM: gate rows then up rows, as transformers' Qwen2-MoE processor joins them;
# gpt-oss: interleaved)
LAYER_PARTS = {
    "glm4moe": {"mlp.experts.gate_up_proj": (("FFN_GATE_EXP", "weight"), ("FFN_UP_EXP", "weight"))},
    "gpt-oss": {"mlp.experts.gate_up_proj": (("FFN_GATE_EXP", "weight"), ("FFN_UP_EXP", "weight")),
                "mlp.experts.gate_up_proj_bias": (("FFN_GATE_EXP", "bias"), ("FFN_UP_EXP", "bias"))},
}

# per architecture: header key (after "<arch>.") -> config attribute
_COMMON_HEADER = {"context_length": "max_position_embeddings", "embedding_length": "hidden_size",
                  "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
                  "attention.key_length": "head_dim", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
                  "expert_used_count": "num_experts_per_tok"}
HEADER = {
    "glm4moe": {**_COMMON_HEADER, "feed_forward_length": "intermediate_size", "expert_count": "n_routed_experts",
                "expert_feed_forward_length": "moe_intermediate_size", "expert_shared_count": "n_shared_experts",
                "leading_dense_block_count": "first_k_dense_replace", "expert_weights_scale": "routed_scaling_factor",
                "expert_weights_norm": "norm_topk_prob", "expert_group_count": "n_group",
                "expert_group_used_count": "topk_group", "nextn_predict_layers": "num_nextn_predict_layers"},
    "gpt-oss": {**_COMMON_HEADER, "expert_feed_forward_length": "intermediate_size",
                "expert_count": "num_local_experts", "attention.sliding_window": "sliding_window"},
}
# gpt-oss's YaRN: header key (after "<arch>.rope.scaling.") -> rope_parameters key, and the values transformers'
# GptOssConfig has where the header has none (llama.cpp's own defaults for beta_fast / beta_slow are the same)
YARN = {"factor": "factor", "original_context_length": "original_max_position_embeddings",
        "yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow"}
YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}


def owned(architecture: str) -> bool:
    """Whether a GGUF of ``architecture`` (general.architecture) is mapped here rather than by transformers."""
    return architecture in OWN_ARCHITECTURES


def config(reader: Any, architecture: str) -> Any:
    """The transformers config of a GGUF of ``architecture`` from its header."""
    import transformers

    fields = header_fields(reader, architecture)
    blocks = header_value(reader, f"{architecture}.block_count")
    tensors = {t.name: t for t in reader.tensors}
    if blocks is None or "token_embd.weight" not in tensors:
        raise ImportFailed("the GGUF file has no block_count or no token_embd tensor; the file is incomplete")
    nextn = int(fields.get("num_nextn_predict_layers") or 0)
    layers = int(blocks) - nextn
    head_dim = int(fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"])
    rotary = header_value(reader, f"{architecture}.rope.dimension_count") or head_dim
    rope: dict[str, Any] = {"rope_type": "default",
                            "rope_theta": float(header_value(reader, f"{architecture}.rope.freq_base") or 10000.0)}
    fields.update(num_hidden_layers=layers, head_dim=head_dim, vocab_size=int(tensors["token_embd.weight"].shape[-1]),
                  attention_bias="blk.0.attn_q.bias" in tensors, tie_word_embeddings="output.weight" not in tensors)
    if architecture == "glm4moe":
        fields["use_qk_norm"] = "blk.0.attn_q_norm.weight" in tensors
        rope["partial_rotary_factor"] = int(rotary) / head_dim
    if architecture == "gpt-oss":
        # llama.cpp's gpt-oss: sliding-window attention in every other layer, the first included
        fields["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        if header_value(reader, f"{architecture}.rope.scaling.type") == "yarn":
            rope.update(YARN_DEFAULTS, rope_type="yarn")
            for key, name in YARN.items():
                value = header_value(reader, f"{architecture}.rope.scaling.{key}")
                if value is not None:
                    rope[name] = value
    fields["rope_parameters"] = rope
    fields.update(special_tokens(reader))
    return transformers.AutoConfig.for_model(OWN_ARCHITECTURES[architecture], **fields)


def header_fields(reader: Any, architecture: str) -> dict[str, Any]:
    out = {}
    for key, attribute in HEADER[architecture].items():
        value = header_value(reader, f"{architecture}.{key}")
        if value is not None:
            out[attribute] = value
    return out


def special_tokens(reader: Any) -> dict[str, int]:
    out = {}
    for name in ("bos", "eos", "padding"):
        value = header_value(reader, f"tokenizer.ggml.{name}_token_id")
        if value is not None:
            out[{"padding": "pad"}.get(name, name) + "_token_id"] = int(value)
    return out


def weights_map(architecture: str, config: Any) -> dict[str, str]:
    """GGUF tensor name -> transformers name for a GGUF of ``architecture``, its decoder's layers only (a GLM file's
    NextN layers after them are left unnamed, so an import leaves them out)."""
    from gguf import MODEL_TENSOR, TENSOR_NAMES

    names: dict[str, str] = {}
    for member, hf_name in _GLOBAL.items():
        gguf_name = TENSOR_NAMES[MODEL_TENSOR[member]]
        names.update({f"{gguf_name}.weight": f"{hf_name}.weight", f"{gguf_name}.bias": f"{hf_name}.bias"})
    for bid in range(int(config.num_hidden_layers)):
        layer = f"model.layers.{bid}."
        for member, hf_name in LAYER_TENSORS[architecture].items():
            gguf_name = TENSOR_NAMES[MODEL_TENSOR[member]].format(bid=bid)
            names.update({f"{gguf_name}.weight": f"{layer}{hf_name}.weight",
                          f"{gguf_name}.bias": f"{layer}{hf_name}.bias"})
        for (member, suffix), hf_name in LAYER_SPECIAL[architecture].items():
            names[f"{TENSOR_NAMES[MODEL_TENSOR[member]].format(bid=bid)}.{suffix}"] = layer + hf_name
        for hf_name, parts in LAYER_PARTS[architecture].items():
            for member, suffix in parts:
                names[f"{TENSOR_NAMES[MODEL_TENSOR[member]].format(bid=bid)}.{suffix}"] = layer + hf_name
    return names


def joined_parts(architecture: str, config: Any) -> dict[str, int]:
    """GGUF tensor name -> its place among the parts of the transformers tensor it is a part of."""
    from gguf import MODEL_TENSOR, TENSOR_NAMES

    out = {}
    for bid in range(int(config.num_hidden_layers)):
        for parts in LAYER_PARTS[architecture].values():
            for index, (member, suffix) in enumerate(parts):
                out[f"{TENSOR_NAMES[MODEL_TENSOR[member]].format(bid=bid)}.{suffix}"] = index
    return out
