"""The prefix cache: the leader's index (block names, hits and misses at block edges, eviction under pressure) and
the stages carrying out its plans in a ring in one process -- a hit prefills only the rest of the prompt, on every
stage, and never changes a reply (over 2 and 3 stages, with batching, with drafting ahead)."""

from __future__ import annotations

import pytest
import torch

from exactness import check_reply, reference
from reference_model import load_reference_model
from swarm import messages
from swarm.leader.serving.prefix_index import PrefixCaches, PrefixIndex, block_names, sliding
from swarm.stage import LocalRing, StageModel, stage_specs
from swarm.stage.prefix_cache import store_of
from swarm.store.manifest import load_manifest

B = 8  # tokens per block in these tests
BIG = 1 << 20  # a limit that never evicts


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return [(seed * 131 + i * 37) % 300 + 3 for i in range(n)]  # the tiny models have 320 tokens


def served(index: PrefixIndex, rid: str, prompt: list[int], limit: int = BIG) -> messages.PrefixPlan | None:
    """A request planned, run (its first token arrived) and ended, as the leader sees it."""
    plan = index.plan(rid, prompt, limit)
    index.first_token(rid)
    index.ended(rid)
    return plan


# --- the index -------------------------------------------------------------------------------------------------------


def test_block_names_chain_over_every_token_before():
    a, b = prompt_of(40), prompt_of(40)
    b[12] += 1  # in the second block
    names_a, names_b = block_names(a, B), block_names(b, B)
    assert len(names_a) == 5 and len(block_names(a[:39], B)) == 4
    assert names_a[0] == names_b[0] and all(x != y for x, y in zip(names_a[1:], names_b[1:]))
    assert block_names(a[8:16], B)[0] != names_a[1]  # a block's name depends on what came before it


def test_hits_and_misses_at_block_edges():
    index = PrefixIndex(B)
    first = prompt_of(3 * B + 5)
    plan = served(index, "r1", first)
    assert plan is not None and plan.reuse == [] and plan.keep_at == [0, 1, 2]
    # exactly two blocks: the last token must be computed, so only the first block is reused
    plan = index.plan("r2", first[: 2 * B], BIG)
    assert plan is not None and plan.cached == B and plan.keep == []
    index.ended("r2")
    # one token past two blocks: both reused
    plan = index.plan("r3", first[: 2 * B + 1], BIG)
    assert plan is not None and plan.cached == 2 * B
    index.ended("r3")
    # the last token of the first block differs: nothing reused, and the new blocks are kept
    other = list(first)
    other[B - 1] += 1
    plan = index.plan("r4", other, BIG)
    assert plan is not None and plan.reuse == [] and plan.keep_at == [0, 1, 2]
    index.ended("r4")  # it ended before its first token: its blocks are forgotten, and evicted with the next plan
    plan = index.plan("r5", first + [7] * B, BIG)
    assert plan is not None and plan.cached == 3 * B and plan.keep_at == [3]
    assert sorted(plan.evict) == sorted(block_names(other, B))
    # a block still being kept by a running request is not reused before its first token
    assert index.plan("r6", first + [7] * B + [1], BIG).cached == 3 * B  # type: ignore[union-attr]
    index.first_token("r5")
    assert index.cached_tokens("r6") == 3 * B
    assert index.plan("r7", first + [7] * B + [1], BIG).cached == 4 * B  # type: ignore[union-attr]


def test_eviction_is_least_recently_used_and_spares_running_requests():
    index = PrefixIndex(B)
    a, b = prompt_of(2 * B + 1, 1), prompt_of(2 * B + 1, 2)
    served(index, "a", a)
    served(index, "b", b)
    assert index.tokens == 4 * B
    # "a" is used again: "b" is now the least recently used, and goes first, tail first
    plan = index.plan("a2", a, BIG)
    assert plan is not None and plan.cached == 2 * B  # running: its blocks are in use
    c = prompt_of(B + 1, 3)
    plan = index.plan("c", c, 4 * B)  # room for one more block: one of b's goes, its tail
    assert plan is not None and plan.evict == [block_names(b, B)[1]] and plan.keep_at == [0]
    # under more pressure than the idle blocks free: the blocks in use stay, what does not fit is not kept
    d = prompt_of(3 * B + 1, 4)
    plan = index.plan("d", d, 2 * B)
    assert plan is not None and plan.keep == []
    assert block_names(b, B)[0] in plan.evict and index.blocks.keys() >= set(block_names(a, B))
    for rid in ("a2", "c", "d"):
        index.first_token(rid)
        index.ended(rid)
    plan = index.plan("e", prompt_of(B + 1, 5), B)  # now a's blocks may go too
    assert plan is not None and set(plan.evict) >= set(block_names(a, B))


def test_caches_follow_the_share_and_skip_groups_and_sliding_windows():
    caches = PrefixCaches(share=2 * B)
    caches.reset("m")
    caches.indexes["m"].block = B
    generate = messages.Generate("m", "r1", prompt_of(5 * B), 4, [], messages.Sampling())
    plan = caches.attach(generate, room=BIG).prefix
    assert plan is not None and plan.keep_at == [0, 1]  # the share holds two blocks
    other = messages.Generate("m", "r2", prompt_of(5 * B, 1), 4, [], messages.Sampling())
    assert caches.attach(other, room=0).prefix is None  # no room, and r1's blocks are in use: nothing to do
    group = messages.Generate("m", "g", prompt_of(5 * B), 4, [], messages.Sampling(), siblings=[messages.Sibling("x")])
    assert caches.attach(group, room=BIG).prefix is None
    assert sliding({"layer_types": ["sliding_attention", "full_attention"]}) and not sliding({"model_type": "llama"})
    off = PrefixCaches(share=0)
    off.reset("m")
    assert off.attach(generate, room=BIG).prefix is None


# --- stages ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama"]
    return model_dir, load_reference_model(model_dir)


def ring_of(model_dir, stages: int, max_batch: int = 16, chunk: int = B, kv_cache: str = "auto") -> LocalRing:
    specs = stage_specs(load_manifest(model_dir).num_layers, stages)
    models = [StageModel.load_dir(model_dir, s) for s in specs]
    for model in models:
        model.kv_cache = kv_cache
    ring = LocalRing(models, prefill_chunk=chunk)
    for protocol in ring.protocols:
        protocol.max_batch = max_batch
    return ring


def run_turns(ring: LocalRing, index: PrefixIndex | None, prompts: list[list[int]], steps: int, draft: int = 0,
              together: bool = False, replies_too: bool = False) -> list[list[int]]:
    """Each prompt's greedy reply, one after the other (or all at once, ``together``), planned by ``index`` (with
    ``replies_too``, the stages keep the replies' blocks as well)."""
    replies = []
    rids = [f"t{len(ring.replies)}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(rids, prompts):
        plan = index.plan(rid, prompt, BIG, reply=steps if replies_too else 0) if index is not None else None
        replies.append(ring.submit(rid, prompt, steps, draft=draft, prefix=plan))
        if not together:
            ring.run()
            end(index, rid, replies[-1].tokens)
    ring.run()
    for rid, reply in zip(rids, replies):
        if together:
            end(index, rid, reply.tokens)
    assert all(r.error is None for r in replies), [r.error for r in replies]
    return [r.tokens for r in replies]


def end(index: PrefixIndex | None, rid: str, tokens: list[int]) -> None:
    """What the leader does when a reply ends with its last token (swarm.leader.serving.prefix_index.PrefixCaches)."""
    if index is not None:
        index.first_token(rid)
        index.reply_tokens(rid, tokens)
        index.finished(rid)
        index.ended(rid)


def held(ring: LocalRing) -> list[set[bytes]]:
    return [set(store_of(stage).blocks) for stage in ring.stages]


@pytest.mark.parametrize("stages", [2, 3])
def test_a_hit_prefills_only_the_rest_on_every_stage_and_keeps_the_reply(llama, stages):
    model_dir, model = llama
    steps = 12
    turn1 = prompt_of(3 * B + 3)
    cold = ring_of(model_dir, stages)
    [reply1] = run_turns(cold, None, [turn1], steps)
    turn2 = turn1 + reply1 + prompt_of(B + 2, 9)  # the next turn: the conversation so far, and more
    [want2] = run_turns(cold, None, [turn2], steps)
    ref, margins = reference(model, turn2, steps)
    check_reply(want2, ref, margins)

    index = PrefixIndex(B)
    ring = ring_of(model_dir, stages)
    assert run_turns(ring, index, [turn1], steps) == [reply1]
    computed = [p.prefill_tokens for p in ring.protocols]
    assert held(ring) == [set(block_names(turn1, B))] * stages  # every stage keeps the same blocks
    assert run_turns(ring, index, [turn2], steps) == [want2]
    cached = 3 * B
    # every stage computed only what came after the cached blocks
    assert [p.prefill_tokens - c for p, c in zip(ring.protocols, computed)] == [len(turn2) - cached] * stages
    assert held(ring) == [set(block_names(turn2, B))] * stages
    assert ring.holding() == [[]] * stages and not any(stage.requests() for stage in ring.stages)


@pytest.mark.parametrize("kv_cache", ["q8", "f16"])
def test_a_hit_on_packed_keys_and_values_keeps_them_as_packed(llama, kv_cache):
    """With --kv-cache q8 (or f16) the blocks are kept as the stage holds them, packed: a hit continues from the same
    8-bit values and scales, so the reply is the one the same ring gives without the cache."""
    model_dir, _ = llama
    steps = 8
    turn1 = prompt_of(2 * B + 5)
    cold = ring_of(model_dir, 2, kv_cache=kv_cache)
    [reply1] = run_turns(cold, None, [turn1], steps)
    turn2 = turn1 + reply1 + prompt_of(B, 4)
    [want2] = run_turns(cold, None, [turn2], steps)

    index = PrefixIndex(B)
    ring = ring_of(model_dir, 2, kv_cache=kv_cache)
    assert run_turns(ring, index, [turn1], steps) == [reply1]
    computed = [p.prefill_tokens for p in ring.protocols]
    assert run_turns(ring, index, [turn2], steps) == [want2]
    assert [p.prefill_tokens - c for p, c in zip(ring.protocols, computed)] == [len(turn2) - 2 * B] * 2
    kept = next(iter(store_of(ring.stages[0]).blocks.values()))[0]
    assert [t.dtype for t in kept[0]] == ([torch.int8, torch.float16] if kv_cache == "q8" else [torch.float16])


def test_hits_in_one_batch_and_with_drafting_keep_the_replies(llama):
    model_dir, _ = llama
    steps = 10
    shared = prompt_of(4 * B, 5)
    prompts = [shared + prompt_of(3 + i, 20 + i) for i in range(4)]
    cold = ring_of(model_dir, 2)
    want = run_turns(cold, None, prompts, steps, together=True)
    index = PrefixIndex(B)
    ring = ring_of(model_dir, 2)
    run_turns(ring, index, [shared + [1]], 2)  # the shared part is cached
    before = ring.batches
    assert run_turns(ring, index, prompts, steps, together=True) == want
    assert ring.batches - before < sum(len(p) - 4 * B + steps for p in prompts)  # they were batched
    # drafting ahead on a hit: the same replies as without either
    assert run_turns(ring, index, prompts, steps, draft=3) == want


def test_a_new_epoch_clears_the_stages_and_a_stale_reuse_fails_clearly(llama):
    model_dir, _ = llama
    index = PrefixIndex(B)
    ring = ring_of(model_dir, 2)
    prompt = prompt_of(2 * B + 2, 7)
    [want] = run_turns(ring, index, [prompt], 6)
    assert all(held(ring))
    # the leader's cache starts over (a failover): the next plan's epoch empties every stage, then it refills
    index = PrefixIndex(B)
    assert run_turns(ring, index, [prompt], 6) == [want]
    assert held(ring) == [set(block_names(prompt, B))] * 2
    # a plan that reuses blocks the stages do not hold fails the request with words, not a crash
    stale = messages.PrefixPlan(index.epoch, B, reuse=[b"\0" * 16])
    reply = ring.submit("stale", prompt, 4, prefix=stale)
    ring.run()
    assert reply.error is not None and "prefix cache" in reply.error
    assert ring.holding() == [[]] * 2


def test_the_built_in_model_over_three_stages_drafting_on_a_chat_s_next_turn(smollm_model_dir):
    """A real chat's second turn (the first turn's prompt and reply, then a question) hits the first turn's blocks;
    drafting ahead on, the reply is the one without the cache."""
    from swarm.leader.chat.chat_format import encode_chat, load_tokenizer

    steps = 8
    first = [{"role": "user", "content": "Name three colours of the rainbow."}]
    cold = ring_of(smollm_model_dir, 3, chunk=256)
    turn1 = encode_chat(smollm_model_dir, first, None)
    [reply1] = run_turns(cold, None, [turn1], steps)
    text = load_tokenizer(str(smollm_model_dir)).decode(reply1, skip_special_tokens=True)
    turn2 = encode_chat(smollm_model_dir, [*first, {"role": "assistant", "content": text},
                                           {"role": "user", "content": "And two more?"}], None)
    [want2] = run_turns(cold, None, [turn2], steps, draft=3)
    index = PrefixIndex()  # the leader's own block size
    ring = ring_of(smollm_model_dir, 3, chunk=256)
    assert run_turns(ring, index, [turn1], steps, draft=3) == [reply1]
    plan = index.plan("peek", turn2, BIG)  # a request that ends before its first token: its blocks are orphans...
    index.ended("peek")
    assert plan is not None and plan.cached >= len(turn1) - index.block
    assert run_turns(ring, index, [turn2], steps, draft=3) == [want2]
    # ...which the next plan keeps again rather than evicts: every stage holds every block of both prompts
    assert held(ring) == [set(block_names(turn2, index.block)) | set(block_names(turn1, index.block))] * 3


# --- replies' blocks -------------------------------------------------------------------------------------------------


def test_a_finished_reply_s_blocks_are_named_by_its_tokens_and_a_cut_off_one_s_are_evicted():
    index = PrefixIndex(B)
    prompt = prompt_of(2 * B + 3)
    plan = index.plan("r1", prompt, BIG, reply=3 * B)
    assert plan is not None and plan.reply and plan.reply_blocks == (3 + 3 * B) // B
    reply = prompt_of(2 * B, 3)
    index.first_token("r1")
    index.reply_tokens("r1", reply[:5])
    index.reply_tokens("r1", reply[5:])
    index.finished("r1")
    index.ended("r1")
    # the stages computed every row up to the last token's position: blocks 2 and 3 (prompt's tail, then the reply)
    whole = prompt + reply
    names = block_names(whole[: len(whole) - 1], B)
    assert [index.blocks[n].key for n in names[2:]] == [plan.reply_key(2), plan.reply_key(3)]
    # the one block its plan allowed but the reply did not fill is evicted with the next plan, under its stage key
    nxt = index.plan("r2", whole + [1], BIG)
    assert nxt is not None and nxt.cached == 4 * B and nxt.reuse[2:] == [plan.reply_key(2), plan.reply_key(3)]
    assert nxt.evict == [plan.reply_key(4)]
    index.ended("r2")
    # a request cut off after its first tokens (a cancel, a failure): whatever a stage kept of it goes
    plan = index.plan("r3", prompt_of(B + 1, 8), BIG, reply=B)
    assert plan is not None and plan.reply_blocks == 1
    index.first_token("r3")
    index.reply_tokens("r3", [5, 6])
    index.ended("r3")
    assert index.plan("r4", prompt_of(3, 9), BIG).evict == [plan.reply_key(1)]  # type: ignore[union-attr]


def test_plans_go_only_to_rings_whose_fellows_all_take_them():
    from types import SimpleNamespace

    serving = SimpleNamespace(stages=[SimpleNamespace(plan=SimpleNamespace(fellow_id=i)) for i in (1, 2)])
    new, old = SimpleNamespace(prefix_cache=True), SimpleNamespace(prefix_cache=False)
    assert PrefixCaches.ring_takes_plans(serving, {1: new, 2: new})
    assert not PrefixCaches.ring_takes_plans(serving, {1: new, 2: old})  # an older fellow's hello lacks the flag
    assert not PrefixCaches.ring_takes_plans(serving, {1: new})  # offline


@pytest.mark.parametrize("draft", [0, 3])
def test_the_next_turn_hits_through_the_reply_over_two_stages_batched_and_drafting(llama, draft):
    """A chat's next turn is the prompt, the reply and a new message: with the replies' blocks kept it reuses every
    full block up to the reply's last computed row, and its reply is the one the same ring gives without the cache
    (the reply's KV was computed while decoding, in other shapes than a prefill: the same computation)."""
    model_dir, _ = llama
    steps = 3 * B + 2
    firsts = [prompt_of(2 * B + 3 + i, 30 + i) for i in range(3)]
    cold = ring_of(model_dir, 2)
    replies1 = run_turns(cold, None, firsts, steps, draft=draft, together=True)
    seconds = [p + r + prompt_of(B + 1, 40 + i) for i, (p, r) in enumerate(zip(firsts, replies1))]
    want2 = run_turns(cold, None, seconds, steps, draft=draft, together=True)

    index = PrefixIndex(B)
    ring = ring_of(model_dir, 2)
    before = ring.batches
    assert run_turns(ring, index, firsts, steps, draft=draft, together=True, replies_too=True) == replies1
    assert ring.batches - before < 2 * sum(-(-len(p) // B) + steps for p in firsts)  # batched: fewer passes
    computed = [p.prefill_tokens for p in ring.protocols]
    hits = [(len(p) + len(r) - 1) // B * B for p, r in zip(firsts, replies1)]  # the reply's last row is not computed
    plans = [index.plan(f"peek{i}", s, BIG) for i, s in enumerate(seconds)]
    assert [p.cached for p in plans if p is not None] == hits
    for i in range(len(seconds)):
        index.ended(f"peek{i}")
    assert run_turns(ring, index, seconds, steps, draft=draft, together=True, replies_too=True) == want2
    assert [p.prefill_tokens - c for p, c in zip(ring.protocols, computed)] == \
        [sum(len(s) - h for s, h in zip(seconds, hits))] * 2
    assert held(ring)[0] == held(ring)[1]  # both stages keep the same blocks
    assert ring.holding() == [[]] * 2 and not any(stage.requests() for stage in ring.stages)
