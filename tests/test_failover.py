"""Failover decisions as plain functions over made-up fleets: who takes a lost stage, which stage a standby covers,
what a cut-off request is sent again as."""

from __future__ import annotations

from swarm.leader.planning.failover import Candidate, choose_cover, choose_replacement, resume, why_no_replacement
from swarm.leader.planning.placement import GB, OVERHEAD_BYTES, StagePlan


def plan(index=1, fellow_id=2, weight=2 * GB, kv=GB // 2) -> StagePlan:
    return StagePlan(index, fellow_id, f"f{fellow_id}", 0, 10, int(weight), int(kv))


NEED = 2 * GB + GB // 2 + OVERHEAD_BYTES


def test_a_standby_with_room_goes_first_even_when_an_idle_fellow_has_more():
    fleet = [Candidate(3, "idle", 40 * GB, standby=False, serving=False),
             Candidate(4, "standby", 4 * GB, standby=True, serving=False)]
    assert choose_replacement(plan(), fleet).name == "standby"


def test_no_standby_then_the_roomiest_idle_fellow_never_a_busy_one():
    fleet = [Candidate(3, "busy", 80 * GB, standby=False, serving=True),
             Candidate(4, "small", 3 * GB, standby=False, serving=False),
             Candidate(5, "big", 9 * GB, standby=False, serving=False)]
    assert choose_replacement(plan(), fleet).name == "big"


def test_memory_is_budgeted_like_a_load_weights_kv_and_overhead():
    just = Candidate(3, "just", NEED, standby=True, serving=False)
    short = Candidate(4, "short", NEED - 1, standby=True, serving=False)
    assert choose_replacement(plan(), [short]) is None
    assert choose_replacement(plan(), [short, just]).name == "just"


def test_the_lost_fellow_and_fellows_that_failed_are_not_chosen():
    fleet = [Candidate(2, "lost", 50 * GB, standby=True, serving=False),
             Candidate(3, "failed", 50 * GB, standby=True, serving=False),
             Candidate(4, "ok", 5 * GB, standby=False, serving=False)]
    assert choose_replacement(plan(fellow_id=2), fleet, exclude={3}).name == "ok"
    assert choose_replacement(plan(fellow_id=2), fleet[:2], exclude={3}) is None


def test_why_nobody_can_take_it_names_each_fellow():
    fleet = [Candidate(3, "gpu-a", 80 * GB, standby=False, serving=True),
             Candidate(4, "gpu-b", 1.2 * GB, standby=False, serving=False)]
    text = why_no_replacement(plan(), fleet)
    assert "stage 1 needs 2.7 GB" in text and "gpu-a serves another stage" in text and "gpu-b has 1.2 GB" in text
    assert "none is online" in why_no_replacement(plan(), [])


def test_hot_cover_picks_the_costliest_stage_that_fits_a_free_standby():
    plans = [plan(0, 1, weight=1 * GB), plan(1, 2, weight=6 * GB), plan(2, 3, weight=3 * GB)]
    small = Candidate(9, "small-standby", 5 * GB, standby=True, serving=False)
    big = Candidate(8, "big-standby", 9 * GB, standby=True, serving=False)
    assert choose_cover(plans, [small], set()) == (2, small)  # stage 1 does not fit: the next costliest does
    assert choose_cover(plans, [small, big], set()) == (1, big)
    assert choose_cover(plans, [big], {1})[0] == 2
    busy = Candidate(7, "covering", 90 * GB, standby=True, serving=False, covering=True)
    assert choose_cover(plans, [busy], set()) is None
    assert choose_cover(plans, [Candidate(6, "plain", 90 * GB, standby=False, serving=False)], set()) is None


def test_a_cut_off_request_resumes_with_its_prefix_and_what_it_had_left():
    again = resume([1, 2, 3], [7, 8], 10)
    assert again.prompt == [1, 2, 3, 7, 8] and again.max_tokens == 8 and again.drawn == 2
    assert resume([1], [5, 5, 5], 3) is None  # nothing left to generate
