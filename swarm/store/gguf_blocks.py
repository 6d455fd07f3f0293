"""Writing a GGUF's tensors as the file has them into an imported model's per-layer safetensors files.

Why per-layer safetensors files around the file's own bytes, rather than keeping the GGUF and handing each stage byte
ranges of it: every other part of swarm already deals in those files -- the manifest's sha256 per file, a fellow's
download of only its stage's files (resumed, verified, cached by content hash), the stage's loader, the reference
model -- so a GGUF model needs no second way to fetch and verify. The cost is a safetensors header per file: a few KB,
against the 1.02x of the GGUF's size an import may take (measured on the built-in model in tests/test_model_import.py).

A quantized tensor is written as a uint8 tensor of its block bytes, shaped (rows, bytes per row); F32, F16 and BF16
tensors as safetensors tensors of that dtype, exactly the file's bytes (GGUF and safetensors are both little-endian).
What a stage needs to turn them back into transformers' tensors goes in the file's metadata (swarm.model_format,
GGUF_TENSORS_KEY): per tensor its GGUF type, logical shape, GGUF name and whether transformers' fix-up still
applies, and for a part of a tensor transformers joins from several (a MoE layer's ffn_gate_exps and ffn_up_exps:
its experts' gate_up_proj) the joined tensor's name and the part's place. swarm.stage.weights reads it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from swarm.errors import ImportFailed
from swarm.model_format import GGUF_ARCHITECTURE_KEY, GGUF_FLOAT_TYPES, GGUF_TENSORS_KEY

# GGUF float type -> safetensors dtype name (https://github.com/huggingface/safetensors, "Format"); every quantized
# type is stored as U8
_SAFETENSORS_NAMES = {name: name for name in GGUF_FLOAT_TYPES}  # the same names in both formats
_ELEMENT_BYTES = {"F32": 4, "F16": 2, "BF16": 2}


def _layout(group: dict[str, Any]) -> list[tuple[str, Any]]:
    """The file's tensors in the order they are written: float32 first, then 16-bit floats, then block bytes, so
    every tensor starts at a multiple of its element size (the data starts 8-aligned after the padded header, and a
    safetensors file has no gaps to align with)."""
    def rank(item: tuple[str, Any]) -> int:
        return -_ELEMENT_BYTES.get(item[1].gguf_type, 1)

    return sorted(group.items(), key=rank)


def header(group: dict[str, Any], architecture: str) -> bytes:
    """The safetensors header of a file holding ``group`` (name in the file -> GGUF tensor of gguf_source) as the GGUF
    has them, with the metadata the stage's loader reads."""
    tensors = {key: {"type": t.gguf_type, "shape": list(t.shape), "name": t.gguf_name, "fixup": bool(t.fixup),
                     # a part is named "<joined tensor>.<its GGUF kind>" (swarm.store.gguf_source), in the file's names
                     **({"into": key.rpartition(".")[0], "part": t.part} if getattr(t, "into", "") else {}),
                     **({"join": t.join} if getattr(t, "join", "") else {})}
               for key, t in group.items()}
    head: dict[str, Any] = {"__metadata__": {"format": "pt", GGUF_ARCHITECTURE_KEY: architecture,
                                             GGUF_TENSORS_KEY: json.dumps(tensors, separators=(",", ":"))}}
    offset = 0
    for key, tensor in _layout(group):
        dtype = _SAFETENSORS_NAMES.get(tensor.gguf_type, "U8")
        end = offset + tensor.raw_bytes
        head[key] = {"dtype": dtype, "shape": list(tensor.raw_shape), "data_offsets": [offset, end]}
        offset += tensor.raw_bytes
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_file(path: Path, group: dict[str, Any], architecture: str,
               on_tensor: Callable[[str], None]) -> dict[str, int]:
    """Write ``group``'s tensors to ``path`` as the GGUF has them, one at a time, a chunk at a time; returns the
    weight values it holds by GGUF type (what a stage holds of each differs: swarm.quantization.gguf_layer_bytes).
    ``on_tensor(key)`` is called before each tensor (progress)."""
    with open(path, "wb") as out:
        out.write(header(group, architecture))
        for key, tensor in _layout(group):
            on_tensor(key)
            start = out.tell()
            tensor.copy_raw(out)
            if out.tell() - start != tensor.raw_bytes:
                raise ImportFailed(f"{key} of {path.name}: copied {out.tell() - start} bytes, expected "
                                   f"{tensor.raw_bytes}; the GGUF may be damaged")
    types: dict[str, int] = {}
    for tensor in group.values():
        n = 1
        for d in tensor.shape:
            n *= int(d)
        types[tensor.gguf_type] = types.get(tensor.gguf_type, 0) + n
    return types
