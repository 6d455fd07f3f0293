"""The leader's request lifecycle as plain logic (swarm.leader.requests): no fellows, no sockets."""

from __future__ import annotations

import trio
import trio.testing

from swarm import messages
from swarm.leader.requests import NotLoaded, Reader, Request, RequestBook, ToStage0


def new_request(model="m", prompt=(1, 2, 3)) -> Request:
    return Request(model=model, prompt=list(prompt), max_tokens=10, sampling=messages.Sampling(), eos=[2])


def tokens(rid, ids, done=False, finish=None, model="m"):
    return messages.Tokens(model, [messages.TokenBatch(rid, list(ids), done, finish)])


def test_submit_stream_and_finish():
    book = RequestBook()
    request = new_request()
    (action,) = book.submit(request)
    assert action == ToStage0("m", request.generate_message())
    assert action.message.rid == request.rid and action.message.prompt == [1, 2, 3]
    book.on_tokens(tokens(request.rid, [5, 6]))
    book.on_tokens(tokens(request.rid, [7], done=True, finish="length"))
    assert request.tokens == [5, 6, 7] and request.finish_reason == "length" and request.error is None
    assert book.by_rid == {}


def test_a_failed_attempt_is_sent_again_with_its_streamed_prefix_then_gives_up():
    book = RequestBook(max_resends=2)
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
    book = RequestBook()
    request = new_request()
    request.max_tokens = 2
    book.submit(request)
    book.on_tokens(tokens(request.rid, [5, 6]))  # the last token, but the done flag never came
    book.on_failed(messages.Failed("m", request.rid, "stage 1 went away"))
    assert request.finish_reason == "length" and request.tokens == [5, 6]


def test_not_loaded_on_a_fellow_reloads_and_the_request_waits():
    book = RequestBook()
    request = new_request()
    book.submit(request)
    book.on_tokens(tokens(request.rid, [5]))
    actions = book.on_failed(messages.Failed("m", request.rid, "model m is not loaded on f1", not_loaded=True))
    assert NotLoaded("m", "model m is not loaded on f1") in actions
    assert request.state == "waiting" and not request.ended and book.waiting["m"] == [request]
    (resend,) = book.resume("m")
    assert resend.message.prompt == [1, 2, 3, 5] and resend.message.drawn == 1


def test_a_broken_path_sends_every_request_on_it_again_from_where_it_stands():
    book = RequestBook()
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
    book = RequestBook()
    a, b = new_request(), new_request()
    book.submit(a)
    book.on_tokens(tokens(a.rid, [9]))
    book.hold(b)  # arrived while the model was recovering
    old_a = a.rid
    cancels = book.interrupt("m")
    assert cancels == [ToStage0("m", messages.Cancel("m", old_a))]
    assert a.state == b.state == "waiting" and book.by_rid == {}
    book.on_tokens(tokens(old_a, [77]))  # what the old ring still sends is ignored
    assert a.tokens == [9]
    first, second = book.resume("m")
    assert first.message.prompt == [1, 2, 3, 9] and first.message.max_tokens == 9
    assert second.message.prompt == [1, 2, 3] and b.attempts == 1
    book.end_model("m", "gone")
    assert a.error == b.error == "gone"


def test_a_waiting_request_can_be_cancelled():
    book = RequestBook()
    request = new_request()
    book.hold(request)
    assert book.find(request.id) is request
    assert book.cancel(request) == []  # nothing on the ring to cancel
    assert request.finish_reason == "cancelled" and book.waiting["m"] == []
    assert book.resume("m") == []


def test_cancel_and_what_arrives_after_it():
    book = RequestBook()
    request = new_request()
    book.submit(request)
    assert book.cancel(request) == [ToStage0("m", messages.Cancel("m", request.rid))]
    assert request.finish_reason == "cancelled"
    assert book.cancel(request) == []  # once
    book.on_tokens(tokens(request.rid, [5], done=True, finish="stop"))
    assert request.tokens == [] and request.finish_reason == "cancelled"


def test_a_fellow_cannot_feed_another_models_request():
    book = RequestBook()
    request = new_request(model="m")
    book.submit(request)
    book.on_tokens(tokens(request.rid, [66], model="other"))
    assert book.on_failed(messages.Failed("other", request.rid, "forged")) == []
    assert request.tokens == [] and not request.ended


async def test_readers_never_hold_up_the_producer_and_see_every_token():
    book = RequestBook()
    request = new_request()
    book.submit(request)
    for i in range(500):  # nobody reads meanwhile: nothing blocks, nothing is lost
        book.on_tokens(tokens(request.rid, [i]))
    book.on_tokens(tokens(request.rid, [500], done=True, finish="length"))
    reader = Reader(request)
    assert await reader.next(1) == ("tokens", list(range(501)))
    assert await reader.next(1) == ("done", "length")


async def test_a_reader_wakes_on_each_batch_then_on_the_end():
    book = RequestBook()
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
    book = RequestBook()
    request = new_request()
    book.submit(request)
    started = trio.current_time()
    kind, text = await Reader(request).next(120)
    assert kind == "error" and "no token for 120 s" in text
    assert trio.current_time() - started >= 120


async def test_a_waiting_request_does_not_stall_out(autojump_clock):
    """While its model recovers a request waits as long as recovery takes; the stall time is for running ones."""
    book = RequestBook()
    request = new_request()
    book.hold(request)
    reader = Reader(request)

    async def later():
        await trio.sleep(500)
        book.resume("m")
        book.on_tokens(tokens(request.rid, [1], done=True, finish="stop"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(later)
        assert await reader.next(120) == ("tokens", [1])


async def test_a_request_waits_for_its_model_only_so_long(autojump_clock):
    book = RequestBook()
    request = new_request()
    book.hold(request)
    kind, text = await Reader(request, stall_s=120, wait_s=900).next()
    assert kind == "error" and "not ready within 900 s" in text and "SWARM_SERVE_QUEUE_TIMEOUT_S" in text
