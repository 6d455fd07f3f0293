"""Writing an import's weight files (named in swarm.model_format), one file at a time and one tensor at a time:
a safetensors folder's or a dequantized GGUF's tensors in one float dtype (write_weights; a tensor whose
``stored_dtype`` says otherwise in that one, as GLM's router is kept in float32), or a GGUF's tensors as the
file has them (write_blocks, through swarm.store.gguf_blocks). swarm.store.importer plans what goes where.

torch and safetensors are imported inside the functions that need them.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from swarm.errors import ImportFailed
from swarm.model_format import DTYPE_BYTES, EMBED_FILE, FINAL_FILE, WEIGHTS_DIR, layer_file
from swarm.store import gguf_blocks

# progress(phase, fraction of the phase done, detail), as swarm.store.importer reports it
Progress = Callable[..., None]


def write_blocks(work: Path, groups: dict[str, dict[str, Any]], num_layers: int, architecture: str,
                  report: Progress) -> dict[str, dict[str, int]]:
    """Write every weight file with a GGUF's tensors as the file has them (swarm.store.gguf_blocks), one tensor at a
    time and a chunk at a time; returns each file's weight values by GGUF type. Progress as write_weights'."""
    (work / WEIGHTS_DIR).mkdir()
    order = [EMBED_FILE, *map(layer_file, range(num_layers)), FINAL_FILE]
    total = sum(len(groups[rel]) for rel in order)
    done = 0
    types = {}
    for rel in order:
        what = _file_label(rel, num_layers)

        def on_tensor(key: str, what: str = what) -> None:
            nonlocal done
            report("write layers", done / total, f"{what}: {key}")
            done += 1

        types[rel] = gguf_blocks.write_file(work / rel, groups[rel], architecture, on_tensor)
        report("write layers", done / total, f"{what} written")
    return types


def write_weights(work: Path, groups: dict[str, dict[str, Any]], num_layers: int, dtype: str,
                   report: Progress) -> None:
    """Write every weight file, one at a time and one tensor at a time: a tensor the source can hand over in slices
    (most of them; a GGUF's embedding and head included) is never whole in memory, the others (Llama's q/k
    projections of a GGUF, norms) are held one at a time. Progress goes per tensor ("write layers", the fraction
    of all tensors, and which file and tensor)."""
    import torch
    from safetensors.torch import save_file

    (work / WEIGHTS_DIR).mkdir()
    torch_dtype = getattr(torch, dtype)
    order = [EMBED_FILE, *map(layer_file, range(num_layers)), FINAL_FILE]
    total = sum(len(groups[rel]) for rel in order)
    done = 0
    for rel in order:
        what = _file_label(rel, num_layers)
        group = groups[rel]
        if all(getattr(t, "floating", True) for t in group.values()):
            dtypes = {k: getattr(t, "stored_dtype", None) or dtype for k, t in group.items()}
            with open(work / rel, "wb") as out:
                out.write(_safetensors_header({k: t.shape for k, t in group.items()}, dtypes))
                for key, tensor in group.items():
                    report("write layers", done / total, f"{what}: {key}")
                    start = out.tell()
                    if tensor.write is not None:
                        tensor.write(getattr(torch, dtypes[key]), out)
                    else:
                        value = tensor.read(getattr(torch, dtypes[key])).contiguous()
                        out.write(memoryview(value.view(-1).view(torch.uint8).numpy()))
                        del value
                    if out.tell() - start != _nbytes(tensor.shape, dtypes[key]):
                        raise ImportFailed(f"{key} of {rel}: wrote {out.tell() - start} bytes, expected "
                                           f"{_nbytes(tensor.shape, dtypes[key])}; the source may be damaged")
                    done += 1
        else:  # integer tensors kept as they are: the library's writer, the file's tensors together
            tensors_out = {}
            for key, tensor in group.items():
                report("write layers", done / total, f"{what}: {key}")
                tensors_out[key] = tensor.read(torch_dtype).contiguous()
                done += 1
            save_file(tensors_out, str(work / rel), metadata={"format": "pt"})
            del tensors_out
        report("write layers", done / total, f"{what} written")


# torch dtype names -> safetensors' (https://github.com/huggingface/safetensors, "Format")
_SAFETENSORS_NAMES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    n = DTYPE_BYTES[dtype]
    for d in shape:
        n *= int(d)
    return n


def _safetensors_header(shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str]) -> bytes:
    """A safetensors header for these tensors, each in its ``dtypes``, laid out in this order: an 8-byte length,
    then the JSON (padded with spaces to a multiple of 8, as the library writes it) -- so the tensors can follow one
    by one."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, shape in shapes.items():
        size = _nbytes(shape, dtypes[key])
        header[key] = {"dtype": _SAFETENSORS_NAMES[dtypes[key]], "shape": list(shape),
                       "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _file_label(rel: str, num_layers: int) -> str:
    if rel == EMBED_FILE:
        return "embedding"
    if rel == FINAL_FILE:
        return "final norm and head"
    return f"layer {int(rel.rsplit('_', 1)[1].split('.')[0]) + 1} of {num_layers}"
