"""A fellow's torch work runs on one thread (swarm.fellow.compute): OpenMP keeps a team per thread that runs parallel
regions, and with more team threads than cores every region paid a wake-up (a pass 1.75x slower on 2 cores)."""

from __future__ import annotations

import threading
import time

import pytest
import trio

from swarm.fellow import compute


async def test_every_call_runs_on_the_same_thread_and_returns_or_raises():
    threads = [await compute.run(threading.get_ident) for _ in range(5)]
    assert len(set(threads)) == 1 and threads[0] != threading.get_ident()
    assert await compute.run(sum, [1, 2, 3]) == 6
    with pytest.raises(ZeroDivisionError):
        await compute.run(lambda: 1 / 0)


async def test_calls_take_turns_and_a_cancelled_caller_waits_for_its_call():
    spans = []

    def work():
        start = time.monotonic()
        time.sleep(0.2)
        spans.append((start, time.monotonic()))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(compute.run, work)
        nursery.start_soon(compute.run, work)
    (a0, a1), (b0, b1) = sorted(spans)
    assert b0 >= a1  # one after the other, never at once

    with trio.move_on_after(0.05):
        await compute.run(work)  # torch cannot stop mid-pass: the caller waits for the call to end
    assert len(spans) == 3
