"""One thread per fellow process runs all of its torch work: loads, warm-ups, passes, the calibration.

Measured on a 2-core CPU with torch's OpenMP build: a decode pass of the built-in model's two int4-fast stages took
17-18 ms per token on the one thread that had used OpenMP, and 24-34 ms on any other thread while that one was alive
(each thread that runs a parallel region keeps an OpenMP team of its own; with more team threads than cores the
runtime stops spinning between regions and every region pays a wake-up). trio.to_thread hands each call to whichever
cached thread is free, so a fellow's passes, loads and calibration used several. Here they all use one.

A finished call wakes its caller through a socket pair the caller's task waits on, not through
``TrioToken.run_sync_soon``: that path wakes trio's entry-queue task, which only then reschedules the caller, one
scheduler round more. Measured on a 2-core VM: 0.25 against 0.40 ms from the end of a call to its caller running, paid
by every stage at every decode step.
"""

from __future__ import annotations

import queue
import socket
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


class _Waker:
    """One trio run's way back from the compute thread: a finished call writes a byte to ``writer``; its caller waits
    for ``reader`` to be readable. Callers take turns (``lock``), as their calls do on the one thread anyway."""

    def __init__(self):
        self.lock = trio.Lock()
        self.reader, self.writer = socket.socketpair()
        self.reader.setblocking(False)

    async def close_at_end(self) -> None:
        try:
            await trio.sleep_forever()
        finally:
            self.reader.close()
            self.writer.close()


_WAKER: trio.lowlevel.RunVar = trio.lowlevel.RunVar("swarm_compute_waker")


def _waker() -> _Waker:
    try:
        return _WAKER.get()
    except LookupError:
        waker = _Waker()
        _WAKER.set(waker)
        trio.lowlevel.spawn_system_task(waker.close_at_end)  # cancelled, and so closed, when the run ends
        return waker


async def run(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the compute thread, awaited like ``trio.to_thread.run_sync``. Calls from several fellows in
    one process (the tests' harness) take turns; a caller cancelled while waiting for its turn gives up, and one whose
    call has started still waits for the call to end (torch cannot be interrupted mid-pass)."""
    waker = _waker()
    async with waker.lock:
        box: list[outcome.Outcome] = []

        def job() -> None:
            box.append(outcome.capture(fn, *args))
            try:
                waker.writer.send(b"\0")
            except OSError:  # the caller's run ended meanwhile (its pair closed): nobody waits for the result
                pass

        _queue().put(job)
        with trio.CancelScope(shield=True):
            while not box:
                await trio.lowlevel.wait_readable(waker.reader)
                try:
                    waker.reader.recv(64)
                except BlockingIOError:  # woken without a byte: look again
                    pass
    return box[0].unwrap()
