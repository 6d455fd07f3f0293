"""The prefix cache's index, on the leader: which blocks of recent prompts the stages of each model hold.

A chat sends its whole conversation again at every turn, and agents send long prompts that share a prefix: every
stage would prefill them again. The stages keep the KV of recent prompts instead, in blocks of BLOCK_TOKENS tokens,
each named by a hash chained over its tokens and its parent's name (vLLM's automatic prefix caching): two prompts
whose first blocks have the same names start with the same tokens, so those blocks' keys and values are the same
computation. Stages past the first never see tokens, so the leader -- which does -- owns the index and every choice,
and tells the stages with each request (messages.PrefixPlan; swarm.stage.prefix_cache carries it out):

- reuse: the longest run of held blocks the prompt starts with (never its last token, which must be computed for the
  first reply token's logits); the stages start the request's cache with them and compute only the rest;
- keep: the prompt's other full blocks, which the stages copy from the request's cache once its prompt is computed;
  they count as held (reusable) once its first token arrives, when every stage has them;
- evict: least recently used blocks no running request uses, to keep the store within its share. A reuse touches the
  blocks last-first, so a chain is evicted from its tail and never loses its head while its tail stays.

A block a request was to keep but that never became held (the request ended before its first token) may still have
been kept by some stage: it is evicted with the next plan. A failover, unload or reload resets the index: a new
``epoch`` makes every stage forget its blocks when the next plan reaches it.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import time
from array import array
from collections.abc import Sequence

from swarm import messages
from swarm.leader.drafting import sliding  # the same rule: such layers cannot give rows back

# Tokens per block. Small enough that a chat's turn reuses nearly all of the turns before it (the built-in model's
# chat template adds ~10 tokens a turn), big enough that an 8,000-token prefix is 250 blocks, not thousands of tiny
# tensors to concatenate on every stage. vLLM uses 16.
BLOCK_TOKENS = 32

_last_epoch = 0


def _new_epoch() -> int:
    """A cache generation larger than any before it, also across leader restarts (the clock, in microseconds)."""
    global _last_epoch
    _last_epoch = max(_last_epoch + 1, time.time_ns() // 1000)
    return _last_epoch


def block_names(prompt: Sequence[int], block: int) -> list[bytes]:
    """The names of the prompt's full blocks: each a hash of its tokens chained with its parent's name."""
    names: list[bytes] = []
    parent = b""
    for start in range(0, len(prompt) - block + 1, block):
        parent = hashlib.blake2b(parent + array("q", prompt[start : start + block]).tobytes(), digest_size=16).digest()
        names.append(parent)
    return names


@dataclasses.dataclass
class _Block:
    held: bool  # every stage holds it (the request that kept it has had its first token)
    users: set[str]  # the running requests (ring ids) that reuse or keep it: never evicted while any is


class PrefixIndex:
    """The blocks the stages of one model hold, least recently used first."""

    def __init__(self, block: int = BLOCK_TOKENS):
        self.block = block
        self.epoch = _new_epoch()
        self.blocks: collections.OrderedDict[bytes, _Block] = collections.OrderedDict()
        self.orphans: list[bytes] = []  # forgotten here, perhaps kept by a stage: evicted with the next plan
        self.uses: dict[str, list[bytes]] = {}  # running ring id -> the blocks it reuses or keeps
        self.reused: dict[str, int] = {}  # running ring id -> how many blocks it reuses

    @property
    def tokens(self) -> int:
        """Tokens the stages hold (or will, once the requests keeping them have their first token)."""
        return len(self.blocks) * self.block

    def plan(self, rid: str, prompt: Sequence[int], limit: int, reuse: bool = True) -> messages.PrefixPlan | None:
        """Request ``rid``'s plan: what it reuses, keeps and evicts, holding at most ``limit`` tokens in all."""
        names = block_names(prompt, self.block)
        reused: list[bytes] = []
        if reuse:
            for name in names[: (len(prompt) - 1) // self.block]:
                found = self.blocks.get(name)
                if found is None or not found.held:
                    break
                reused.append(name)
        for name in reversed(reused):  # the head ends most recently used: eviction takes chains from their tail
            self.blocks.move_to_end(name)
        new = [(i, name) for i, name in enumerate(names) if i >= len(reused) and name not in self.blocks]
        evict, self.orphans = self.orphans, []
        while self.blocks and self.tokens + len(new) * self.block > limit:
            victim = next((name for name, b in self.blocks.items() if not b.users and name not in reused), None)
            if victim is None:
                break
            del self.blocks[victim]
            evict.append(victim)
        new = new[: max(0, (limit - self.tokens) // self.block)]
        kept = {name for _, name in new}
        # a stage evicts after it keeps (swarm.stage.prefix_cache.after): a block kept again must not go with it
        evict = [name for name in evict if name not in kept]
        for _, name in reversed(new):
            self.blocks[name] = _Block(False, {rid})
        for name in reused:
            self.blocks[name].users.add(rid)
        self.uses[rid] = reused + [name for _, name in new]
        self.reused[rid] = len(reused)
        if not (reused or new or evict):
            return None
        return messages.PrefixPlan(self.epoch, self.block, reused, [n for _, n in new], [i for i, _ in new], evict)

    def first_token(self, rid: str) -> None:
        """Request ``rid`` had its first token: every stage computed its prompt, and kept its blocks."""
        for name in self.uses.get(rid, []):
            found = self.blocks.get(name)
            if found is not None:
                found.held = True

    def ended(self, rid: str) -> None:
        """Request ``rid`` ended on the ring (or was cut off): its blocks may go."""
        self.reused.pop(rid, None)
        for name in self.uses.pop(rid, []):
            found = self.blocks.get(name)
            if found is None:
                continue
            found.users.discard(rid)
            if not found.held and not found.users:
                del self.blocks[name]
                self.orphans.append(name)

    def cached_tokens(self, rid: str) -> int:
        return self.reused.get(rid, 0) * self.block


class PrefixCaches:
    """The index of every served model, and what the serving brain (swarm.leader.serving) tells it.

    ``share``: SWARM_SERVE_PREFIX_CACHE_TOKENS, the tokens each stage may hold (0: off; None: what the model's KV
    budget leaves free beside its running requests, which is also the bound of a share set higher)."""

    def __init__(self, share: int | None):
        self.share = share
        self.indexes: dict[str, PrefixIndex] = {}

    def reset(self, model: str, config: dict | None = None) -> None:
        """The ring of ``model`` is whole again (loaded, failed over, reloaded): a new, empty index, whose epoch makes
        every stage forget the blocks it held."""
        if self.share == 0 or sliding(config or {}):
            self.indexes.pop(model, None)
        else:
            self.indexes[model] = PrefixIndex()

    def forget(self, model: str) -> None:
        self.indexes.pop(model, None)

    def attach(self, message: messages.Generate, room: int, reuse: bool = True) -> messages.Generate:
        """``message`` with its plan, the index holding at most ``room`` tokens (and the share); without ``reuse``
        its prompt is computed whole (its blocks may still be kept)."""
        index = self.indexes.get(message.model)
        if index is None or message.siblings:
            return message
        limit = room if self.share is None else min(room, self.share)
        plan = index.plan(message.rid, message.prompt, max(0, limit),
                          reuse=reuse and message.sampling.prompt_logprobs is None)  # those need every row's logits
        return message if plan is None else dataclasses.replace(message, prefix=plan)

    def cached_tokens(self, model: str, rid: str) -> int:
        index = self.indexes.get(model)
        return index.cached_tokens(rid) if index is not None else 0

    def on_tokens(self, message: messages.Tokens) -> None:
        index = self.indexes.get(message.model)
        if index is None:
            return
        for batch in message.batches:
            index.first_token(batch.rid)
            if batch.done:
                index.ended(batch.rid)

    def ended(self, model: str, rid: str) -> None:
        index = self.indexes.get(model)
        if index is not None:
            index.ended(rid)

    def failed(self, model: str, rid: str) -> None:
        """Request ``rid`` failed on a stage: where it reused blocks, a stage may lack them (say, one restarted
        without the leader noticing), so the index starts over rather than fail its retries the same way."""
        index = self.indexes.get(model)
        if index is not None and index.reused.get(rid):
            self.indexes[model] = PrefixIndex(index.block)
