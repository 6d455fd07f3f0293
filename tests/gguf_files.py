"""GGUF files made up for tests: a Llama-shaped model of any size whose matrices are Q8_0 blocks of random bytes
(written directly, no quantizer: generating a few hundred MB takes a second or two), or blocks of any other type:
random data quantized by gguf-py where it has a quantizer for the type, else random block bytes (gguf-py has no
quantizer for the K-quants and IQ4 types; their bytes are any bytes, with the fp16 scales set to small finite
values so that the values are finite)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

Q8_0_BLOCK = 32  # values per Q8_0 block: one float16 scale, then 32 int8


def _q8_0(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q8_0 data for a (rows, cols) matrix, as the (rows, bytes per row) uint8 array GGUF stores."""
    blocks = cols // Q8_0_BLOCK
    data = rng.integers(-127, 128, size=(rows, blocks, 2 + Q8_0_BLOCK), dtype=np.int8).view(np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    data[:, :, :2] = scale
    return data.reshape(rows, blocks * (2 + Q8_0_BLOCK))


# Where each type without a gguf-py quantizer keeps its fp16 scales (byte offsets in its block; ggml-common.h's
# block_q2_K ... block_iq4_xs): set to a small finite value so random blocks dequantize to finite values.
_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,),
           "IQ4_XS": (0,)}


def quantized_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, bytes per row) uint8 blocks of ``kind`` for a random (rows, cols) matrix: quantized by gguf-py where it
    can, else random bytes with finite scales. Q8_0 is random int8 with scale 0.01 (fast at any size)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    if kind == "Q8_0":
        return _q8_0(rows, cols, rng)
    qtype = GGMLQuantizationType[kind]
    try:
        return quants.quantize((0.05 * rng.standard_normal((rows, cols))).astype(np.float32), qtype)
    except NotImplementedError:
        pass
    block, size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
    for at in _SCALES.get(kind, ()):
        data[:, :, at : at + 2] = scale
    return data.reshape(rows, -1)


def write_llama_gguf(path: Path, *, hidden: int, intermediate: int, layers: int, vocab: int, heads: int = 8,
                     kv_heads: int = 4, tied: bool = False, seed: int = 0, matrices: str = "Q8_0") -> int:
    """Write a random Llama GGUF to ``path`` with its matrices in ``matrices`` (F16, F32, or any quantized type,
    see quantized_blocks); returns the number of weight values (for its dequantized size)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type({"Q8_0": 7, "F16": 1, "F32": 0}.get(matrices, 7))

    values = 0

    def matrix(name: str, rows: int, cols: int) -> None:
        nonlocal values
        if matrices in ("F16", "F32"):
            dtype = np.float16 if matrices == "F16" else np.float32
            writer.add_tensor(name, (0.02 * rng.standard_normal((rows, cols))).astype(dtype))
        else:
            writer.add_tensor(name, quantized_blocks(matrices, rows, cols, rng),
                              raw_dtype=GGMLQuantizationType[matrices])
        values += rows * cols

    def vector(name: str, n: int) -> None:
        nonlocal values
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))
        values += n

    head_dim = hidden // heads
    matrix("token_embd.weight", vocab, hidden)
    for i in range(layers):
        vector(f"blk.{i}.attn_norm.weight", hidden)
        matrix(f"blk.{i}.attn_q.weight", hidden, hidden)
        matrix(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_output.weight", hidden, hidden)
        vector(f"blk.{i}.ffn_norm.weight", hidden)
        matrix(f"blk.{i}.ffn_gate.weight", intermediate, hidden)
        matrix(f"blk.{i}.ffn_up.weight", intermediate, hidden)
        matrix(f"blk.{i}.ffn_down.weight", hidden, intermediate)
    vector("output_norm.weight", hidden)
    if not tied:
        matrix("output.weight", vocab, hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return values
