"""`swarm model import`: convert a model into per-layer files in the leader's data dir and list it in the catalogue."""

from __future__ import annotations

import sys
from pathlib import Path

from swarm.errors import ImportFailed
from swarm.store.db import leader_store
from swarm.store.fleet import DEFAULT_POOL, check_pool_name, model_id
from swarm.store.importer import BUILTIN_MODELS, default_name, import_model
from swarm.store.manifest import Manifest, load_manifest


def import_into_leader(source: str, data_dir: Path, name: str | None = None, *, replace: bool = False,
                       show_progress: bool = False, dtype: str = "auto", pool: str = DEFAULT_POOL) -> Manifest:
    """Import SOURCE into ``pool`` and list it in the catalogue -- only once its files are complete, so a failed or
    interrupted import (a --replace included) leaves the catalogue as it was. In a pool other than the default its
    id (and folder) is NAME@POOL (swarm.store.fleet)."""
    if pool != DEFAULT_POOL:
        check_pool_name(pool)
        _pool_id(data_dir, pool)  # refuses an unknown pool before anything is read
        base = name or (source if source in BUILTIN_MODELS else default_name(Path(source)))
        if "@" in base:
            raise ImportFailed(f"{base!r} cannot be a model name: use letters, digits, '.', '_' and '-' "
                               "(--pool names the pool)")
        name = model_id(base, pool)
    progress = _ProgressBar() if show_progress else None
    try:
        manifest = import_model(source, data_dir / "models", name, progress, replace=replace, dtype=dtype)
    finally:
        if progress is not None:
            progress.close()
    register(data_dir, manifest, pool)
    return manifest


def _pool_id(data_dir: Path, pool: str) -> int:
    store = leader_store(data_dir)
    try:
        if pool == DEFAULT_POOL:
            return store.ensure_default_pool(None).id
        return store.pool_by_name(pool).id
    finally:
        store.close()


def register(data_dir: Path, manifest: Manifest, pool: str = DEFAULT_POOL) -> None:
    """List an imported model (its folder is data_dir/models/<its id>) in ``pool``'s catalogue."""
    pool_id = _pool_id(data_dir, pool)
    store = leader_store(data_dir)
    try:
        store.upsert_model(manifest.name, pool_id, manifest.to_json())
    finally:
        store.close()


def ensure_imported(source: str, data_dir: Path, name: str, show_progress: bool = True) -> Manifest:
    """Import once; a second call reuses the imported files (and re-lists them if the catalogue lost them)."""
    model_dir = data_dir / "models" / name
    if (model_dir / "manifest.json").exists():
        manifest = load_manifest(model_dir)
        register(data_dir, manifest)
        return manifest
    return import_into_leader(source, data_dir, name, show_progress=show_progress)


class _ProgressBar:
    """One tqdm bar per import phase (read, write layers, checksum), the current layer and tensor beside it."""

    def __init__(self):
        from tqdm import tqdm

        self._tqdm = tqdm
        self.bar = None
        self.phase = None

    def __call__(self, phase: str, fraction: float, detail: str = "") -> None:
        if phase != self.phase:
            self.close()
            self.phase = phase
            self.bar = self._tqdm(total=1000, desc=f"import: {phase}", file=sys.stderr,
                                  bar_format="{desc:<24} {bar} {percentage:3.0f}%{postfix}")
        assert self.bar is not None  # opened for this phase, now or before
        self.bar.n = int(fraction * 1000)
        if detail:
            self.bar.set_postfix_str(detail, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
