"""Many chats at once over the real ring: every request's greedy reply is generate's, whatever else is in the batch.

Computing several requests' rows in one pass sums floats in another order than one row alone (BLAS blocks
differently), so a batched reply may leave generate's, but only where generate itself was at a near-tie
(tests/exactness.py). A lone request stays bit-exact."""

from __future__ import annotations

import random

import pytest
import trio

from exactness import check_reply, reference
from harness import running_swarm
from reference_model import load_reference_model
from swarm import messages
from swarm.leader.serving.request import Reader, Request

pytestmark = pytest.mark.e2e

NEW_TOKENS = 16
_rng = random.Random(7)
PROMPTS = [[_rng.randrange(3, 320) for _ in range(n)] for n in (3, 40, 12, 7, 25, 5, 18, 33)]
NEAR_TIES: list[str] = []


async def ask(swarm, model: str, prompt: list[int]) -> list[int]:
    return await swarm.greedy(model, prompt, NEW_TOKENS)


@pytest.mark.parametrize("stages", [1, 2])
async def test_concurrent_replies_match_generate_for_every_family(tmp_path, tiny_model_dirs, stages):
    dirs = [tiny_model_dirs[k] for k in ("llama", "qwen2", "qwen3")]
    expected = {}
    for d in dirs:
        model = load_reference_model(d)
        expected[d.name] = [reference(model, p, NEW_TOKENS) for p in PROMPTS]
    outcomes = []
    with trio.fail_after(300):
        async with running_swarm(tmp_path, dirs, fellows=stages,
                                 fellow_env={"SWARM_SERVE_PREFILL_CHUNK": "8"}) as swarm:

            async def ask_into(got: list, i: int, name: str) -> None:
                got[i] = await ask(swarm, name, PROMPTS[i])

            for d in dirs:
                await swarm.load(d.name, stages)
                for concurrent in (1, 2, 4, 8):
                    got = [None] * concurrent
                    async with trio.open_nursery() as nursery:
                        for i in range(concurrent):
                            nursery.start_soon(ask_into, got, i, d.name)
                    for i in range(concurrent):
                        want, margins = expected[d.name][i]
                        outcome = check_reply(got[i], want, margins)
                        if concurrent == 1:
                            assert outcome == "identical", "a lone request must stay bit-exact"
                        outcomes.append(outcome)
                await swarm.http.post(f"/api/v1/models/{d.name}/unload")
    ties = [o for o in outcomes if o != "identical"]
    print(f"{stages} stage(s): {len(outcomes)} replies, {len(ties)} left generate's at a near-tie {ties}")


async def test_a_long_prompt_does_not_stall_the_other_chats(tmp_path, tiny_model_dirs):
    """While a long prompt goes through in chunks, a short chat's reply keeps coming: its tokens arrive between the
    long prompt's chunks, not after them all."""
    d = tiny_model_dirs["llama"]
    long_prompt = [(i * 7) % 300 + 3 for i in range(200)]  # 25 chunks of 8
    with trio.fail_after(300):
        async with running_swarm(tmp_path, [d], fellows=2, fellow_env={"SWARM_SERVE_PREFILL_CHUNK": "8"}) as swarm:
            await swarm.load(d.name, 2)
            short = Request(model=d.name, prompt=[5, 6, 7], max_tokens=40, sampling=messages.Sampling(), eos=[])
            long = Request(model=d.name, prompt=long_prompt, max_tokens=1, sampling=messages.Sampling(), eos=[])
            await swarm.leader.serving.intake.submit(short)
            await swarm.leader.serving.intake.submit(long)
            reader = Reader(long)
            while (await reader.next(60))[0] != "done":
                pass
            # about one token per two chunks over two stages; all at the end would be 0 or 1
            assert len(short.tokens) >= 6, "the short chat waited for the whole long prompt"


async def test_a_small_pool_queues_chats_and_refuses_what_it_cannot_hold(tmp_path, tiny_model_dirs, monkeypatch):
    """Fellows with little memory: the leader lowers how many chats run at once instead of refusing the load, the
    others wait their turn (first come, first served), and a conversation longer than the pool is a 413."""
    from swarm.fellow import hardware
    from swarm.leader.planning.placement import OVERHEAD_BYTES
    from swarm.messages import Hardware

    d = tiny_model_dirs["llama"]
    weights = sum(f.stat().st_size for f in (d / "weights").iterdir())
    kv_per_token = 2 * 2 * 16 * 4 * 2  # k and v, 2 kv heads of 16, float32, 2 layers a stage
    free = weights + OVERHEAD_BYTES + 100 * kv_per_token  # room for ~100 tokens of KV cache
    monkeypatch.setattr(hardware, "probe", lambda: Hardware(2, 1 << 34, free, []))
    with trio.fail_after(300):
        async with running_swarm(tmp_path, [d], fellows=2, leader_env={"SWARM_SERVE_CONTEXT_TOKENS": "48"}) as swarm:
            await swarm.load(d.name, 2)
            budget = swarm.leader.serving.models[d.name].budget(swarm.leader.settings)
            assert budget.max_requests == 1 and 48 <= budget.tokens < 2000  # not the 8 two stages take at most
            requests = [Request(model=d.name, prompt=[5, 6, 7 + i], max_tokens=30, sampling=messages.Sampling(),
                                eos=[]) for i in range(3)]
            for r in requests:
                await swarm.leader.serving.intake.submit(r)
            assert [r.state for r in requests] == ["running", "waiting", "waiting"]
            for r in requests:
                reader = Reader(r)
                while (await reader.next(60))[0] != "done":
                    pass
            assert requests[0].queue_s < requests[1].queue_s < requests[2].queue_s  # one after another, in order
            # longer than the model's served context (the leader's cap of 48 here; the pool holds more): the seed's
            # words
            from swarm.errors import ContextTooLong

            reply = budget.tokens - 39
            with pytest.raises(ContextTooLong) as refused:
                await swarm.leader.serving.intake.submit(Request(model=d.name, prompt=[1] * 40, max_tokens=reply,
                                                          sampling=messages.Sampling(), eos=[]))
            assert (f"this conversation needs {budget.tokens + 1} tokens (40 in the prompt and up to {reply} in the "
                    "reply); the pool serving this model holds 48") in str(refused.value)
            assert "maximum context length" in str(refused.value)
            assert "SWARM_SERVE_CONTEXT_TOKENS" in str(refused.value)
