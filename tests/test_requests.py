"""The leader's request lifecycle as plain logic (swarm.leader.serving.requests): no fellows, no sockets."""

from __future__ import annotations

import trio
import trio.testing

from swarm import messages
from swarm.leader.serving.admission import Budget
from swarm.leader.serving.request import Reader, Request
from swarm.leader.serving.requests import NotLoaded, RequestBook, ToStage0

ROOMY = Budget(max_requests=16, tokens=100_000)


def ready_book(**kwargs) -> RequestBook:
    """A book whose models' rings are whole, with room for plenty."""
    book = RequestBook(**kwargs)
    book.resume("m", ROOMY)
    book.resume("other", ROOMY)
    return book


def new_request(model="m", prompt=(1, 2, 3)) -> Request:
    return Request(model=model, prompt=list(prompt), max_tokens=10, sampling=messages.Sampling(), eos=[2])


def tokens(rid, ids, done=False, finish=None, model="m"):
    return messages.Tokens(model, [messages.TokenBatch(rid, list(ids), done, finish)])


def test_submit_stream_and_finish():
    book = ready_book()
    request = new_request()
    (action,) = book.submit(request)
    assert action == ToStage0("m", request.generate_message())
    assert action.message.rid == request.rid and action.message.prompt == [1, 2, 3]
    book.on_tokens(tokens(request.rid, [5, 6]))
    book.on_tokens(tokens(request.rid, [7], done=True, finish="length"))
    assert request.tokens == [5, 6, 7] and request.finish_reason == "length" and request.error is None
    assert book.by_rid == {}


def test_a_failed_attempt_is_sent_again_with_its_streamed_prefix_then_gives_up():
    book = ready_book(max_resends=2)
    request = new_request()
    book.submit(request)
    stable_id = request.id
    book.on_tokens(tokens(request.rid, [5, 6]))
    first_rid = request.rid
    cancel, resend = book.on_failed(messages.Failed("m", first_rid, "the direct link broke", stage=0))
    assert cancel == ToStage0("m", messages.Cancel("m", first_rid))  # frees what the first attempt left
    generate = resend.message
    assert isinstance(generate, messages.Generate) and generate.rid == request.rid != first_rid
    # the prompt plus what was streamed, with the tokens it had left; a seeded sampler goes on from token 2
    assert generate.prompt == [1, 2, 3, 5, 6] and generate.max_tokens == 8 and generate.drawn == 2
    assert request.id == stable_id and not request.ended
    book.on_tokens(tokens(first_rid, [99]))  # the first attempt's late tokens are not the reply's
    book.on_tokens(tokens(request.rid, [7]))
    assert request.tokens == [5, 6, 7]
    book.on_failed(messages.Failed("m", request.rid, "again"))
    assert not request.ended
    actions = book.on_failed(messages.Failed("m", request.rid, "still broken"))
    assert actions == [ToStage0("m", messages.Cancel("m", request.rid))]
    assert "still broken" in request.error and "sent 3 times" in request.error and book.by_rid == {}


def test_an_attempt_cut_off_after_its_last_token_just_ends():
    book = ready_book()
    request = new_request()
    request.max_tokens = 2
    book.submit(request)
    book.on_tokens(tokens(request.rid, [5, 6]))  # the last token, but the done flag never came
    book.on_failed(messages.Failed("m", request.rid, "stage 1 went away"))
    assert request.finish_reason == "length" and request.tokens == [5, 6]


def test_not_loaded_on_a_fellow_reloads_and_the_request_waits():
    book = ready_book()
    request = new_request()
    book.submit(request)
    book.on_tokens(tokens(request.rid, [5]))
    actions = book.on_failed(messages.Failed("m", request.rid, "model m is not loaded on f1", not_loaded=True))
    assert NotLoaded("m", "model m is not loaded on f1") in actions
    assert request.state == "waiting" and not request.ended and book.waiting["m"] == [request]
    (resend,) = book.resume("m", ROOMY)
    assert resend.message.prompt == [1, 2, 3, 5] and resend.message.drawn == 1


def test_a_broken_path_sends_every_request_on_it_again_from_where_it_stands():
    book = ready_book()
    fresh, streaming, elsewhere = new_request(), new_request(), new_request(model="other")
    for r in (fresh, streaming, elsewhere):
        book.submit(r)
    book.on_tokens(tokens(streaming.rid, [4, 4]))
    old = {fresh.rid, streaming.rid}
    actions = book.on_path_lost("m")
    generates = {a.message.rid: a.message for a in actions if isinstance(a.message, messages.Generate)}
    assert set(generates) == {fresh.rid, streaming.rid} and not old & set(generates)
    assert generates[streaming.rid].prompt == [1, 2, 3, 4, 4]
    assert not fresh.ended and not streaming.ended and not elsewhere.ended


def test_a_rebuilt_ring_holds_requests_then_sends_them_again_in_order():
    book = ready_book()
    a, b = new_request(), new_request()
    book.submit(a)
    book.on_tokens(tokens(a.rid, [9]))
    old_a = a.rid
    cancels = book.interrupt("m")
    assert cancels == [ToStage0("m", messages.Cancel("m", old_a))]
    assert book.submit(b) == []  # arrived while the model was recovering: it waits
    assert a.state == b.state == "waiting" and book.by_rid == {}
    book.on_tokens(tokens(old_a, [77]))  # what the old ring still sends is ignored
    assert a.tokens == [9]
    first, second = book.resume("m", ROOMY)
    assert first.message.prompt == [1, 2, 3, 9] and first.message.max_tokens == 9
    assert second.message.prompt == [1, 2, 3] and b.attempts == 1
    book.end_model("m", "gone")
    assert a.error == b.error == "gone"


def test_a_waiting_request_can_be_cancelled():
    book = RequestBook()
    request = new_request()
    book.submit(request)
    assert book.find(request.id) is request
    assert book.cancel(request) == []  # nothing on the ring to cancel
    assert request.finish_reason == "cancelled" and book.waiting["m"] == []
    assert book.resume("m", ROOMY) == []


def test_cancel_and_what_arrives_after_it():
    book = ready_book()
    request = new_request()
    book.submit(request)
    assert book.cancel(request) == [ToStage0("m", messages.Cancel("m", request.rid))]
    assert request.finish_reason == "cancelled"
    assert book.cancel(request) == []  # once
    book.on_tokens(tokens(request.rid, [5], done=True, finish="stop"))
    assert request.tokens == [] and request.finish_reason == "cancelled"


def test_a_fellow_cannot_feed_another_models_request():
    book = ready_book()
    request = new_request(model="m")
    book.submit(request)
    book.on_tokens(tokens(request.rid, [66], model="other"))
    assert book.on_failed(messages.Failed("other", request.rid, "forged")) == []
    assert request.tokens == [] and not request.ended


async def test_readers_never_hold_up_the_producer_and_see_every_token():
    book = ready_book()
    request = new_request()
    book.submit(request)
    for i in range(500):  # nobody reads meanwhile: nothing blocks, nothing is lost
        book.on_tokens(tokens(request.rid, [i]))
    book.on_tokens(tokens(request.rid, [500], done=True, finish="length"))
    reader = Reader(request)
    assert await reader.next(1) == ("tokens", list(range(501)))
    assert await reader.next(1) == ("done", "length")


async def test_a_reader_wakes_on_each_batch_then_on_the_end():
    book = ready_book()
    request = new_request()
    book.submit(request)
    reader = Reader(request)
    got = []

    async def read():
        while True:
            kind, value = await reader.next(60)
            got.append((kind, value))
            if kind != "tokens":
                return

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        await trio.testing.wait_all_tasks_blocked()
        book.on_tokens(tokens(request.rid, [1, 2]))
        await trio.testing.wait_all_tasks_blocked()
        book.on_tokens(tokens(request.rid, [3], done=True, finish="stop"))
    assert got == [("tokens", [1, 2]), ("tokens", [3]), ("done", "stop")]


async def test_a_silent_ring_is_reported_after_the_stall_time(autojump_clock):
    book = ready_book()
    request = new_request()
    book.submit(request)
    started = trio.current_time()
    kind, text = await Reader(request).next(120)
    assert kind == "error" and "no token for 120 s" in text
    assert trio.current_time() - started >= 120


async def test_a_waiting_request_does_not_stall_out(autojump_clock):
    """While its model recovers a request waits as long as recovery takes; the stall time is for running ones."""
    book = ready_book()
    request = new_request()
    book.hold(request)
    reader = Reader(request)

    async def later():
        await trio.sleep(500)
        book.resume("m", ROOMY)
        book.on_tokens(tokens(request.rid, [1], done=True, finish="stop"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(later)
        assert await reader.next(120) == ("tokens", [1])


async def test_a_request_waits_for_its_model_only_so_long(autojump_clock):
    book = ready_book()
    request = new_request()
    book.hold(request)
    kind, text = await Reader(request, stall_s=120, wait_s=900).next()
    assert kind == "error" and "not ready within 900 s" in text and "SWARM_SERVE_QUEUE_TIMEOUT_S" in text



def generates(actions) -> list[str]:
    return [a.message.rid for a in actions if isinstance(a, ToStage0) and isinstance(a.message, messages.Generate)]


def test_no_more_requests_run_than_the_budget_holds_and_the_rest_wait_in_order():
    book = RequestBook()
    book.resume("m", Budget(max_requests=2, tokens=100_000))
    reqs = [new_request() for _ in range(4)]
    started = [generates(book.submit(r)) for r in reqs]
    assert started == [[reqs[0].rid], [reqs[1].rid], [], []]
    assert [r.state for r in reqs] == ["running", "running", "waiting", "waiting"]
    # the first ends: the next in line starts, not the last
    assert generates(book.on_tokens(tokens(reqs[0].rid, [5], done=True, finish="stop"))) == [reqs[2].rid]
    assert generates(book.cancel(reqs[1])) == [reqs[3].rid]


def test_the_token_budget_holds_a_long_conversation_back_until_it_fits_and_nobody_passes_it():
    book = RequestBook()
    book.resume("m", Budget(max_requests=8, tokens=100))
    short = Request(model="m", prompt=[1] * 10, max_tokens=20, sampling=messages.Sampling(), eos=[])  # needs 30
    long = Request(model="m", prompt=[1] * 50, max_tokens=40, sampling=messages.Sampling(), eos=[])  # needs 90
    later = Request(model="m", prompt=[1] * 5, max_tokens=5, sampling=messages.Sampling(), eos=[])  # needs 10
    assert generates(book.submit(short)) == [short.rid]
    assert book.submit(long) == []  # 30 + 90 > 100: it waits
    assert book.submit(later) == []  # would fit, but it came after the long one: first come, first served
    assert generates(book.on_tokens(tokens(short.rid, [2], done=True, finish="stop"))) == [long.rid, later.rid]


def test_the_admission_budget_follows_the_placement():
    from swarm.leader.planning.placement import GB, OVERHEAD_BYTES, StagePlan
    from swarm.leader.serving.admission import budget

    kv = 100_000  # bytes per token per layer
    plans = [StagePlan(0, 1, "a", 0, 10, 2 * GB, 0), StagePlan(1, 2, "b", 10, 20, 2 * GB, 0)]
    roomy = {1: 2 * GB + OVERHEAD_BYTES + 10 * kv * 40_000, 2: 2 * GB + OVERHEAD_BYTES + 10 * kv * 50_000}
    b = budget(plans, roomy, kv, typical_tokens=1024, context_tokens=4096)
    assert b.tokens == 40_000 and b.max_requests == 8  # four per stage, and the caches hold 39 typical chats
    tight = {1: 2 * GB + OVERHEAD_BYTES + 10 * kv * 5_000, 2: roomy[2]}
    b = budget(plans, tight, kv, typical_tokens=1024, context_tokens=4096)
    assert b.tokens == 5_000 and b.max_requests == 4  # lowered to what fits, not refused
    b = budget(plans, {1: 0, 2: 0}, kv, typical_tokens=1024, context_tokens=4096)
    assert b.tokens == 4096 and b.max_requests == 4  # placement guaranteed one full context


async def test_a_full_queue_says_when_to_come_back_from_the_rings_recent_pace(autojump_clock):
    book = RequestBook()
    book.resume("m", Budget(max_requests=2, tokens=100_000))
    assert book.retry_after("m") == 1 and book.queued("m") == 0  # nothing waits: come back at once
    requests = [new_request() for _ in range(6)]
    for request in requests:
        book.submit(request)
    assert book.queued("m") == 4  # two run, four wait
    await trio.sleep(8)
    book.on_tokens(tokens(requests[0].rid, [5], done=True, finish="stop"))  # it ran 8 s
    assert book.service_s["m"] == 8.0
    # three wait now, two run, a request takes ~8 s: the queue is worked through in ~12 s
    assert book.queued("m") == 3 and book.retry_after("m") == 12
    book.cancel(requests[3])  # a cancelled request neither waits nor counts
    assert book.queued("m") == 2 and book.retry_after("m") == 8


# --- sampled choices of one prompt, started as one group ----------------------------------------------------------


def choices(n=3, prompt=(1, 2, 3), max_tokens=10) -> list[Request]:
    return [Request(model="m", prompt=list(prompt), max_tokens=max_tokens, eos=[2],
                    sampling=messages.Sampling(temperature=1.0, seed=seed)) for seed in range(100, 100 + n)]


def test_sampled_choices_start_as_one_group_prefilled_once():
    book = ready_book()
    group = choices()
    (action,) = book.submit_group(group)
    start = action.message
    assert isinstance(start, messages.Generate) and start.prompt == [1, 2, 3] and start.max_tokens == 10
    assert start.siblings == [messages.Sibling(r.rid, r.sampling.seed) for r in group]
    assert start.rid not in [r.rid for r in group] and start.rids == [r.rid for r in group]
    assert all(r.state == "running" and r.attempts == 1 for r in group)
    # each choice streams and ends on its own; a cancel of one frees only its own
    book.on_tokens(tokens(group[0].rid, [5, 6], done=True, finish="stop"))
    assert (group[0].tokens, group[0].finish_reason) == ([5, 6], "stop") and not group[1].ended
    assert book.cancel(group[1]) == [ToStage0("m", messages.Cancel("m", group[1].rid))]
    book.on_tokens(tokens(group[2].rid, [7]))
    assert group[2].tokens == [7] and sorted(book.by_rid) == [group[2].rid]


def test_a_group_waits_whole_until_the_budget_holds_every_choice():
    book = RequestBook()
    book.resume("m", Budget(max_requests=4, tokens=100_000))
    alone = new_request()
    book.submit(alone)
    group = choices(4)
    assert book.submit_group(group) == []  # one running + four would be five
    assert all(r.state == "waiting" for r in group)
    (action,) = book.on_tokens(tokens(alone.rid, [5], done=True, finish="stop"))
    assert action.message.rids == [r.rid for r in group]  # the whole group, in one start
    # by tokens too: two choices of 13 tokens do not fit beside a running 13 in a pool of 30
    book = RequestBook()
    book.resume("m", Budget(max_requests=8, tokens=30))
    book.submit(new_request())
    pair = choices(2)
    assert book.submit_group(pair) == []
    later = new_request()
    assert book.submit(later) == []  # nobody passes a waiting group


def test_a_group_alone_on_the_ring_may_pass_the_request_count_but_not_the_memory():
    book = RequestBook()
    book.resume("m", Budget(max_requests=4, tokens=100_000))
    group = choices(6)
    (action,) = book.submit_group(group)
    assert len(action.message.siblings) == 6
    # too big for the pool's caches as a whole: its choices go one by one, as the budget allows
    book = RequestBook()
    book.resume("m", Budget(max_requests=8, tokens=30))
    group = choices(3)
    actions = book.submit_group(group)
    assert [a.message.rid for a in actions] == [group[0].rid, group[1].rid]
    assert all(not a.message.siblings for a in actions) and group[2].state == "waiting"


def test_a_failed_choice_is_sent_again_alone_and_an_offline_stage_fails_them_all():
    book = ready_book()
    group = choices()
    book.submit_group(group)
    book.on_tokens(tokens(group[1].rid, [5]))
    failed_rid = group[1].rid
    cancel, resend = book.on_failed(messages.Failed("m", failed_rid, "a stage failed"))
    assert cancel == ToStage0("m", messages.Cancel("m", failed_rid))
    again = resend.message
    assert again.rid == group[1].rid != failed_rid and not again.siblings  # alone: its own prefill
    assert again.prompt == [1, 2, 3, 5] and again.drawn == 1 and again.sampling.seed == group[1].sampling.seed
    # a ring rebuilt: the running choices go out again one by one
    book.interrupt("m")
    actions = book.resume("m", ROOMY)
    assert sorted(a.message.rid for a in actions) == sorted(r.rid for r in group)
    assert all(not a.message.siblings for a in actions)
