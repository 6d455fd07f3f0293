"""Leaving without a pause: a fellow hands its stages over before it goes (swarm.leader.serving.drain does the handing
over).

Three ways in:
  - SIGTERM of the fellow's process (a service stopped, a log-out or a shutdown: the installers' systemd unit and
    launchd agent send it and wait SWARM_LEAVE_WAIT_S + 30 s before SIGKILL); on Windows Ctrl+Break (SIGBREAK) and
    the console-control events of a console's close, a log-off and a shutdown (ConsoleStop): the fellow asks the
    leader to drain it ({"t": "leave", "force": true}) and goes once told to ({"t": "leave"}) or after
    SWARM_LEAVE_WAIT_S -- a stage nobody could take fails over;
  - `swarm leave` on the fellow's machine: a control session of its own asks the leader, which drains the running
    fellow and tells it to leave; without --force a stage nobody can take keeps the fellow where it is, and the
    command says why;
  - Drain on the admin page (POST /api/v1/fellows/{id}/drain): as `swarm leave`, from the leader.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import signal
import sys
import threading

import trio

from swarm import __version__, wire
from swarm.control_messages import Leave, LeaveRefused, Left, Refused
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

    def on_message(self, message: Leave | LeaveRefused) -> None:
        """Leave (go now) or LeaveRefused from the leader."""
        self.message = message.message
        if isinstance(message, Leave):
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
            await fellow.send_to_leader(Leave(force, wait_s))
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


# Windows' console-control events that end the process once the handler returns (wincon.h). Windows allows the
# handler about 5 s for a console's close, a log-off or a shutdown (SPI_GETHUNGAPPTIMEOUT / SPI_GETWAITTOKILLTIMEOUT)
# and 20 s for a service's shutdown: a switch to a hot cover fits, a standby's load may not, and then fails over.
CTRL_CLOSE_EVENT, CTRL_LOGOFF_EVENT, CTRL_SHUTDOWN_EVENT = 2, 5, 6
STOP_EVENTS = {CTRL_CLOSE_EVENT: "the console closed", CTRL_LOGOFF_EVENT: "log-off", CTRL_SHUTDOWN_EVENT: "shutdown"}


class ConsoleStop:
    """Windows: a console's close, a log-off and a shutdown come as console-control events, on a thread the system
    starts, not as signals. The handler asks for the same handover as SIGTERM and holds the process (returning ends
    it) until the fellow has left or ``wait_s`` passed."""

    def __init__(self, requests: trio.MemorySendChannel[str], token: trio.lowlevel.TrioToken, wait_s: float):
        self.requests = requests
        self.token = token
        self.wait_s = wait_s
        self.gone = threading.Event()  # set once the fellow has left
        self._installed = None  # the ctypes callback, kept alive while installed

    def __call__(self, event: int) -> bool:
        why = STOP_EVENTS.get(event)
        if why is None:
            return False  # Ctrl+C and Ctrl+Break: Python's own handlers (SIGINT, SIGBREAK)
        try:
            trio.from_thread.run_sync(self.requests.send_nowait, why, trio_token=self.token)
        except (trio.RunFinishedError, trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the fellow is going already
        self.gone.wait(self.wait_s)
        return True

    def install(self) -> bool:
        """Register with SetConsoleCtrlHandler (Windows only; False elsewhere or when refused)."""
        if sys.platform != "win32":
            return False
        routine = ctypes.WINFUNCTYPE(ctypes.c_int, ctypes.c_ulong)(lambda event: int(self(int(event))))
        if not ctypes.windll.kernel32.SetConsoleCtrlHandler(routine, True):
            log.warning("could not register for the console's close, log-off and shutdown: they end this fellow "
                        "without handing its stages over (they fail over)")
            return False
        self._installed = routine
        return True


async def run_until_left(fellow) -> None:
    """Run ``fellow`` until the leader tells it to leave, or a stop request comes -- a signal, or on Windows a
    console-control event -- (the stages are handed over first; a second request while that runs ends the process
    at once)."""
    send, receive = trio.open_memory_channel[str](8)
    console = ConsoleStop(send.clone(), trio.lowlevel.current_trio_token(), fellow.settings.leave_wait_s + GRACE_S)
    console.install()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(fellow.run)
            nursery.start_soon(_forward_signals, send)
            nursery.start_soon(_on_stop_request, fellow, receive)
            await fellow.leaving.left.wait()
            nursery.cancel_scope.cancel()
    finally:
        console.gone.set()
    print(f"{fellow.name} left: {fellow.leaving.message or 'its stages were handed over'}", flush=True)


async def _forward_signals(requests: trio.MemorySendChannel[str]) -> None:
    with trio.open_signal_receiver(*stop_signals()) as signals:
        async for number in signals:
            with contextlib.suppress(trio.WouldBlock):  # a fellow asked eight times over is going already
                requests.send_nowait(signal.Signals(number).name)


async def _on_stop_request(fellow, requests: trio.MemoryReceiveChannel[str]) -> None:
    async for why in requests:
        log.info("%s: handing the stages over before leaving", why)
        async with trio.open_nursery() as nursery:

            async def ask() -> None:
                await fellow.leaving.ask(True)
                nursery.cancel_scope.cancel()

            nursery.start_soon(ask)
            async for _ in requests:  # a second request: go now
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
        reply = wire.unpack(await channel.receive())
    if isinstance(reply, Refused):
        raise DrainRefused(reply.message)
    if not isinstance(reply, Left):
        raise LinkClosed(f"unexpected answer from the leader: {getattr(reply, 'TYPE', None) or reply.get('t')!r}")
    return reply.message
