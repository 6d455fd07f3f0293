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


def test_a_failure_before_the_first_token_is_retried_once_with_a_new_ring_id():
    book = RequestBook()
    request = new_request()
    book.submit(request)
    first_rid, stable_id = request.rid, request.id
    actions = book.on_failed(messages.Failed("m", first_rid, "the direct link broke", stage=0))
    cancel, resend = actions
    assert cancel == ToStage0("m", messages.Cancel("m", first_rid))  # frees what the first attempt left
    assert isinstance(resend.message, messages.Generate) and resend.message.rid == request.rid != first_rid
    assert request.id == stable_id and not request.ended
    # tokens of the first attempt that arrive late are not the reply's
    book.on_tokens(tokens(first_rid, [99]))
    assert request.tokens == []
    # a second failure ends it
    actions = book.on_failed(messages.Failed("m", request.rid, "still broken"))
    assert actions == [ToStage0("m", messages.Cancel("m", request.rid))]
    assert request.error == "still broken" and book.by_rid == {}


def test_a_failure_after_tokens_streamed_ends_the_request():
    book = RequestBook()
    request = new_request()
    book.submit(request)
    book.on_tokens(tokens(request.rid, [5]))
    book.on_failed(messages.Failed("m", request.rid, "stage 1 failed"))
    assert request.error == "stage 1 failed" and request.tokens == [5]


def test_not_loaded_on_a_fellow_marks_the_model():
    book = RequestBook()
    request = new_request()
    book.submit(request)
    actions = book.on_failed(messages.Failed("m", request.rid, "model m is not loaded on f1", not_loaded=True))
    assert NotLoaded("m", "model m is not loaded on f1") in actions
    assert request.error and request.ended


def test_a_broken_path_resends_requests_with_nothing_streamed_and_ends_the_others():
    book = RequestBook()
    fresh, streaming, elsewhere = new_request(), new_request(), new_request(model="other")
    for r in (fresh, streaming, elsewhere):
        book.submit(r)
    book.on_tokens(tokens(streaming.rid, [4, 4]))
    old = fresh.rid
    actions = book.on_path_lost("m")
    generates = [a.message for a in actions if isinstance(a.message, messages.Generate)]
    assert [g.rid for g in generates] == [fresh.rid] and fresh.rid != old
    assert streaming.error and not fresh.ended and not elsewhere.ended


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
