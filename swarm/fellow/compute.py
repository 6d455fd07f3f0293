"""One thread per fellow process runs all of its torch work: loads, warm-ups, passes, the calibration.

Measured on a 2-core CPU with torch's OpenMP build: a decode pass of the built-in model's two int4-fast stages took
17-18 ms per token on the one thread that had used OpenMP, and 24-34 ms on any other thread while that one was alive
(each thread that runs a parallel region keeps an OpenMP team of its own; with more team threads than cores the
runtime stops spinning between regions and every region pays a wake-up). trio.to_thread hands each call to whichever
cached thread is free, so a fellow's passes, loads and calibration used several. Here they all use one.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import trio

T = TypeVar("T")

_jobs: queue.SimpleQueue | None = None
_started = threading.Lock()


def _serve(jobs: queue.SimpleQueue) -> None:
    while True:
        job = jobs.get()
        job()


def _queue() -> queue.SimpleQueue:
    global _jobs
    with _started:
        if _jobs is None:
            _jobs = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(_jobs,), name="swarm-compute", daemon=True).start()
        return _jobs


async def run(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the compute thread, awaited like ``trio.to_thread.run_sync`` (a cancelled caller still waits
    for the call to end: torch cannot be interrupted mid-pass). Calls from several fellows in one process (the tests'
    harness) take turns."""
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()
    box: list[outcome.Outcome] = []

    def job() -> None:
        box.append(outcome.capture(fn, *args))
        try:
            token.run_sync_soon(done.set)
        except trio.RunFinishedError:  # the caller's loop ended meanwhile: nobody waits for the result
            pass

    _queue().put(job)
    with trio.CancelScope(shield=True):
        await done.wait()
    return box[0].unwrap()
