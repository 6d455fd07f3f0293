"""Hole punching across the lab's internet of 1 to 3 routers, with the fellow's own code (tests/lab_punch.py: the
rendezvous, the path trace, the punch; no model). The first probes' IP TTL is traced per attempt, so they leave
every NAT of ours and die before the far one whatever lies between: routers that answer strangers punch on the
first try with one router between the homes, where the old fixed TTL of 3 reached the far NAT and never punched.
Impossible pairs fail with a reason a user can act on. Needs root; skips otherwise. bench/lab_punch_grid.py runs the
whole grid 20 times per cell."""

from __future__ import annotations

import pytest

import lab_punch
import netlab

_reason = netlab.available()
if _reason:
    pytest.skip(_reason, allow_module_level=True)

pytestmark = pytest.mark.lab

ATTEMPTS = 3
B_LATE_S = 0.02  # well under the low-TTL rounds' 50-100 ms, well over a packet's way across the lab


@pytest.fixture(scope="module", params=[(1, 0.0), (3, 10.0)], ids=["depth1-no-delay", "depth3-10ms"])
def lab(request):
    depth, delay = request.param
    homes = ("nat-a", "nat-b", "nat-p", "nat-q", "nat-c", "nat-r")
    with netlab.world(public=(netlab.LEADER,), homes=homes, far=("nat-b", "nat-q", "nat-r"), delay_ms=delay,
                      depth=depth) as lab:
        yield lab


@pytest.fixture
def punchers(lab, process_logs):
    made = []

    def make(a: str, b: str, **kwargs) -> lab_punch.Punchers:
        p = lab_punch.Punchers(lab, a, b, **kwargs)
        made.append(p)
        process_logs(lambda: {name: path for q in made for name, path in q.logs.items()})
        return p

    yield make
    for p in made:
        p.close()


def _hops_to_first_public_router(lab: netlab.Lab, host: str) -> int:
    """How many routers lie between ``host`` and the internet: its home router, and its carrier's NAT if any."""
    n, node = 1, lab.hosts[host].router
    while lab.routers[node].upstream != "core":
        n, node = n + 1, lab.routers[node].upstream
    return n + 1


@pytest.mark.parametrize("pair", [("a1", "b1"), ("p1", "q1"), ("c1", "q1")],
                         ids=["masquerade", "routers-that-answer-strangers", "cgnat-x-answers-strangers"])
def test_every_attempt_punches_first_time_with_the_traced_ttl(lab, punchers, pair):
    p = punchers(*pair)
    outcomes = [p.attempt()[0] for _ in range(ATTEMPTS)]
    print(lab.depth, pair, [(o["ok"], round(o["seconds"], 2), o["low_ttl"]) for o in outcomes])
    assert all(o["ok"] for o in outcomes), outcomes
    want = tuple(_hops_to_first_public_router(lab, h) for h in pair)
    assert all(o["low_ttl"] == want for o in outcomes), (want, outcomes)
    assert all("traced" in how for o in outcomes for how in o["how"]), outcomes
    assert max(o["seconds"] for o in outcomes) < 1.0 + 2 * lab.depth * lab.delay_ms / 1000  # start to both locked


def test_the_old_fixed_ttl_reached_the_far_nat_with_one_router_between(lab, punchers):
    """One end starts 20 ms after the other, as two PCs told by the leader over different paths do: the first end's
    opening probes reach the far NAT before that NAT has the mapping of its own end. With the old TTL of 3 they get
    there, and the far NAT's port for this peer changes; with the traced TTL they die on the way and the punch works.
    (Started at the same microsecond the race goes either way, so the test does not rely on it.)"""
    if lab.depth != 1:
        pytest.skip("the fixed TTL of 3 died before the far NAT where two or more routers lie between the homes")
    old = punchers("p1", "q1", fixed_ttl=3)
    outcome = old.attempt(b_late_s=B_LATE_S)[0]
    old.close()  # its rendezvous server holds the port the next pair's needs
    assert not outcome["ok"]
    assert any("IP TTL 3" in m and "heard nothing from the peer" in m for m in outcome["messages"]), outcome
    traced = punchers("p1", "q1").attempt(b_late_s=B_LATE_S)[0]
    assert traced["ok"], traced
    assert traced["low_ttl"] == (2, 2), traced


def test_a_port_changing_nat_fails_with_a_reason_to_act_on(lab, punchers):
    if lab.depth != 3:
        pytest.skip("one lab shape is enough for a pair that cannot punch")
    outcome = punchers("r1", "b1").attempt()[0]
    assert not outcome["ok"]
    message = outcome["messages"][0]
    assert "\n" not in message
    assert "relay" in message and "endpoint-independent mapping" in message and "next attempt" in message
    assert "traced: the first router past this fellow's NATs is 2 hops away" in message
