"""Real mixture-of-experts models as the planner sees them, without their weights: each model's published dimensions
(the values of its config.json on the Hugging Face Hub, written here from the model cards' config files:
Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B, zai-org/GLM-4.5-Air, openai/gpt-oss-120b) and a GGUF of it written with
gguf-py's writer -- the header (tensor infos of llama.cpp's names, types and shapes) and the data left as a hole
(a sparse file), so the file has the real file's length. The planner's own functions
(swarm.leader.serving.models.model_size, swarm.leader.planning.placement.place) then count what each stage holds and how
many PCs of a given free memory it asks for.

Tensor types: Q4_K_M as llama.cpp's quantize chooses them (Q4_K, with attn_v and ffn_down in Q6_K in the layers
its use_more_bits picks; Q5_0 / Q8_0 where a row is not whole 256-value blocks; the head in Q6_K; norms and routers
F32); gpt-oss's MXFP4 GGUF as ggml-org publishes it (experts MXFP4, the rest BF16, norms, sinks and biases F32).
GLM-4.5-Air's next-token-prediction layer (its 47th block in a GGUF, which swarm does not run) is left out.
"""

from __future__ import annotations

from pathlib import Path

from swarm.model_format import GGUF_MOE_ARCHITECTURES

QWEN3_30B = dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                 vocab_size=151936, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                 tie_word_embeddings=False)
QWEN3_235B = dict(hidden_size=4096, num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
                  head_dim=128, vocab_size=151936, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536,
                  tie_word_embeddings=False)
GLM45_AIR = dict(hidden_size=4096, num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
                 vocab_size=151552, n_routed_experts=128, num_experts_per_tok=8, moe_intermediate_size=1408,
                 n_shared_experts=1, first_k_dense_replace=1, intermediate_size=10944, tie_word_embeddings=False)
GPT_OSS_120B = dict(hidden_size=2880, num_hidden_layers=36, num_attention_heads=64, num_key_value_heads=8,
                    head_dim=64, vocab_size=201088, num_local_experts=128, num_experts_per_tok=4,
                    intermediate_size=2880, tie_word_embeddings=False)
MODELS = {  # name -> (model_type, config, file type)
    "Qwen3-30B-A3B Q4_K_M": ("qwen3_moe", QWEN3_30B, "Q4_K_M"),
    "gpt-oss-120b MXFP4": ("gpt_oss", GPT_OSS_120B, "MXFP4"),
    "GLM-4.5-Air Q4_K_M": ("glm4_moe", GLM45_AIR, "Q4_K_M"),
    "Qwen3-235B-A22B Q4_K_M": ("qwen3_moe", QWEN3_235B, "Q4_K_M"),
}
CONTEXT = 4096  # tokens of KV cache each stage keeps room for
FREE_GB = (16, 32)


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v and ffn_down Q4_K_M keeps in Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensors(config: dict, file_type: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, shape as gguf-py writes it -- rows' length last --, type) of every tensor of the model."""
    h, n = config["hidden_size"], config["num_hidden_layers"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    experts = config.get("num_experts") or config.get("n_routed_experts") or config["num_local_experts"]
    rows = config.get("moe_intermediate_size") or config["intermediate_size"]
    mxfp4 = file_type == "MXFP4"
    dense_kind = "BF16" if mxfp4 else "Q4_K"
    out: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (config["vocab_size"], h), dense_kind),
                                                   ("output_norm.weight", (h,), "F32"),
                                                   ("output.weight", (config["vocab_size"], h),
                                                    "BF16" if mxfp4 else "Q6_K")]
    for i in range(n):
        more = not mxfp4 and _more_bits(i, n)
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (h,), "F32"), (b + "attn_q.weight", (q, h), dense_kind),
                (b + "attn_k.weight", (kv, h), dense_kind),
                (b + "attn_v.weight", (kv, h), "Q6_K" if more else dense_kind),
                (b + "attn_output.weight", (h, q), dense_kind),
                # llama.cpp names GLM's and gpt-oss's post-attention norm post_attention_norm, Qwen3's ffn_norm
                (b + ("ffn_norm.weight" if "num_experts" in config else "post_attention_norm.weight"), (h,), "F32")]
        if "num_experts" in config:  # Qwen3's norms of queries and keys
            out += [(b + "attn_q_norm.weight", (config["head_dim"],), "F32"),
                    (b + "attn_k_norm.weight", (config["head_dim"],), "F32")]
        if "n_routed_experts" in config or mxfp4:  # GLM's and gpt-oss's attention biases
            out += [(b + f"attn_{m}.bias", (size,), "F32") for m, size in (("q", q), ("k", kv), ("v", kv))]
        if mxfp4:
            out += [(b + "attn_output.bias", (h,), "F32"),
                    (b + "attn_sinks.weight", (config["num_attention_heads"],), "F32")]
        if i < config.get("first_k_dense_replace", 0):  # GLM's first layer: a dense MLP
            inner = config["intermediate_size"]
            out += [(b + "ffn_gate.weight", (inner, h), "Q4_K"), (b + "ffn_up.weight", (inner, h), "Q4_K"),
                    (b + "ffn_down.weight", (h, inner), "Q6_K" if more else "Q4_K")]
            continue
        kind = "MXFP4" if mxfp4 else "Q4_K"
        out += [(b + "ffn_gate_inp.weight", (experts, h), "F32"),
                (b + "ffn_gate_exps.weight", (experts, rows, h), kind),
                (b + "ffn_up_exps.weight", (experts, rows, h), kind),
                (b + "ffn_down_exps.weight", (experts, h, rows), "Q6_K" if more else kind)]
        if mxfp4:
            out += [(b + "ffn_gate_inp.bias", (experts,), "F32")]
            out += [(b + f"ffn_{m}_exps.bias", (experts, size), "F32")
                    for m, size in (("gate", rows), ("up", rows), ("down", h))]
        if config.get("n_shared_experts"):
            shared = rows * config["n_shared_experts"]
            out += [(b + "exp_probs_b.bias", (experts,), "F32"),
                    (b + "ffn_gate_shexp.weight", (shared, h), "Q4_K"),
                    (b + "ffn_up_shexp.weight", (shared, h), "Q4_K"),
                    (b + "ffn_down_shexp.weight", (h, shared), "Q6_K" if more else "Q4_K")]
    return [(name, shape, _whole_blocks(shape, kind)) for name, shape, kind in out]


def _whole_blocks(shape: tuple[int, ...], kind: str) -> str:
    """llama.cpp's fallback for a row that is not whole K-quant blocks (256 values): Q4_K -> Q5_0, Q6_K -> Q8_0."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, _ = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    if shape[-1] % block == 0:
        return kind
    return {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}[kind]


def write_header(path: Path, model_type: str, config: dict, file_type: str) -> None:
    """A GGUF of the model's tensor infos, its data a hole of the data's length."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), model_type.replace("_", ""))
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_embedding_length(config["hidden_size"])
    write_tensor_infos(writer, path, tensors(config, file_type))


def write_tensor_infos(writer, path: Path, infos: list[tuple[str, tuple[int, ...], str]]) -> None:
    """Write ``infos`` (name, shape, GGUF type) as the tensors of the GGUF ``writer`` writes to ``path`` (its keys
    added before), then close it: a header-only file, its data a hole of the data's length (no disk space taken)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType

    data = 0
    for name, shape, kind in infos:
        kind_enum = GGMLQuantizationType[kind]
        block, size = GGML_QUANT_SIZES[kind_enum]
        nbytes = int(np.prod(shape)) // block * size
        # gguf-py takes a quantized tensor's shape in bytes per row: (..., row values / block * block bytes)
        raw = (*shape[:-1], shape[-1] // block * size) if block > 1 else shape
        writer.add_tensor_info(name, raw, np.dtype(np.uint8 if block > 1 else np.float32), nbytes, raw_dtype=kind_enum)
        data += _padded(nbytes, GGUF_DEFAULT_ALIGNMENT)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    start = _padded(path.stat().st_size, GGUF_DEFAULT_ALIGNMENT)
    with open(path, "r+b") as f:
        f.truncate(start + data)


def _padded(n: int, alignment: int = 32) -> int:
    return (n + alignment - 1) // alignment * alignment


def manifest_from_header(path: Path, model_type: str, config: dict) -> dict:
    """The manifest an import would write for the GGUF at ``path`` (blocks kept: each file's block bytes and its
    weight values), from its tensor infos read back by gguf-py's reader."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    n = config["num_hidden_layers"]
    layers = [[0, 0] for _ in range(n)]
    embed, final = [0, 0], [0, 0]
    for t in reader.tensors:
        entry = layers[int(t.name.split(".")[1])] if t.name.startswith("blk.") else (
            embed if t.name.startswith("token_embd") else final)
        entry[0] += int(t.n_bytes)
        entry[1] += int(t.n_elements)
    files = [{"kind": "layer", "layer": i, "size": s, "params": p} for i, (s, p) in enumerate(layers)]
    files += [{"kind": "embed", "size": embed[0], "params": embed[1]},
              {"kind": "final", "size": final[0], "params": final[1]}]
    kv = 2 * config["num_key_value_heads"] * config["head_dim"] * 2  # keys and values, bfloat16, per layer
    return {"architecture": model_type, "num_layers": n, "hidden_size": config["hidden_size"], "dtype": "bfloat16",
            "tie_word_embeddings": False, "kv_bytes_per_token": kv, "files": files, "storage": "gguf"}


def pcs_needed(manifest: dict, free_gb: int, quantization: str, cpu: bool = False) -> int | None:
    """The fewest GPU PCs (CPU PCs where ``cpu``) with ``free_gb`` GB free each that the planner places the model on
    (None: over 64)."""
    from swarm.errors import PlacementError
    from swarm.leader.planning.placement import FellowCapacity, place
    from swarm.leader.serving.models import model_size

    size = model_size(manifest, cpu=cpu, quantization=quantization)
    for n in range(1, 65):
        fellows = [FellowCapacity(i, f"pc-{i}", free_gb * 10**9) for i in range(n)]
        try:
            place(size, fellows, n, CONTEXT)
        except PlacementError:
            continue
        return n
    return None


def table_rows(folder: Path) -> list[str]:
    """The README's table: one markdown row a model."""
    rows = []
    for name, (model_type, config, file_type) in MODELS.items():
        path = folder / (name.replace(" ", "-") + ".gguf")
        write_header(path, model_type, config, file_type)
        manifest = manifest_from_header(path, model_type, config)
        cells = [name, f"{path.stat().st_size / 1e9:.1f} GB"]
        for kind in ("none", "int4-fast"):
            cells += [str(pcs_needed(manifest, gb, kind) or "more than 64") for gb in FREE_GB]
        # at gguf on CPU PCs: the file's blocks, experts included, as the kernels repack them -- for the families
        # whose GGUFs import (swarm.model_format.GGUF_MOE_ARCHITECTURES)
        at_gguf = {**manifest, "file_type": file_type}
        cells += [str(pcs_needed(at_gguf, gb, "gguf", cpu=True) or "more than 64")
                  if model_type in GGUF_MOE_ARCHITECTURES else "-" for gb in FREE_GB]
        path.unlink()
        rows.append("| " + " | ".join(cells) + " |")
    return rows
