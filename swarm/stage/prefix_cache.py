"""The prefix cache of one stage: the KV of recent prompts' blocks, for requests whose prompts start the same way.

The leader decides everything (swarm.leader.serving.prefix_index: which blocks a request reuses, which of its blocks to
keep, which to forget) and tells every stage in the request's plan (messages.PrefixPlan), so all the stages of a ring
hold the same blocks; stages after the first never see tokens, only the blocks' names. Here the plan is carried out:

  begin   a request's first computed chunk: its KV cache starts as the reused blocks' keys and values, concatenated
          (the same tensors the prompt's own prefill would have computed), so the request computes only the rest
  after   a computed batch: the last prompt chunk of a request keeps the plan's new blocks (copies of its cache's
          rows), and a request's first chunk forgets the blocks its plan evicts -- after the keeps of the same batch,
          which came before it on the ring
  finish  a request that ended with its last token (not a cancel, not a failure): before its cache is dropped, it
          keeps the blocks of its prompt's tail and its reply, under names the plan gives (the leader names them by
          their tokens once it has them all), so the next turn of a chat -- the prompt, the reply, a new message --
          reuses the reply too

A plan's ``epoch`` is the leader's cache generation: a newer one (a failover, a reload, a new leader) empties the
store first, and a plan of an older one neither reuses nor keeps anything. A sliding-window layer keeps only its last
window of tokens, so it cannot give a block's rows back: such stages keep nothing (the leader plans nothing for them).
"""

from __future__ import annotations

from typing import Any

import torch

from swarm.errors import ModelError
from swarm.stage.kv_cache import PackedLayer

# One layer's rows of a block: its keys' and values' tensors (one each, or the parts a packed layer holds them in,
# swarm.stage.kv_cache) and the dtype they are attended in.
Rows = tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], torch.dtype]


class PrefixStore:
    """The blocks one stage holds: block name -> each layer's (keys, values) of the block's rows."""

    def __init__(self) -> None:
        self.epoch = -1
        self.blocks: dict[bytes, list[Rows]] = {}

    def adopt(self, epoch: int) -> bool:
        """Take the plan's ``epoch``: a newer one empties the store. False for an older one (a late plan)."""
        if epoch > self.epoch:
            self.epoch = epoch
            self.blocks.clear()
        return epoch == self.epoch

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layers in self.blocks.values()
                   for keys, values, _ in layers for t in (*keys, *values))


def store_of(stage: Any) -> PrefixStore:
    """The stage's store (made on first use; it goes with the stage's model when that is unloaded)."""
    store = getattr(stage, "prefix_store", None)
    if store is None:
        store = stage.prefix_store = PrefixStore()
    return store


def begin(stage: Any, work: Any) -> None:
    """Start request ``work.rid``'s KV cache for its first computed chunk: empty, or its plan's reused blocks."""
    stage.new_request(work.rid)
    plan = work.request.start.prefix
    if plan is None:
        return
    store = store_of(stage)
    current = store.adopt(plan.epoch)
    if not plan.reuse:
        return
    missing = [h for h in plan.reuse if h not in store.blocks] if current else plan.reuse
    if missing:
        raise ModelError(f"the prefix cache of this stage lacks {len(missing)} of the {len(plan.reuse)} blocks request "
                         f"{work.rid!r} reuses (the leader's cache was reset meanwhile); it is sent again")
    cache = stage.request_cache(work.rid)
    blocks = [store.blocks[h] for h in plan.reuse]
    with torch.inference_mode():
        for index in range(len(blocks[0])):
            parts = len(blocks[0][index][0])
            keys = tuple(torch.cat([block[index][0][i] for block in blocks], dim=-2) for i in range(parts))
            values = tuple(torch.cat([block[index][1][i] for block in blocks], dim=-2) for i in range(parts))
            layer = cache.layers[index] if index < len(getattr(cache, "layers", ())) else None
            if isinstance(layer, PackedLayer):  # held packed (--kv-cache q8, f16): the packed rows as they were
                layer.extend(keys, values, blocks[0][index][2])
            else:
                cache.update(keys[0], values[0], index)


def after(stage: Any, batch: list) -> None:
    """A batch was computed: the requests' last prompt chunks keep their plans' blocks, then first chunks evict."""
    for work in batch:
        plan = work.request.start.prefix
        if plan is None or not plan.keep or not (work.last and work.prefill) or not stage.has_request(work.rid):
            continue
        store = store_of(stage)
        if store.adopt(plan.epoch):
            _keep(store, stage.request_cache(work.rid), plan)
    for work in batch:
        plan = work.request.start.prefix
        if plan is not None and plan.evict and work.start and store_of(stage).adopt(plan.epoch):
            for h in plan.evict:
                store_of(stage).blocks.pop(h, None)


def finish(stage: Any, release: Any) -> None:
    """Request ``release.rid`` ended with its last token at ``release.end``: before its cache goes, keep the blocks of
    its prompt's tail and its reply that its plan asks for (the rows the stage computed while decoding: the same
    computation the next turn's prompt would make of those tokens)."""
    plan = release.start.prefix if release.start is not None else None
    if plan is None or not plan.reply or plan.reply_blocks <= 0 or not stage.has_request(release.rid):
        return
    store = store_of(stage)
    if not store.adopt(plan.epoch):
        return
    first = release.start.prompt_len // plan.block
    # rows past ``end`` may be guessed tokens a pass rejected (drafting ahead): they are never kept
    count = min(plan.reply_blocks, release.end // plan.block - first)
    at = list(range(first, first + count))
    keep_rows(store, stage.request_cache(release.rid), plan.block, [plan.reply_key(i) for i in at], at)


def _keep(store: PrefixStore, cache: Any, plan: Any) -> None:
    keep_rows(store, cache, plan.block, plan.keep, plan.keep_at)


def keep_rows(store: PrefixStore, cache: Any, block: int, names: list[bytes], at: list[int]) -> None:
    """Keep blocks ``at`` of ``cache`` (copies of their rows) under ``names``; none of a cache that cannot give rows
    back, nor one past the rows the cache holds."""
    layers = cache.layers
    if any(getattr(layer, "is_sliding", False) or (getattr(layer, "keys", None) is None
                                                   and not isinstance(layer, PackedLayer)) for layer in layers):
        return  # a sliding window (or a cache that keeps its rows otherwise) cannot give a block's rows back
    length = cache.get_seq_length()
    with torch.inference_mode():
        for h, i in zip(names, at):
            start, end = i * block, (i + 1) * block
            if end <= length:
                store.blocks[h] = [_rows(layer, start, end) for layer in layers]


def _rows(layer: Any, start: int, end: int) -> Rows:
    if isinstance(layer, PackedLayer):
        return (*layer.rows(start, end), layer.dtype)
    return (layer.keys[:, :, start:end].clone(),), (layer.values[:, :, start:end].clone(),), layer.keys.dtype
