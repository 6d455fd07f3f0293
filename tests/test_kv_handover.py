"""A KV handover at a drain or a re-layout: the stages of a ring keep a running request's computed blocks, the rows of
the layers a new stage needs travel (as wire bytes, in parts that fit a control link message) to it -- a fresh copy
of a drained stage, or a stage of another split put together from the old stages' layers -- and the new ring goes
on from them, computing only the tokens after the last whole block; the reply is the uninterrupted one. And the
leader's index carries its epoch across the switch only to the ring the blocks were handed to."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from swarm import wire
from swarm.errors import ProtocolError
from swarm.handover_messages import KvImport, KvImported, KvKeep, KvKept, join_blocks, split_blocks
from swarm.leader.serving.prefix_index import PrefixCaches, PrefixIndex, block_names
from swarm.stage import LocalRing, StageModel, stage_specs
from swarm.stage.kv_handover import export_blocks, import_blocks, keep_running
from swarm.stage.prefix_cache import store_of
from swarm.store.manifest import load_manifest
from test_prefix_cache import BIG, B, prompt_of


def stages_of(model_dir, kv_cache: str) -> list[StageModel]:
    models = [StageModel.load_dir(model_dir, s) for s in stage_specs(load_manifest(model_dir).num_layers, 2)]
    for model in models:
        model.kv_cache = kv_cache
    return models


def streamed_on(old, prompt: list[int], steps: int, streamed: int):
    """A reply streaming on ``old``'s ring until ``streamed`` tokens, as the leader sees it when a switch comes. ->
    (its prefix index, the tokens streamed, prompt + tokens, the count of whole blocks every stage has computed --
    all but the latest token's rows -- and their names)."""
    index = PrefixIndex(B)
    reply = old.submit("r", prompt, steps, prefix=index.plan("r", prompt, BIG))
    while len(reply.tokens) < streamed:
        old.step()
    index.first_token("r")
    tokens = reply.tokens[:streamed]  # what the leader had streamed when the switch came
    seq = prompt + tokens
    count = (len(seq) - 1) // B
    return index, tokens, seq, count, block_names(seq, B, count)


@pytest.mark.parametrize("kv_cache", ["auto", "q8"])
def test_a_switch_goes_on_from_the_handed_over_blocks_and_the_reply_is_the_same(tiny_model_dirs, kv_cache):
    model_dir = tiny_model_dirs["llama"]
    steps, streamed = 14, 9
    prompt = prompt_of(2 * B + 3, 3)
    cold = LocalRing(stages_of(model_dir, kv_cache), prefill_chunk=B)
    want = cold.submit("w", prompt, steps).tokens
    cold.run()
    assert len(want) == steps

    old = LocalRing(stages_of(model_dir, kv_cache), prefill_chunk=B)
    index, tokens, seq, count, names = streamed_on(old, prompt, steps, streamed)
    assert count == 3
    kept = [keep_running(stage, index.epoch, B, [("r", names)]) for stage in old.stages]
    assert kept == [names, names]

    taker = stages_of(model_dir, kv_cache)[1]  # a fresh copy of stage 1: the hot cover
    sent = wire.unpack(wire.encode(KvImport("m", "x1", 0, export_blocks(old.stages[1], names))))
    assert import_blocks(taker, index.epoch, sent.blocks) == names
    assert [t.dtype for t in store_of(taker).blocks[names[0]][0][0]] == \
        [t.dtype for t in store_of(old.stages[1]).blocks[names[0]][0][0]]

    # the switch: the request comes off the ring, the index carries the blocks, the new ring gets it again
    index.ended("r")
    index.carry(names)
    new = LocalRing([old.stages[0], taker], prefill_chunk=B)
    plan = index.plan("r2", seq, BIG)
    assert plan is not None and plan.cached == count * B
    rest = new.submit("r2", seq, steps - streamed, prefix=plan)
    new.run()
    assert rest.error is None, rest.error
    assert tokens + rest.tokens == want
    # each stage computed only the tokens after the last whole block
    assert [p.prefill_tokens for p in new.protocols] == [len(seq) - count * B] * 2


def test_a_handed_over_block_that_does_not_fit_is_refused_whole(tiny_model_dirs):
    from swarm.errors import ProtocolError

    model_dir = tiny_model_dirs["llama"]
    stage = stages_of(model_dir, "auto")[1]
    ring = LocalRing(stages_of(model_dir, "auto"), prefill_chunk=B)
    prompt = prompt_of(2 * B + 1, 5)
    ring.submit("r", prompt, 2)
    for _ in range(3):
        ring.step()
    names = block_names(prompt, B)
    assert keep_running(ring.stages[1], 7, B, [("r", names), ("gone", [b"x" * 16])]) == names
    blocks = export_blocks(ring.stages[1], names)
    bad = [blocks[0], {"name": b"y" * 16, "layers": blocks[1]["layers"][:-1]}]  # a layer short
    with pytest.raises(ProtocolError):
        import_blocks(stage, 7, bad)
    with pytest.raises(ProtocolError):  # an empty store too: the count is the stage's own
        import_blocks(stage, 7, [{"name": b"y" * 16, "layers": blocks[1]["layers"][:-1]}])
    packed = stages_of(model_dir, "q8")[1]
    with pytest.raises(ProtocolError):  # rows held otherwise than this stage's cache holds them
        import_blocks(packed, 7, blocks)
    with pytest.raises(ProtocolError):
        export_blocks(ring.stages[1], names, (1, 3))  # the stage has 2 cache layers
    assert store_of(stage).blocks == {} and store_of(packed).blocks == {}
    assert [len(b["layers"]) for b in export_blocks(ring.stages[1], names, (1, 2))] == [1, 1]
    assert import_blocks(stage, 7, blocks) == names
    assert import_blocks(stage, 6, blocks) == []  # a handover of an older epoch than the stage's: stale, ignored


def test_the_index_carries_its_epoch_only_to_the_ring_the_drain_handed_over_to():
    caches = PrefixCaches(None)
    caches.reset("m")
    index = caches.indexes["m"]
    block = index.block
    running = prompt_of(3 * block + 4, 2)
    names = block_names(running, block)
    index.plan("b", running, BIG)
    index.first_token("b")
    caches.carry("m", index.epoch, names[:2], (1, 3))
    caches.reset("m", None, (1, 2))  # the ring came back otherwise (a failover): a new cache
    assert caches.indexes["m"] is not index and "m" not in caches.carried

    index = caches.indexes["m"]
    other = prompt_of(2 * block + 1, 1)
    index.plan("a", other, BIG)  # another chat's blocks: the taker does not hold them
    index.first_token("a")
    index.ended("a")
    index.plan("b", running, BIG)
    index.first_token("b")
    caches.carry("m", index.epoch, names[:2], (1, 3))
    index.ended("b")  # the switch takes the request off the ring
    caches.reset("m", None, (1, 3))
    assert caches.indexes["m"] is index  # the same epoch: the stages keep what they hold
    assert sorted(index.orphans) == sorted([*block_names(other, block), names[2]])
    plan = index.plan("b2", running + [5, 6], BIG)
    assert plan is not None and plan.reuse == names[:2] and plan.keep == names[2:3]
    # what no stage of the new ring is sure to hold goes from the stages that still do
    assert sorted(plan.evict) == sorted(block_names(other, block))


@pytest.mark.parametrize(("layout", "kv_cache"), [([(0, 5)], "auto"), ([(0, 1), (1, 5)], "q8")])
def test_a_relayout_assembles_each_new_stage_from_the_old_stages_layers(tiny_model_dirs, layout, kv_cache):
    """A re-layout's handover: the old ring's two stages (layers 0-2, 3-4) keep a running request's blocks; each new
    stage -- the whole model, or layers 0 and 1-4 -- gets its layers' rows from the old stages that held them (a
    range of each, as wire bytes), put together in layer order by the leader; the new ring goes on from them,
    computing only the tail, and the reply is the uninterrupted one."""
    from swarm.leader.serving.kv_carry import assemble, export_spans, sources
    from swarm.stage.slice_load import StageSpec

    model_dir = tiny_model_dirs["qwen3"]
    layers = load_manifest(model_dir).num_layers
    assert layers == 5

    def stages(spans: list[tuple[int, int]]) -> list[StageModel]:
        out = [StageModel.load_dir(model_dir, StageSpec(a, b, a == 0, b == layers)) for a, b in spans]
        for model in out:
            model.kv_cache = kv_cache
        return out

    old_spans = [(0, 3), (3, 5)]
    steps, streamed = 12, 7
    prompt = prompt_of(2 * B + 5, 4)
    cold = LocalRing(stages(old_spans), prefill_chunk=B)
    want = cold.submit("w", prompt, steps).tokens
    cold.run()

    old = LocalRing(stages(old_spans), prefill_chunk=B)
    index, tokens, seq, count, names = streamed_on(old, prompt, steps, streamed)
    assert [keep_running(stage, index.epoch, B, [("r", names)]) for stage in old.stages] == [names, names]

    # the leader's side: which old stage gives which layers, each exports its span once, each new stage's pieces
    pieces = sources(old_spans, [1, 2], [(a, b, 10 + j) for j, (a, b) in enumerate(layout)])
    spans = export_spans(pieces)
    kept = {}
    for i, (a, b) in spans.items():
        # each export travels in parts that fit a control link message (here one of at most 3000 bytes of rows)
        parts = split_blocks(export_blocks(old.stages[i], names, (a - old_spans[i][0], b - old_spans[i][0])), 3000)
        sent = [wire.encode(KvKept("m", "x", [], part, more=True)) for part in parts]
        assert len(parts) > 1 and max(len(m) for m in sent) <= 3000 + 100
        kept[i] = KvKept("m", "x", names, join_blocks([b for m in sent for b in wire.unpack(m).blocks]))
    new = stages(layout)
    for j, stage in enumerate(new):
        sent = wire.unpack(wire.encode(KvImport("m", "x", 0, assemble(pieces[j], spans, kept))))
        assert import_blocks(stage, index.epoch, sent.blocks) == names
    assert len(store_of(new[-1]).blocks[names[0]]) == layout[-1][1] - layout[-1][0]

    index.ended("r")
    index.carry(names)
    ring = LocalRing(new, prefill_chunk=B)
    plan = index.plan("r2", seq, BIG)
    assert plan is not None and plan.cached == count * B
    rest = ring.submit("r2", seq, steps - streamed, prefix=plan)
    ring.run()
    assert rest.error is None, rest.error
    assert tokens + rest.tokens == want
    assert [p.prefill_tokens for p in ring.protocols] == [len(seq) - count * B] * len(layout)


def test_a_new_stage_takes_its_pieces_from_the_old_stages_and_a_kept_stage_none():
    from swarm.leader.serving.kv_carry import assemble, export_spans, sources

    old = [(0, 10), (10, 20), (20, 30)]
    # fellow 1 keeps its stage narrowed to 0-4 (it holds those rows); fellow 9 takes 5-24; fellow 3 keeps its stage
    pieces = sources(old, [1, 2, 3], [(0, 5, 1), (5, 25, 9), (20, 30, 3)])
    assert pieces == {1: [(0, 5, 10), (1, 10, 20), (2, 20, 25)]}
    spans = export_spans(pieces)
    assert spans == {0: (5, 10), 1: (10, 20), 2: (20, 25)}

    def export(i: int, names: list[bytes]) -> KvKept:
        a, b = spans[i]
        return KvKept("m", "x", names, [{"name": n, "layers": [[n, layer] for layer in range(a, b)]} for n in names])

    # a block an old stage lacks, or exported with another layer count (a fellow from before), is left out whole
    short = KvKept("m", "x", [b"a"], [{"name": b"c", "layers": [[b"c", 10]]}])
    exports = {0: export(0, [b"a", b"b", b"c"]), 1: export(1, [b"a", b"b"]), 2: export(2, [b"b", b"a"])}
    blocks = assemble(pieces[1], spans, exports)
    assert [b["name"] for b in blocks] == [b"a", b"b"]
    assert blocks[0]["layers"] == [[b"a", layer] for layer in range(5, 25)]
    assert assemble(pieces[1], spans, {**exports, 1: short}) == []


def test_an_export_in_parts_leaves_out_what_cannot_travel_whole():

    def layer(size: int) -> list:
        return [[{"dtype": "int8", "shape": [size], "data": b"k" * size}],
                [{"dtype": "int8", "shape": [size], "data": b"v" * size}], "float32"]

    blocks = [{"name": b"a", "layers": [layer(100)] * 3}, {"name": b"big", "layers": [layer(5000), layer(10)]},
              {"name": b"b", "layers": [layer(300)] * 2}]
    parts = split_blocks(blocks, 2000)
    assert all(sum(len(t["data"]) for p in part for lay in p["layers"] for t in (*lay[0], *lay[1])) <= 2000
               for part in parts)
    assert join_blocks([p for part in parts for p in part]) == [blocks[0], blocks[2]]  # one layer of big is too big
    # a piece missing in between: that block is not whole
    pieces = [p for part in parts for p in part]
    cut = next(i for i, p in enumerate(pieces) if p["name"] == b"b" and p["at"] == 0)
    assert [b["name"] for b in join_blocks(pieces[:cut] + pieces[cut + 1:])] == [b"a"]


class _Fellow:
    """A fellow's control link as KvCarry sees it: it answers KvKeep and KvImport as swarm.fellow.handover does, its
    export in parts (``part``: bytes of rows a part), each layer's rows a tensor tagged with its layer number."""

    prefix_cache = True
    kv_extension = True

    def __init__(self, carry, fid: int, first: int, end: int, holds: int, part: int = 1 << 30):
        self.carry, self.id, self.name, self.first, self.end, self.holds, self.part = carry, fid, f"f{fid}", first, \
            end, holds, part
        self.imported: list[dict] = []
        self.extension: list[int] = []
        self.parts = self.exported = 0

    def post(self, message) -> None:
        if isinstance(message, KvKeep):
            names = [n for _, ns in message.requests for n in ns][: self.holds]  # what it still holds of them
            a, b = message.export_layers or [0, self.end - self.first]
            blocks = [{"name": n, "layers": [[[wire.tensor_to_wire(torch.full((1, 1, B, 2), float(self.first + i)))],
                                              [], "float32"] for i in range(a, b)]} for n in names] \
                if message.export else []
            parts = split_blocks(blocks, self.part)
            self.parts, self.exported = len(parts), len(blocks)
            for i, part in enumerate(parts):
                self.carry.on_message(self, KvKept(message.model, message.handover, names if i == len(parts) - 1
                                                   else [], part, None, i < len(parts) - 1))
        else:
            self.imported, self.extension = message.blocks, message.extension
            self.carry.on_message(self, KvImported(message.model, message.handover,
                                                   [b["name"] for b in message.blocks]))


def _plan(fid: int, first: int, end: int):
    """A stage's plan as KvCarry reads it: fellow f<fid> holds layers first..end-1."""
    return SimpleNamespace(fellow_id=fid, fellow_name=f"f{fid}", first_layer=first, end_layer=end)


class _TwoStages:
    """The leader's side of a handover for model "m" served by 2 stages (layers 0-2 on f1, 3-4 on f2) with one running
    request of three whole blocks and a tail; ``fellows``: each online fellow's (id, first, end, holds[, part])."""

    def __init__(self, *fellows: tuple[int, ...]):
        from swarm.leader.serving.kv_carry import KvCarry

        self.caches = PrefixCaches(None)
        self.caches.reset("m")
        self.index = self.caches.indexes["m"]
        serving = SimpleNamespace(prefix=self.caches, online={})
        self.carry = KvCarry(serving)
        self.fellows = [_Fellow(self.carry, *spec) for spec in fellows]
        serving.online = {f.id: f for f in self.fellows}
        request = SimpleNamespace(rid="r", model="m", prompt=prompt_of(3 * self.index.block + 5), tokens=[7, 8])
        serving.book = SimpleNamespace(by_rid={"r": request}, of_model=lambda name: [request])
        self.model = SimpleNamespace(name="m", ring_id="g1", stages=[SimpleNamespace(plan=_plan(1, 0, 3)),
                                                                      SimpleNamespace(plan=_plan(2, 3, 5))])
        self.names = block_names(request.prompt + request.tokens, self.index.block, 3)


async def test_the_leader_hands_each_new_stage_its_layers_from_the_old_ring_and_carries_what_all_hold():
    """2 stages (layers 0-2 on f1, 3-4 on f2) -> 2 others: f1 keeps its stage narrowed to layers 0-1, f3 takes 2-4 --
    layer 2 from f1's export, 3-4 from f2's, which comes in parts. f2 holds only two of the request's three blocks:
    two are carried, and the third, kept by f1, goes with the index's next plan."""
    ring = _TwoStages((1, 0, 3, 3), (2, 3, 5, 2, 400), (3, 2, 5, 9))
    f1, f2, f3 = ring.fellows
    assert await ring.carry.hand_over(ring.model, [_plan(1, 0, 2), _plan(3, 2, 5)]) == 2
    assert ring.caches.carried["m"] == (ring.index.epoch, ring.names[:2], (1, 3))
    assert f2.parts == 4 and f1.parts == 1
    assert [b["name"] for b in f3.imported] == ring.names[:2]  # the blocks both old stages exported, whole
    assert [wire.tensor_from_wire(layer[0][0])[0, 0, 0, 0].item() for layer in f3.imported[0]["layers"]] == [2, 3, 4]
    assert ring.index.orphans == [ring.names[2]]


@pytest.mark.parametrize(("old_spans", "extends", "kv_cache"), [
    ([(0, 3), (3, 5)], 1, "auto"),  # the last stage extends to the whole model: a first part before it
    ([(0, 1), (1, 3), (3, 5)], 1, "q8"),  # the middle one: a part before it and one after, each with its rows
])
def test_an_extending_stage_keeps_its_blocks_and_joins_the_lacking_layers_rows_at_its_splice(
        tiny_model_dirs, old_spans, extends, kv_cache):
    """A re-layout to one stage whose fellow extends its own stage in place (swarm.stage.resplit): it keeps its
    blocks for the layers it holds; only the rows of the layers it lacks travel, from the old stages that hold them,
    held with the parts loaded beside it; at the splice each block is joined in layer order, and the stage goes on
    from them as a fresh stage of the whole model would: only the tail is computed, the reply is the uninterrupted
    one. A block whose lacking rows did not come goes whole."""
    from swarm.leader.serving.kv_carry import assemble, export_spans, extending, sources
    from swarm.stage.resplit import extend, lacking
    from swarm.stage.slice_load import StageSpec

    model_dir = tiny_model_dirs["qwen3"]
    layers = load_manifest(model_dir).num_layers

    def stage(a: int, b: int) -> StageModel:
        out = StageModel.load_dir(model_dir, StageSpec(a, b, a == 0, b == layers))
        out.kv_cache = kv_cache
        return out

    steps, streamed = 12, 7
    prompt = prompt_of(3 * B + 5, 5)
    cold = LocalRing([stage(0, layers)], prefill_chunk=B)
    want = cold.submit("w", prompt, steps).tokens
    cold.run()

    old = LocalRing([stage(a, b) for a, b in old_spans], prefill_chunk=B)
    index, tokens, seq, count, names = streamed_on(old, prompt, steps, streamed)
    assert count == 4
    assert [keep_running(s, index.epoch, B, [("r", names)]) for s in old.stages] == [names] * len(old_spans)

    fellows = list(range(1, len(old_spans) + 1))
    new = [(0, layers, fellows[extends])]
    pieces = sources(old_spans, fellows, new)
    spans = export_spans(pieces)
    assert extending(old_spans, fellows, new) == {0}
    a, b = old_spans[extends]
    assert [(first, end) for _, first, end in pieces[0]] == [r for r in ((0, a), (b, layers)) if r[0] < r[1]]
    kept = {i: KvKept("m", "x", names, export_blocks(old.stages[i], names, (f - old_spans[i][0], e - old_spans[i][0])))
            for i, (f, e) in spans.items()}
    blocks = wire.unpack(wire.encode(KvImport("m", "x", 0, assemble(pieces[0], spans, kept), [0, layers]))).blocks
    assert [len(block["layers"]) for block in blocks] == [layers - (b - a)] * count

    grown = old.stages[extends]
    parts = [stage(s.first_layer, s.end_layer) for s in lacking(grown.spec, 0, layers, True, True)]
    with pytest.raises(ProtocolError):  # the rows of the lacking layers do not fit the serving stage
        import_blocks(grown, index.epoch, blocks)
    # the last block's lacking rows do not come: it goes whole at the splice, the others are joined
    assert import_blocks(grown, index.epoch, blocks[:-1], parts) == names[:-1]
    assert list(store_of(grown).blocks) == names  # the old ring's blocks stay as they are until the splice
    extend(grown, parts, 0, layers, True, True)
    assert list(store_of(grown).blocks) == names[:-1]
    assert all(len(rows) == layers for rows in store_of(grown).blocks.values())

    index.ended("r")
    index.carry(names[:-1])
    ring = LocalRing([grown], prefill_chunk=B)
    plan = index.plan("r2", seq, BIG)
    assert plan is not None and plan.cached == (count - 1) * B
    rest = ring.submit("r2", seq, steps - streamed, prefix=plan)
    ring.run()
    assert rest.error is None, rest.error
    assert tokens + rest.tokens == want
    assert [p.prefill_tokens for p in ring.protocols] == [len(seq) - (count - 1) * B]


async def test_the_leader_asks_an_extending_fellow_only_for_the_layers_it_lacks_and_carries_what_it_joins():
    """2 stages (layers 0-2 on f1, 3-4 on f2) -> 1 on f2, which extends its stage in place: f2 keeps its own blocks
    and imports only layers 0-2's rows, exported whole by f1, for its extension. f2 kept two of the request's three
    blocks, so two are carried though it imported all three."""
    ring = _TwoStages((1, 0, 3, 3), (2, 3, 5, 2))
    f1, f2 = ring.fellows
    assert await ring.carry.hand_over(ring.model, [_plan(2, 0, 5)]) == 2
    assert ring.caches.carried["m"] == (ring.index.epoch, ring.names[:2], (2,))
    assert f2.extension == [0, 5] and [b["name"] for b in f2.imported] == ring.names
    assert [wire.tensor_from_wire(layer[0][0])[0, 0, 0, 0].item() for layer in f2.imported[0]["layers"]] == [0, 1, 2]
    assert f1.imported == [] and (f1.exported, f2.exported) == (3, 0)  # no stage needs f2's layers
    assert ring.index.orphans == [ring.names[2]]
    # a fellow from before would take the rows as its serving stage's: it is not asked, and nothing is carried
    f2.kv_extension, f2.imported = False, []
    assert await ring.carry.hand_over(ring.model, [_plan(2, 0, 5)]) == 0
    assert f2.imported == [] and "m" not in ring.caches.carried
