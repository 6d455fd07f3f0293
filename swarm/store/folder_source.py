"""Reading a transformers folder (safetensors, one file or sharded with its index) for import, one tensor at a time.

Tensors are read through safetensors' ``safe_open`` only when the importer asks for them, so a folder of any size is
converted holding one stage file's tensors at a time.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarm.errors import ImportFailed
from swarm.model_format import CONFIG_FILE

INDEX_FILE = "model.safetensors.index.json"  # transformers' name for a sharded checkpoint's key -> file map

# safetensors' dtype names -> torch's
_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


@dataclass(frozen=True)
class FolderTensor:
    hf_name: str
    shape: tuple[int, ...]
    read: Callable[[Any], Any]  # dtype -> the torch tensor in that dtype
    write: Callable[[Any, Any], None] | None = None  # (dtype, binary file) -> its bytes, a slice of rows at a time
    floating: bool = True


class FolderSource:
    """A transformers folder opened for import: config.json's contents and where each tensor lies."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        config_path = self.folder / CONFIG_FILE
        if not config_path.is_file():
            raise ImportFailed(
                f"{self.folder} has no {CONFIG_FILE}; give a folder saved by transformers' save_pretrained"
            )
        try:
            self.raw_config = json.loads(config_path.read_text())
        except ValueError as exc:
            raise ImportFailed(f"{config_path} is not valid JSON ({exc}); fix or re-download the model") from exc
        self.architecture = self.raw_config.get("model_type")

    def weight_files(self) -> list[Path]:
        """The safetensors files holding the weights: those the index names when the checkpoint is sharded (a
        folder may also carry other copies, e.g. Mistral's consolidated.safetensors), else every one there is."""
        index = self.folder / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ImportFailed(f"{index} is damaged ({exc}); re-download the model") from exc
            files = [self.folder / name for name in sorted(set(weight_map.values()))]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise ImportFailed(
                    f"{self.folder} is missing {len(missing)} of the {len(files)} weight files its index lists "
                    f"({', '.join(missing[:3])}); download the whole model"
                )
            return files
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise ImportFailed(
                f"{self.folder} has no *.safetensors weights; swarm imports safetensors folders or GGUF files "
                "(convert .bin checkpoints with transformers' save_pretrained(safe_serialization=True))"
            )
        return files

    def tensors(self) -> list[FolderTensor]:
        from safetensors import safe_open

        out: list[FolderTensor] = []
        seen: dict[str, Path] = {}
        for path in self.weight_files():
            try:
                with safe_open(str(path), framework="pt") as handle:
                    for key in handle.keys():  # a safe_open handle is no dict
                        if key in seen:
                            raise ImportFailed(f"{self.folder}: tensor {key!r} is in both {seen[key].name} and "
                                               f"{path.name}; remove the stray copy")
                        seen[key] = path
                        piece = handle.get_slice(key)
                        shape = tuple(piece.get_shape())
                        floating = piece.get_dtype() in _SAFETENSORS_DTYPES
                        write = functools.partial(_write, path, key) if floating else None  # write(dtype, out)
                        out.append(FolderTensor(key, shape, functools.partial(_read, path, key), write, floating))
            except ImportFailed:
                raise
            except Exception as exc:
                raise ImportFailed(f"cannot read the weights in {path} ({exc}); the file may be damaged") from exc
        return out

    def stored_dtype(self) -> str:
        """The dtype to store in: the 16-bit dtype config.json names, else the one most of the weights are in."""
        named = self.raw_config.get("dtype") or self.raw_config.get("torch_dtype")
        if named in ("bfloat16", "float16"):
            return named
        from safetensors import safe_open

        counts: dict[str, int] = {}
        for path in self.weight_files():
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():  # a safe_open handle is no dict
                    piece = handle.get_slice(key)
                    kind = _SAFETENSORS_DTYPES.get(piece.get_dtype())
                    if kind is not None:
                        n = 1
                        for d in piece.get_shape():
                            n *= int(d)
                        counts[kind] = counts.get(kind, 0) + n
        return max(counts, key=lambda kind: counts[kind]) if counts else "float32"


# Values converted per slice when a tensor is written slice by slice: bounds the copy of a large embedding.
WRITE_SLICE_ELEMENTS = 4 << 20


def _write(path: Path, key: str, dtype: Any, out: Any) -> None:
    """Write one floating tensor of a safetensors file to ``out`` in ``dtype``, a slice of rows at a time.

    The bytes are read with plain reads at the offsets the file's header gives, not through safetensors' memory map:
    pages touched through a map count against the importing process until it is closed (a whole embedding's worth).
    """
    import torch

    with open(path, "rb", buffering=0) as f:
        head = _header(f, path)
        entry = head[key]
        source = getattr(torch, _SAFETENSORS_DTYPES[entry["dtype"]])
        shape = [int(d) for d in entry["shape"]]
        begin, end = (int(x) for x in entry["data_offsets"])
        base = 8 + head["__length__"] + begin
        item = torch.empty((), dtype=source).element_size()
        row = item
        for d in shape[1:]:
            row *= d
        rows = shape[0] if shape else 1
        if row * rows != end - begin:
            raise ImportFailed(f"{path}: tensor {key!r} has {end - begin} bytes for shape {shape}; the file is damaged")
        step = max(1, WRITE_SLICE_ELEMENTS * item // max(1, row))
        for start in range(0, rows, step):
            count = min(step, rows - start)
            buf = bytearray(count * row)
            if os.preadv(f.fileno(), [buf], base + start * row) != len(buf):
                raise ImportFailed(f"{path} ends inside tensor {key!r}; the file is incomplete")
            chunk = torch.frombuffer(buf, dtype=source) if buf else torch.empty(0, dtype=source)
            # numpy's stubs make an array a buffer for Python 3.12 on only
            out.write(memoryview(chunk.to(dtype).contiguous().view(torch.uint8).numpy()))  # type: ignore[arg-type]


def _header(f: Any, path: Path) -> dict:
    """A safetensors file's header (its JSON), with ``__length__``: the JSON's length in bytes."""
    raw = os.pread(f.fileno(), 8, 0)
    if len(raw) != 8:
        raise ImportFailed(f"{path} is not a safetensors file (too short)")
    length = struct.unpack("<Q", raw)[0]
    try:
        head = json.loads(os.pread(f.fileno(), length, 8))
    except ValueError as exc:
        raise ImportFailed(f"{path} has a damaged safetensors header ({exc})") from exc
    head["__length__"] = length
    return head


def _read(path: Path, key: str, dtype: Any) -> Any:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        tensor = handle.get_tensor(key)
    return tensor.to(dtype) if tensor.is_floating_point() else tensor
