"""Live-move proposals over made-up rings (swarm.leader.serving.rebalance): a stage goes to an idle fellow only when the
ring is predicted at least 1.3x faster, with the measured links counted."""

import pytest

from swarm.config import Settings
from swarm.errors import ConfigError
from swarm.leader.planning.placement import FellowCapacity, place
from swarm.leader.serving.rebalance import MIN_SPEEDUP, Move, propose
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
