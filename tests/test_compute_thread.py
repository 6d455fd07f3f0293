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


async def test_a_caller_cancelled_before_its_turn_gives_up_and_its_call_never_runs():
    ran = []

    def work(name):
        time.sleep(0.2)
        ran.append(name)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(compute.run, work, "first")
        await trio.sleep(0.05)  # the first call is running
        with trio.move_on_after(0.05):
            await compute.run(work, "second")  # still waiting for its turn when cancelled
    await compute.run(work, "third")
    assert ran == ["first", "third"]


def test_each_trio_run_gets_its_own_way_back_and_closes_it():
    import os

    def open_files() -> int:
        return len(os.listdir("/proc/self/fd"))

    async def calls():
        assert [await compute.run(pow, 2, n) for n in range(3)] == [1, 2, 4]

    trio.run(calls)
    before = open_files()
    for _ in range(20):
        trio.run(calls)
    assert open_files() == before  # the socket pair of each run closed with it
