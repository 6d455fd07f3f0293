"""Leaving without a pause: a fellow hands its stages over before it goes (swarm.leader.serving.drain does the handing
over).

Three ways in:
  - SIGTERM of the fellow's process (a service stopped, a shutdown where the service gets the signal; SIGBREAK, a
    console's close, on Windows): the fellow asks the leader to drain it ({"t": "leave", "force": true}) and goes
    once told to ({"t": "leave"}) or after SWARM_LEAVE_WAIT_S -- a stage nobody could take fails over;
  - `swarm leave` on the fellow's machine: a control session of its own asks the leader, which drains the running
    fellow and tells it to leave; without --force a stage nobody can take keeps the fellow where it is, and the
    command says why;
  - Drain on the admin page (POST /api/v1/fellows/{id}/drain): as `swarm leave`, from the leader.
"""

from __future__ import annotations

import logging
import signal

import trio

from swarm import __version__, wire
from swarm.errors import DrainRefused, LinkClosed, SwarmError

log = logging.getLogger(__name__)

GRACE_S = 5.0  # past the leader's own wait: its answer's way back
LINK_CHECK_S = 0.5  # how often a fellow waiting for its answer looks whether the link to the leader is still up


class Leaving:
    """The running fellow's side: it asks to leave, and goes when the leader says so."""

    def __init__(self, fellow):
        self.fellow = fellow
        self.left = trio.Event()  # the leader said: your stages are handed over, go
        self.message: str | None = None  # what the leader said about it
        self._answer = trio.Event()

    def on_message(self, message: dict) -> None:
        """{"t": "leave"} (go now) or {"t": "leave_refused"} from the leader."""
        self.message = str(message.get("message") or "")
        if message["t"] == "leave":
            log.info("leaving: %s", self.message or "the leader said so")
            self.left.set()
        else:
            log.warning("%s", self.message)
        self._answer.set()

    async def ask(self, force: bool = True) -> None:
        """Ask the leader to hand this fellow's stages over, and wait for its word (at most SWARM_LEAVE_WAIT_S and a
        little). A fellow that holds nothing, or has no leader to ask, just goes."""
        fellow = self.fellow
        wait_s = fellow.settings.leave_wait_s
        if not fellow.stages:
            return
        self._answer = trio.Event()
        try:
            await fellow.send_to_leader({"t": "leave", "force": force, "wait_s": wait_s})
        except SwarmError as exc:
            log.warning("could not ask the leader to take this fellow's stages (%s): they fail over", exc)
            return
        log.info("handing %s over before leaving (up to %.0f s, SWARM_LEAVE_WAIT_S)", ", ".join(fellow.stages),
                 wait_s)
        with trio.move_on_after(wait_s + GRACE_S):
            while not self._answer.is_set() and fellow.control.up:  # a leader that went away answers nothing
                with trio.move_on_after(LINK_CHECK_S):
                    await self._answer.wait()
        if not fellow.control.up:
            log.warning("the leader went away before it took this fellow's stages: they fail over")
        elif not self._answer.is_set():
            log.warning("the leader did not hand this fellow's stages over within %.0f s: they fail over", wait_s)


def stop_signals() -> list[int]:
    """The signals that stop a fellow's process gracefully: SIGTERM, and SIGBREAK where Windows has it."""
    return [signal.SIGTERM] + ([signal.SIGBREAK] if hasattr(signal, "SIGBREAK") else [])


async def run_until_left(fellow) -> None:
    """Run ``fellow`` until the leader tells it to leave, or a stop signal comes (the stages are handed over first;
    a second signal while that runs ends the process at once)."""
    async with trio.open_nursery() as nursery:
        await nursery.start(fellow.run)
        nursery.start_soon(_on_stop_signal, fellow)
        await fellow.leaving.left.wait()
        nursery.cancel_scope.cancel()
    print(f"{fellow.name} left: {fellow.leaving.message or 'its stages were handed over'}", flush=True)


async def _on_stop_signal(fellow) -> None:
    with trio.open_signal_receiver(*stop_signals()) as signals:
        async for number in signals:
            log.info("%s: handing the stages over before leaving", signal.Signals(number).name)
            async with trio.open_nursery() as nursery:

                async def ask() -> None:
                    await fellow.leaving.ask(True)
                    nursery.cancel_scope.cancel()

                nursery.start_soon(ask)
                async for _ in signals:  # a second signal: go now
                    break
                nursery.cancel_scope.cancel()
            fellow.leaving.left.set()
            return


async def leave_command(fellow, force: bool = False) -> str:
    """`swarm leave` on a fellow's machine: ask the leader to drain the running fellow. Returns what to print;
    DrainRefused when it stays."""
    from swarm.fellow.update import open_control

    async with open_control(fellow) as channel:
        await channel.send(wire.encode({"t": "hello", "purpose": "leave", "name": fellow.name, "version": __version__,
                                        "protocol": wire.PROTOCOL_VERSION, "force": force,
                                        "wait_s": fellow.settings.leave_wait_s}))
        reply = wire.decode(await channel.receive())
    kind = reply.get("t")
    if kind == "refused":
        raise DrainRefused(str(reply.get("message")))
    if kind != "left":
        raise LinkClosed(f"unexpected answer from the leader: {kind!r}")
    return str(reply.get("message"))
