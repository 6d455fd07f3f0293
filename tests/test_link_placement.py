"""Link-aware placement over made-up pools and link matrices (swarm.leader.planning.link_placement): the ring's order,
which fellows it leaves out and why, and that nothing moves without measurements or on a LAN."""

import pytest

from swarm.leader.planning.link_placement import arrange, link_hops
from swarm.leader.planning.placement import FellowCapacity, ModelSize, place
from swarm.leader.planning.planner import Hop, layer_speed

# Eight layers of 1 MB, an untied head of 10 kB; every fellow decodes a layer in 2 ms (1 ms + 1e-6 ms/byte).
SIZE = ModelSize(layer_bytes=(1_000_000,) * 8, embed_bytes=500_000, final_bytes=10_000, tied_embeddings=False,
                 kv_bytes_per_token_per_layer=100)
GB = 1_000_000_000
HIDDEN = 2304  # bytes of a hidden state per token (576 floats)


def speed(ms_small: float, ms_large: float):
    return layer_speed({"prefill_tokens": 1000, "points": [
        {"weight_bytes": 1_000_000, "decode_ms": ms_small, "prefill_ms": 100 * ms_small},
        {"weight_bytes": 3_000_000, "decode_ms": ms_large, "prefill_ms": 100 * ms_large}]})


def pool(n: int, free: int = 10 * GB) -> list[FellowCapacity]:
    return [FellowCapacity(i, f"pc-{i}", free) for i in range(1, n + 1)]


def matrix(n: int, rtt_ms: float = 1.0, **slow: float) -> dict[tuple[int, int], Hop]:
    """Every pair at ``rtt_ms`` but those named like ``p1_3=120`` (pc-1 <-> pc-3)."""
    hops = {(a, b): Hop(rtt_ms, True) for a in range(1, n + 1) for b in range(1, n + 1) if a != b}
    for pair, rtt in slow.items():
        a, b = (int(x) for x in pair[1:].split("_"))
        hops[(a, b)] = hops[(b, a)] = Hop(rtt, True)
    return hops


def ring(plans) -> list[int]:
    return [p.fellow_id for p in plans]


def edges(plans) -> set[frozenset[int]]:
    ids = ring(plans)
    return {frozenset((ids[i], ids[(i + 1) % len(ids)])) for i in range(len(ids))}


SAME = {i: speed(2, 4) for i in range(1, 7)}


def test_a_far_fellow_is_left_out_and_the_plan_says_why():
    fellows = pool(3)
    baseline = place(SIZE, fellows, 3, 100)
    # pc-3 is 120 ms away from both others (60 ms each way); pc-1 <-> pc-2 a LAN's 1 ms
    got = arrange(SIZE, fellows, baseline, SAME, matrix(3, p1_3=120, p2_3=120), HIDDEN, 100, choose_count=True)
    assert ring(got.plans) in ([1, 2], [2, 1])
    assert [p.first_layer for p in got.plans] == [0, 4] and got.plans[-1].end_layer == 8
    # with pc-3 a token pays two 60 ms hops on top of 16 ms of layers; without it one LAN hop each way
    assert got.link_blind_ms_per_token == pytest.approx(16 + 60 + 60 + 0.5 + HIDDEN / 12_500_000 * 1e3, abs=0.5)
    assert got.ms_per_token == pytest.approx(16 + 1.0 + HIDDEN / 12_500_000 * 1e3, abs=0.5)
    why = (f"pc-3 left out: 120 ms to pc-1 (a token takes {got.link_blind_ms_per_token:.0f} ms with it, "
           f"{got.ms_per_token:.0f} ms without)")
    assert got.left_out == [why]


def test_a_lan_keeps_every_fellow_in_the_link_blind_order():
    fellows = pool(3)
    baseline = place(SIZE, fellows, 3, 100)
    got = arrange(SIZE, fellows, baseline, SAME, matrix(3, rtt_ms=1.5), HIDDEN, 100, choose_count=True)
    assert got.plans == baseline and got.left_out == []


def test_no_measurements_and_no_speeds_place_as_before():
    fellows = pool(3)
    baseline = place(SIZE, fellows, 3, 100)
    assert arrange(SIZE, fellows, baseline, SAME, {}, HIDDEN, 100, True).plans == baseline
    # pc-3 has not reported its speed yet: nothing to weigh its layers by
    speeds = {1: SAME[1], 2: SAME[2]}
    far = matrix(3, p1_3=120, p2_3=120)
    assert arrange(SIZE, fellows, baseline, speeds, far, HIDDEN, 100, True).plans == baseline


def test_the_ring_order_avoids_slow_links():
    """Four fellows, pc-1 <-> pc-2 and pc-3 <-> pc-4 on slow links: the link-blind ring 1-2-3-4 crosses both; the
    chosen one none."""
    fellows = pool(4)
    baseline = place(SIZE, fellows, 4, 100)
    hops = matrix(4, p1_2=80, p3_4=80)
    got = arrange(SIZE, fellows, baseline, SAME, hops, HIDDEN, 100, choose_count=False)
    assert sorted(ring(got.plans)) == [1, 2, 3, 4] and got.left_out == []
    assert frozenset((1, 2)) not in edges(got.plans) and frozenset((3, 4)) not in edges(got.plans)
    assert got.ms_per_token < got.link_blind_ms_per_token - 70


def test_a_given_number_of_stages_picks_the_near_fellows():
    """Two stages asked of three fellows: memory alone picks the two with most free memory (pc-3 among them), the
    links the two near ones."""
    fellows = [FellowCapacity(1, "pc-1", 8 * GB), FellowCapacity(2, "pc-2", 9 * GB), FellowCapacity(3, "pc-3", 10 * GB)]
    baseline = place(SIZE, fellows, 2, 100)
    assert ring(baseline) == [2, 3]
    got = arrange(SIZE, fellows, baseline, SAME, matrix(3, p1_3=140, p2_3=140), HIDDEN, 100, choose_count=False)
    assert sorted(ring(got.plans)) == [1, 2]
    assert got.left_out[0].startswith("pc-3 left out: 140 ms to pc-2")


def test_a_far_fellow_the_model_needs_stays():
    """The layers fill every fellow's memory: leaving pc-3 out would not hold the model, so it stays."""
    big = ModelSize(layer_bytes=(1 * GB,) * 6, embed_bytes=10_000_000, final_bytes=10_000, tied_embeddings=False,
                    kv_bytes_per_token_per_layer=100)
    fellows = pool(3, free=int(2.5 * GB))
    baseline = place(big, fellows, 3, 100)
    got = arrange(big, fellows, baseline, SAME, matrix(3, p1_3=120, p2_3=120), HIDDEN, 100, choose_count=True)
    assert sorted(ring(got.plans)) == [1, 2, 3] and got.left_out == []


def test_a_slow_computing_fellow_on_a_lan_stays():
    """pc-3 computes 4x slower, but its links are a LAN's: the ring is slower with it, not because of its links, so
    it keeps its stage (it still adds a stage's worth of chats at once)."""
    fellows = pool(3)
    baseline = place(SIZE, fellows, 3, 100)
    speeds = {1: SAME[1], 2: SAME[2], 3: speed(8, 16)}
    got = arrange(SIZE, fellows, baseline, speeds, matrix(3), HIDDEN, 100, choose_count=True)
    assert 3 in ring(got.plans) and got.left_out == []


# A toy model: four layers of 100 kB, ~1 ms of compute each -- a ring's hops then
# weigh more than its layers, where noise on a link matters most.
TINY = ModelSize(layer_bytes=(100_000,) * 4, embed_bytes=50_000, final_bytes=1_000, tied_embeddings=False,
                 kv_bytes_per_token_per_layer=100)


def test_lan_jitter_leaves_no_fellow_out_of_a_tiny_models_ring():
    """A jittery LAN (or a busy machine's loopback, least of its keepalives: swarm.mesh.hop.RTT_WINDOW) at 6.5 ms a
    round trip: a ring of two over such hops is slower than one fellow alone by two such hops, yet nothing a LAN's
    noise could not make -- both stay, and the plan still shows the measured figures."""
    fellows = pool(2)
    baseline = place(TINY, fellows, 2, 100)
    got = arrange(TINY, fellows, baseline, SAME, matrix(2, rtt_ms=6.5), HIDDEN, 100, choose_count=True)
    assert got.plans == baseline and got.left_out == []
    assert got.ms_per_token == got.link_blind_ms_per_token > 6.5  # two hops of half a measured 6.5 ms in the figure


def test_a_noisy_pair_does_not_reorder_the_ring():
    """Four fellows, one pair of them at a jittery 6.5 ms and the rest at 1 ms: the link-blind ring crosses the noisy
    pair, and stays as it is."""
    fellows = pool(4)
    baseline = place(TINY, fellows, 4, 100)
    got = arrange(TINY, fellows, baseline, SAME, matrix(4, p1_2=6.5), HIDDEN, 100, choose_count=False)
    assert got.plans == baseline and got.left_out == []


def test_a_link_past_the_noise_still_leaves_its_fellow_out():
    """The same tiny model with the far fellow 30 ms round trip from both others: 10 ms a hop past any LAN's noise,
    twice a token -- left out, the sentence giving the measured figures."""
    fellows = pool(3)
    baseline = place(TINY, fellows, 3, 100)
    got = arrange(TINY, fellows, baseline, SAME, matrix(3, p1_3=30, p2_3=30), HIDDEN, 100, choose_count=True)
    assert sorted(ring(got.plans)) == [1, 2]
    why = (f"pc-3 left out: 30 ms to pc-1 (a token takes {got.link_blind_ms_per_token:.0f} ms with it, "
           f"{got.ms_per_token:.0f} ms without)")
    assert got.left_out == [why]
    assert got.link_blind_ms_per_token - got.ms_per_token > 25  # measured: two 15 ms hops one way, for 0.5 ms


def test_judged_hops_take_the_noise_off_but_never_go_under_a_lan():
    from swarm.leader.planning.link_placement import LAN_NOISE_RTT_MS, judged_hop
    from swarm.leader.planning.planner import ASSUMED_RTT_MS

    assert judged_hop(Hop(0.5, True)).rtt_ms == 0.5  # a quiet loopback stays what it is
    assert judged_hop(Hop(6.5, True)).rtt_ms == ASSUMED_RTT_MS
    assert judged_hop(Hop(120.0, True, "direct", 1e6)) == Hop(120.0 - LAN_NOISE_RTT_MS, True, "direct", 1e6)


def test_a_hop_reports_the_least_of_its_latest_round_trips():
    """A pong late for a busy peer's event loop does not make the hop's figure: the least of the latest RTT_WINDOW
    pongs is, and a link that really slows shows once its faster pongs have left the window."""
    from swarm.mesh.hop import RTT_WINDOW, RoundTrips

    trips = RoundTrips()
    assert trips.least is None
    for seconds in (0.015, 0.0005, 0.012):
        trips.add(seconds)
    assert trips.least == 0.0005
    for _ in range(RTT_WINDOW):
        trips.add(0.040)
    assert trips.least == 0.040


def test_probe_figures_become_hops():
    links = {(1, 2): {"path": "direct", "rtt_ms": 120.5, "mbps": 80.0},
             (2, 1): {"path": "relay", "rtt_ms": None, "mbps": None, "error": "no serving port to dial"}}
    assert link_hops(links) == {(1, 2): Hop(120.5, True, "direct", 10_000_000.0)}


def test_a_pair_keeps_the_least_round_trip_of_its_latest_rounds():
    """One probe that met a busy fellow (a model loading, a loaded machine) reads high; the matrix keeps the least round
    trip of the pair's latest rounds over the same path, so one slow round does not leave a fellow out of a ring."""
    import types

    import trio

    from swarm.control_links import LinkFigures, LinkReport
    from swarm.leader.fleet.link_matrix import WINDOW_ROUNDS, LinkMatrix

    def report(**figures) -> LinkReport:
        return LinkReport([LinkFigures(fellow_id=2, **figures)])

    a, b = (types.SimpleNamespace(id=i, pool_id=1) for i in (1, 2))
    matrix = LinkMatrix(types.SimpleNamespace(hub=types.SimpleNamespace(online={1: a, 2: b})))

    async def rounds():
        for rtt, mbps in [(1.5, 90.0), (152.0, 3.0), (2.0, 80.0)]:
            matrix.on_report(a, report(path="direct", rtt_ms=rtt, mbps=mbps))
        assert (matrix.links[(1, 2)]["rtt_ms"], matrix.links[(1, 2)]["mbps"]) == (1.5, 90.0)
        assert matrix.links[(1, 2)]["last_rtt_ms"] == 2.0 and matrix.links[(1, 2)]["rounds"] == 3
        for _ in range(WINDOW_ROUNDS):  # the link really did get slower: after a window of rounds, it says so
            matrix.on_report(a, report(path="direct", rtt_ms=60.0, mbps=10.0))
        assert matrix.links[(1, 2)]["rtt_ms"] == 60.0
        # another path starts afresh: the relay's round trip is not the direct link's
        matrix.on_report(a, report(path="relay", rtt_ms=9.0, mbps=5.0))
        assert (matrix.links[(1, 2)]["rtt_ms"], matrix.links[(1, 2)]["rounds"]) == (9.0, 1)
        # a failed probe leaves the pair unmeasured until the next one that gets through
        matrix.on_report(a, report(path="relay", error="timed out"))
        assert matrix.links[(1, 2)]["rtt_ms"] is None and matrix.links[(1, 2)]["error"] == "timed out"
        assert link_hops(matrix.links) == {}

    trio.run(rounds)
