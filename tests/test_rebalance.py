"""Live-move proposals over made-up rings (swarm.leader.serving.rebalance): a stage goes to an idle fellow only when the
ring is predicted at least 1.3x faster, with the measured links counted."""

import dataclasses
import types

import pytest

from swarm.config import Settings
from swarm.errors import ConfigError
from swarm.leader.planning.placement import DraftSize, FellowCapacity, ModelSize, place
from swarm.leader.planning.relayout import same_split
from swarm.leader.serving.rebalance import MIN_SPEEDUP, Move, propose, propose_layout
from test_link_placement import GB, HIDDEN, SAME, SIZE, matrix, speed


def two_stage_ring(first: int, second: int):
    return place(SIZE, [FellowCapacity(first, f"pc-{first}", 10 * GB), FellowCapacity(second, f"pc-{second}", 10 * GB)],
                 2, 100)


def test_a_stage_behind_a_far_link_moves_to_a_near_idle_fellow():
    ring = two_stage_ring(1, 3)  # pc-3 is 120 ms from everyone; pc-2 joined since, idle, on the LAN
    hops = matrix(3, p1_3=120, p2_3=120)
    found = propose("m", ring, SIZE, [FellowCapacity(2, "pc-2", 10 * GB)], SAME, hops, HIDDEN)
    assert found is not None and found.moves == [Move(1, 3, "pc-3", 2, "pc-2")]
    assert found.speedup > 5  # 16 ms of layers + two 60 ms hops against 16 ms + a LAN round trip
    assert found.text().startswith("m: move stage 1 from pc-3 to pc-2: about ")


def test_a_much_faster_fellow_takes_the_slow_ones_stage():
    ring = two_stage_ring(1, 2)
    speeds = {1: speed(2, 4), 2: speed(16, 32), 3: speed(1, 2)}  # pc-2 8x slower than pc-1; pc-3 twice as fast
    found = propose("m", ring, SIZE, [FellowCapacity(3, "pc-3", 10 * GB)], speeds, matrix(3), HIDDEN)
    assert found is not None and found.moves == [Move(1, 2, "pc-2", 3, "pc-3")]
    assert found.speedup >= MIN_SPEEDUP


def test_no_move_for_a_small_gain_a_full_fellow_or_an_unknown_speed():
    ring = two_stage_ring(1, 2)
    # an equal fellow on the same LAN: nothing to gain
    assert propose("m", ring, SIZE, [FellowCapacity(3, "pc-3", 10 * GB)], SAME, matrix(3), HIDDEN) is None
    far = two_stage_ring(1, 3)
    hops = matrix(3, p1_3=120, p2_3=120)
    # the near fellow has no room for the stage
    assert propose("m", far, SIZE, [FellowCapacity(2, "pc-2", 1_000)], SAME, hops, HIDDEN) is None
    # a fellow of the ring has not reported its speed
    assert propose("m", far, SIZE, [FellowCapacity(2, "pc-2", 10 * GB)], {2: SAME[2], 3: SAME[3]}, hops,
                   HIDDEN) is None


def test_the_setting_is_checked():
    assert Settings.from_env({}).serve_rebalance == "propose"
    assert Settings.from_env({"SWARM_SERVE_REBALANCE": "auto"}).serve_rebalance == "auto"
    with pytest.raises(ConfigError, match="SWARM_SERVE_REBALANCE is 'sometimes'; use off, propose or auto"):
        Settings.from_env({"SWARM_SERVE_REBALANCE": "sometimes"})


# --- re-layouts: another number of stages or split of the layers (swarm.leader.planning.relayout) ---------------

def relayout(ring, idle, speeds, hops=None, held_free=None, narrowing=(), size=SIZE, extending=()):
    found = propose("m", ring, size, idle, speeds, hops or matrix(4), HIDDEN)
    held = held_free if held_free is not None else {p.fellow_id: 10 * GB for p in ring}
    return propose_layout("m", ring, size, idle, held, speeds, hops or matrix(4), HIDDEN, 100, found,
                          narrowing=narrowing, extending=extending)


def test_a_fast_fellow_with_room_takes_the_whole_model_as_one_stage():
    ring = two_stage_ring(1, 2)
    speeds = {1: speed(2, 4), 2: speed(2, 4), 3: speed(0.5, 1)}  # pc-3 four times faster, and idle
    moves_only = propose("m", ring, SIZE, [FellowCapacity(3, "pc-3", 10 * GB)], speeds, matrix(3), HIDDEN)
    assert moves_only is not None and [m.to_id for m in moves_only.moves] == [3]  # a stage to it: 2x at best
    found, left_out = relayout(ring, [FellowCapacity(3, "pc-3", 10 * GB)], speeds)
    assert found is not None and left_out == []
    assert found.moves == [] and [(p.fellow_id, p.first_layer, p.end_layer) for p in found.layout] == [(3, 0, 8)]
    assert found.proposed_ms_per_token < moves_only.proposed_ms_per_token
    assert found.speedup > 3  # 8 layers at 0.5 ms against 8 at 2 ms and two hops
    assert found.text().startswith("m: re-lay out 2 stages -> 1 stage on pc-3: about ")
    view = found.view()
    assert view["kind"] == "relayout" and view["layout"] == [
        {"index": 0, "fellow_id": 3, "fellow": "pc-3", "layers": [0, 8]}]


def test_a_fast_ring_fellow_with_room_extends_its_stage_to_the_whole_model():
    ring = two_stage_ring(1, 2)
    # pc-1 (in the ring) is the fast one: the best layout is the whole model on it, grown from its stage 0
    speeds = {1: speed(0.5, 1), 2: speed(4, 8), 3: speed(4, 8)}
    found, left_out = relayout(ring, [FellowCapacity(3, "pc-3", 10 * GB)], speeds, narrowing={1, 2},
                               extending={1, 2})
    assert found is not None and left_out == [] and found.moves == []
    assert [(p.fellow_id, p.first_layer, p.end_layer) for p in found.layout] == [(1, 0, 8)]
    assert found.text().startswith("m: re-lay out 2 stages -> 1 stage on pc-1: about ")
    # a version that can narrow its stage in place but not extend it: left out, and why
    found, left_out = relayout(ring, [FellowCapacity(3, "pc-3", 10 * GB)], speeds, narrowing={1, 2})
    assert found is None
    assert left_out[0].startswith("the layout 2 stages -> 1 stage on pc-1 (")
    assert left_out[0].endswith("is left out: pc-1 would extend its stage 0 (layers 0-3) to layers 0-7, and its swarm "
                                "version cannot: run swarm update on it")


def test_an_extension_counts_what_it_loads_beside_the_stage():
    """Only the lacking layers and ends, and the KV cache the stage grows by; shifted, the layers it drops still
    count until the switch (they serve meanwhile)."""
    from swarm.leader.planning.relayout import extension_bytes, why_not_beside

    first, last = place(BIG, [FellowCapacity(1, "pc-1", 900 * MB), FellowCapacity(2, "pc-2", 900 * MB)], 2, 100)
    assert (first.first_layer, first.end_layer) == (0, 6)
    whole = dataclasses.replace(first, end_layer=12, weight_bytes=1300 * MB, kv_bytes=2 * first.kv_bytes)
    assert extension_bytes(BIG, whole, 1, first, 2) == 600 * MB + 50 * MB + first.kv_bytes  # layers 6-11, head
    assert extension_bytes(BIG, whole, 1, last, 2) == 600 * MB + 50 * MB + last.kv_bytes  # layers 0-5, embedding
    shifted = dataclasses.replace(last, first_layer=3, end_layer=9, index=1)  # a middle stage of 3: the head goes
    assert extension_bytes(BIG, shifted, 3, last, 2) == 300 * MB  # layers 3-5 only
    apart = dataclasses.replace(first, first_layer=7, end_layer=12, index=1)
    assert extension_bytes(BIG, apart, 2, first, 2) is None  # no shared layer
    plans = [whole]
    assert why_not_beside(plans, [first, last], {}, {1: 700 * MB}, {1}, BIG, {1}) is None
    assert why_not_beside(plans, [first, last], {}, {1: 600 * MB}, {1}, BIG, {1}) == (
        "pc-1 would extend its stage 0 (layers 0-5) to layers 0-11, loading 0.7 GB beside it, and has 0.6 GB free")
    assert why_not_beside([dataclasses.replace(apart, index=0, first_layer=6)], [first, last], {}, {1: GB}, {1}, BIG,
                          {1}).endswith("which shares no layer with it, and a fellow holds one stage of a model at a "
                                        "time (it may keep, narrow or extend it)")


# 12 layers of 100 MB (the planner's working memory, 200 MB a stage, small beside them)
BIG = ModelSize(layer_bytes=(100_000_000,) * 12, embed_bytes=50_000_000, final_bytes=50_000_000,
                tied_embeddings=False, kv_bytes_per_token_per_layer=100)
MB = 1_000_000


def test_a_third_fellow_joins_and_the_ring_fellows_narrow_their_stages_to_make_three():
    """pc-1 (layers 0-5) and pc-2 (6-11) serve; pc-3, 8x faster, joins with room for 4 layers but not for a whole
    stage (no move): the 3-stage layout pc-1 0-3, pc-3 4-7, pc-2 8-11 loads only pc-3's stage beside the ring, the
    two ring fellows narrowing theirs at the switch."""
    ring = place(BIG, [FellowCapacity(1, "pc-1", 900 * MB), FellowCapacity(2, "pc-2", 900 * MB)], 2, 100)
    assert [(p.first_layer, p.end_layer) for p in ring] == [(0, 6), (6, 12)]
    speeds = {1: speed(4, 8), 2: speed(4, 8), 3: speed(0.5, 1)}
    idle = [FellowCapacity(3, "pc-3", 700 * MB)]
    held = {1: 250 * MB, 2: 250 * MB}  # free beside their stages: each has 900 MB in all
    assert propose("m", ring, BIG, idle, speeds, matrix(3), HIDDEN) is None  # no room on pc-3 for a whole stage
    found, left_out = relayout(ring, idle, speeds, held_free=held, narrowing={1, 2}, size=BIG)
    assert found is not None and left_out == [] and found.moves == []
    assert [(p.fellow_id, p.first_layer, p.end_layer) for p in found.layout] == [(1, 0, 4), (3, 4, 8), (2, 8, 12)]
    assert found.speedup >= MIN_SPEEDUP
    assert found.text().startswith("m: re-lay out 2 stages -> 3 stages on pc-1, pc-3, pc-2: about ")
    # fellows of a version that cannot narrow in place: left out, and why
    found, left_out = relayout(ring, idle, speeds, held_free=held, narrowing={2}, size=BIG)
    assert found is None
    assert left_out[0].startswith("the layout 2 stages -> 3 stages on pc-1, pc-3, pc-2 (")
    assert left_out[0].endswith("is left out: pc-1 would narrow its stage 0 (layers 0-5) to layers 0-3, and its swarm "
                                "version cannot: run swarm update on it")


def test_a_ring_fellow_may_narrow_into_a_sub_range_but_not_into_a_part_it_lacks():
    from swarm.leader.planning.relayout import narrows

    first, last = place(BIG, [FellowCapacity(1, "pc-1", 900 * MB), FellowCapacity(2, "pc-2", 900 * MB)], 2, 100)

    def stage(index: int, layers: tuple[int, int]):
        return dataclasses.replace(first, index=index, first_layer=layers[0], end_layer=layers[1])

    assert narrows(stage(0, (0, 4)), 3, first, 2)  # layers 0-3 of 0-5, first as it was
    assert narrows(stage(1, (2, 5)), 3, first, 2)  # a middle stage: the embedding goes
    assert not narrows(stage(2, (3, 6)), 3, first, 2)  # last: it lacks the head
    assert not narrows(stage(1, (4, 8)), 3, first, 2)  # layers it does not hold
    assert narrows(stage(2, (8, 12)), 3, last, 2) and narrows(stage(1, (6, 8)), 3, last, 2)  # the head kept or not
    assert not narrows(stage(0, (6, 8)), 1, last, 2)  # first: it lacks the embedding


def test_whole_stage_moves_win_over_a_resplit_that_is_no_faster():
    ring = two_stage_ring(1, 2)
    speeds = {1: speed(4, 8), 2: speed(4, 8), 3: speed(0.5, 1), 4: speed(0.5, 1)}
    # neither has room for the whole model: the fastest layout is the ring as it is split, on them
    idle = [FellowCapacity(3, "pc-3", 206_000_000), FellowCapacity(4, "pc-4", 207_000_000)]
    found, left_out = relayout(ring, idle, speeds)
    assert found is not None and found.layout is None and {m.to_id for m in found.moves} == {3, 4}
    assert found.speedup > 3 and left_out == [] and found.view()["kind"] == "move"


def test_no_relayout_on_an_equal_pool_or_without_a_speed():
    ring = two_stage_ring(1, 2)
    assert relayout(ring, [FellowCapacity(3, "pc-3", 10 * GB)], SAME) == (None, [])
    speeds = {1: speed(2, 4), 3: speed(0.5, 1)}  # pc-2 of the ring has not reported its speed
    assert relayout(ring, [FellowCapacity(3, "pc-3", 10 * GB)], speeds) == (None, [])


# --- applying a re-layout (swarm.leader.serving.relayout), over a leader's serving state made up in memory ----------

class FakeFellow:
    def __init__(self, fellow_id: int):
        self.id, self.name, self.posted = fellow_id, f"pc-{fellow_id}", []
        self.hardware = types.SimpleNamespace(serving_free_bytes=lambda device: 5 * GB)

    def post(self, message: dict) -> None:
        self.posted.append(message)


def serving_state(fellows: int, linked: bool = True):
    """A model ready over pc-1 and pc-2 (two_stage_ring), ``fellows`` online; linking a ring makes it ready at once
    (``linked``) or never."""
    from swarm.leader.serving.models import ModelServing, ModelStatus, StageState

    model = ModelServing("m", "load-1", [StageState(p, phase="ready", ready=True, linked=True, free_bytes=GB)
                                         for p in two_stage_ring(1, 2)], status=ModelStatus.READY, size=SIZE)
    online = {i: FakeFellow(i) for i in range(1, fellows + 1)}
    interrupted: list[str] = []

    async def next_token(m):
        return None

    async def hand_over(m, plans):  # the running requests' KV (swarm.leader.serving.kv_carry), before the switch
        interrupted.append(f"kv to {[(p.fellow_id, p.first_layer, p.end_layer) for p in plans]}")
        return 0

    def link(m):
        if linked:
            m.status = ModelStatus.READY
            m.notify()

    serving = types.SimpleNamespace(
        hub=types.SimpleNamespace(online=online), models={"m": model}, settings=Settings.from_env({}),
        drains=types.SimpleNamespace(next_token=next_token, kv=types.SimpleNamespace(hand_over=hand_over)),
        recovery=types.SimpleNamespace(link=link),
        book=types.SimpleNamespace(interrupt=lambda name: interrupted.append(name) or []),
        perform=lambda actions: None)
    return serving, model, online, interrupted


async def test_a_relayout_loads_beside_switches_and_unloads_the_old_stages(monkeypatch):
    import trio

    from swarm import control_messages as cm
    from swarm.leader.serving import relayout

    monkeypatch.setattr(relayout, "load_message", lambda model, i, cover=False: {
        "t": "load", "model": model.name, "stage": i, "num_stages": len(model.stages), "cover": cover})
    serving, model, online, interrupted = serving_state(3)
    relayouts = relayout.Relayouts(serving)
    one = place(SIZE, [FellowCapacity(3, "pc-3", 10 * GB)], 1, 100)
    async with trio.open_nursery() as nursery:
        done: list[str] = []

        async def run():
            done.append(await relayouts.apply(model, one))

        nursery.start_soon(run)
        await trio.sleep(0.01)
        # pc-3 loads the whole model beside the ring, which serves on meanwhile
        assert online[3].posted == [{"t": "load", "model": "m", "stage": 0, "num_stages": 1, "cover": True}]
        assert [s.plan.fellow_id for s in model.stages] == [1, 2] and interrupted == []
        assert relayouts.on_stage_event(model, online[3], cm.LoadProgress("m", "l", "load", 0.5))
        assert not relayouts.on_stage_event(model, online[1], cm.Loaded("m", "l"))  # not one of the next stages
        relayouts.on_stage_event(model, online[3], cm.Loaded("m", "l"))
        model.notify()
    assert done == ["m: 2 stages -> 1 stage on pc-3: re-laid out"]
    # the running requests' KV went to the new ring, then they went on from what they had streamed
    assert interrupted == ["kv to [(3, 0, 8)]", "m"]
    assert [(s.plan.fellow_id, s.plan.first_layer, s.plan.end_layer) for s in model.stages] == [(3, 0, 8)]
    assert model.stages[0].free_bytes == 5 * GB + one[0].weight_bytes and model.relayout == []
    assert online[1].posted == online[2].posted == [cm.Unload("m")]


async def test_a_relayout_whose_stage_fails_to_load_leaves_the_ring_as_it_was(monkeypatch):
    import trio

    from swarm import control_messages as cm
    from swarm.leader.serving import relayout

    monkeypatch.setattr(relayout, "load_message", lambda model, i, cover=False: {"t": "load", "stage": i})
    serving, model, online, interrupted = serving_state(4)
    relayouts = relayout.Relayouts(serving)
    two = place(SIZE, [FellowCapacity(3, "pc-3", 10 * GB), FellowCapacity(4, "pc-4", 5 * GB)], 2, 100)
    assert [(p.first_layer, p.end_layer) for p in two] == [(0, 5), (5, 8)]  # split by their memory: a re-layout
    async with trio.open_nursery() as nursery:
        done: list[str] = []

        async def run():
            done.append(await relayouts.apply(model, two))

        nursery.start_soon(run)
        await trio.sleep(0.01)
        relayouts.on_stage_event(model, online[3], cm.Loaded("m", "l"))
        relayouts.on_stage_event(model, online[4], cm.LoadFailed("m", "l", "out of memory"))
        model.notify()
    assert done == ["m: 2 stages -> 2 stages on pc-3, pc-4 not done: stage 1 did not load on pc-4: out of memory"]
    assert [s.plan.fellow_id for s in model.stages] == [1, 2] and model.relayout == [] and interrupted == []
    assert online[3].posted[-1] == online[4].posted[-1] == cm.Unload("m")  # the new stages go
    assert online[1].posted == online[2].posted == []  # the old ring serves on


async def test_a_relayout_that_extends_a_ring_fellows_stage_loads_what_it_lacks_beside_it(monkeypatch):
    """2 stages -> 1 stage on pc-1: pc-1 loads what its stage lacks (Load.extend), its load events are the re-layout's
    (not its serving stage's), the link gives it the whole model, and pc-2 unloads; given up, what pc-1 loaded goes
    and its stage serves on."""
    import trio

    from swarm import control_messages as cm
    from swarm.leader.serving import relayout

    monkeypatch.setattr(relayout, "load_message", lambda model, i, cover=False, extend=False: {
        "t": "load", "stage": i, "num_stages": len(model.stages), "extend": extend})
    one = place(SIZE, [FellowCapacity(1, "pc-1", 10 * GB)], 1, 100)
    for fails in (False, True):
        serving, model, online, interrupted = serving_state(2)
        relayouts = relayout.Relayouts(serving)
        async with trio.open_nursery() as nursery:
            done: list[str] = []

            async def run(relayouts=relayouts, model=model, done=done):
                done.append(await relayouts.apply(model, one))

            nursery.start_soon(run)
            await trio.sleep(0.01)
            assert online[1].posted == [{"t": "load", "stage": 0, "num_stages": 1, "extend": True}]
            assert relayouts.extends(model, 1) and not relayouts.extends(model, 2)
            assert relayouts.on_stage_event(model, online[1], cm.LoadProgress("m", "l", "download", 0.5))
            assert model.stages[0].phase == "ready" and model.relayout[0].phase == "download"
            relayouts.on_stage_event(model, online[1], cm.LoadFailed("m", "l", "no room") if fails else
                                     cm.Loaded("m", "l"))
            model.notify()
        assert not relayouts.extends(model, 1)
        if fails:
            assert done == ["m: 2 stages -> 1 stage on pc-1 not done: stage 0 did not load on pc-1: no room"]
            assert [s.plan.fellow_id for s in model.stages] == [1, 2] and interrupted == []
            assert online[1].posted[-1] == cm.DropExtension("m") and online[2].posted == []
        else:
            assert done == ["m: 2 stages -> 1 stage on pc-1: re-laid out"]
            assert interrupted == ["kv to [(1, 0, 8)]", "m"]  # the KV first, then the switch
            assert [s.plan for s in model.stages] == one and model.stages[0].free_bytes == GB
            assert online[1].posted[1:] == [] and online[2].posted == [cm.Unload("m")]


# --- a model served with a draft model (SWARM_SERVE_DRAFT_MODEL): its last stage holds the draft model too ----------

# layers of 100 MB, so that the stages' working memory (200 MB each) does not swamp their split
DRAFTED = ModelSize(layer_bytes=(100 * MB,) * 8, embed_bytes=50 * MB, final_bytes=MB, tied_embeddings=False,
                kv_bytes_per_token_per_layer=1000)
DRAFT = DraftSize(150 * MB, 2000)
FAST = {1: speed(4, 8), 2: speed(4, 8), 3: speed(0.5, 1), 4: speed(0.5, 1)}  # pc-3 and pc-4 eight times faster


def drafted_ring():
    ring = place(DRAFTED, [FellowCapacity(1, "pc-1", 10 * GB), FellowCapacity(2, "pc-2", 10 * GB)], 2, 100, draft=DRAFT)
    assert ring[-1].draft_bytes == DRAFT.weight_bytes and ring[0].draft_bytes == 0
    return ring


def relayout_drafted(idle, drafts=None):
    ring = drafted_ring()
    found = propose("m", ring, DRAFTED, idle, FAST, matrix(4), HIDDEN)
    return propose_layout("m", ring, DRAFTED, idle, {1: 9 * GB, 2: 9 * GB}, FAST, matrix(4), HIDDEN, 100, found,
                          DRAFT, drafts)


def test_a_drafted_models_relayout_puts_the_draft_model_on_its_new_last_stage():
    # neither fast fellow has room for the whole model (1.05 GB); pc-4 has room for the last stage and the draft model
    idle = [FellowCapacity(3, "pc-3", 560 * MB), FellowCapacity(4, "pc-4", 1040 * MB)]
    found, left_out = relayout_drafted(idle)
    assert found is not None and found.layout is not None and found.moves == [], (found, left_out)
    assert {p.fellow_id for p in found.layout} == {3, 4} and not same_split(found.layout, drafted_ring())
    last = found.layout[-1]
    assert (last.draft_bytes, last.draft_kv_per_token) == (DRAFT.weight_bytes, DRAFT.kv_bytes_per_token)
    assert last.kv_bytes == (1000 * (last.end_layer - last.first_layer) + DRAFT.kv_bytes_per_token) * 100
    assert last.need_bytes <= {3: 560 * MB, 4: 1040 * MB}[last.fellow_id]
    assert all(p.draft_bytes == p.draft_kv_per_token == 0 for p in found.layout[:-1])
    assert found.speedup > 3  # both stages on fast fellows; a move could take only one (the other has no room)
    # a fellow of an earlier version cannot hold the draft model: a layout with it last is left out, and told
    found, left_out = relayout_drafted(idle, drafts={1, 2, 3})
    assert found is not None and found.layout is not None and found.layout[-1].fellow_id == 3
    assert found.layout[-1].draft_bytes == DRAFT.weight_bytes
    assert any(note.endswith("pc-4 would hold the last stage and runs a version without draft models")
               for note in found.left_out), found.left_out


def test_a_layout_whose_last_fellow_has_no_room_for_the_draft_model_is_left_out_and_told_why():
    # without the draft model the layers split 4/4 over pc-3 and pc-4; with it, neither order fits
    idle = [FellowCapacity(3, "pc-3", 660 * MB), FellowCapacity(4, "pc-4", 660 * MB)]
    found, _ = relayout_drafted(idle)
    assert found is not None and found.layout is None  # stage 0 alone moves (stage 1 and its draft model fit nowhere)
    assert [(m.index, m.to_id) for m in found.moves] == [(0, 3)]
    assert found.left_out[0].startswith("the layout 2 stages -> 2 stages on pc-3, pc-4 (")
    assert found.left_out[0].endswith("is left out: pc-4 would hold the last stage and has no room for the draft "
                                      "model beside it (0.2 GB with its KV cache at 100 tokens; 0.7 GB free)")


def test_a_drafted_model_laid_out_on_one_fellow_has_no_draft_model_as_a_load_on_one():
    found, _ = relayout_drafted([FellowCapacity(3, "pc-3", 10 * GB)])
    assert found is not None and [(p.fellow_id, p.draft_bytes) for p in found.layout] == [(3, 0)]


@pytest.mark.parametrize("stages", [2, 1])
async def test_a_drafted_models_new_last_stage_loads_the_draft_model_beside_the_ring(monkeypatch, stages):
    """Over two stages the new last fellow is sent the draft model (and may fetch its files) and keeps it after the
    switch; on one stage the model goes on by prompt lookup alone, as a load on one fellow does."""
    import trio

    from swarm import control_messages as cm
    from swarm.leader.serving import relayout

    monkeypatch.setattr(relayout, "load_message", lambda model, i, cover=False: {
        "t": "load", "stage": i, "draft": (model.draft or {}).get("model") if i == len(model.stages) - 1 else None})
    serving, model, online, _ = serving_state(4)
    model.draft = {"model": "tiny-draft", "files": [{"path": "weights/layer_000.safetensors"}]}
    small = DraftSize(MB, 10)
    fellows = [FellowCapacity(3, "pc-3", 10 * GB), FellowCapacity(4, "pc-4", 5 * GB)][:stages]
    plans = place(SIZE, fellows, stages, 100, draft=small if stages > 1 else None)
    relayouts = relayout.Relayouts(serving)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(relayouts.apply, model, plans)
        await trio.sleep(0.01)
        if stages == 2:
            assert online[3].posted == [{"t": "load", "stage": 0, "draft": None}]
            assert online[4].posted == [{"t": "load", "stage": 1, "draft": "tiny-draft"}]
            assert model.draft_files_for(4) == {"weights/layer_000.safetensors"} and model.draft_files_for(3) == set()
        else:
            assert online[3].posted == [{"t": "load", "stage": 0, "draft": None}]
        for fellow_id in range(3, 3 + stages):
            relayouts.on_stage_event(model, online[fellow_id], cm.Loaded("m", "l"))
        model.notify()
    assert [s.plan.fellow_id for s in model.stages] == list(range(3, 3 + stages))
    assert model.draft == (None if stages == 1 else {"model": "tiny-draft",
                                                     "files": [{"path": "weights/layer_000.safetensors"}]})


def test_the_served_context_of_a_drafted_ring_is_the_one_it_was_placed_for():
    from swarm.leader.serving.models import ModelServing, StageState
    from swarm.leader.serving.relayout import served_context

    settings = Settings.from_env({})
    first, last = drafted_ring()
    # the last stage's KV cache counts the draft model's too: 100 tokens, not 150 (stage 0's cache told apart)
    model = ModelServing("m", "l", [StageState(dataclasses.replace(first, kv_bytes=0)), StageState(last)], size=DRAFTED)
    assert served_context(model, settings) == 100
    model.context_tokens = 4096  # its load's served context comes first
    assert served_context(model, settings) == 4096


def test_a_fellow_keeping_the_very_last_stage_keeps_its_draft_model():
    # stage 0 splits over two fast idle fellows (neither has room for it whole); pc-2 keeps layers 4-7 and the draft
    ring = drafted_ring()
    speeds = {**FAST, 2: speed(0.5, 1), 5: speed(0.5, 1)}
    idle = [FellowCapacity(3, "pc-3", 600 * MB), FellowCapacity(5, "pc-5", 600 * MB)]
    # pc-2's free memory beside its stage: the split gives it as much room as the two new fellows together
    held_free = {1: 9 * GB, 2: 1200 * MB + DRAFT.weight_bytes + 100 * DRAFT.kv_bytes_per_token - ring[1].need_bytes
                 + 200 * MB}
    found, left_out = propose_layout("m", ring, DRAFTED, idle, held_free, speeds, matrix(5), HIDDEN, 100, None, DRAFT)
    assert found is not None and found.layout is not None, left_out
    assert [p.fellow_id for p in found.layout][-1] == 2 and {p.fellow_id for p in found.layout} == {2, 3, 5}
    assert found.layout[-1] == dataclasses.replace(ring[1], index=2)  # the very stage it holds, its draft model too


async def test_a_relayout_that_narrows_the_ring_fellows_loads_only_the_new_stage_and_links_their_new_layers(
        monkeypatch):
    import trio

    from swarm import control_messages as cm
    from swarm.leader.planning.placement import place_in_order
    from swarm.leader.serving import relayout
    from swarm.leader.serving.models import link_message

    monkeypatch.setattr(relayout, "load_message", lambda model, i, cover=False: {"t": "load", "stage": i})
    serving, model, online, interrupted = serving_state(3)
    relayouts = relayout.Relayouts(serving)
    three = place_in_order(SIZE, [FellowCapacity(i, f"pc-{i}", 10 * GB) for i in (1, 3, 2)], 100)
    assert [(p.fellow_id, p.first_layer, p.end_layer) for p in three] == [(1, 0, 3), (3, 3, 5), (2, 5, 8)]
    async with trio.open_nursery() as nursery:
        done: list[str] = []

        async def run():
            done.append(await relayouts.apply(model, three))

        nursery.start_soon(run)
        await trio.sleep(0.01)
        assert online[3].posted == [{"t": "load", "stage": 1}] and online[1].posted == online[2].posted == []
        assert [(s.plan.first_layer, s.plan.end_layer) for s in model.stages] == [(0, 4), (4, 8)]  # serving as it was
        relayouts.on_stage_event(model, online[3], cm.Loaded("m", "l"))
        model.notify()
    assert done == ["m: 2 stages -> 3 stages on pc-1, pc-3, pc-2: re-laid out"]
    assert interrupted == ["kv to [(1, 0, 3), (3, 3, 5), (2, 5, 8)]", "m"]  # the KV first, then the switch
    assert [s.plan for s in model.stages] == three
    # the narrowed stages' free memory as placed: their budget counts the weights they dropped
    assert [s.free_bytes for s in model.stages] == [GB, 5 * GB + three[1].weight_bytes, GB]
    assert model.budget(serving.settings).tokens > 0
    assert online[1].posted == online[2].posted == []  # kept: nothing unloads
    # the link tells a fellow that says it can narrow its new layers; one that cannot is sent none (it never gets a
    # narrowing: swarm.leader.planning.relayout)
    model.ring_id, model.hop_ids = "g1", ["h0", "h1", "h2"]
    for i, conn in online.items():
        conn.narrowing, conn.serve_host, conn.serve_port, conn.public_key = i != 2, None, None, b"k" * 32
        conn.extending = False
    first, last = link_message(model, 0, online, "relay"), link_message(model, 2, online, "relay")
    assert (first.first_layer, first.end_layer) == (0, 3) and (last.first_layer, last.end_layer) == (None, None)
