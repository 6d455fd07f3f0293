"""What an import will write, known before the first byte is: the source's config, its tensors (read lazily), the
dtype they are stored in, tokenizer and generation config; and the checks that refuse an import before anything is
written (architecture, GGUF tensor types, free disk). swarm.store.importer writes it."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarm.errors import ImportFailed, UnsupportedArchitecture
from swarm.model_format import (
    CONFIG_FILE,
    DTYPE_BYTES,
    GENERATION_CONFIG_FILE,
    SUPPORTED_ARCHITECTURES,
    check_sliceable,
)
from swarm.store import gguf_moe, gguf_source
from swarm.store.folder_source import FolderSource
from swarm.store.moe_layout import dequantized_mxfp4

log = logging.getLogger(__name__)

# Beyond the weights, an import writes config, tokenizer and manifest files (a large vocabulary's tokenizer.json is
# tens of MB) and safetensors headers: room kept free on top of the weights' own bytes.
DISK_MARGIN_BYTES = 256 << 20


def check_architecture(model_type: str | None, where: object) -> str:
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"{where} is a {model_type or 'unknown'!s} model; swarm can split only these architectures into stages: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}. Pick a model of one of those families."
        )
    return model_type


# --- the plan --------------------------------------------------------------------------------------


@dataclass
class Plan:
    """Everything an import writes, known before the first byte is: config, the tensors (read lazily), the dtype they
    are stored in, tokenizer and generation config."""

    source: str
    config: Any
    tensors: list  # of objects with hf_name, shape, read(dtype)
    dtype: str
    tokenizer: Callable[[], Any]
    generation_config: Any
    # a GGUF's tensors kept as the file has them (swarm.store.gguf_blocks), and the file's general.architecture
    keep_blocks: bool = False
    architecture: str = ""
    # a GGUF's quantization as llama.cpp names it ("Q4_K_M") and its size label ("135M"), for the model lists
    file_type: str = ""
    size_label: str = ""

    def weight_bytes(self) -> int:
        tied = bool(getattr(self.config, "tie_word_embeddings", False))
        total = 0
        for tensor in self.tensors:
            if tied and tensor.hf_name == "lm_head.weight":
                continue
            if self.keep_blocks:
                total += tensor.raw_bytes
                continue
            n = 1
            for d in tensor.shape:
                n *= d
            total += n * DTYPE_BYTES[self.dtype]
        return total


def plan_folder(folder: Path, dtype: str) -> Plan:
    from transformers import AutoConfig

    source = FolderSource(folder)
    check_architecture(source.architecture, folder)
    tensors = dequantized_mxfp4(source.tensors())  # gpt-oss's MXFP4 experts, stored dequantized
    try:
        config = AutoConfig.from_pretrained(folder)
    except Exception as exc:  # transformers raises many kinds here
        raise ImportFailed(f"transformers cannot read {folder / CONFIG_FILE}: {exc}") from exc
    check_sliceable(config)
    if getattr(config, "quantization_config", None) is not None:
        quantization = dict(config.quantization_config)
        if quantization.get("quant_method") != "mxfp4":
            raise ImportFailed(f"{folder} is quantized with {quantization.get('quant_method')!r}, which swarm cannot "
                               "import from a folder; import the unquantized checkpoint (or a GGUF) instead")
        del config.quantization_config  # its MXFP4 experts are stored dequantized: nothing is quantized any more
    if any((folder / f).exists() for f in _TOKENIZER_MARKERS):
        def tokenizer() -> Any:
            return _load_tokenizer(lambda: _auto_tokenizer(folder))
    else:
        def tokenizer() -> Any:
            return ImportFailed(f"no tokenizer files ({', '.join(_TOKENIZER_MARKERS)})")
    return Plan(str(folder), config, tensors, source.stored_dtype() if dtype == "auto" else dtype, tokenizer,
                _load_generation_config(folder))


def plan_gguf(path: Path, dtype: str) -> Plan:
    source = gguf_source.GGUFSource(path)
    if source.architecture not in _GGUF_ARCHITECTURES:
        check_architecture(source.architecture, path)
    unsupported = source.unsupported_types()
    if unsupported:
        kinds = ", ".join(f"{kind} ({len(names)} tensors, e.g. {names[0]})" for kind, names in unsupported.items())
        raise ImportFailed(
            f"{path} stores tensors as {kinds}, which swarm does not run; it runs "
            f"{', '.join(gguf_source.supported_quant_types())}. Use a GGUF of another quantization (Q4_K_M and Q8_0 "
            "are the common ones) or the model's safetensors folder."
        )
    config = source.config()
    check_architecture(config.model_type, path)
    gguf_moe.check_importable(path, config.model_type)  # a MoE family whose GGUFs do not import yet
    check_sliceable(config)
    tensors = source.tensors(config)
    if dtype != "auto":  # widened: a MoE layer's gate and up experts joined as the decoder layer holds them
        tensors = gguf_source.widened(tensors)

    def tokenizer() -> Any:
        return _load_tokenizer(source.tokenizer)

    return Plan(str(path), config, tensors, source.stored_dtype() if dtype == "auto" else dtype, tokenizer,
                source.generation_config(config), keep_blocks=dtype == "auto", architecture=source.architecture,
                file_type=source.file_type() if dtype == "auto" else "", size_label=source.size_label())


# GGUF architecture names (general.architecture) of the supported families, where they differ from transformers'
# model types: llama.cpp calls Gemma 3's text model "gemma3", Qwen's MoE models "qwen2moe" and "qwen3moe", GLM-4.5
# "glm4moe" and gpt-oss "gpt-oss", and writes Mistral (and Mixtral) as "llama".
_GGUF_ARCHITECTURES = {*SUPPORTED_ARCHITECTURES, "gemma3", "qwen2moe", "qwen3moe", "glm4moe", "gpt-oss"}


def check_disk(plan: Plan, models_root: Path) -> None:
    need = plan.weight_bytes() + DISK_MARGIN_BYTES
    free = _free_bytes(models_root)
    if free < need:
        raise ImportFailed(
            f"importing {plan.source} needs {need / 1e9:.1f} GB free in {models_root} "
            f"({plan.weight_bytes() / 1e9:.1f} GB of weights {_stored_as(plan)} + {DISK_MARGIN_BYTES >> 20} MB for "
            f"tokenizer and config), has {free / 1e9:.1f} GB free; free some space or import into another data dir"
        )


def _stored_as(plan: Plan) -> str:
    return "as the GGUF's blocks" if plan.keep_blocks else f"in {plan.dtype}"


def _free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


# Any of these in a folder means it carries a tokenizer (without one, AutoTokenizer may build an empty one).
_TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tokenizer.tiktoken")


def _auto_tokenizer(folder: Path, **kwargs: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, **kwargs)


def _load_tokenizer(load: Callable[[], Any]) -> Any:
    try:
        return load()
    except Exception as exc:  # the model still imports without one (token ids only): the reason goes in its warnings
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.warning("no usable tokenizer: %s", reason)
        return ImportFailed(reason)


def _load_generation_config(folder: Path) -> Any:
    if not (folder / GENERATION_CONFIG_FILE).is_file():
        return None
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(folder)
    except Exception as exc:  # transformers raises many kinds here: said as the import's refusal
        raise ImportFailed(f"cannot read {folder / GENERATION_CONFIG_FILE}: {exc}") from exc


