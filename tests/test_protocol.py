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
from swarm.stage.protocol import StageProtocol
from swarm.stage.protocol_records import Output, Release, Report, Send

EOS = 2


def toy_next(token: int, pos: int, seed: int | None = None) -> int:
    """The toy model's next token after ``token`` at position ``pos`` (never EOS unless it lands there); a seed
    stands for sampling: another seed, another reply."""
    base = (token * 7 + pos * 3) % 97 + 3
    return base if seed is None else (base + seed * 11) % 97 + 3


def toy_reference(prompt: list[int], max_tokens: int, eos=(EOS,), seed: int | None = None) -> tuple[list[int], str]:
    out, token, pos = [], prompt[-1], len(prompt) - 1
    while True:
        token = toy_next(token, pos, seed)
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
        rows, tokens, fanned = [], [], []
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
            members = work.request.members if work.fans_out else []
            for member in members:  # a group's last prompt chunk: each sibling gets a copy of the cache
                stage.caches[member.rid] = list(cache)
            if members:
                del stage.caches[work.rid]
            if stage.index == stage.num_stages - 1:
                pos = work.pos + work.n - 1
                fanned.append([(toy_next(ids[-1], pos, m.sampling.seed), None) for m in members] or None)
                tokens.append(toy_next(ids[-1], pos, work.request.sampling.seed) if work.last and not members
                              else None)
        if stage.index == stage.num_stages - 1:
            return Output(tokens=tokens, fanned=fanned if any(fanned) else None)
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


# --- groups: sampled choices of one prompt, prefilled once ------------------------------------------------------------


SEEDS = [("c0", 11), ("c1", 22), ("c2", 33), ("c3", None)]


@pytest.mark.parametrize("num_stages", [1, 2, 3])
@pytest.mark.parametrize("prompt_len, chunk", [(1, 4), (4, 4), (10, 4), (9, 3)])
def test_a_group_prefills_once_and_each_sibling_decodes_its_own_reply(num_stages, prompt_len, chunk):
    prompt = [(11 * i) % 90 + 5 for i in range(prompt_len)]
    r = ring(num_stages, chunk)
    replies = r.submit_group("g", SEEDS, prompt, 9, eos=[])
    r.run()
    for rid, seed in SEEDS:  # what n separate requests with these seeds give
        assert (replies[rid].tokens, replies[rid].finish_reason) == (toy_reference(prompt, 9, (), seed)[0], "length")
    assert [p.prefill_tokens for p in r.protocols] == [prompt_len] * num_stages  # once, not once per sibling
    assert sum(rids == ["g"] for rids in r.stages[0].batches) == -(-prompt_len // chunk)
    apart = ring(num_stages, chunk)
    for rid, seed in SEEDS:
        apart.submit(rid, prompt, 9, messages.Sampling(seed=seed), eos=[])
    apart.run()
    assert [p.prefill_tokens for p in apart.protocols] == [4 * prompt_len] * num_stages
    assert {rid: apart.replies[rid].tokens for rid, _ in SEEDS} == {rid: replies[rid].tokens for rid, _ in SEEDS}
    assert_clean(r)


def test_siblings_end_on_their_own_eos():
    prompt = [5, 6, 7]
    eos = toy_reference(prompt, 4, (), 22)[0][3]  # c1's fourth token
    r = ring(2)
    replies = r.submit_group("g", SEEDS, prompt, 30, eos=[eos])
    r.run()
    assert (replies["c1"].tokens, replies["c1"].finish_reason) == toy_reference(prompt, 30, (eos,), 22)
    for rid, seed in SEEDS:
        assert (replies[rid].tokens, replies[rid].finish_reason) == toy_reference(prompt, 30, (eos,), seed)
    assert_clean(r)


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_a_sibling_cancelled_before_the_copy_is_left_out_and_the_others_go_on(num_stages):
    prompt = list(range(10, 30))
    r = ring(num_stages, chunk=2)
    replies = r.submit_group("g", SEEDS, prompt, 6, eos=[])
    for _ in range(3):  # a few chunks in
        r.step()
    r.cancel("c1")
    r.run()
    assert replies["c1"].tokens == [] and replies["c1"].finish_reason == "cancelled"
    for rid, seed in SEEDS:
        if rid != "c1":
            assert replies[rid].tokens == toy_reference(prompt, 6, (), seed)[0]
    assert all("c1" not in rids for stage in r.stages for rids in stage.batches)  # never a cache, never a step
    assert_clean(r)


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_a_sibling_cancelled_mid_decode_frees_only_its_cache(num_stages):
    prompt = [3, 4, 5]
    r = ring(num_stages)
    replies = r.submit_group("g", SEEDS, prompt, 40, eos=[])
    while len(replies["c2"].tokens) < 3:
        r.step()
    r.cancel("c2")
    for _ in range(3 * num_stages):
        r.step()
    assert all("c2" not in stage.caches for stage in r.stages)
    assert all({"c0", "c1", "c3"} <= set(stage.caches) for stage in r.stages)  # the others' caches are untouched
    r.run()
    assert 3 <= len(replies["c2"].tokens) < 10
    for rid, seed in SEEDS:
        if rid != "c2":
            assert replies[rid].tokens == toy_reference(prompt, 40, (), seed)[0]
    assert_clean(r)


@pytest.mark.parametrize("num_stages", [2, 3])
def test_cancelling_every_sibling_mid_prefill_stops_the_prompt(num_stages):
    r = ring(num_stages, chunk=2)
    replies = r.submit_group("g", SEEDS, list(range(10, 40)), 5)
    for _ in range(4):
        r.step()
    for rid, _ in SEEDS:
        r.cancel(rid)
    r.run()
    assert all(reply.tokens == [] for reply in replies.values())
    assert len(r.stages[0].batches) < 15, "the prompt went on after every sibling was cancelled"
    assert_clean(r)


@pytest.mark.parametrize("failing_stage", [0, 1, 2])
def test_a_failing_prefill_fails_every_sibling_and_nothing_else(failing_stage):
    r = ring(3, chunk=2, fail_on={(failing_stage, "g")})
    other = r.submit("other", [4, 4, 4, 4, 4], 8, eos=[])
    replies = r.submit_group("g", SEEDS, [9, 8, 7, 6, 5], 8, eos=[])
    r.run()
    for reply in replies.values():
        assert reply.error is not None and f"stage {failing_stage}" in reply.error and reply.tokens == []
    assert other.tokens == toy_reference([4] * 5, 8, eos=())[0]
    assert_clean(r)


def test_a_failed_send_of_a_groups_last_chunk_fails_its_siblings():
    p = StageProtocol(model="m", index=0, num_stages=2, prefill_chunk=4)
    group = [messages.Sibling("a", 1), messages.Sibling("b", 2)]
    assert p.receive(messages.Generate("m", "g", [1, 2, 3], 5, [], messages.Sampling(temperature=1.0),
                                       siblings=group)) == []
    release, send = p.computed(p.next_batch(), Output(hidden=wire.tensor_to_wire(torch.zeros(1, 3, 1))))
    assert release == Release("g")  # the carrier's cache went to the siblings: it is done here
    (part,) = send.message.parts
    assert (part.rid, part.siblings, part.start.group) == ("g", group, ["a", "b"])
    assert sorted(p.requests) == ["a", "b"]  # the carrier is done here; the siblings wait for their first tokens
    actions = p.send_failed(send.message, "the link broke")
    assert sorted(a.message.rid for a in actions if isinstance(a, Report)) == ["a", "b", "g"]
    assert p.requests == {}


def test_a_group_start_travels_on_the_wire_and_names_its_replies():
    message = messages.Generate("m", "g", [1, 2], 5, [2], messages.Sampling(temperature=0.7),
                                siblings=[messages.Sibling("a", 1), messages.Sibling("b", None)])
    assert wire.decode_message(wire.encode(message)) == message
    assert message.rids == ["a", "b"]
    assert messages.Generate("m", "g", [1], 5, [], messages.Sampling()).rids == ["g"]
    clash = StageProtocol(model="m", index=0, num_stages=1)
    clash.receive(messages.Generate("m", "a", [1], 5, [], messages.Sampling()))
    reports = clash.receive(message)
    assert [r.message.rid for r in reports] == ["a", "b"] and "already" in reports[0].message.message
