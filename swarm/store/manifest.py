"""The manifest of an imported model: every file with its size and sha256, and the facts the leader places and
budgets by (layers, dtype, KV bytes per token). The files themselves are named in swarm.model_format.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from swarm.errors import ModelError, ModelNotFound
from swarm.model_format import MANIFEST_FILE, dtype_bytes, stage_file_paths

MANIFEST_VERSION = 1


# --- manifest --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the model dir, "/" separated
    sha256: str
    size: int
    kind: str  # "embed" | "layer" | "final" | "config" | "tokenizer"
    layer: int | None = None
    # weight values the file holds, where its size does not say (a GGUF's blocks); 0: size / the manifest's dtype
    params: int = 0
    # a GGUF's blocks: those weight values by GGUF type ({"MXFP4": ..., "BF16": ..., "F32": ...}), which the planner
    # counts a stage's bytes by (swarm.quantization.gguf_layer_bytes); {} in manifests written before
    types: dict[str, int] = dataclasses.field(default_factory=dict, hash=False)


@dataclasses.dataclass
class Manifest:
    name: str
    architecture: str  # the transformers model_type
    num_layers: int
    hidden_size: int
    vocab_size: int
    # of the stored weights: "float32", "bfloat16", "float16"; with storage "gguf", the float type a GPU computes
    # the GGUF's tensors in (a CPU computes in float32)
    dtype: str
    tie_word_embeddings: bool
    eos_token_ids: list[int]
    bytes_per_layer: int  # the largest layer file
    total_bytes: int
    files: list[FileEntry]
    kv_bytes_per_token: int = 0  # per layer, at `dtype`; see kv_bytes_per_token()
    source: str = ""
    warnings: list[str] = dataclasses.field(default_factory=list)
    version: int = MANIFEST_VERSION
    # "": every weight file holds its tensors in ``dtype`` (safetensors folders, and every import before GGUFs kept
    # their blocks); "gguf": the files keep a GGUF's tensors as it has them (swarm.model_format, GGUF_TENSORS_KEY)
    storage: str = ""
    # with storage "gguf": the file's quantization as llama.cpp names it ("Q4_K_M", "Q8_0"); and the source's own size
    # label where it has one ("135M")
    file_type: str = ""
    size_label: str = ""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: dict) -> Manifest:
        known = {f.name for f in dataclasses.fields(cls)}
        data = {k: v for k, v in data.items() if k in known}
        fields = {f.name for f in dataclasses.fields(FileEntry)}
        data["files"] = [FileEntry(**{k: v for k, v in f.items() if k in fields}) for f in data.get("files", [])]
        return cls(**data)

    def file(self, path: str) -> FileEntry:
        for entry in self.files:
            if entry.path == path:
                return entry
        raise ModelError(f"model {self.name!r} has no file {path!r} in its manifest; re-import it")


def load_manifest(model_dir: Path) -> Manifest:
    path = Path(model_dir) / MANIFEST_FILE
    try:
        return Manifest.from_json(path.read_text())
    except FileNotFoundError:
        raise ModelNotFound(
            f"no model at {model_dir}: {MANIFEST_FILE} is missing; import it with `swarm model import`") from None
    except (ValueError, TypeError, KeyError) as exc:
        raise ModelError(f"the manifest {path} is damaged ({exc}); import the model again with --replace") from exc


def stage_files(manifest: Manifest, first_layer: int, end_layer: int, is_first: bool, is_last: bool) -> list[FileEntry]:
    """The files a stage holding layers [first_layer, end_layer) needs: config, its weights, nothing else.

    The last stage needs the embedding too when embeddings are tied: its head *is* the embedding matrix; and the
    tokenizer's files, which constrained sampling (the API's response_format) reads to know each token's text.
    """
    if not 0 <= first_layer < end_layer <= manifest.num_layers:
        raise ModelError(
            f"layers {first_layer}..{end_layer - 1} are not a slice of {manifest.name!r}, "
            f"which has layers 0..{manifest.num_layers - 1}"
        )
    paths = stage_file_paths(first_layer, end_layer, is_first, is_last, manifest.tie_word_embeddings)
    tokenizer = [f for f in manifest.files if f.kind == "tokenizer"] if is_last else []
    return [manifest.file(p) for p in paths] + tokenizer


def kv_bytes_per_token(config: Mapping[str, Any], dtype: str = "float32") -> int:
    """KV-cache bytes one token takes in ONE decoder layer: keys and values, each num_kv_heads * head_dim values."""
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return 2 * kv_heads * head_dim * dtype_bytes(dtype)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
