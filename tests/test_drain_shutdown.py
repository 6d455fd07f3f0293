"""The shutdown paths reach the drain (issue 37): the service the installer writes gives the fellow SIGTERM and time
to hand its stages over (the systemd unit and the launchd agent, written by the real script's service part and
parsed), and Windows' console-control handler asks for the same handover as SIGTERM and holds the process until the
fellow has left. That a fellow given SIGTERM drains is tests/test_drain_e2e.py's
test_sigterm_hands_the_stage_to_the_standby_while_the_reply_streams."""

from __future__ import annotations

import configparser
import os
import plistlib
import shutil
import subprocess
from pathlib import Path

import pytest
import trio

from swarm.fellow.leave import CTRL_CLOSE_EVENT, CTRL_SHUTDOWN_EVENT, GRACE_S, ConsoleStop
from swarm.leader.fleet.install import SCRIPTS

CTRL_C_EVENT = 0


def _service_part(tmp_path: Path, system: str, leave_wait_s: str | None) -> subprocess.CompletedProcess:
    """Run install.sh's service part as the script runs it, on a PC whose service manager does not answer (the
    file is written, nothing started); ``system`` is what uname says."""
    script = (SCRIPTS / "install.sh").read_text()
    part = script[script.index("# --- a service that runs swarm join at start-up"):]
    prelude = ("set -eu\nsay() { printf '%s\\n' \"$*\" >&2; }\ndie() { say \"error: $*\"; exit 1; }\n"
               "LEADER_URL='http://10.0.0.5:8000'\nSWARM=/bin/true\nHOME_DIR=\"$HOME/swarm home\"\n"
               "DATA=\"$HOME_DIR/fellow\"\n")
    tools = tmp_path / "bin"
    tools.mkdir(exist_ok=True)
    for name, body in (("uname", f"echo {system}"), ("systemctl", "exit 1"), ("launchctl", "exit 1")):
        (tools / name).write_text(f"#!/bin/sh\n{body}\n")
        (tools / name).chmod(0o755)
    env = {"PATH": f"{tools}:{os.environ['PATH']}", "HOME": str(tmp_path / "home")}
    if leave_wait_s is not None:
        env["SWARM_LEAVE_WAIT_S"] = leave_wait_s
    return subprocess.run(["sh", "-c", prelude + part], env=env, capture_output=True, text=True, check=False,
                          timeout=30)


def test_the_systemd_unit_sends_sigterm_to_the_fellow_alone_and_waits_for_the_handover(tmp_path):
    done = _service_part(tmp_path, "Linux", "45")
    assert done.returncode == 0, done.stderr
    unit_file = tmp_path / "home" / ".config" / "systemd" / "user" / "swarm-fellow.service"
    unit = configparser.ConfigParser(interpolation=None, strict=False)
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # systemd's keys are case-sensitive
    unit.read_string(unit_file.read_text())
    service = unit["Service"]
    assert service["KillSignal"] == "SIGTERM" and service["KillMode"] == "mixed"
    assert service["Environment"] == "SWARM_LEAVE_WAIT_S=45"
    assert int(service["TimeoutStopSec"]) == 45 + 30 > 45 + GRACE_S  # the wait, the answer's way back, unloading
    assert service["Restart"] == "on-failure"  # a fellow that left stays gone
    assert service["ExecStart"].startswith('"/bin/true" join http://10.0.0.5:8000 --data-dir ')
    # the default wait, and a stop that fits in a shutdown's stop of the user's manager (user@.service: 120 s)
    assert _service_part(tmp_path, "Linux", None).returncode == 0
    assert "TimeoutStopSec=90\n" in unit_file.read_text()
    refused = _service_part(tmp_path, "Linux", "a minute")
    assert refused.returncode == 1 and "SWARM_LEAVE_WAIT_S must be a whole number of seconds" in refused.stderr
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    verified = subprocess.run(["systemd-analyze", "verify", str(unit_file)], capture_output=True, text=True,
                              check=False, timeout=60)
    assert verified.returncode == 0 and verified.stderr == "", verified.stderr


def test_the_launchd_agent_waits_for_the_handover_and_restarts_only_after_a_crash(tmp_path):
    done = _service_part(tmp_path, "Darwin", None)
    assert done.returncode == 0, done.stderr
    agent = plistlib.loads((tmp_path / "home" / "Library" / "LaunchAgents" / "org.swarm.fellow.plist").read_bytes())
    assert agent["ExitTimeOut"] == 90  # launchd's SIGTERM, then SIGKILL after this many seconds (default 20)
    assert agent["KeepAlive"] == {"SuccessfulExit": False}
    assert agent["EnvironmentVariables"] == {"SWARM_LEAVE_WAIT_S": "60"}
    assert agent["ProgramArguments"][:3] == ["/bin/true", "join", "http://10.0.0.5:8000"]


async def test_the_windows_console_handler_asks_for_the_handover_and_holds_the_process_until_the_fellow_left():
    send, receive = trio.open_memory_channel[str](8)
    console = ConsoleStop(send, trio.lowlevel.current_trio_token(), wait_s=30)
    with trio.fail_after(10):
        # Ctrl+C is Python's own (SIGINT): not handled here, nothing asked
        assert await trio.to_thread.run_sync(console, CTRL_C_EVENT) is False
        with pytest.raises(trio.WouldBlock):
            receive.receive_nowait()

        returned: list[bool] = []

        async def windows_calls(event: int) -> None:  # Windows runs the handler on a thread of its own
            returned.append(await trio.to_thread.run_sync(console, event))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(windows_calls, CTRL_SHUTDOWN_EVENT)
            assert await receive.receive() == "shutdown"  # the same request a SIGTERM makes
            await trio.sleep(0.3)
            assert returned == []  # returning would end the process: it holds on while the fellow drains
            console.gone.set()
        assert returned == [True]

    # a fellow that never finishes leaving: the handler lets go after its wait
    late = ConsoleStop(send, trio.lowlevel.current_trio_token(), wait_s=0.2)
    with trio.fail_after(10):
        start = trio.current_time()
        assert await trio.to_thread.run_sync(late, CTRL_CLOSE_EVENT) is True
        assert trio.current_time() - start >= 0.2
        assert await receive.receive() == "the console closed"
    assert late.install() is (os.name == "nt")
