"""The timing of a reply (swarm.leader.serving.timing) and the stages' accounting behind it (swarm.stage.timing), as
plain logic over made-up requests and reports."""

from __future__ import annotations

import pytest

from swarm import messages
from swarm.leader.serving.request import Request
from swarm.leader.serving.requests import RequestBook
from swarm.leader.serving.timing import reply_timing


def _request(**kw) -> Request:
    request = Request(model="m", prompt=[1, 2, 3], max_tokens=50, sampling=messages.Sampling(), eos=[])
    for key, value in kw.items():
        setattr(request, key, value)
    return request


def _times(stage: int, **kw) -> messages.StageTimes:
    return messages.StageTimes("m", "r", stage, **kw)


def test_two_stage_split_adds_up_and_links_share_by_round_trip():
    # 21 tokens, the first at 1.0 s, the last at 3.0 s: 20 steady tokens in 2 s, 100 ms each.
    request = _request(tokens=list(range(21)), created_at=0.0, started_at=0.2, first_token_at=1.0, first_tokens=1,
                       last_token_at=3.0)
    request.stage_times = {
        0: _times(0, prefill_s=0.3, prefill_tokens=3, decode_s=0.4, decode_steps=20, ring_s=1.4, ring_steps=20,
                  sent_bytes=20 * 1200, sent_tokens=20),
        1: _times(1, prefill_s=0.2, prefill_tokens=3, decode_s=0.6, decode_steps=20, sent_bytes=20 * 90,
                  sent_tokens=20),
    }
    hops = [{"transport": "relay", "rtt_ms": 30.0}, {"transport": "direct", "rtt_ms": 10.0}]
    t = reply_timing(request, ["a", "b"], hops)
    assert t["queue_ms"] == pytest.approx(200.0)
    assert t["ttft_ms"] == pytest.approx(1000.0)
    assert t["prompt_ms"] == pytest.approx(800.0)
    assert t["tokens"] == 21
    assert t["tokens_per_s"] == pytest.approx(10.0)
    assert t["ms_per_token"] == pytest.approx(100.0)
    assert [(s["stage"], s["fellow"], s["compute_ms_per_token"], s["prefill_ms"]) for s in t["stages"]] == \
        [(0, "a", 20.0, 300.0), (1, "b", 30.0, 200.0)]
    # the ring's 70 ms per step less stage 1's 30 ms of compute: 40 ms on the links, 3:1 by their round trips
    assert t["link_ms_per_token"] == pytest.approx(40.0)
    assert [(link["from_stage"], link["to_stage"], link["transport"], link["ms_per_token"], link["bytes_per_token"])
            for link in t["links"]] == [(0, 1, "relay", 30.0, 1200), (1, 0, "direct", 10.0, 90)]
    assert t["bytes_per_token"] == {"forward": 1200, "back": 90}
    assert t["split"] == "fellows"
    assert (t["spec_passes"], t["spec_tokens"], t["spec_drafted"], t["spec_accepted"]) == (0, 0, 0, 0)
    total = sum(s["compute_ms_per_token"] for s in t["stages"]) + t["link_ms_per_token"]
    assert total == pytest.approx(90.0)  # of the measured 100: stage 0's gap between a token and its next step


def test_one_stage_has_compute_and_no_link():
    request = _request(tokens=[5, 6, 7, 8, 9], created_at=0.0, started_at=0.0, first_token_at=0.5, first_tokens=1,
                       last_token_at=0.55)
    request.stage_times = {0: _times(0, prefill_s=0.4, decode_s=0.048, decode_steps=4)}
    t = reply_timing(request, ["solo"], [])
    assert t["tokens_per_s"] == pytest.approx(80.0)
    assert t["stages"] == [{"stage": 0, "fellow": "solo", "compute_ms_per_token": 12.0, "prefill_ms": 400.0}]
    assert t["links"] == [] and t["link_ms_per_token"] is None
    assert t["bytes_per_token"] == {"forward": None, "back": None}
    assert t["split"] == "fellows"


def test_without_reports_only_the_leaders_figures():
    request = _request(tokens=[1], created_at=0.0, started_at=0.1, first_token_at=0.3, first_tokens=1,
                       last_token_at=0.3)
    t = reply_timing(request, ["a", "b"], [{"transport": "relay", "rtt_ms": None}] * 2)
    assert t["split"] is None and t["stages"] == [] and t["link_ms_per_token"] is None
    assert t["tokens_per_s"] is None  # one token: no steady rate
    assert t["ttft_ms"] == pytest.approx(300.0)
    assert [link["transport"] for link in t["links"]] == ["relay", "relay"]


def test_unknown_round_trips_split_the_links_evenly():
    request = _request(tokens=[1, 2, 3], created_at=0.0, started_at=0.0, first_token_at=1.0, first_tokens=1,
                       last_token_at=1.2)
    request.stage_times = {0: _times(0, decode_s=0.02, decode_steps=2, ring_s=0.18, ring_steps=2),
                           1: _times(1, decode_s=0.02, decode_steps=2), 2: _times(2, decode_s=0.02, decode_steps=2)}
    t = reply_timing(request, ["a", "b", "c"], [{"rtt_ms": 5.0}, {"rtt_ms": None}, {}])
    assert t["link_ms_per_token"] == pytest.approx(70.0)
    assert [link["ms_per_token"] for link in t["links"]] == pytest.approx([70 / 3] * 3, abs=0.01)


def test_the_book_keeps_times_that_come_after_the_end():
    book = RequestBook()
    request = _request()
    book.by_rid[request.rid] = request
    book._end(request, finish="stop")
    book.on_stage_times(messages.StageTimes("m", request.rid, 1, decode_s=0.1, decode_steps=2))
    book.on_stage_times(messages.StageTimes("other", request.rid, 0))  # another model's: not this request's
    book.on_stage_times(messages.StageTimes("m", "r-unknown", 0))
    assert list(request.stage_times) == [1]


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_each_stage_counts_its_prompt_and_every_decode_step(num_stages):
    """Over the ring in one process with the toy model: a 10-token prompt in chunks of 4, a reply of 7 tokens."""
    from test_protocol import ring

    r = ring(num_stages, chunk=4)
    prompt = [(11 * i) % 90 + 5 for i in range(10)]
    reply = r.submit("a", prompt, 7, eos=[])
    r.run()
    assert len(reply.tokens) == 7
    times = r.times["a"]
    assert sorted(times) == list(range(num_stages))  # every stage reported once it dropped the request
    for i, t in times.items():
        assert (t.stage, t.rid, t.prefill_tokens, t.decode_steps) == (i, "a", 10, 6)  # the first token is the prompt's
        assert t.prefill_s > 0 and t.decode_s > 0
    first, last = times[0], times[num_stages - 1]
    if num_stages == 1:
        assert (first.ring_steps, first.sent_tokens) == (0, 0)
        return
    assert first.ring_steps == 6 and first.ring_s > 0  # each decode step's round trip, timed on stage 0
    assert all(times[i].ring_steps == 0 for i in range(1, num_stages))
    # forward: one int64 row of the toy's hidden state per step, plus the message around it; back: the tokens
    assert first.sent_tokens == 6 and 8 < first.sent_bytes / 6 < 300
    # (the last token goes back after the last stage dropped the request: its bytes are not counted)
    assert last.sent_tokens == 5 and 0 < last.sent_bytes / 5 < 200
    assert r.timers[0]._totals == {} and r.timers[0]._out == {}  # nothing left behind


def test_a_cancelled_request_reports_what_it_computed():
    from test_protocol import ring

    r = ring(2, chunk=4)
    r.submit("a", list(range(5, 25)), 50, eos=[])
    r.step()
    r.step()
    r.cancel("a")
    r.run()
    assert sorted(r.times["a"]) == [0, 1]
    assert r.times["a"][0].prefill_tokens > 0


def test_the_cli_speed_line_reads_like_the_seeds():
    from swarm.client import speed_line

    two = {"split": "fellows", "link_ms_per_token": 152.4,
           "stages": [{"stage": 0, "compute_ms_per_token": 4.2}, {"stage": 1, "compute_ms_per_token": 0.46}]}
    assert speed_line(80, 12.5, 0.42, two) == \
        "12.5 tokens/s · 80 tokens · 0.42 s to first token · stage 0 4 ms/token · link 152 ms · stage 1 0.5 ms"
    one = {"split": "fellows", "link_ms_per_token": None, "stages": [{"stage": 0, "compute_ms_per_token": 12.3}]}
    assert speed_line(1, None, 0.2, one) == "1 token · 0.20 s to first token · compute 12 ms/token"
    # fellows that did not report the split: the browser's figures alone
    assert speed_line(5, 20.0, 0.1, {"split": None, "stages": []}) == "20.0 tokens/s · 5 tokens · 0.10 s to first token"
    assert speed_line(5, 20.0, None, None) == "20.0 tokens/s · 5 tokens"


def _ring_of(protocols: list[int | None]):
    """The leader's view of a ring whose stage i runs on fellow i+1 speaking ``protocols[i]`` (None: offline)."""
    from types import SimpleNamespace

    from swarm.leader.planning.placement import StagePlan

    stages = [SimpleNamespace(plan=StagePlan(i, i + 1, f"f{i + 1}", i, i + 1, 0, 0)) for i in range(len(protocols))]
    online = {i + 1: SimpleNamespace(protocol=p) for i, p in enumerate(protocols) if p is not None}
    return SimpleNamespace(models={"m": SimpleNamespace(stages=stages)}, hub=SimpleNamespace(online=online))


@pytest.mark.parametrize("protocols, waits", [([1, 1], True), ([1, 0], False), ([1, None], False), ([0], False)])
def test_a_reply_waits_for_the_times_only_from_a_ring_that_sends_them(protocols, waits):
    """settle waits (up to its cap) for each stage's StageTimes, but not at all when a fellow of the ring speaks a
    protocol from before StageTimes (or is gone): such a ring would hold every reply's end for the whole cap."""
    import trio
    import trio.testing

    from swarm.leader.serving.timing import settle

    serving = _ring_of(protocols)

    async def waited() -> float:
        request = _request(tokens=[1, 2])
        start = trio.current_time()
        await settle(serving, request, wait_s=1.0)
        return trio.current_time() - start

    assert trio.run(waited, clock=trio.testing.MockClock(autojump_threshold=0)) == (1.0 if waits else 0.0)


def test_settle_ends_when_the_last_stage_reports():
    import trio
    import trio.testing

    from swarm.leader.serving.timing import settle

    serving = _ring_of([1, 1])
    request = _request(tokens=[1, 2])

    async def main() -> float:
        async with trio.open_nursery() as nursery:
            async def report() -> None:
                for stage in (0, 1):
                    await trio.sleep(0.1)
                    request.stage_times[stage] = _times(stage)
                    request.changed.set()
                    request.changed = trio.Event()
            nursery.start_soon(report)
            start = trio.current_time()
            await settle(serving, request, wait_s=1.0)
            return trio.current_time() - start

    assert trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)) == pytest.approx(0.2)
