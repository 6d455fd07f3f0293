"""An unload followed at once by a load at another quantization, as Load beside the quantization picker does it, in
a process holding a large heap (like a long test session's, whose in-process fellows share one trio loop with their
leader). An unloaded stage's memory used to be handed back with a full gc.collect() in the event loop: about 1 s per
stage here, 3 s and more with millions of objects, during which no control link was read -- the leader took both
fellows for silent (SILENT_S, 4 s), dropped them, and the load was refused ("needs 2 fellows online") or lost. The
stage's tensors now go by reference counting."""

from __future__ import annotations

import time

import pytest
import trio

from harness import running_swarm

pytestmark = pytest.mark.e2e

HEAP_OBJECTS = 4_000_000  # lists the collector walks in a full collection: ~1 s more each on this repository's VMs


async def test_unload_then_load_at_int8_at_once_keeps_the_fellows_and_loads(tmp_path, smollm_model_dir):
    name = smollm_model_dir.name
    heap = [[i] for i in range(HEAP_OBJECTS)]
    stall = [0.0]

    async def watch_the_loop():
        while True:
            before = time.monotonic()
            await trio.sleep(0.05)
            stall[0] = max(stall[0], time.monotonic() - before - 0.05)

    with trio.fail_after(300):
        async with running_swarm(tmp_path, [smollm_model_dir]) as swarm:
            await swarm.load(name, 2)
            await swarm.chat(name, [{"role": "user", "content": "Hi"}], max_tokens=4)
            links = dict(swarm.leader.hub.online)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch_the_loop)
                assert (await swarm.http.post(f"/api/v1/models/{name}/unload")).status_code == 200
                await trio.sleep(0.5)  # the page opens meanwhile: the stages finish going
                r = await swarm.http.post(f"/api/v1/models/{name}/load", json={"quantization": "int8"})
                assert r.status_code == 202, r.text
                await swarm.leader.serving.loader.wait_ready(name, 120)
                nursery.cancel_scope.cancel()
            # the same control links all along: no fellow was taken for silent and dropped
            assert swarm.leader.hub.online == links, f"the loop stalled up to {stall[0]:.1f} s"
            assert (await swarm.http.get(f"/api/v1/models/{name}")).json()["quantization"] == "int8"
            assert all(not f.stages[name].driver.stage_model.requests() for f in swarm.fellows)
            await swarm.chat(name, [{"role": "user", "content": "Hi"}], max_tokens=4)
    del heap
