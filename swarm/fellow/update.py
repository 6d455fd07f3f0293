"""`swarm update`: put the leader's own version of swarm on this fellow, then restart it.

The leader announces its wheel over the encrypted control link (version, protocol, file name, sha256, size); the
fellow downloads it with its node credential from the leader alone (the content-addressed cache of model files,
swarm.fellow.downloads, so the sha256 is checked as it arrives), installs it into its own environment with
`python -m pip install --no-deps --force-reinstall --no-index WHEEL` run by its own interpreter, and restarts: a
re-exec of the same command, so it rejoins with the same key and name and the leader gives it back its stages.

Two ways in:
  - the running fellow gets {"t": "update", ...} on its control link (the admin page's "Update outdated fellows",
    or `swarm update` on its machine while it runs) and does it all itself;
  - `swarm update` on a machine whose fellow is not running opens a control session of its own just for this: the
    leader answers with the offer and a node credential, the command installs, and the next `swarm join` (or the
    service) starts the new version.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import trio
import trio_websocket

from swarm import __version__, wire
from swarm.control_messages import Current, Refused, Update, UpdateFailed, Updating
from swarm.errors import AuthError, LinkClosed, SwarmError, UpdateError
from swarm.fellow.downloads import fetch_with_retries
from swarm.mesh.websocket import WebSocketFrameTransport, ws_url
from swarm.tunnel.channel import NoiseChannel, close_quietly
from swarm.tunnel.tls import context_for

log = logging.getLogger(__name__)

INSTALL_TIMEOUT_S = 600.0  # pip installing one wheel without dependencies: seconds, even on a slow disk
SESSION_TIMEOUT_S = 300.0  # the leader may build its wheel first (7 s measured here for this repo)
WHEEL_NAME = re.compile(r"^swarm-[A-Za-z0-9_.+!]+-py3-none-any\.whl$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")


def check_offer(offer: dict) -> dict:
    """The offer's fields, each checked: it names a file we write and a path we ask the leader for."""
    name, sha256, size, path = offer.get("file"), offer.get("sha256"), offer.get("size"), offer.get("path")
    if not (isinstance(name, str) and WHEEL_NAME.match(name) and isinstance(sha256, str) and SHA256.match(sha256)
            and isinstance(size, int) and not isinstance(size, bool) and size > 0 and path == f"/api/v1/update/{name}"):
        raise UpdateError(f"the leader's update offer is malformed ({name!r}); update the leader and try again.")
    return {"file": name, "sha256": sha256, "size": size, "path": path, "version": str(offer.get("version", "?")),
            "protocol": offer.get("protocol")}


async def download(leader_url: str, offer: dict, credential: str, cache_dir: Path) -> Path:
    """The offered wheel in the cache, its sha256 checked (ChecksumMismatch, CredentialRefused, DownloadError)."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=60.0),
                                 verify=context_for(leader_url) or True) as client:
        return await fetch_with_retries(client, leader_url.rstrip("/") + offer["path"], cache_dir, offer["sha256"],
                                        offer["size"], lambda: {"authorization": f"Bearer {credential}"})


def install(wheel: Path, file_name: str, python: str = sys.executable) -> None:
    """pip install the verified wheel (cached under its hash) into ``python``'s environment."""
    with tempfile.TemporaryDirectory(prefix="swarm-update-") as scratch:
        named = Path(scratch) / file_name  # pip reads name and version from the file name
        shutil.copyfile(wheel, named)
        args = [python, "-m", "pip", "install", "--no-deps", "--force-reinstall", "--no-index",
                "--disable-pip-version-check", "-q", str(named)]
        try:
            done = subprocess.run(args, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise UpdateError(f"could not run pip with {python}: {exc}") from None
    if done.returncode != 0:
        last = ((done.stderr or done.stdout).strip().splitlines() or ["no output"])[-1]
        raise UpdateError(
            f"pip could not install {file_name} into {sys.prefix}: {last}. Install it by hand with "
            f"`{python} -m pip install --no-deps --force-reinstall {file_name}`, or reinstall swarm with the "
            "leader's install command.")


async def fetch_and_install(leader_url: str, offer: dict, credential: str, cache_dir: Path) -> dict:
    offer = check_offer(offer)
    wheel = await download(leader_url, offer, credential, cache_dir)
    log.info("installing %s (sha256 %s… verified)", offer["file"], offer["sha256"][:12])
    await trio.to_thread.run_sync(install, wheel, offer["file"])
    return offer


def restart_command(argv: list[str] | None = None) -> list[str]:
    """The command that runs this fellow again: the same interpreter and arguments, through `python -m swarm` (the
    launcher script of the old version may be gone)."""
    return [sys.executable, "-m", "swarm", *(sys.argv[1:] if argv is None else argv)]


def restart(command: list[str]) -> None:
    """Replace this process with ``command``. On POSIX an exec keeps the process id (a service manager sees the
    same process); Windows has no exec that does, so it starts the new process and this one ends."""
    sys.stdout.flush()
    sys.stderr.flush()
    if os.name == "posix":
        os.execv(command[0], command)
    subprocess.Popen(command)  # our own interpreter and arguments
    os._exit(0)


class FellowUpdater:
    """The running fellow's side: what it does with an Update from the leader."""

    def __init__(self, fellow, restart_with: list[str] | None = None):
        self.fellow = fellow
        # The command to re-exec once installed. None: this fellow runs inside another program (the demo, a test),
        # whose environment is not the fellow's to change -- it downloads and verifies, and installs nothing.
        self.restart_with = restart_with
        self.downloaded: Path | None = None  # the verified wheel of the last update
        self._busy = False

    async def run(self, message: Update) -> None:
        if self._busy:
            return
        self._busy = True
        fellow = self.fellow
        try:
            offer = check_offer(message.offer())
            self.downloaded = await download(fellow.leader_url, offer, fellow.credential or "", fellow.cache_dir)
            if self.restart_with is None:
                log.warning("downloaded swarm %s (sha256 verified) but installed nothing: this fellow runs inside "
                            "another program; update that program's environment instead", offer["version"])
                return
            log.info("installing %s (sha256 %s… verified)", offer["file"], offer["sha256"][:12])
            await trio.to_thread.run_sync(install, self.downloaded, offer["file"])
        except SwarmError as exc:
            log.error("swarm update failed: %s", exc)
            try:
                await fellow.send_to_leader(UpdateFailed(str(exc)[:500]))
            except SwarmError:  # the link to the leader is down: the failure is in this fellow's log, it runs on
                pass
            return
        finally:
            self._busy = False
        log.warning("installed swarm %s (protocol %s); restarting as %s", offer["version"], offer["protocol"],
                    " ".join(self.restart_with))
        restart(self.restart_with)


@contextlib.asynccontextmanager
async def open_control(fellow):
    """A short control session of the fellow's own (its key, the pinned leader key), closed on the way out; the
    whole of it must end within SESSION_TIMEOUT_S."""
    await fellow.pin_leader_certificate()
    async with trio.open_nursery() as nursery:
        try:
            ws = await trio_websocket.connect_websocket_url(
                nursery, ws_url(fellow.leader_url, "/fellow/link"), max_message_size=1 << 20,
                ssl_context=context_for(fellow.leader_url))
        except (OSError, trio_websocket.HandshakeError) as exc:
            raise LinkClosed(f"cannot reach the leader at {fellow.leader_url}: {exc}") from None
        transport = WebSocketFrameTransport(ws)
        try:
            with trio.fail_after(SESSION_TIMEOUT_S):
                yield await NoiseChannel.connect(transport, fellow.private, fellow.leader_public)
        except trio.TooSlowError:
            raise LinkClosed(f"the leader did not answer within {SESSION_TIMEOUT_S:.0f} s") from None
        finally:
            await close_quietly(transport)
            nursery.cancel_scope.cancel()


async def update_command(fellow, force: bool = False) -> str:
    """`swarm update` on a fellow's machine: ask the leader for its version; the running fellow installs it itself,
    or this command does when no fellow runs. Returns what to print."""
    async with open_control(fellow) as channel:
        await channel.send(wire.encode({"t": "hello", "purpose": "update", "name": fellow.name,
                                        "version": __version__, "protocol": wire.PROTOCOL_VERSION, "force": force}))
        reply = wire.unpack(await channel.receive())
    if isinstance(reply, Refused):
        raise AuthError(f"the leader refused the update: {reply.message}")
    if isinstance(reply, Current):
        return (f"{fellow.name} already runs swarm {__version__}, the leader's version "
                f"(protocol {wire.PROTOCOL_VERSION}).")
    if isinstance(reply, Updating):
        return (f"{fellow.name} is running: it installs swarm {reply.version} from the leader and restarts "
                "itself, then rejoins.")
    if not isinstance(reply, Update):
        raise LinkClosed(f"unexpected answer from the leader: {getattr(reply, 'TYPE', None) or reply.get('t')!r}")
    offer = await fetch_and_install(fellow.leader_url, reply.offer(), reply.credential or "", fellow.cache_dir)
    if reply.running:
        return (f"Installed swarm {offer['version']} (protocol {offer['protocol']}); {fellow.name} still runs the old "
                "version: stop it and start `swarm join` again (a service restarts on its own).")
    return (f"Installed swarm {offer['version']} (protocol {offer['protocol']}). Start the fellow with `swarm join "
            f"{fellow.leader_url}` (a fellow installed as a service starts it on its own).")
