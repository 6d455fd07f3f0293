"""Idle unload (SWARM_MODEL_IDLE_UNLOAD_S): a model is idle only once it has been ready -- every stage loaded and
linked -- and unused for the limit. A fellow used to start a stage's idle clock when the stage itself finished
loading: with a 10 s limit and a second stage that took longer to load, the first stage unloaded itself as idle and
the load failed with not_loaded."""

from __future__ import annotations

import pytest
import trio

from harness import running_swarm, wait_until
from swarm.fellow.idle import idle_seconds, unload_due

LIMIT = 10.0


def test_a_stage_whose_ring_is_not_ready_is_never_idle():
    # loading (the other stages not loaded or linked yet), recovering (unlinked), a cover: however long ago its use
    assert not unload_due(1_000.0, limit=LIMIT, ready_since=None, last_used=0.0, busy=False)
    assert idle_seconds(1_000.0, ready_since=None, last_used=0.0, busy=False) == 0.0


def test_the_idle_clock_starts_when_the_whole_model_is_ready():
    # the stage loaded at 0 and was last touched then; the ring became ready at 50
    assert not unload_due(50.0 + LIMIT - 0.1, limit=LIMIT, ready_since=50.0, last_used=0.0, busy=False)
    assert unload_due(50.0 + LIMIT, limit=LIMIT, ready_since=50.0, last_used=0.0, busy=False)
    assert idle_seconds(55.0, ready_since=50.0, last_used=0.0, busy=False) == 5.0


def test_each_request_restarts_the_idle_clock_and_a_busy_stage_is_never_idle():
    assert not unload_due(100.0, limit=LIMIT, ready_since=50.0, last_used=95.0, busy=False)
    assert unload_due(105.0, limit=LIMIT, ready_since=50.0, last_used=95.0, busy=False)
    # a request held for longer than the limit
    assert not unload_due(1_000.0, limit=LIMIT, ready_since=50.0, last_used=60.0, busy=True)


def test_a_limit_of_zero_keeps_the_model_loaded():
    assert not unload_due(1e9, limit=0.0, ready_since=0.0, last_used=0.0, busy=False)


@pytest.mark.e2e
async def test_a_stage_that_loads_first_waits_for_the_slow_one_then_the_ready_model_goes_idle(
        tmp_path, tiny_model_dirs):
    """Stage 1 takes 4 s longer to load than a 1 s idle limit: stage 0 must wait for it, not unload (the old clock
    unloaded it ~1-2 s after its own load and the load failed); once ready, the unused model does go."""
    model_dir = tiny_model_dirs["llama"]
    name = model_dir.name
    with trio.fail_after(120):
        async with running_swarm(tmp_path, [model_dir], fellow_env={"SWARM_MODEL_IDLE_UNLOAD_S": "1"}) as swarm:
            slow = swarm.fellows[1].loader
            build = slow._fetch_and_build

            async def slow_build(message, progress):
                stage_model = await build(message, progress)
                await trio.sleep(4.0)  # a big shard, a slow disk: stage 0 is loaded and waiting meanwhile
                return stage_model

            slow._fetch_and_build = slow_build
            await swarm.load(name, 2, timeout=60)
            ready_at = trio.current_time()
            # the leader tells each stage the ring is ready (ring_ready) right after: the idle clocks start then
            await wait_until(lambda: all(name in f.stages and f.stages[name].ready_since is not None
                                         for f in swarm.fellows), 5)
            # unused since it became ready: it goes after the limit (checked every second), not before
            await wait_until(lambda: swarm.leader.serving.status(name) == "not_loaded", 15)
            assert trio.current_time() - ready_at >= 1.0
            await wait_until(lambda: all(not f.stages for f in swarm.fellows), 10,
                             message=lambda: [list(f.stages) for f in swarm.fellows])
