"""The ring protocol as plain logic (swarm.stage.protocol), run by LocalRing with a toy model: no sockets, no threads.

The toy "model" is deterministic arithmetic with real KV-cache bookkeeping: each stage keeps, per request, the
positions it has seen and refuses a chunk that does not start where its cache ends (as StageModel does), so these
tests check what the protocol asks of a stage, not only what comes out.
"""

from __future__ import annotations

import pytest
import torch

from swarm import messages, wire
from swarm.errors import ProtocolError
from swarm.stage.local import LocalRing
from swarm.stage.protocol import Output, Release, Report, Send, StageProtocol

EOS = 2


def toy_next(token: int, pos: int) -> int:
    """The toy model's next token after ``token`` at position ``pos`` (never EOS unless it lands there)."""
    return (token * 7 + pos * 3) % 97 + 3


def toy_reference(prompt: list[int], max_tokens: int, eos=(EOS,)) -> tuple[list[int], str]:
    out, token, pos = [], prompt[-1], len(prompt) - 1
    while True:
        token = toy_next(token, pos)
        out.append(token)
        pos += 1
        if token in eos:
            return out, "stop"
        if len(out) == max_tokens:
            return out, "length"


class ToyStage:
    """Per-request caches: the list of positions this stage computed."""

    def __init__(self, index: int, num_stages: int):
        self.index, self.num_stages = index, num_stages
        self.caches: dict[str, list[int]] = {}
        self.batches: list[list[str]] = []

    def drop(self, rid: str) -> None:
        self.caches.pop(rid, None)


def toy_execute(fail_on: set[tuple[int, str]] = frozenset()):
    def execute(stage: ToyStage, batch) -> Output:
        stage.batches.append([w.rid for w in batch])
        rows, tokens = [], []
        for work in batch:
            if (stage.index, work.rid) in fail_on:
                raise RuntimeError(f"boom on {work.rid}")
            if work.start:
                stage.caches[work.rid] = []
            cache = stage.caches[work.rid]
            assert work.pos == len(cache), f"stage {stage.index}: {work.rid} chunk at {work.pos}, cache {len(cache)}"
            cache.extend(range(work.pos, work.pos + work.n))
            ids = work.ids if work.ids is not None else \
                work.rows.source.tensor()[0, work.rows.row : work.rows.row + work.n, 0].tolist()
            rows += ids
            if stage.index == stage.num_stages - 1:
                tokens.append(toy_next(ids[-1], work.pos + work.n - 1) if work.last else None)
        if stage.index == stage.num_stages - 1:
            return Output(tokens=tokens)
        return Output(hidden=wire.tensor_to_wire(torch.tensor(rows, dtype=torch.int64).reshape(1, -1, 1)))

    return execute


def ring(num_stages: int, chunk: int = 4, **kw) -> LocalRing:
    return LocalRing([ToyStage(i, num_stages) for i in range(num_stages)], prefill_chunk=chunk,
                     execute=toy_execute(**kw))


def assert_clean(r: LocalRing) -> None:
    assert r.holding() == [[] for _ in r.stages], "a stage still holds request state"
    assert all(stage.caches == {} for stage in r.stages), "a stage still holds a KV cache"


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
@pytest.mark.parametrize("prompt_len, chunk", [(1, 4), (4, 4), (10, 4), (9, 3), (17, 256)])
def test_chunked_prefill_then_decode_gives_the_reference_reply(num_stages, prompt_len, chunk):
    r = ring(num_stages, chunk)
    prompt = [(11 * i) % 90 + 5 for i in range(prompt_len)]
    reply = r.submit("a", prompt, 12, eos=[])
    r.run()
    want, _ = toy_reference(prompt, 12, eos=())
    assert reply.tokens == want and reply.finish_reason == "length"
    first = r.stages[0].batches
    assert len(first) == -(-prompt_len // chunk) + 11  # the prompt's chunks, then one step per token but the last
    assert_clean(r)


def test_end_of_turn_ends_the_reply_with_stop_and_frees_every_stage():
    prompt = [5, 6, 7]
    want, finish = toy_reference(prompt, 100, eos=(want_eos := toy_reference(prompt, 6, eos=())[0][5],))
    r = ring(3)
    reply = r.submit("a", prompt, 100, eos=[want_eos])
    r.run()
    assert (reply.tokens, reply.finish_reason) == (want, "stop") and reply.tokens[-1] == want_eos
    assert len(reply.tokens) == 6
    assert_clean(r)


@pytest.mark.parametrize("num_stages", [2, 3])
def test_cancel_mid_prefill_stops_the_prompt_and_frees_everything(num_stages):
    r = ring(num_stages, chunk=2)
    reply = r.submit("a", list(range(10, 40)), 5)
    for _ in range(4):  # a few chunks in
        r.step()
    assert 0 < len(r.stages[0].batches) < 15
    r.cancel("a")
    r.run()
    assert reply.tokens == [] and reply.finish_reason == "cancelled"
    assert len(r.stages[0].batches) < 15, "the prompt went on after the cancel"
    assert_clean(r)


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_cancel_mid_decode_stops_the_reply_and_frees_everything(num_stages):
    r = ring(num_stages)
    reply = r.submit("a", [3, 4, 5], 1000, eos=[])
    while len(reply.tokens) < 5:
        r.step()
    r.cancel("a")
    r.run()
    assert 5 <= len(reply.tokens) < 10
    assert_clean(r)


@pytest.mark.parametrize("failing_stage", [0, 1, 2])
def test_a_failing_request_does_not_touch_the_others(failing_stage):
    r = ring(3, fail_on={(failing_stage, "bad")})
    good = r.submit("good", [9, 8, 7, 6, 5], 20, eos=[])
    bad = r.submit("bad", [1, 2, 3], 20, eos=[])
    other = r.submit("other", [4, 4, 4, 4, 4, 4], 20, eos=[])
    r.run()
    assert bad.error is not None and f"stage {failing_stage}" in bad.error and "boom" in bad.error
    assert (good.tokens, good.finish_reason) == (toy_reference([9, 8, 7, 6, 5], 20, eos=())[0], "length")
    assert other.tokens == toy_reference([4] * 6, 20, eos=())[0]
    assert_clean(r)


def test_requests_interleave_round_robin_so_a_long_prompt_holds_others_by_one_chunk():
    r = ring(2, chunk=2)
    long = r.submit("long", list(range(10, 50)), 3, eos=[])  # 20 chunks
    short = r.submit("short", [7, 8], 3, eos=[])
    r.run()
    assert long.tokens == toy_reference(list(range(10, 50)), 3, eos=())[0]
    assert short.tokens == toy_reference([7, 8], 3, eos=())[0]
    order = [rids[0] for rids in r.stages[0].batches]
    # "short"'s one chunk runs right after "long"'s first, and its decode steps run between "long"'s chunks
    assert order[:2] == ["long", "short"]
    assert order.index("short", 2) < 10
    assert_clean(r)


def test_many_requests_at_once_each_get_their_own_reply():
    r = ring(3, chunk=3)
    prompts = {f"r{i}": [(i * 13 + j) % 80 + 5 for j in range(3 + i)] for i in range(8)}
    replies = {rid: r.submit(rid, p, 4 + rid.__len__() + int(rid[1:]), eos=[]) for rid, p in prompts.items()}
    r.run()
    for rid, reply in replies.items():
        assert reply.tokens == toy_reference(prompts[rid], 6 + int(rid[1:]), eos=())[0], rid
    assert_clean(r)


def test_a_failed_send_fails_the_requests_it_carried():
    p = StageProtocol(model="m", index=0, num_stages=2, prefill_chunk=4)
    assert p.receive(messages.Generate("m", "a", [1, 2, 3], 5, [], messages.Sampling())) == []
    batch = p.next_batch()
    hidden = wire.tensor_to_wire(torch.zeros(1, 3, 1))
    (send,) = p.computed(batch, Output(hidden=hidden))
    assert isinstance(send, Send) and [part.rid for part in send.message.parts] == ["a"]
    assert send.message.parts[0].start.max_tokens == 5
    actions = p.send_failed(send.message, "the link broke")
    assert Release("a") in actions
    (report,) = [a for a in actions if isinstance(a, Report)]
    assert report.message.rid == "a" and "the link broke" in report.message.message
    assert not any(isinstance(a, Send) for a in actions)  # nothing more goes to the broken link
    assert p.requests == {} and p.next_batch() == []


def test_a_stage_refuses_messages_that_are_not_for_it():
    middle = StageProtocol(model="m", index=1, num_stages=3)
    with pytest.raises(ProtocolError):
        middle.receive(messages.Generate("m", "a", [1], 5, [], messages.Sampling()))
    first = StageProtocol(model="m", index=0, num_stages=3)
    with pytest.raises(ProtocolError):
        first.receive(messages.Hidden("m", [], {}))


def test_late_messages_of_an_ended_request_are_ignored():
    last = StageProtocol(model="m", index=1, num_stages=2)
    hidden = wire.tensor_to_wire(torch.zeros(1, 1, 1))
    # a decode step of a request this stage never started (it was freed): no work, no crash
    assert last.receive(messages.Hidden("m", [messages.Part("gone", 7, 1, True)], hidden)) == []
    assert last.next_batch() == []
    first = StageProtocol(model="m", index=0, num_stages=2)
    assert first.receive(messages.Sampled("m", [messages.SampledToken("gone", 8, 5, False)])) == []
    assert first.receive(messages.Cancel("m", "gone")) == []


def test_an_empty_prompt_is_refused_with_a_failure_report():
    first = StageProtocol(model="m", index=0, num_stages=2)
    (report,) = first.receive(messages.Generate("m", "a", [], 5, [], messages.Sampling()))
    assert isinstance(report, Report) and "empty" in report.message.message
