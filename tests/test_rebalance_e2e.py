"""A live move (issue 37, SWARM_SERVE_REBALANCE): a leader and three fellows in one process, the built-in model over
two of them. The idle third fellow and one of the two serving are made out (by their calibration) to decode four times
faster than the other (so that a move of its stage, not a re-layout, is the clear choice); the admin API proposes
moving that stage to the idle one, applying the proposal moves the stage the drain's way (load beside,
switch between two tokens, unload the old stage), and the greedy reply afterwards is the one from before the move."""

from __future__ import annotations

import pytest
import trio

from harness import running_swarm, wait_until
from swarm.leader.serving.prefix_index import BLOCK_TOKENS

pytestmark = pytest.mark.e2e


def calibration(ms_per_mb: float) -> dict:
    """A made-up speed (the fellows run with SWARM_CALIBRATE=0): a decode step of ``ms_per_mb`` ms per MB of layer."""
    return {"prefill_tokens": 256, "points": [
        {"weight_bytes": 1_000_000, "decode_ms": ms_per_mb, "prefill_ms": 30 * ms_per_mb},
        {"weight_bytes": 10_000_000, "decode_ms": 10 * ms_per_mb, "prefill_ms": 300 * ms_per_mb}]}


class Streamed:
    """A long greedy reply streaming while the ring changes, and the leader's view of it: (time, tokens streamed,
    attempt) at each change of its request."""

    def __init__(self, swarm, name: str, messages: list[dict], max_tokens: int):
        self.swarm, self.name, self.messages, self.max_tokens = swarm, name, messages, max_tokens
        self.replies: list[list[int]] = []
        self.marks: list[tuple[float, int, int]] = []
        self.running: list = []  # the leader's request
        self.done_at: float | None = None

    def start(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self._reply)
        nursery.start_soon(self._watch)

    async def _reply(self) -> None:
        reply = await self.swarm.chat(self.name, self.messages, max_tokens=self.max_tokens, ignore_eos=True)
        self.replies.append(reply["choices"][0]["token_ids"])
        self.done_at = trio.current_time()

    async def _watch(self) -> None:
        await wait_until(lambda: self.swarm.leader.serving.book.by_rid, 30)  # the reply is on the ring
        (request,) = self.swarm.leader.serving.book.by_rid.values()
        self.running.append(request)
        while not request.ended:
            if not self.marks or self.marks[-1][1:] != (len(request.tokens), request.attempts):
                self.marks.append((trio.current_time(), len(request.tokens), request.attempts))
            await trio.sleep(0.002)

    def switch(self) -> tuple[float, float, int]:
        """The switch came while the reply streamed: it went on once, from its streamed tokens, on the new ring. ->
        (the pause at the switch, the median time between tokens before it, the tokens streamed before it)."""
        marks = self.marks
        assert marks[-1][2] == 2, marks[-1]
        resumed = next(i for i, m in enumerate(marks) if m[2] == 2)
        last_old = max(t for t, n, _ in marks[:resumed] if n == marks[resumed][1])
        first_new = next(t for t, n, _ in marks[resumed:] if n > marks[resumed][1])
        gaps = sorted(b[0] - a[0] for a, b in zip(marks[:resumed], marks[1:resumed]))
        return first_new - last_old, gaps[len(gaps) // 2], marks[resumed][1]

    def tail(self, carried: int, streamed: int) -> int:
        """The tokens the new ring computes after the ``carried`` KV blocks: the prompt's and the streamed ones."""
        return len(self.running[0].prompt) + streamed - BLOCK_TOKENS * carried


async def test_a_stage_moves_to_a_faster_idle_fellow_on_request(tmp_path, smollm_model_dir):
    name = smollm_model_dir.name
    messages = [{"role": "user", "content": "Name three colours."}]
    with trio.fail_after(240):
        async with running_swarm(tmp_path, [smollm_model_dir], fellows=3) as swarm:
            await swarm.load(name, 2)
            serving = swarm.leader.serving.models[name].fellow_ids
            (idle,) = set(swarm.leader.hub.online) - serving
            before = (await swarm.chat(name, messages, max_tokens=12))["choices"][0]["token_ids"]
            nothing = (await swarm.http.get("/api/v1/rebalance")).json()
            assert nothing == {"mode": "propose", "proposals": []}  # no speeds yet: nothing to weigh

            slow = min(serving)
            for conn in swarm.leader.hub.online.values():
                conn.calibration = calibration(4.0 if conn.id == slow else 1.0)
            proposals = (await swarm.http.get("/api/v1/rebalance")).json()["proposals"]
            assert len(proposals) == 1, proposals
            (move,) = proposals[0]["moves"]
            assert move["to_id"] == idle and move["from_id"] == slow
            assert proposals[0]["speedup"] >= 1.3 and proposals[0]["text"].startswith(f"{name}: move stage ")

            applied = await swarm.http.post("/api/v1/rebalance", json={"model": name}, timeout=120)
            assert applied.status_code == 200, applied.text
            assert f"moved from {move['from_name']} to {move['to_name']}" in applied.json()["done"]
            model = swarm.leader.serving.models[name]
            await wait_until(lambda: model.status == "ready", 60)
            assert model.stages[move["index"]].plan.fellow_id == idle
            after = (await swarm.chat(name, messages, max_tokens=12))["choices"][0]["token_ids"]
            assert after == before
            # moved already: nothing more to propose, and asking to apply says so
            assert (await swarm.http.get("/api/v1/rebalance")).json()["proposals"] == []
            again = await swarm.http.post("/api/v1/rebalance", json={"model": name})
            assert again.status_code == 400 and "no live move is proposed" in again.json()["error"]["message"]


async def test_auto_moves_a_stage_mid_reply_and_the_reply_stays_exact(tmp_path, smollm_model_dir, monkeypatch):
    """SWARM_SERVE_REBALANCE=auto: a faster fellow shows up while a long greedy reply streams; the leader moves a
    stage to it by itself, between two tokens, and the reply is token for token the one of an uninterrupted run."""
    from swarm.leader.serving import rebalance

    monkeypatch.setattr(rebalance, "SETTLE_S", 0.2)
    name = smollm_model_dir.name
    messages = [{"role": "user", "content": "List the numbers from 1 to 80, separated by commas."}]
    with trio.fail_after(280):
        async with running_swarm(tmp_path, [smollm_model_dir], fellows=3,
                                 leader_env={"SWARM_SERVE_REBALANCE": "auto"}) as swarm:
            await swarm.load(name, 2)
            model = swarm.leader.serving.models[name]
            (idle,) = set(swarm.leader.hub.online) - model.fellow_ids
            reference = (await swarm.chat(name, messages, max_tokens=200, ignore_eos=True))["choices"][0]["token_ids"]
            times: dict[str, float] = {}
            replies: list[list[int]] = []

            async def long_reply():
                reply = await swarm.chat(name, messages, max_tokens=200, ignore_eos=True)
                replies.append(reply["choices"][0]["token_ids"])
                times["done"] = trio.current_time()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(long_reply)
                await wait_until(lambda: swarm.leader.serving.book.by_rid, 30)  # the reply is on the ring
                await trio.sleep(0.5)
                slow = min(model.fellow_ids)
                for conn in swarm.leader.hub.online.values():
                    conn.calibration = calibration(4.0 if conn.id == slow else 1.0)
                swarm.leader.serving.rebalance.pool_changed()  # as a join or a link report does
                await wait_until(lambda: idle in model.fellow_ids and model.status == "ready", 120)
                times["moved"] = trio.current_time()
            assert times["moved"] < times["done"], times  # the switch came while the reply streamed
            assert replies == [reference]
            assert len(model.fellow_ids) == 2


async def test_auto_relays_the_model_out_onto_a_faster_fellow_that_joins_mid_reply(tmp_path, smollm_model_dir,
                                                                                  monkeypatch):
    """SWARM_SERVE_REBALANCE=auto, a re-layout: the model serves over two stages on two slow fellows; while a long
    greedy reply streams, a fellow four times faster with room for the whole model joins (a real `swarm join`
    process). The leader loads the whole model on it beside the ring, switches between two tokens from 2 stages to
    1, and unloads the old stages; the reply is token for token the one of an uninterrupted run. The request's KV
    goes over before the switch, each old stage's layers to the new one, which then computes only the tail."""
    from fleet import FellowProcess
    from swarm.leader.serving import rebalance

    monkeypatch.setattr(rebalance, "SETTLE_S", 0.2)
    name = smollm_model_dir.name
    # long enough (about 300 tokens) for a fellow process to start and load the whole model while it streams
    messages = [{"role": "user", "content": "List the numbers from 1 to 150, separated by commas."}]
    with trio.fail_after(280):
        async with running_swarm(tmp_path, [smollm_model_dir], fellows=2,
                                 leader_env={"SWARM_SERVE_REBALANCE": "auto"}) as swarm:
            await swarm.load(name, 2)
            model, online = swarm.leader.serving.models[name], swarm.leader.hub.online
            reference = (await swarm.chat(name, messages, max_tokens=300, ignore_eos=True))["choices"][0]["token_ids"]
            for conn in online.values():
                conn.calibration = calibration(4.0)
            streamed = Streamed(swarm, name, messages, 300)
            joined = None
            try:
                async with trio.open_nursery() as nursery:
                    streamed.start(nursery)
                    await wait_until(lambda: streamed.marks, 30)
                    joined = FellowProcess(swarm.url, swarm.join_token(), tmp_path / "fast", "fellow-fast",
                                           env={"SWARM_CALIBRATE": "0"}).start()
                    await wait_until(lambda: len(online) == 3, 90, message=lambda: joined.log())
                    (fast,) = set(online) - model.fellow_ids
                    online[fast].calibration = calibration(1.0)  # its speed, as its calibration would report it
                    swarm.leader.serving.rebalance.pool_changed()  # as its join and its links' report do
                    await wait_until(lambda: model.fellow_ids == {fast} and model.status == "ready", 120,
                                     message=lambda: joined.log())
                pause, every, before = streamed.switch()
                # the old stages' KV of the request went to the new stage (layers 0-14 from one, 15-29 from the
                # other): it computed only the tokens after the blocks carried (a few more may stream meanwhile)
                carried = swarm.leader.serving.rebalance.relayouts.carried
                tail = streamed.tail(carried, before)
                times_new = streamed.running[0].stage_times[0]  # the new stage's, of the attempt after the switch
                print(f"re-layout under a reply: paused {pause:.2f} s at the switch (tokens every {every:.2f} s "
                      f"before it), {before} tokens streamed, {carried} KV blocks handed over, "
                      f"{times_new.prefill_tokens} tokens prefilled in {1000 * times_new.prefill_s:.0f} ms")
                assert streamed.replies == [reference]
                assert carried >= 1 and 0 < tail <= BLOCK_TOKENS + 12, (carried, before)
                assert times_new.prefill_tokens == tail
                layers = len(model.size.layer_bytes)
                assert [(s.plan.first_layer, s.plan.end_layer) for s in model.stages] == [(0, layers)]
                # the old stages are unloaded from the two fellows that held them
                await wait_until(lambda: not any(name in f.stages for f in swarm.fellows), 30)
                after = (await swarm.chat(name, messages, max_tokens=12))["choices"][0]["token_ids"]
                assert after == reference[:12]
            finally:
                if joined is not None:
                    joined.stop()


async def test_a_third_fellow_joins_mid_reply_and_the_ring_narrows_to_three_stages(tmp_path, smollm_model_dir,
                                                                                   monkeypatch):
    """SWARM_SERVE_REBALANCE=auto, a re-layout that narrows the ring's own fellows (swarm.stage.narrow): the model
    serves over fellow-0 (layers 0-14) and fellow-1 (15-29), each lent 0.58 GB; while a long greedy reply streams, a
    third fellow joins, 16 times faster, lent 0.53 GB -- too little for a whole stage of the ring (no move), enough
    for 10 layers. The leader loads layers 10-19 on it beside the ring; at the switch fellow-0 narrows to 0-9 and
    fellow-1 to 20-29 in place, freeing what they dropped. The reply is token for token the one of an uninterrupted
    run, and the ring is 3 stages."""
    from swarm.config import Settings
    from swarm.fellow import Fellow
    from swarm.leader.serving import rebalance

    monkeypatch.setattr(rebalance, "SETTLE_S", 0.2)
    name = smollm_model_dir.name
    messages = [{"role": "user", "content": "List the numbers from 1 to 80, separated by commas."}]
    with trio.fail_after(120):
        async with running_swarm(tmp_path, [smollm_model_dir], fellows=2, fellow_env={"SWARM_SERVE_MEMORY_GB": "0.58"},
                                 leader_env={"SWARM_SERVE_REBALANCE": "auto",
                                             "SWARM_SERVE_CONTEXT_TOKENS": "1024"}) as swarm:
            await swarm.load(name, 2)
            model, online = swarm.leader.serving.models[name], swarm.leader.hub.online
            assert [(s.plan.first_layer, s.plan.end_layer) for s in model.stages] == [(0, 15), (15, 30)]
            held = {f.name: f.stages[name].placement()["bytes"] for f in swarm.fellows}
            reference = (await swarm.chat(name, messages, max_tokens=160, ignore_eos=True))["choices"][0]["token_ids"]
            for conn in online.values():
                conn.calibration = calibration(8.0)
                # as a version that narrows but does not extend (swarm.stage.resplit): with one that does, the planner
                # takes a faster layout that shifts fellow-1's stage and gives the fast fellow the head (fellow-0
                # 0-9, fellow-1 10-20, fellow-2 21-29)
                conn.extending = False
            streamed = Streamed(swarm, name, messages, 160)

            settings = Settings.from_env({"SWARM_SERVE_PORT": "0", "SWARM_HEARTBEAT_S": "1", "SWARM_CALIBRATE": "0",
                                          "SWARM_SERVE_MEMORY_GB": "0.53"})
            third = Fellow(leader_url=swarm.url, data_dir=tmp_path / "fellow-2", settings=settings, name="fellow-2",
                           join_token=swarm.join_token())
            async with trio.open_nursery() as fellows:
                async with trio.open_nursery() as nursery:
                    streamed.start(nursery)
                    await wait_until(lambda: streamed.marks, 30)
                    await fellows.start(third.run)  # it joins while the reply streams
                    await third.connected.wait()
                    new = third.fellow_id
                    online[new].calibration = calibration(0.5)  # its speed, as its calibration would report it
                    swarm.leader.serving.rebalance.pool_changed()  # as its join and its links' report do
                    await wait_until(lambda: len(model.stages) == 3 and model.status == "ready", 60,
                                     message=lambda: str(swarm.leader.serving.rebalance.left_out))
                pause, every, before = streamed.switch()
                narrowed = {f.name: f.stages[name].placement()["bytes"] for f in swarm.fellows}
                print(f"narrowing re-layout under a reply: paused {pause:.2f} s at the switch (tokens every "
                      f"{every:.2f} s before it), {before} tokens streamed; weights held "
                      + ", ".join(f"{n} {held[n] / 1e6:.0f} -> {b / 1e6:.0f} MB" for n, b in narrowed.items()))
                assert streamed.replies == [reference]
                ids = {f.fellow_id: f.name for f in [*swarm.fellows, third]}
                assert [(ids[s.plan.fellow_id], s.plan.first_layer, s.plan.end_layer) for s in model.stages] == [
                    ("fellow-0", 0, 10), ("fellow-2", 10, 20), ("fellow-1", 20, 30)]
                # the ring's fellows narrowed in place: they hold their new layers only, and what they dropped is freed
                for fellow, (first, end) in zip(swarm.fellows, [(0, 10), (20, 30)]):
                    stage = fellow.stages[name]
                    assert (stage.first_layer, stage.end_layer) == (first, end)
                    assert stage.summary()["first_layer"] == first  # what a restarted leader adopts
                    assert narrowed[fellow.name] < held[fellow.name] - 70_000_000  # 5 layers of ~14 MB
                after = (await swarm.chat(name, messages, max_tokens=12))["choices"][0]["token_ids"]
                assert after == reference[:12]
                fellows.cancel_scope.cancel()


async def test_a_fast_ring_fellow_extends_its_stage_to_the_whole_model_mid_reply(tmp_path, smollm_model_dir,
                                                                                 monkeypatch):
    """SWARM_SERVE_REBALANCE=auto, a re-layout that extends a ring fellow's stage in place (swarm.stage.resplit): the
    model serves over two fellows (layers 0-14, 15-29); while a long greedy reply streams, the one holding the last
    stage is found 8 times faster than the other, with room for the whole model. It loads only layers 0-14 and the
    embedding beside its stage while the ring serves; at the switch it splices them in (2 stages -> 1), and the other
    fellow unloads. The reply is token for token the one of an uninterrupted run, and the request's KV went over: the
    fellow kept its own layers' blocks and got only layers 0-14's rows, so the new stage computed only the tail.
    Before, a try whose parts fail to load leaves the ring and the fellow's stage as they were."""
    from swarm.errors import ModelError
    from swarm.leader.serving import rebalance
    from swarm.stage.slice import StageModel

    monkeypatch.setattr(rebalance, "SETTLE_S", 0.2)
    name = smollm_model_dir.name
    messages = [{"role": "user", "content": "List the numbers from 1 to 80, separated by commas."}]
    with trio.fail_after(120):
        async with running_swarm(tmp_path, [smollm_model_dir], fellows=2,
                                 leader_env={"SWARM_SERVE_REBALANCE": "auto"}) as swarm:
            await swarm.load(name, 2)
            model, online = swarm.leader.serving.models[name], swarm.leader.hub.online
            assert [(s.plan.first_layer, s.plan.end_layer) for s in model.stages] == [(0, 15), (15, 30)]
            by_id = {f.fellow_id: f for f in swarm.fellows}
            slow, fast = (by_id[s.plan.fellow_id] for s in model.stages)
            held = fast.stages[name].placement()["bytes"]
            reference = (await swarm.chat(name, messages, max_tokens=80, ignore_eos=True))["choices"][0]["token_ids"]
            failing = {"on": True, "tries": 0}
            load = StageModel.load.__func__  # type: ignore[attr-defined]

            def failing_load(cls, *args, **kwargs):
                if failing["on"]:
                    failing["tries"] += 1
                    raise ModelError("out of memory (made up by the test)")
                return load(cls, *args, **kwargs)

            monkeypatch.setattr(StageModel, "load", classmethod(failing_load))
            online[slow.fellow_id].calibration = calibration(8.0)
            online[fast.fellow_id].calibration = calibration(1.0)
            swarm.leader.serving.rebalance.pool_changed()
            await wait_until(lambda: failing["tries"] and not model.relayout and not fast.loader.extending, 30)
            # given up: the ring serves as it was, the fellow's stage untouched and nothing held beside it
            assert [(s.plan.first_layer, s.plan.end_layer) for s in model.stages] == [(0, 15), (15, 30)]
            stage = fast.stages[name]
            assert (stage.first_layer, stage.end_layer, stage.extension) == (15, 30, None)
            assert stage.placement()["bytes"] == held
            streamed = Streamed(swarm, name, messages, 80)
            async with trio.open_nursery() as nursery:
                streamed.start(nursery)
                await wait_until(lambda: streamed.marks, 30)
                failing["on"] = False  # the parts load now
                swarm.leader.serving.rebalance.pool_changed()  # as a link report does
                await wait_until(lambda: len(model.stages) == 1 and model.status == "ready", 60,
                                 message=lambda: str(swarm.leader.serving.rebalance.left_out))
            pause, every, before = streamed.switch()
            grown = fast.stages[name].placement()["bytes"]
            # the KV went over: the fellow kept layers 15-29's blocks and joined layers 0-14's (from the other fellow)
            # at its splice, so it computed only the tokens after the blocks carried (a few more may stream meanwhile)
            carried = swarm.leader.serving.rebalance.relayouts.carried
            tail = streamed.tail(carried, before)
            times_new = streamed.running[0].stage_times[0]  # the new stage's, of the attempt after the switch
            print(f"extending re-layout under a reply: paused {pause:.2f} s at the switch (tokens every {every:.2f} s "
                  f"before it), {before} tokens streamed, {carried} KV blocks handed over, {times_new.prefill_tokens} "
                  f"tokens prefilled in {1000 * times_new.prefill_s:.0f} ms; weights held {held / 1e6:.0f} -> "
                  f"{grown / 1e6:.0f} MB")
            assert streamed.replies == [reference]
            assert carried >= 1 and 0 < tail <= BLOCK_TOKENS + 12, (carried, before)
            assert times_new.prefill_tokens == tail
            assert [(s.plan.fellow_id, s.plan.first_layer, s.plan.end_layer) for s in model.stages] == [
                (fast.fellow_id, 0, 30)]
            stage = fast.stages[name]
            assert (stage.first_layer, stage.end_layer, stage.extension) == (0, 30, None)
            assert stage.summary()["first_layer"] == 0 and stage.summary()["num_stages"] == 1  # what a leader adopts
            # 15 more layers of ~14 MB; the embedding is the tied head's matrix, held once
            assert 190_000_000 < grown - held < 240_000_000
            await wait_until(lambda: name not in slow.stages, 30)  # the other fellow unloaded
            after = (await swarm.chat(name, messages, max_tokens=12))["choices"][0]["token_ids"]
            assert after == reference[:12]
