"""A fellow that leaves hands its stages over first, while a streamed reply runs through them: a real leader (in
this process), fellows in this process, and the leaving fellow as a real `swarm join` process where it must really
go (SIGTERM, --force).

- SIGTERM of the fellow's process, no hot cover: the standby loads the stage while the old one serves, the ring
  switches, the reply is generate's and pauses only for the switch, not for the load;
- `swarm leave` with a hot cover: the ring switches at once, the reply pausing a few tokens' time (the goal is
  0.5 s; bench/drain_gap.py measures it);
- in both, the reply's KV goes over to the new ring (from the leaving process to the standby in the first): each
  stage of the new ring prefills only what came after the last whole block handed over;
- no fellow to take a stage: `swarm leave` and the admin API's Drain refuse, saying why; `--force` leaves with
  failover, and the stage is loaded again once a fellow joins.

Each test starts its own small fleet: the leader lives in the test's trio run, and the fellow processes go.
"""

from __future__ import annotations

import json
import signal
import sys

import pytest
import torch
import trio

from exactness import check_reply, reference
from fleet import FellowProcess, logs
from harness import running_swarm, wait_until
from swarm.config import Settings
from swarm.fellow.process import Fellow

pytestmark = pytest.mark.e2e

PROMPT = [{"role": "user", "content": "List the numbers from 1 to 80, separated by commas."}]  # no near-tie
TOKENS = 90
HOT_COVER_GAP_S = 0.5  # the promise for a drain with a hot cover


@pytest.fixture(scope="module")
def expected(smollm_model_dir):
    from reference_model import load_reference_model
    from swarm.leader.chat.chat_format import encode_chat

    model = load_reference_model(smollm_model_dir, dtype=torch.float32)
    prompt = encode_chat(smollm_model_dir, PROMPT, None)
    tokens, margins = reference(model, prompt, TOKENS, eos=[2])
    return tokens, margins


PROGRESS: dict = {}  # the last stream's progress, shown when a test fails


async def stream_while(swarm, name: str, act, at: int = 12) -> dict:
    """Stream the prompt's reply; once ``at`` chunks came, start ``act()`` beside it. -> {"text", "arrivals" (each
    chunk's time), "request" (the leader's), "acted" (act's result)}"""
    out: dict = {"text": [], "arrivals": [], "tokens": []}
    PROGRESS.clear()
    PROGRESS.update(out=out, began=trio.current_time())
    body = {"model": name, "messages": PROMPT, "temperature": 0, "max_tokens": TOKENS, "stream": True}
    async with trio.open_nursery() as nursery:
        async def run_act():
            out["acted"] = await act()

        async with swarm.http.stream("POST", "/v1/chat/completions", json=body, timeout=300) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                assert "error" not in data, data
                if data["choices"][0]["delta"].get("content"):
                    if "request" not in out:
                        out["request"] = next(iter(swarm.leader.serving.requests.values()))
                        nursery.start_soon(watch, out)
                    out["text"].append(data["choices"][0]["delta"]["content"])
                    out["arrivals"].append(trio.current_time())
                    if len(out["arrivals"]) == at:
                        PROGRESS["acted_at"] = trio.current_time()
                        nursery.start_soon(run_act)
    out["text"] = "".join(out["text"])
    return out


async def watch(out: dict) -> None:
    """(time, tokens, attempt) of the leader's request whenever its tokens or its attempt change, until it ends."""
    request, last = out["request"], None
    while not request.ended:
        now = (len(request.tokens), request.attempts)
        if now != last:
            out["tokens"].append((trio.current_time(), *now))
            last = now
        await trio.sleep(0.002)


def progress() -> str:
    """Where the last stream stood: chunks and their times since it began, when act started."""
    out, began = PROGRESS.get("out", {}), PROGRESS.get("began", 0.0)
    times = [round(t - began, 2) for t in out.get("arrivals", [])]
    acted = PROGRESS.get("acted_at")
    return f"{len(times)} chunks at {times}; act at {None if acted is None else round(acted - began, 2)}"


def longest_gap(arrivals: list[float]) -> float:
    return max(b - a for a, b in zip(arrivals, arrivals[1:]))


def token_pace(result: dict) -> float:
    """The median time between two of the reply's tokens before the switch, as the leader streamed them."""
    marks = result["tokens"]
    resumed = next(i for i, (_, _, attempt) in enumerate(marks) if attempt == 2)
    times = [t for t, n, _ in marks[:resumed]]
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    return gaps[len(gaps) // 2]


def switch_gap(result: dict) -> float:
    """The reply's pause across the switch, as the leader streams it: from the old ring's last token to the new
    ring's first (the leader's tokens, watched every 2 ms)."""
    marks = result["tokens"]
    resumed = next(i for i, (_, _, attempt) in enumerate(marks) if attempt == 2)
    first_new = next(t for t, n, attempt in marks[resumed:] if n > marks[resumed][1])
    last_old = max(t for t, n, attempt in marks[:resumed] if n == marks[resumed][1])
    return first_new - last_old


def check_carried(swarm, result: dict) -> int:
    """The switch handed the request's KV over (swarm.leader.serving.kv_carry): each stage of the new ring computed
    only the tokens after the blocks carried. -> how many blocks were."""
    from swarm.leader.serving.prefix_index import BLOCK_TOKENS

    switch = swarm.leader.serving.drains.switches[-1]
    request, marks = result["request"], result["tokens"]
    streamed = next(n for _, n, attempt in marks if attempt == 2)  # when it was sent again
    assert switch.carried >= 1 and 0 < len(request.prompt) + streamed - BLOCK_TOKENS * switch.carried <= BLOCK_TOKENS \
        + 12, (switch.carried, len(request.prompt), streamed)  # (a few tokens may stream during the handover)
    prefills = [t.prefill_tokens for _, t in sorted(request.stage_times.items())]
    assert prefills == [len(request.prompt) + streamed - BLOCK_TOKENS * switch.carried] * len(prefills), prefills
    return switch.carried


def check_exact(swarm, result: dict, expected, model_dir) -> str:
    from swarm.leader.chat.chat_format import load_tokenizer

    want, margins = expected
    request = result["request"]
    assert request.error is None and request.finish_reason in ("stop", "length"), request.error
    assert request.attempts == 2, "the ring did not switch under the reply"  # it went on from its streamed tokens
    outcome = check_reply(request.tokens, want, margins)
    # the stream paused and went on: no token lost, none repeated
    assert result["text"] == load_tokenizer(str(model_dir)).decode(request.tokens, skip_special_tokens=True)
    return outcome


async def set_standby(swarm, name: str) -> None:
    fellow_id = next(c.id for c in swarm.leader.hub.online.values() if c.name == name)
    assert (await swarm.http.put(f"/api/v1/fellows/{fellow_id}", json={"standby": True})).status_code == 200


async def swarm_leave(data_dir, *extra: str) -> trio.Process:
    """`swarm leave` on a fellow's machine (its data dir)."""
    return await trio.run_process([sys.executable, "-m", "swarm", "leave", "--data-dir", str(data_dir), *extra],
                                  capture_stdout=True, capture_stderr=True, check=False)


def stage_fellows(swarm, name: str) -> list[str]:
    return [s.plan.fellow_name for s in swarm.leader.serving.models[name].stages]


async def test_sigterm_hands_the_stage_to_the_standby_while_the_reply_streams(tmp_path, smollm_model_dir,
                                                                              expected):
    name = smollm_model_dir.name
    with trio.fail_after(280):
        async with running_swarm(tmp_path, [smollm_model_dir], fellows=2) as swarm:
            await set_standby(swarm, "fellow-1")  # in this process: it loads the stage in seconds
            leaving = FellowProcess(swarm.url, swarm.join_token(1), tmp_path / "leaving", "leaving",
                                    env={"SWARM_CALIBRATE": "0", "SWARM_LEAVE_WAIT_S": "150"}).start()
            try:
                await wait_until(lambda: len(swarm.leader.hub.online) == 3, 120, message=leaving.log)
                await swarm.load(name, 2, timeout=180)
                index = stage_fellows(swarm, name).index("leaving")
                serving = swarm.leader.serving.models[name]

                async def sigterm():
                    leaving.proc.send_signal(signal.SIGTERM)
                    signalled = trio.current_time()
                    # the ring switches once the standby has loaded the stage (its cover is then its stage)
                    await wait_until(lambda: serving.stages[index].plan.fellow_name == "fellow-1", 150)
                    return trio.current_time() - signalled  # the standby's load (and the switch): the old stage served

                result = await stream_while(swarm, name, sigterm)
                outcome = check_exact(swarm, result, expected, smollm_model_dir)
                assert await trio.to_thread.run_sync(leaving.proc.wait, 60) == 0
                assert f"handed over stage {index} of {name} to fellow-1" in leaving.log(), leaving.log()
                assert stage_fellows(swarm, name)[index] == "fellow-1" and serving.status == "ready"
                gap, load_s = switch_gap(result), result["acted"]
                carried = check_carried(swarm, result)  # the leaving process's blocks went to the standby
                print(f"drain without hot cover: the standby loaded for {load_s:.2f} s, the stream paused "
                      f"{gap:.2f} s at the switch (longest gap {longest_gap(result['arrivals']):.2f} s), "
                      f"{carried} KV blocks handed over; the reply is {outcome}")
                assert gap < load_s  # the old stage served while the new one loaded
            except BaseException:
                print(logs([leaving]), progress())
                raise
            finally:
                leaving.stop()


async def test_swarm_leave_with_a_hot_cover_switches_at_once(tmp_path, smollm_model_dir, expected):
    name = smollm_model_dir.name
    with trio.fail_after(280):
        async with running_swarm(tmp_path, [smollm_model_dir], fellows=3,
                                 leader_env={"SWARM_SERVE_HOT_COVER": "1"}) as swarm:
            await set_standby(swarm, "fellow-2")
            await swarm.load(name, 2)
            serving = swarm.leader.serving.models[name]
            await wait_until(lambda: any(s.cover_ready for s in serving.stages), 60)
            index = next(i for i, s in enumerate(serving.stages) if s.cover_ready)
            leaving = swarm.fellows[[f.name for f in swarm.fellows].index(serving.stages[index].plan.fellow_name)]

            async def leave():
                return await swarm_leave(leaving.data_dir)

            try:
                result = await stream_while(swarm, name, leave)
            except BaseException:
                print(progress())
                raise
            outcome = check_exact(swarm, result, expected, smollm_model_dir)
            done = result["acted"]
            assert done.returncode == 0, done.stderr
            assert f"handed over stage {index} of {name} to fellow-2 (hot cover)" in done.stdout.decode()
            assert stage_fellows(swarm, name)[index] == "fellow-2" and serving.status == "ready"
            await wait_until(lambda: not leaving.stages, 10)  # it unloaded its stage
            gap, pace = switch_gap(result), token_pace(result)
            [switch] = swarm.leader.serving.drains.switches
            assert switch.last_token_at is not None
            after_token = switch.switched_at - switch.last_token_at
            check_carried(swarm, result)
            print(f"drain with hot cover: the stream paused {gap:.2f} s at the switch, tokens came every {pace:.2f} s "
                  f"before it (longest gap {longest_gap(result['arrivals']):.2f} s), the switch came "
                  f"{1000 * after_token:.0f} ms after a token, the new ring linked in "
                  f"{1000 * (switch.linked_at - switch.switched_at):.0f} ms and, {switch.carried} KV blocks handed "
                  "over, prefilled "
                  + ", ".join(f"{t.prefill_tokens} tokens in {1000 * t.prefill_s:.0f} ms on stage {i}"
                              for i, t in sorted(result["request"].stage_times.items()))
                  + f"; the reply is {outcome}")
            # the switch waited for a token boundary: it came right after a token, not anywhere in the step after
            assert after_token < min(0.25, pace / 2), (after_token, pace)
            # 0.5 s is the goal on a machine of its own (bench/drain_gap.py); on one shared with other suites
            # every step of the switch (relinking, opening the new hops, prefilling the reply so far) runs at the
            # machine's pace: measured here 1.19 s with tokens every 0.20 s, 2.83 s at load 12. What the test holds
            # to is that the pause is a few tokens' time, never a load's (~11 s here without a cover); a fresh-clone
            # CI run measured 0.90 s with tokens every 0.10 s.
            assert gap < max(3.0, 15 * pace)


async def test_with_nobody_to_take_a_stage_leave_refuses_and_force_fails_over(tmp_path, smollm_model_dir):
    name = smollm_model_dir.name
    with trio.fail_after(280):
        async with running_swarm(tmp_path, [smollm_model_dir], fellows=1) as swarm:
            leaving = FellowProcess(swarm.url, swarm.join_token(1), tmp_path / "leaving", "leaving",
                                    env={"SWARM_CALIBRATE": "0"}).start()
            try:
                await wait_until(lambda: len(swarm.leader.hub.online) == 2, 120, message=leaving.log)
                await swarm.load(name, 2, timeout=180)
                index = stage_fellows(swarm, name).index("leaving")
                refused = await swarm_leave(leaving.data_dir)
                assert refused.returncode == 1
                err = refused.stderr.decode()
                assert f"no fellow can take stage {index} of {name} from leaving" in err and "--force" in err, err
                fellow_id = next(c.id for c in swarm.leader.hub.online.values() if c.name == "leaving")
                response = await swarm.http.post(f"/api/v1/fellows/{fellow_id}/drain", json={})
                assert response.status_code == 409 and response.json()["error"]["code"] == "drain_refused"
                assert leaving.proc.poll() is None and swarm.leader.serving.status(name) == "ready"  # it stays

                forced = await swarm_leave(leaving.data_dir, "--force")
                assert forced.returncode == 0, forced.stderr
                assert "fails over" in forced.stdout.decode()
                assert await trio.to_thread.run_sync(leaving.proc.wait, 60) == 0
                await wait_until(lambda: swarm.leader.serving.status(name) == "recovering", 30)
                # a fellow joins: the failover loads the stage there
                settings = Settings.from_env({"SWARM_SERVE_PORT": "0", "SWARM_HEARTBEAT_S": "1",
                                              "SWARM_CALIBRATE": "0"})
                async with trio.open_nursery() as nursery:
                    joined = Fellow(leader_url=swarm.url, data_dir=tmp_path / "joined", settings=settings,
                                    name="joined", join_token=swarm.join_token(1))
                    await nursery.start(joined.run)
                    await wait_until(lambda: swarm.leader.serving.status(name) == "ready", 120)
                    assert stage_fellows(swarm, name)[index] == "joined"
                    nursery.cancel_scope.cancel()
            except BaseException:
                print(logs([leaving]), progress())
                raise
            finally:
                leaving.stop()
