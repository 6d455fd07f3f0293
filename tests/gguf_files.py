"""GGUF files made up for tests: a Llama-shaped model of any size whose matrices are Q8_0 blocks of random bytes
(written directly, no quantizer: generating a few hundred MB takes a second or two)."""

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


def write_llama_gguf(path: Path, *, hidden: int, intermediate: int, layers: int, vocab: int, heads: int = 8,
                     kv_heads: int = 4, tied: bool = False, seed: int = 0, matrices: str = "Q8_0") -> int:
    """Write a random Llama GGUF to ``path`` with its matrices in ``matrices`` (Q8_0, F16 or F32); returns the
    number of weight values (for its dequantized size)."""
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
    writer.add_file_type({"Q8_0": 7, "F16": 1, "F32": 0}[matrices])

    values = 0

    def matrix(name: str, rows: int, cols: int) -> None:
        nonlocal values
        if matrices == "Q8_0":
            writer.add_tensor(name, _q8_0(rows, cols, rng), raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            dtype = np.float16 if matrices == "F16" else np.float32
            writer.add_tensor(name, (0.02 * rng.standard_normal((rows, cols))).astype(dtype))
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
