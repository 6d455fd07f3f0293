"""Spot checks of the fellows' work on a real ring (leader and fellows in this process, the built-in model, float32
on CPU): three fellows serve the model's three stages, a standby holds a copy of the middle one and recomputes its
picked passes (hidden states in, hidden states out); the admin is told that stages 0 and 2 have no checker.
Honest fellows are never flagged over every pass checked; a fellow whose stage corrupts its hidden states (tests/
corrupt_stage.py) is caught, taken out of service and its stage moves to the standby, and replies are exact again."""

from __future__ import annotations

import pytest
import trio

from corrupt_stage import corrupting
from harness import running_swarm, wait_until
from swarm.config import Settings
from swarm.fellow.process import Fellow
from swarm.leader.serving.verify import MAX_PICKS, TOLERANCE_FLOAT32

pytestmark = pytest.mark.e2e

PROMPTS = [[{"role": "user", "content": text}] for text in
           ("Count from 1 to 10.", "Name three colours.", "What is the capital of France?")]
TOKENS = 16
HONEST_CHATS = 2  # two at a time: batched passes are checked against single-row recomputations
FRACTION = 0.1  # while the corrupt stage serves: 2 failures need ~2 / 0.1 = 20 passes, about one reply


async def settled(verifier) -> None:
    """Every sample that is coming has come and been recomputed."""
    await trio.sleep(1)
    await wait_until(lambda: not verifier.outstanding, 90)


async def test_honest_fellows_pass_every_check_and_a_corrupt_middle_stage_is_caught_and_taken_out(tmp_path,
                                                                                                  smollm_model_dir):
    name = smollm_model_dir.name
    with trio.fail_after(290):
        async with running_swarm(tmp_path, [smollm_model_dir], fellows=3) as swarm, trio.open_nursery() as nursery:
            settings = Settings.from_env({"SWARM_SERVE_PORT": "0", "SWARM_HEARTBEAT_S": "1", "SWARM_CALIBRATE": "0"})
            standby = Fellow(leader_url=swarm.url, data_dir=tmp_path / "standby", settings=settings,
                             name="standby", join_token=swarm.join_token(), standby=True)
            await nursery.start(standby.run)
            await standby.connected.wait()
            verifier = swarm.leader.serving.verifier
            await swarm.load(name, 3, timeout=240)
            model = swarm.leader.serving.models[name]
            index = 1  # the middle stage: its checker is placed by hand (covers go to the heaviest stages first)
            assert await swarm.leader.serving.recovery.place_cover(model, {0, 2}, "a copy to check it")
            await wait_until(lambda: model.stages[index].cover_ready, 240)
            put = await swarm.http.put("/api/v1/verification", json={"fraction": 1.0})
            assert put.status_code == 200 and put.json()["fraction"] == 1.0
            # the one standby checks stage 1; the page says what is not checked
            unchecked = put.json()["unchecked"]
            assert [u["stage"] for u in unchecked] == [0, 2]
            assert unchecked[0]["message"].startswith(f"no checker for stage 0 of {name}: no standby has room")
            bad_name = model.stages[index].plan.fellow_name
            print(f"{trio.current_time():.0f} loaded and covered", flush=True)

            # every pass of honest fellows checked (MAX_PICKS per stage and request), two chats at a time
            honest: dict[int, list[int]] = {}

            async def chat(i: int) -> None:
                reply = await swarm.chat(name, PROMPTS[i % len(PROMPTS)], max_tokens=TOKENS)
                honest.setdefault(i % len(PROMPTS), reply["choices"][0]["token_ids"])

            for first in range(0, HONEST_CHATS, 2):
                async with trio.open_nursery() as pair:
                    pair.start_soon(chat, first)
                    pair.start_soon(chat, first + 1)
            await settled(verifier)
            print(f"honest: {verifier.checks} checks, largest difference {verifier.largest_honest:.2e} "
                  f"(tolerance {TOLERANCE_FLOAT32:g})")
            assert verifier.failures == 0 and not verifier.alerts
            assert verifier.checks >= HONEST_CHATS * MAX_PICKS / 2  # replies may end before a pick

            # the checked stage goes bad
            put = await swarm.http.put("/api/v1/verification", json={"fraction": FRACTION})
            assert put.json()["fraction"] == FRACTION
            bad = swarm.stage(name, index).driver.stage_model
            chats = 0
            with corrupting(bad):
                while not verifier.alerts and chats < 8:
                    await swarm.chat(name, PROMPTS[0], max_tokens=TOKENS)
                    chats += 1
                    print(f"{trio.current_time():.0f} corrupt chat {chats}: {verifier.view()}", flush=True)
                    await settled(verifier)
            print(f"corrupt stage caught after {chats} replies (~{chats * TOKENS} passes at F={FRACTION})")
            assert verifier.alerts, "the corrupt stage was never caught"
            view = (await swarm.http.get("/api/v1/verification")).json()
            alert = view["alerts"][0]
            assert (alert["fellow"], alert["model"], alert["stage"]) == (bad_name, name, index)
            assert alert["difference"] > alert["tolerance"]
            assert alert["requests"] and all(r["user"] == swarm.leader.first_start.admin_name
                                             for r in alert["requests"])
            assert bad_name in alert["message"] and f"stage {index}" in alert["message"]
            metrics = (await swarm.http.get("/metrics")).text
            assert any(line.startswith("swarm_verification_failures_total{") and f'fellow="{bad_name}"' in line
                       for line in metrics.splitlines())
            assert "swarm_verification_checks_total" in metrics

            # the stage moved to its copy on the standby; replies are the honest ones again
            await swarm.leader.serving.loader.wait_ready(name, 120)
            assert model.stages[index].plan.fellow_name == "standby"
            for i, prompt in enumerate(PROMPTS[:HONEST_CHATS]):
                reply = await swarm.chat(name, prompt, max_tokens=TOKENS)
                assert reply["choices"][0]["token_ids"] == honest[i]
            nursery.cancel_scope.cancel()
