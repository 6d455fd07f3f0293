"""Live-move proposals over made-up rings (swarm.leader.serving.rebalance): a stage goes to an idle fellow only when the
ring is predicted at least 1.3x faster, with the measured links counted."""

import types

import pytest

from swarm.config import Settings
from swarm.errors import ConfigError
from swarm.leader.planning.placement import FellowCapacity, place
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

def relayout(ring, idle, speeds, hops=None, held_free=None):
    found = propose("m", ring, SIZE, idle, speeds, hops or matrix(4), HIDDEN)
    held = held_free if held_free is not None else {p.fellow_id: 10 * GB for p in ring}
    return propose_layout("m", ring, SIZE, idle, held, speeds, hops or matrix(4), HIDDEN, 100, found)


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


def test_a_faster_layout_that_would_load_beside_a_stage_of_the_ring_is_left_out_and_told_why():
    ring = two_stage_ring(1, 2)
    # pc-1 (in the ring) is the fast one: the best layout is the whole model on it, but it holds stage 0 already
    speeds = {1: speed(0.5, 1), 2: speed(4, 8), 3: speed(4, 8)}
    found, left_out = relayout(ring, [FellowCapacity(3, "pc-3", 10 * GB)], speeds)
    assert found is None
    assert left_out[0].startswith("the layout 2 stages -> 1 stage on pc-1 (")
    assert left_out[0].endswith("is left out: pc-1 would load stage 0 (layers 0-7, 0.2 GB) beside its stage 0 of the "
                                "same model, and a fellow holds one stage of a model at a time")
    # counted what it holds: with too little free memory for both, that is what is said
    # (its free memory and what its stage holds would take the whole model, its free memory alone would not)
    _, left_out = relayout(ring, [FellowCapacity(3, "pc-3", 10 * GB)], speeds, held_free={1: 205_000_000, 2: GB})
    assert left_out[0].endswith("pc-1 would load stage 0 (layers 0-7, 0.2 GB) beside its stage 0 (0.0 GB held) and "
                                "has 0.2 GB free")


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
