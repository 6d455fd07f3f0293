"""The performance view's rollups as plain functions over made-up records (swarm.leader.serving.performance), the
serving history's table (swarm.store.history) and its batched writer (swarm.leader.serving.history): no fellows, no
sockets."""

from __future__ import annotations

from pathlib import Path

import argon2
import pytest
import trio
import trio.testing

from swarm import messages
from swarm.errors import BadRequest
from swarm.leader.serving import history as history_module
from swarm.leader.serving.admission import Budget
from swarm.leader.serving.history import MEMORY_S, ServingHistory
from swarm.leader.serving.performance import (
    RANGES,
    bottleneck,
    hop_rate,
    live_rate,
    parse_range,
    percentile,
    pipeline_stage,
    speed,
    speed_series,
    table,
    time_split,
)
from swarm.leader.serving.request import Request
from swarm.leader.serving.requests import RequestBook
from swarm.messages import Gpu, Hardware
from swarm.store.db import Store
from swarm.store.history import ServedRequest

NOW = 1_700_000_000.0


def fellows_timing(compute: list[float], links: list[float], prompt_ms: float | None = None) -> dict:
    """A reply's swarm.timing as swarm.leader.serving.timing builds it once every stage reported."""
    return {"split": "fellows", "prompt_ms": prompt_ms,
            "stages": [{"stage": i, "compute_ms_per_token": ms} for i, ms in enumerate(compute)],
            "links": [{"from_stage": i, "ms_per_token": ms} for i, ms in enumerate(links)]}
CHEAP = argon2.PasswordHasher(time_cost=1, memory_cost=8, parallelism=1)


def served(ended_ago: float, tokens: int = 100, rate: float | None = 20.0, ttft: float | None = 300.0,
           queue: float | None = 5.0, outcome: str = "done", timing: dict | None = None, model: str = "m",
           rid: str | None = None) -> ServedRequest:
    return ServedRequest(id=rid or f"q{ended_ago}-{tokens}", model=model, started_at=NOW - ended_ago - 6,
                         ended_at=NOW - ended_ago, outcome=outcome, prompt_tokens=12, reply_tokens=tokens,
                         ttft_ms=ttft, tokens_per_s=rate, queue_ms=queue, timing=timing)


# --- ranges and series -----------------------------------------------------------------------------------------------


def test_ranges_and_their_steps_follow_the_seed():
    assert parse_range(None) == "15m" and parse_range("7d") == "7d"
    with pytest.raises(BadRequest, match="15m, 1h, 6h, 24h, 7d"):
        parse_range("2h")
    steps = [RANGES[r][1] for r in ("15m", "1h", "6h", "24h", "7d")]
    assert steps[0] == 30 and steps[-1] == 3 * 3600 and steps == sorted(steps)  # 30 s up to three hours
    for span, step in RANGES.values():
        assert 24 <= len(speed_series([], NOW, span, step)) <= 56


def test_speed_series_buckets_by_end_on_fixed_steps():
    records = [served(10, tokens=50, rate=10.0), served(20, tokens=30, rate=30.0), served(20.5, tokens=7, rate=20.0),
               served(200, tokens=40, rate=40.0), served(2000, tokens=999, rate=99.0)]  # the last is out of range
    series = speed_series(records, NOW, 900, 30)
    assert len(series) == 30
    assert all(b["t"] % 30 == 0 for b in series)  # steps on multiples of 30 s: a point keeps its place
    assert series[-1]["t"] <= NOW < series[-1]["t"] + 30
    by_time = {b["t"]: b for b in series}
    last = by_time[series[-1]["t"]]
    assert sum(b["replies"] for b in series) == 4 and sum(b["tokens"] for b in series) == 127
    # the three recent ones fall in the last one or two steps; each step shows its replies' median
    recent = [b for b in series if b["replies"] and b["t"] > NOW - 60]
    assert sum(b["replies"] for b in recent) == 3
    assert last["tokens_per_s"] in (10.0, 20.0, 30.0)
    assert [b["tokens_per_s"] for b in series if b["t"] <= NOW - 200 < b["t"] + 30] == [40.0]
    assert sum(b["tokens_per_s"] is None for b in series) >= 26  # no replies: no point, not a zero


# --- headline and table ----------------------------------------------------------------------------------------------


def test_percentile_interpolates_like_numpy():
    assert percentile([], 50) is None
    assert percentile([7.0], 95) == 7.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(1, 101)), 95) == pytest.approx(95.05)


def test_speed_is_the_streaming_rate_else_the_median():
    records = [served(1, rate=10.0, ttft=100), served(2, rate=20.0, ttft=300), served(3, rate=60.0, ttft=200)]
    between = speed(records, [])
    assert between["tokens_per_s"] == 20.0 and between["median_tokens_per_s"] == 20.0 and between["streaming"] == 0
    assert between["median_ttft_ms"] == 200.0 and between["tokens"] == 300
    now = speed(records, [12.5, 30.0])  # two replies streaming: the cluster's rate is their sum
    assert now["tokens_per_s"] == 42.5 and now["streaming"] == 2 and now["median_tokens_per_s"] == 20.0
    assert speed([], [])["tokens_per_s"] is None
    assert live_rate(11, 10.0, 12.0) == 5.0  # a reply streaming now: 10 tokens in the 2 s after its first
    assert live_rate(1, 10.0, 12.0) is None and live_rate(5, None, 12.0) is None


def test_last_15_minutes_table():
    records = [served(1, tokens=101, rate=20.0, ttft=100, queue=0),      # 100 steps in 5 s: 50 ms each
               served(2, tokens=51, rate=10.0, ttft=300, queue=10),      # 50 steps in 5 s: 100 ms each
               served(3, tokens=0, rate=None, ttft=None, queue=900, outcome="failed"),
               served(4, tokens=5, rate=None, ttft=250, queue=20, outcome="cancelled")]
    t = table(records)
    assert (t["replies"], t["failed"], t["cancelled"], t["tokens"]) == (4, 1, 1, 157)
    assert t["tokens_per_s"] == {"p50": 15.0, "p95": 19.5}
    assert t["ttft_ms"]["p50"] == 250.0 and t["ttft_ms"]["p95"] == pytest.approx(295.0)
    assert t["queue_ms"]["p50"] == 15.0
    assert t["mean_ms_between_tokens"] == pytest.approx(1000 * 10 / 150, abs=0.01)  # all decode time / all steps
    empty = table([])
    assert empty["replies"] == 0 and empty["tokens_per_s"] == {"p50": None, "p95": None}
    assert empty["mean_ms_between_tokens"] is None


# --- the time per token and the bottleneck ---------------------------------------------------------------------------

HOPS = [{"rtt_ms": 150.0, "bytes_per_token": 2400, "transport": "relay"},
        {"rtt_ms": 150.0, "bytes_per_token": 60, "transport": "relay"}]


def test_split_from_the_fellows_is_weighted_by_tokens_and_adds_up():
    records = [served(1, tokens=100, timing=fellows_timing([4.0, 5.0], [100.0, 50.0], 80)),
               served(2, tokens=300, timing=fellows_timing([8.0, 9.0], [60.0, 40.0], 120)),
               served(3, tokens=50),  # an old fellow's reply: no split, left out of the average
               served(4, tokens=50, timing={**fellows_timing([1.0, 1.0], [1.0, 1.0]), "split": None})]  # not all
    split = time_split(records, HOPS, ["fellow-0", "fellow-1"])
    assert split["source"] == "fellows" and split["replies"] == 2
    assert [p["label"] for p in split["parts"]] == ["stage 0", "link", "stage 1"]
    stage0, link, stage1 = (p["ms"] for p in split["parts"])
    assert stage0 == pytest.approx((4 * 100 + 8 * 300) / 400)
    assert stage1 == pytest.approx((5 * 100 + 9 * 300) / 400)
    assert link == pytest.approx((150 * 100 + 100 * 300) / 400)
    assert split["ms_per_token"] == pytest.approx(stage0 + link + stage1, abs=0.02)
    assert sum(p["share"] for p in split["parts"]) == pytest.approx(1.0, abs=0.002)
    assert split["prompt_ms"] == 100.0
    assert split["bytes_per_token"] == {"forward": 2400, "back": 60}
    sentence = bottleneck(split, [])
    assert sentence.startswith("The link takes most of each token's time (88%)") and "network" in sentence


def test_split_estimated_from_round_trips_until_the_fellows_report_it():
    split = time_split([served(1, rate=5.0), served(2, rate=5.0)], HOPS, ["a", "b"])  # 200 ms a token
    assert split["source"] == "round_trips"
    assert [(p["label"], p["ms"]) for p in split["parts"]] == [("compute", 50.0), ("link", 150.0)]
    assert "estimated" in bottleneck(split, [])
    assert time_split([served(1, rate=None)], HOPS, ["a", "b"]) is None  # nothing to go by
    assert bottleneck(None, []).startswith("No replies in the last 15 minutes")


def test_bottleneck_names_the_slower_stage_and_idle_gpus():
    records = [served(1, timing=fellows_timing([4.0, 9.0], [1.0, 1.0]))]
    split = time_split(records, HOPS, ["fellow-0", "fellow-1"])
    busy = [{"gpus": [{"role": "stage", "load_percent": 90.0}, {"role": "idle", "load_percent": 0.0}]}]
    sentence = bottleneck(split, busy)
    assert "Compute takes most of each token's time (87%)" in sentence
    assert "stage 1 on fellow-1 is the slower side (9.0 ms against 4.0 ms" in sentence
    assert "idle" not in sentence  # the idle card is not the stage's: it does not count
    idle = [{"gpus": [{"role": "stage", "load_percent": 12.0}]}, {"gpus": [{"role": "stage", "load_percent": 8.0}]}]
    assert "mostly idle (10 % busy)" in bottleneck(split, idle)


# --- the pipeline ----------------------------------------------------------------------------------------------------

STAGE = {"index": 0, "fellow": "gpu-1", "fellow_id": 3, "layers": [0, 12], "memory_bytes": 9_000_000_000}


def test_pipeline_card_puts_the_running_gpu_first_and_marks_the_others_idle():
    hw = Hardware(cpu_cores=16, ram_total_bytes=64 << 30, ram_free_bytes=40 << 30, gpus=[
        Gpu(0, "RTX 3060", 12 << 30, 11 << 30, load_percent=2.0, power_w=20.0, temperature_c=35.0),
        Gpu(1, "RTX 4090", 24 << 30, 10 << 30, load_percent=71.0, power_w=310.5, power_limit_w=450.0,
            temperature_c=64.0)])
    card = pipeline_stage(STAGE, hw, {"devices": ["cuda:1"], "bytes": 8_500_000_000})
    assert [(g["index"], g["role"]) for g in card["gpus"]] == [(1, "stage"), (0, "idle")]
    first = card["gpus"][0]
    assert first["model_bytes"] == 8_500_000_000 and first["used_bytes"] == 14 << 30
    assert (first["load_percent"], first["power_w"], first["temperature_c"]) == (71.0, 310.5, 64.0)
    assert card["gpus"][1]["model_bytes"] is None and card["cpu"] is None
    # without a placement report (an older fellow) the stage is on torch's first card, with the planned weights
    card = pipeline_stage(STAGE, hw, None)
    assert card["gpus"][0]["index"] == 0 and card["gpus"][0]["model_bytes"] == 9_000_000_000


def test_pipeline_card_without_gpu_shows_cpu_and_ram():
    hw = Hardware(cpu_cores=2, ram_total_bytes=8 << 30, ram_free_bytes=3 << 30, cpu_load_percent=55.5)
    card = pipeline_stage(STAGE, hw, {"devices": ["cpu"], "bytes": 500})
    assert card["gpus"] == [] and card["cpu"] == {"cores": 2, "load_percent": 55.5, "ram_total_bytes": 8 << 30,
                                                  "ram_used_bytes": 5 << 30}
    assert pipeline_stage(STAGE, None, None)["online"] is False


def test_hop_rate_from_two_heartbeats():
    first = hop_rate(None, {"bytes_sent": 1000}, 10.0)
    assert first["bytes_per_s"] is None and first["at"] == 10.0
    second = hop_rate(first, {"bytes_sent": 11_000}, 15.0)
    assert second["bytes_per_s"] == 2000.0
    assert hop_rate(second, {"bytes_sent": 50}, 20.0)["bytes_per_s"] == 2000.0  # a new path counts from 0 again


# --- the store's table -----------------------------------------------------------------------------------------------


def test_store_keeps_queries_and_prunes_served_requests(store_location):  # on SQLite and PostgreSQL
    with Store(store_location, password_hasher=CHEAP) as store:
        store.add_served_requests([served(10, timing={"stage_ms": [1.5, 2.5]}), served(100, model="other"),
                                   served(5000, rid="old")])
        rows = store.served_requests("m", NOW - 3600)
        assert [r.ended_at for r in rows] == [NOW - 5000, NOW - 10][1:]
        assert rows[0].timing == {"stage_ms": [1.5, 2.5]} and rows[0].reply_tokens == 100
        assert len(store.served_requests(None, NOW - 6000)) == 3
        assert store.prune_served_requests(NOW - 3600) == 1
        assert [r.id for r in store.served_requests(None, 0)] == [served(100).id, served(10).id]
    with Store(store_location, password_hasher=CHEAP) as store:  # and they are there after a reopen
        assert len(store.served_requests(None, 0)) == 2


# --- the history: from the request book to the database ------------------------------------------------------------


class Clock:
    def __init__(self):
        self.now = NOW

    def __call__(self) -> float:
        return self.now


async def test_finished_requests_are_recorded_and_written_in_batches(tmp_path: Path, autojump_clock):
    store = Store(tmp_path / "leader.db", password_hasher=CHEAP)
    clock = Clock()
    history = ServingHistory(store, keep_days=7, clock=clock)
    book = RequestBook()
    book.on_end = history.record
    book.resume("m", Budget(max_requests=8, tokens=10_000))
    req = Request(model="m", prompt=[1, 2, 3], max_tokens=10, sampling=messages.Sampling(), eos=[2], owner=7)
    await trio.sleep(0.25)
    book.submit(req)
    await trio.sleep(0.5)  # the first token half a second after it left the queue, 0.75 s after it came
    book.on_tokens(messages.Tokens("m", [messages.TokenBatch(req.rid, [5])]))
    await trio.sleep(1.0)
    book.on_tokens(messages.Tokens("m", [messages.TokenBatch(req.rid, [6, 7, 8, 9, 10], True, "length")]))
    failed = Request(model="m", prompt=[1], max_tokens=4, sampling=messages.Sampling(), eos=[2])
    book.submit(failed)
    book.end_model("m", "model m was unloaded")
    assert len(history.recent) == 2 and store.served_requests(None, 0) == []  # memory only: the reply never waits
    done = history.in_memory("m", 0)[0]
    assert (done.outcome, done.prompt_tokens, done.reply_tokens, done.user_id) == ("done", 3, 6, 7)
    # time to first token counts the queue wait, as swarm.timing does
    assert done.queue_ms == pytest.approx(250, abs=1) and done.ttft_ms == pytest.approx(750, abs=1)
    assert done.tokens_per_s == pytest.approx(5.0, abs=0.01)  # 5 tokens in the second after the first
    assert history.in_memory("m", 0)[1].outcome == "failed" and history.in_memory("m", 0)[1].error

    req.timing = {"stage_ms": [3.0, 4.0], "tokens_per_s": 6.5}  # the fellows' split comes in after the end
    # (flush and prune are called here as the background task calls them: trio's autojump clock would race its
    # timers against the database's worker thread)
    await history.flush()
    assert store.served_requests(None, 0) == []  # not settled yet: the stages' times may still come
    clock.now += 5
    await history.flush()
    rows = store.served_requests("m", 0)
    assert [r.outcome for r in rows] == ["done", "failed"]
    assert rows[0].timing == {"stage_ms": [3.0, 4.0], "tokens_per_s": 6.5} and rows[0].tokens_per_s == 6.5
    assert history._pending == [] and all(e.request is None for e in history.recent)  # requests let go
    # a longer range reads the database plus what is not written yet
    history.add(served(1, rid="fresh"))
    assert {r.id for r in await history.over("m", 3600)} == {req.id, failed.id, "fresh"}
    async with trio.open_nursery() as nursery:
        await nursery.start(history.run)
        nursery.cancel_scope.cancel()
    assert len(store.served_requests("m", 0)) == 3  # what was pending went out on the way out

    # a restarted leader reads its last 15 minutes back into memory; older ones stay in the database
    store.add_served_requests([served(MEMORY_S + 60, rid="older")])
    again = ServingHistory(store, keep_days=7, clock=clock)
    async with trio.open_nursery() as nursery:
        await nursery.start(again.run)
        assert {r.id for r in again.in_memory("m", 0)} == {req.id, failed.id, "fresh"}
        assert "older" in {r.id for r in await again.over("m", 3600)}
        nursery.cancel_scope.cancel()
    store.close()


async def test_history_is_pruned_past_its_days(store_location):  # on SQLite and PostgreSQL
    store = Store(store_location, password_hasher=CHEAP)
    store.add_served_requests([served(3 * 86400, rid="three days"), served(60, rid="a minute")])
    history = ServingHistory(store, keep_days=2, clock=Clock())
    await history.prune()
    assert [r.id for r in store.served_requests(None, 0)] == ["a minute"]
    assert history_module.PRUNE_S == 3600  # the background task prunes hourly
    store.close()


async def test_longer_ranges_read_the_database_at_most_every_30_s(tmp_path: Path):
    store = Store(tmp_path / "leader.db", password_hasher=CHEAP)
    store.add_served_requests([served(3000, rid="old", timing=fellows_timing([1.0], []))])
    clock = Clock()
    history = ServingHistory(store, keep_days=7, clock=clock)
    reads = []
    real = store.served_requests
    store.served_requests = lambda *args, **kwargs: reads.append(args) or real(*args, **kwargs)
    history.add(served(10, rid="new"))
    first = await history.over("m", 3600)
    assert [r.id for r in first] == ["old", "new"] and first[0].timing is None  # no timing maps from the database
    clock.now += 10
    assert [r.id for r in await history.over("m", 3600)] == ["old", "new"] and len(reads) == 1  # reused
    clock.now += 25
    await history.flush()  # as the background task has long done by now
    assert [r.id for r in await history.over("m", 3600)] == ["old", "new"] and len(reads) == 2  # read again
    assert [r.id for r in await history.over("m", 900)] == ["new"] and len(reads) == 2  # the live range: memory
    store.close()


async def test_metrics_count_each_request_once_when_its_record_settles(tmp_path: Path):
    """swarm.leader.api.metrics is fed as records settle, once each: a database write that fails and is retried does not
    count a request twice, and the stages' times reach the per-stage histograms."""
    from prometheus_client.parser import text_string_to_metric_families

    from swarm.leader.api.metrics import Metrics

    store = Store(tmp_path / "leader.db", password_hasher=CHEAP)
    metrics = Metrics()
    clock = Clock()
    history = ServingHistory(store, keep_days=7, clock=clock, on_settled=metrics.observe)
    written = store.add_served_requests
    store.add_served_requests = lambda batch: (_ for _ in ()).throw(OSError("disk full"))  # the database refuses
    history.add(served(10, tokens=40, rate=20.0, ttft=250.0, timing=fellows_timing([30.0, 12.0], [5.0, 3.0])))
    history.add(served(12, tokens=3, rate=None, ttft=None, outcome="failed", rid="lost"))

    def scraped() -> dict:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(metrics.exposition().decode()) for s in family.samples}

    await history.flush()
    await history.flush()  # retried: still refused
    store.add_served_requests = written
    await history.flush()
    assert len(store.served_requests("m", 0)) == 2
    found = scraped()
    assert found[("swarm_requests_total", (("model", "m"), ("outcome", "done")))] == 1
    assert found[("swarm_requests_total", (("model", "m"), ("outcome", "failed")))] == 1
    assert found[("swarm_reply_tokens_total", (("model", "m"),))] == 43
    assert found[("swarm_time_to_first_token_seconds_count", (("model", "m"),))] == 1  # the failed one had none
    assert found[("swarm_time_to_first_token_seconds_sum", (("model", "m"),))] == pytest.approx(0.25)
    assert found[("swarm_time_per_token_seconds_sum", (("model", "m"),))] == pytest.approx(1 / 20)
    assert found[("swarm_stage_compute_seconds_per_token_sum", (("model", "m"), ("stage", "1")))] == \
        pytest.approx(0.012)
    assert found[("swarm_link_seconds_per_token_count", (("hop", "0->None"), ("model", "m"),
                                                         ("transport", "unknown")))] == 1
    store.close()
