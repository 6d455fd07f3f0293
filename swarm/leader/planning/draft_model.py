"""Which small model drafts for a load (SWARM_SERVE_DRAFT_MODEL), as plain functions over the catalogue's facts.

With drafting ahead on (SWARM_SERVE_SPECULATIVE), a model served over several fellows can also guess with a small
model of its family that its last stage holds whole (swarm.stage.draft_model). The guesses are token ids the target
then verifies, so the two must share a vocabulary: the same tokenizer files (their sha256 in the manifests), or --
files that differ byte for byte -- tokenizers that give the same vocabulary and the same ids for a probe text.

``auto`` picks the smallest such model of the target's pool that is smaller than the target; none found, the load
goes on with prompt lookup alone and the leader says why once. A model named explicitly must exist in the pool and
share the vocabulary, or the load is refused before it starts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable, Iterable
from pathlib import Path

from swarm.errors import PlacementError
from swarm.leader.serving.drafting import sliding

log = logging.getLogger(__name__)

# The files that define a vocabulary (tokenizer_config.json also holds the chat template, which may differ within a
# family without changing a single token id).
VOCAB_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model", "tokenizer.tiktoken")
# Text whose token ids two tokenizers must agree on: words, code, digits, whitespace and non-Latin scripts.
PROBE = ("Drafting ahead: def area(w, h):\n    return w * h  # 12345 67.89\n\tÜber naïve café — 你好，世界。 "
         "Привет! <|im_start|>user\n")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """What the choice needs of one catalogue model."""

    name: str
    pool_id: int | None
    weight_bytes: int  # the manifest's total
    vocab_size: int
    vocabulary: str | None  # digest of its vocabulary files (None: it has no tokenizer)
    sliding: bool  # sliding-window layers: rejected guesses could not be cropped from its cache once it is full


def candidate(name: str, pool_id: int | None, manifest: dict, config: dict) -> Candidate:
    return Candidate(name, pool_id, int(manifest.get("total_bytes") or 0), int(manifest.get("vocab_size") or 0),
                     vocabulary_digest(manifest), sliding(config))


def vocabulary_digest(manifest: dict) -> str | None:
    """sha256 over the model's vocabulary files (their names and sha256), None without any."""
    entries = sorted((f["path"].rsplit("/", 1)[-1], f["sha256"]) for f in manifest.get("files", [])
                     if f.get("kind") == "tokenizer" and f["path"].rsplit("/", 1)[-1] in VOCAB_FILES)
    if not entries:
        return None
    return hashlib.sha256(repr(entries).encode()).hexdigest()


def same_tokenizers(a, b) -> bool:
    """Whether two loaded tokenizers give the same ids: the same vocabulary, and the same ids for PROBE."""
    return len(a) == len(b) and a.get_vocab() == b.get_vocab() and \
        list(a(PROBE)["input_ids"]) == list(b(PROBE)["input_ids"])


def shares_vocabulary(target: Candidate, draft: Candidate, compare: Callable[[str, str], bool] | None = None) -> bool:
    """Whether ``draft``'s token ids are ``target``'s: the same vocabulary files, or -- files that differ --
    ``compare(target name, draft name)`` (loading both tokenizers, :func:`same_tokenizers`). Models without a
    tokenizer (token ids only) share one when their vocabularies are the same size."""
    if target.vocabulary is None or draft.vocabulary is None:
        return target.vocabulary is None and draft.vocabulary is None and target.vocab_size == draft.vocab_size
    if target.vocabulary == draft.vocabulary:
        return True
    return compare is not None and compare(target.name, draft.name)


def choose_auto(target: Candidate, catalogue: Iterable[Candidate],
                compare: Callable[[str, str], bool] | None = None) -> tuple[Candidate | None, str]:
    """(the smallest model of ``target``'s pool that is smaller than it and shares its vocabulary, "") -- or (None,
    why there is none and what to import)."""
    smaller = sorted((c for c in catalogue if c.name != target.name and c.pool_id == target.pool_id
                      and 0 < c.weight_bytes < target.weight_bytes and not c.sliding),
                     key=lambda c: (c.weight_bytes, c.name))
    for c in smaller:
        if shares_vocabulary(target, c, compare):
            return c, ""
    looked = f"{len(smaller)} smaller model{'s' if len(smaller) != 1 else ''} of its pool" if smaller else \
        "no smaller model in its pool"
    return None, (f"SWARM_SERVE_DRAFT_MODEL=auto found no draft model for {target.name} ({looked}, none with its "
                  f"tokenizer): it drafts by prompt lookup alone. Import a small model of its family into its pool "
                  f"(for Qwen3 models, Qwen3-0.6B) and load {target.name} again.")


def check_named(target: Candidate, name: str, draft: Candidate | None,
                compare: Callable[[str, str], bool] | None = None) -> Candidate:
    """The model SWARM_SERVE_DRAFT_MODEL names, checked: PlacementError, saying what to do, when it is not in the
    target's pool, slides, or has another vocabulary."""
    fix = f"Import it into that pool, set SWARM_SERVE_DRAFT_MODEL=auto or unset it, and load {target.name} again."
    if draft is None or draft.pool_id != target.pool_id:
        where = "not in the catalogue" if draft is None else "in another pool"
        raise PlacementError(f"SWARM_SERVE_DRAFT_MODEL names {name}, which is {where}: the draft model must be a "
                             f"model imported into {target.name}'s pool. {fix}")
    if draft.sliding:
        raise PlacementError(f"SWARM_SERVE_DRAFT_MODEL names {name}, whose sliding-window layers cannot take rejected "
                             f"guesses back: the draft model needs full attention. Name another model, or set "
                             f"SWARM_SERVE_DRAFT_MODEL=auto.")
    if not shares_vocabulary(target, draft, compare):
        raise PlacementError(f"SWARM_SERVE_DRAFT_MODEL names {name}, whose tokenizer is not {target.name}'s: its "
                             f"guesses would be other tokens. The draft model needs the target's tokenizer (a model of "
                             f"the same family, e.g. Qwen3-0.6B for Qwen3). Name one, or set "
                             f"SWARM_SERVE_DRAFT_MODEL=auto.")
    return draft


# --- against the leader's catalogue ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Chosen:
    """The draft model of a load: its catalogue name, manifest and config."""

    name: str
    manifest: dict
    config: dict


def resolve(setting: str, target_name: str, target_pool: int | None, store, models_root: Path) -> Chosen | None:
    """The draft model SWARM_SERVE_DRAFT_MODEL (``setting``: auto or a name) gives a load of ``target_name``, from
    the catalogue (reads files: run it in a worker thread). None for auto without a match (logged, with what to
    import); PlacementError for a name that cannot draft for it."""
    rows = {row.name: row for row in store.list_models()}

    def read(row) -> tuple[Candidate, dict]:
        config = json.loads((models_root / row.name / "config.json").read_text())
        return candidate(row.name, row.pool_id, row.manifest, config), config

    def compare(a: str, b: str) -> bool:
        from swarm.leader.chat.chat_format import load_tokenizer

        try:
            return same_tokenizers(load_tokenizer(str(models_root / a)), load_tokenizer(str(models_root / b)))
        except (OSError, ValueError, ImportError) as exc:  # a tokenizer that does not load shares nothing
            log.info("cannot compare the tokenizers of %s and %s: %s", a, b, exc)
            return False

    target, _ = read(rows[target_name])
    if setting == "auto":
        catalogue = {}
        for row in rows.values():
            if row.pool_id == target_pool and row.name != target_name:
                try:
                    catalogue[row.name] = read(row)
                except (OSError, ValueError) as exc:
                    log.info("%s cannot be a draft model: %s", row.name, exc)
        chosen, why = choose_auto(target, [c for c, _ in catalogue.values()], compare)
        if chosen is None:
            log.warning("%s", why)
            return None
        log.info("%s drafts with %s (SWARM_SERVE_DRAFT_MODEL=auto)", target_name, chosen.name)
        return Chosen(chosen.name, rows[chosen.name].manifest, catalogue[chosen.name][1])
    # a name: the model's id, or its name as imported into the target's pool
    row = rows.get(setting)
    if row is None or row.pool_id != target_pool:
        row = next((r for r in rows.values() if r.base_name == setting and r.pool_id == target_pool), row)
    draft, config = read(row) if row is not None else (None, {})
    check_named(target, setting, draft, compare)
    return Chosen(row.name, row.manifest, config)
