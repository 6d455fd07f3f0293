"""Who takes a leaving fellow's stage, as plain functions over made-up fleets (swarm.leader.serving.drain), and the
words of a refusal."""

from __future__ import annotations

from swarm.leader.planning.failover import Candidate
from swarm.leader.planning.placement import GB, StagePlan
from swarm.leader.serving.drain import choose_taker, why_nobody_takes


def plan(index=1, fellow_id=2, weight=2 * GB, kv=GB // 2) -> StagePlan:
    return StagePlan(index, fellow_id, f"f{fellow_id}", 0, 10, int(weight), int(kv))


LEAVING = frozenset({2})


def test_a_loaded_hot_cover_takes_the_stage_before_a_roomier_standby():
    fleet = [Candidate(2, "leaving", 50 * GB, standby=False, serving=True),
             Candidate(3, "standby", 40 * GB, standby=True, serving=False),
             Candidate(4, "cover", 1 * GB, standby=True, serving=False, covering=True)]
    taker = choose_taker("m", plan(), cover=4, cover_ready=True, candidates=fleet, leaving=LEAVING)
    assert (taker.name, taker.hot, taker.index) == ("cover", True, 1)


def test_a_cover_still_loading_is_waited_for_and_a_gone_one_passed_over_for_the_failover_choice():
    fleet = [Candidate(3, "standby", 4 * GB, standby=True, serving=False),
             Candidate(5, "idle", 9 * GB, standby=False, serving=False),
             Candidate(6, "loading", 3 * GB, standby=True, serving=False, covering=True)]
    loading = choose_taker("m", plan(), cover=6, cover_ready=False, candidates=fleet, leaving=LEAVING)
    assert (loading.name, loading.hot) == ("loading", False)  # not a second copy elsewhere
    gone = choose_taker("m", plan(), cover=9, cover_ready=True, candidates=fleet, leaving=LEAVING)
    assert (gone.name, gone.hot) == ("standby", False)  # a standby first, as a failover would


def test_an_idle_fellow_with_room_takes_it_when_there_is_no_standby():
    fleet = [Candidate(3, "busy", 80 * GB, standby=False, serving=True),
             Candidate(4, "small", 1 * GB, standby=False, serving=False),
             Candidate(5, "idle", 9 * GB, standby=False, serving=False)]
    assert choose_taker("m", plan(), None, False, fleet, LEAVING).name == "idle"


def test_no_fellow_that_is_leaving_takes_a_stage_even_its_own_cover():
    fleet = [Candidate(3, "also leaving", 50 * GB, standby=True, serving=False, covering=True)]
    assert choose_taker("m", plan(), cover=3, cover_ready=True, candidates=fleet, leaving={2, 3}) is None


def test_the_refusal_names_the_stage_what_it_needs_and_what_each_fellow_does():
    fleet = [Candidate(2, "f2", 50 * GB, standby=False, serving=True),
             Candidate(3, "gpu-1", 80 * GB, standby=False, serving=True),
             Candidate(4, "laptop", 1 * GB, standby=False, serving=False)]
    text = why_nobody_takes("llama", plan(), fleet, LEAVING)
    assert text == ("no fellow can take stage 1 of llama from f2: it needs 2.7 GB free on a standby or an idle "
                    "fellow (gpu-1 serves another stage; laptop has 1.0 GB free)")
    alone = why_nobody_takes("llama", plan(), fleet[:1], LEAVING)
    assert alone.endswith("(no other fellow of its pool is online)")
