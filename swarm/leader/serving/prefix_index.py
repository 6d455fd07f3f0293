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

- reply: a request that ends with its last token leaves its reply's blocks too (from the block its prompt ends in),
  which the stages computed while decoding: the next turn of a chat sends the prompt, the reply and a new message,
  and reuses all of it up to the last full block the reply's tokens match (a chat template that renders the reply
  otherwise than it was generated stops the hit there). The stages keep them under keys the plan gives
  (PrefixPlan.reply_key); the leader names them by their tokens when the reply's end arrives. They count as held at
  once: the last token reaches stage 0 over one hop while the leader streams it to the client, who must read the
  reply before sending the turn that holds it (a request that still beat it there fails on the stage that lacks a
  block, and the index starts over: see PrefixCaches.failed).

A block a request was to keep but that never became held (the request ended before its first token) may still have
been kept by some stage: it is evicted with the next plan. A failover, unload or reload resets the index: a new
``epoch`` makes every stage forget its blocks when the next plan reaches it. A drain's or a re-layout's switch keeps
the epoch (swarm.leader.serving.kv_carry): the running requests' blocks are on every stage of the new ring, and only
those stay.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import time
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

from swarm import messages
from swarm.leader.serving.drafting import sliding  # the same rule: such layers cannot give rows back

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


def block_names(prompt: Sequence[int], block: int, most: int | None = None) -> list[bytes]:
    """The names of the prompt's full blocks (its first ``most``): each a hash of its tokens chained with its
    parent's name."""
    names: list[bytes] = []
    parent = b""
    for start in range(0, len(prompt) - block + 1, block):
        if most is not None and len(names) >= most:
            break
        parent = hashlib.blake2b(parent + array("q", prompt[start : start + block]).tobytes(), digest_size=16).digest()
        names.append(parent)
    return names


class _Joined(Sequence[int]):
    """A prompt and its reply as one sequence of tokens, without copying the prompt (it may be long)."""

    def __init__(self, head: Sequence[int], tail: Sequence[int]):
        self.head, self.tail = head, tail

    def __len__(self) -> int:
        return len(self.head) + len(self.tail)

    def __getitem__(self, at):  # slices only: what block_names takes
        start, stop = at.start, at.stop
        n = len(self.head)
        return [*self.head[start : min(stop, n)], *self.tail[max(0, start - n) : max(0, stop - n)]]


@dataclasses.dataclass
class _Block:
    held: bool  # every stage holds it (the request that kept it has had its first token)
    users: set[str]  # the running requests (ring ids) that reuse or keep it: never evicted while any is
    key: bytes = b""  # what the stages call it, when not its name: a reply's block (messages.PrefixPlan.reply_key)

    def on_stages(self, name: bytes) -> bytes:
        return self.key or name


@dataclasses.dataclass
class _Reply:
    """A running request whose reply's blocks the stages keep when it ends with its last token."""

    prompt: Sequence[int]  # the prompt it was planned with (the request's own list, not a copy)
    plan: messages.PrefixPlan
    tokens: list[int] = dataclasses.field(default_factory=list)  # its reply so far

    def keys(self) -> list[bytes]:
        """What the stages may have kept of it: every block name its plan allows."""
        first = len(self.prompt) // self.plan.block
        return [self.plan.reply_key(i) for i in range(first, first + self.plan.reply_blocks)]


class PrefixIndex:
    """The blocks the stages of one model hold, least recently used first."""

    def __init__(self, block: int = BLOCK_TOKENS):
        self.block = block
        self.epoch = _new_epoch()
        self.blocks: collections.OrderedDict[bytes, _Block] = collections.OrderedDict()
        self.orphans: list[bytes] = []  # forgotten here, perhaps kept by a stage: evicted with the next plan
        self.uses: dict[str, list[bytes]] = {}  # running ring id -> the blocks it reuses or keeps
        self.reused: dict[str, int] = {}  # running ring id -> how many blocks it reuses
        self.replies: dict[str, _Reply] = {}  # running ring id -> its reply, whose blocks the stages keep at its end

    @property
    def tokens(self) -> int:
        """Tokens the stages hold (or will, once the requests keeping them have their first token)."""
        return len(self.blocks) * self.block

    def plan(self, rid: str, prompt: Sequence[int], limit: int, reuse: bool = True,
             reply: int = 0) -> messages.PrefixPlan | None:
        """Request ``rid``'s plan: what it reuses, keeps and evicts, holding at most ``limit`` tokens in all; with
        ``reply`` (its max_tokens), the stages keep its reply's blocks too when it ends with its last token."""
        self._drop_reply(rid)  # a request sent again (a failover): what its first attempt may have kept goes
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
            evict.append(self.blocks.pop(victim).on_stages(victim))
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
        # the reply's blocks: from the one the prompt ends in, as many as its max_tokens fill, within what is left
        # of the limit now (a reply that ends pushes the least recently used blocks out with the next plan)
        reply_blocks = min((len(prompt) % self.block + reply) // self.block,
                           max(0, (limit - self.tokens) // self.block)) \
            if reply > 0 and all(name in self.blocks for name in names) else 0  # chained to the whole prompt
        seed = hashlib.blake2b(self.epoch.to_bytes(8, "little") + rid.encode(), digest_size=16).digest() \
            if reply_blocks else b""
        if not (reused or new or evict or reply_blocks):
            return None
        plan = messages.PrefixPlan(self.epoch, self.block, [self.blocks[n].on_stages(n) for n in reused],
                                   [n for _, n in new], [i for i, _ in new], evict, seed, reply_blocks)
        if reply_blocks:
            self.replies[rid] = _Reply(prompt, plan)
        return plan

    def reply_tokens(self, rid: str, tokens: Sequence[int]) -> None:
        """Tokens of request ``rid``'s reply arrived (its replies' blocks are named by them once it ends)."""
        reply = self.replies.get(rid)
        if reply is not None:
            reply.tokens.extend(tokens)

    def finished(self, rid: str) -> None:
        """Request ``rid`` ended with its last token: every stage kept the blocks its plan allowed of its prompt's
        tail and reply, up to the last token's position (swarm.stage.prefix_cache.finish); they are named by their
        tokens now and held, so the next turn of the chat reuses them."""
        reply = self.replies.pop(rid, None)
        if reply is None:
            return
        plan, first = reply.plan, len(reply.prompt) // self.block
        end = len(reply.prompt) + len(reply.tokens) - 1  # the last token's position: the rows the stages computed
        count = max(0, min(plan.reply_blocks, end // self.block - first))
        names = block_names(_Joined(reply.prompt, reply.tokens), self.block, first + count)[first:]
        for i, key in enumerate(reply.keys()):
            name = names[i] if i < len(names) else None
            if name is None or name in self.blocks:
                self.orphans.append(key)  # kept by no stage (past the end), or a copy of a block held already
            else:
                self.blocks[name] = _Block(True, set(), key)

    def _drop_reply(self, rid: str) -> None:
        """Request ``rid`` did not end with its last token: whatever a stage kept of its reply goes with the next
        plan (a stage that saw its end before the cancel may have kept it)."""
        reply = self.replies.pop(rid, None)
        if reply is not None and reply.tokens:
            self.orphans += reply.keys()

    def first_token(self, rid: str) -> None:
        """Request ``rid`` had its first token: every stage computed its prompt, and kept its blocks."""
        for name in self.uses.get(rid, []):
            found = self.blocks.get(name)
            if found is not None:
                found.held = True

    def ended(self, rid: str) -> None:
        """Request ``rid`` ended on the ring (or was cut off): its blocks may go."""
        self._drop_reply(rid)
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

    def carry(self, names: Sequence[bytes]) -> None:
        """A drain's or re-layout's switch (swarm.leader.serving.kv_carry): every stage of the new ring holds blocks
        ``names``, kept or handed over under their own names. Nothing else is sure to be on the new stages: the rest
        is forgotten here (and evicted from the stages that still hold it with the next plan)."""
        carried = set(names)
        for rid in list(self.replies):
            self._drop_reply(rid)
        for name, found in list(self.blocks.items()):
            if name not in carried or found.key:
                self.orphans.append(found.on_stages(name))
                del self.blocks[name]
        self.orphans = [name for name in self.orphans if name not in carried]
        self.uses.clear()
        self.reused.clear()
        for name in names:
            self.blocks[name] = _Block(True, set())


class PrefixCaches:
    """The index of every served model, and what the serving brain (swarm.leader.serving.serving) tells it.

    ``share``: SWARM_SERVE_PREFIX_CACHE_TOKENS, the tokens each stage may hold (0: off; None: what the model's KV
    budget leaves free beside its running requests, which is also the bound of a share set higher)."""

    def __init__(self, share: int | None):
        self.share = share
        self.indexes: dict[str, PrefixIndex] = {}
        # model -> the blocks a drain or re-layout carries across its switch: (the index's epoch, the names, the new
        # ring's fellows)
        self.carried: dict[str, tuple[int, list[bytes], tuple[int, ...]]] = {}

    def carry(self, model: str, epoch: int, names: list[bytes], fellows: tuple[int, ...]) -> None:
        """A drain or re-layout handed blocks ``names`` over (swarm.leader.serving.kv_carry): when the ring of
        ``model`` is whole again on ``fellows`` (stage by stage), the index keeps its epoch and those blocks rather
        than start anew."""
        self.carried[model] = (epoch, names, fellows)

    def reset(self, model: str, config: dict | None = None, fellows: tuple[int, ...] = ()) -> None:
        """The ring of ``model`` is whole again (loaded, failed over, reloaded): a new, empty index, whose epoch makes
        every stage forget the blocks it held -- unless a drain carried blocks to this very ring (:meth:`carry`)."""
        carried, index = self.carried.pop(model, None), self.indexes.get(model)
        if carried is not None and index is not None and index.epoch == carried[0] and fellows == carried[2]:
            index.carry(carried[1])
            return
        if self.share == 0 or sliding(config or {}):
            self.indexes.pop(model, None)
        else:
            self.indexes[model] = PrefixIndex()

    def forget(self, model: str) -> None:
        self.indexes.pop(model, None)

    @staticmethod
    def ring_takes_plans(serving: Any, online: Mapping[int, Any]) -> bool:
        """Whether every stage of ``serving``'s ring (swarm.leader.serving.models.ModelServing) runs on a fellow whose
        hello said it carries out prefix cache plans: an older fellow would ignore them, and compute a reused prompt's
        rest without its start."""
        conns = [online.get(stage.plan.fellow_id) for stage in serving.stages]
        return bool(conns) and all(conn is not None and conn.prefix_cache for conn in conns)

    def attach(self, message: messages.Generate, room: int, reuse: bool = True) -> messages.Generate:
        """``message`` with its plan, the index holding at most ``room`` tokens (and the share); without ``reuse``
        its prompt is computed whole (its blocks may still be kept)."""
        index = self.indexes.get(message.model)
        if index is None or message.siblings:
            return message
        limit = room if self.share is None else min(room, self.share)
        plan = index.plan(message.rid, message.prompt, max(0, limit),
                          reuse=reuse and message.sampling.prompt_logprobs is None,  # those need every row's logits
                          reply=message.max_tokens)
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
            index.reply_tokens(batch.rid, batch.tokens)
            if batch.done:
                index.finished(batch.rid)
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
