"""The fellow process: `swarm join URL --token T`.

A Fellow owns everything its process runs, in one nursery: the listener for incoming ring links, the control link
to the leader (rejoined with backoff whenever it drops), and each loaded stage with its own tasks. Its parts:

  control.py       the encrypted control link: enrolment, heartbeats, the leader's instructions
  loading.py       loading a stage: fetch its files, verify, build, warm up, then serve it
  ring.py          the trio driver of a loaded stage's ring protocol
  links.py         incoming ring links: direct TCP and the leader's relay
  direct_links.py  this fellow's side of Direct links (hole-punched tunnels)
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
from pathlib import Path

import trio
import trio_websocket

from swarm.config import Settings
from swarm.errors import AuthError, SwarmError, first_leaf
from swarm.fellow.control import ControlLink
from swarm.fellow.direct_links import DirectLinkAgent
from swarm.fellow.hardware import MachineShare
from swarm.fellow.leave import Leaving, run_until_left
from swarm.fellow.link_probe import LinkProbes
from swarm.fellow.links import IncomingLinks
from swarm.fellow.loading import LoadedStage, StageLoader
from swarm.fellow.update import FellowUpdater, restart_command
from swarm.fellow.verify import Checker
from swarm.tunnel.join_token import join_token_cert_pin, parse_join_token
from swarm.tunnel.keys import decode_key, encode_key, fingerprint, load_or_create_identity
from swarm.tunnel.tls import decode_pin, encode_pin, pinned_context, register

log = logging.getLogger(__name__)

# Reconnect backoff after the leader goes away: quick first retries (a leader restart takes a few seconds), capped so
# a fellow left running rejoins within half a minute of the leader coming back.
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0


class Fellow:
    def __init__(self, *, leader_url: str, data_dir: Path, settings: Settings, name: str | None = None,
                 join_token: str | None = None, standby: bool = False, restart_with: list[str] | None = None):
        self.leader_url = leader_url.rstrip("/")
        self.data_dir = data_dir
        self.settings = settings
        self.private, self.public = load_or_create_identity(data_dir / "identity.key")
        self.state_path = data_dir / "fellow.json"
        state = json.loads(self.state_path.read_text()) if self.state_path.exists() else {}
        self.join_secret: str | None = None
        if join_token:
            leader_key, self.join_secret = parse_join_token(join_token)
            state["leader_key"] = encode_key(leader_key)
            pin = join_token_cert_pin(join_token)
            state.pop("leader_cert_pin", None)
            if pin is not None:
                state["leader_cert_pin"] = encode_pin(pin)
        if "leader_key" not in state:
            raise AuthError("this fellow has not joined a leader yet: run `swarm join URL --token <join token>`.")
        self.leader_public = decode_key(state["leader_key"])
        # The leader's TLS certificate, pinned by the join token (swarm.tunnel.tls); None: plain HTTP or a public CA
        self.leader_cert_pin = decode_pin(state["leader_cert_pin"]) if state.get("leader_cert_pin") else None
        self._tls_ready = False
        state["leader_url"] = self.leader_url
        self.name = name or state.get("name") or socket.gethostname()
        state["name"] = self.name
        data_dir.mkdir(parents=True, exist_ok=True)
        self.state_path.write_text(json.dumps(state, indent=1))
        self.cache_dir = data_dir / "cache"
        self.standby = standby  # offered to take over stages of fellows that drop out, left alone by plain loads
        self.fellow_id: int | None = None
        self.credential: str | None = None
        self.stages: dict[str, LoadedStage] = {}  # model name -> the stage of it this fellow serves
        self.checker = Checker(self)  # recomputes other fellows' passes for the leader's spot checks
        self.connected = trio.Event()
        self.nursery: trio.Nursery | None = None
        self.machine = MachineShare()
        self.control = ControlLink(self)
        self.links = IncomingLinks(self)
        self.link_probes = LinkProbes(self)  # round-trip time and throughput to the pool's fellows
        self.loader = StageLoader(self)
        self.direct_links = DirectLinkAgent(self)
        self.leaving = Leaving(self)  # handing its stages over before it goes (`swarm leave`, SIGTERM, Drain)
        # `swarm update`: install the leader's version, then run ``restart_with`` (the same command) in this process
        self.updater = FellowUpdater(self, restart_with)
        self.checks: str | None = None  # what this PC can hold of the leader's catalogue (the welcome's early checks)
        # how fast this PC runs a decoder layer (swarm.fellow.calibration), and the hardware it was measured on
        self.calibration: dict | None = None
        self.calibration_key: str | None = None
        self.calibrating_key: str | None = None  # the hardware a calibration under way is for

    @property
    def serve_port(self) -> int | None:
        return self.links.serve_port

    def threads_for(self, requests: int) -> int:
        """Torch threads for one pass of a stage holding ``requests`` requests. A stage working alone (one request:
        the other stages wait for it) takes every core; busier stages run at once, so each takes its share of the
        machine. SWARM_THREADS fixes the number."""
        if self.settings.threads:
            return self.settings.threads
        return (os.cpu_count() or 1) if requests <= 1 else self.machine.busy_threads()

    async def pin_leader_certificate(self) -> None:
        """Check the leader's certificate against the pin once, then trust only it for every connection to the
        leader from this process (control link, downloads, relay)."""
        if self._tls_ready or self.leader_cert_pin is None or not self.leader_url.startswith("https://"):
            return
        context = await trio.to_thread.run_sync(pinned_context, self.leader_url, self.leader_cert_pin)
        register(self.leader_url, context)
        self._tls_ready = True

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.machine.register()
        try:
            await self._run(task_status)
        finally:
            self.machine.unregister()

    async def _run(self, task_status) -> None:
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            await self.links.start_listener(nursery)
            task_status.started()
            backoff = BACKOFF_FIRST_S
            while True:
                try:
                    try:
                        await self.control.session()
                    except BaseExceptionGroup as group:
                        raise first_leaf(group) from None
                    backoff = BACKOFF_FIRST_S
                except AuthError as exc:
                    log.error("%s", exc)
                    raise
                except (OSError, SwarmError, trio_websocket.HandshakeError, trio_websocket.ConnectionClosed,
                        trio.TooSlowError) as exc:
                    log.warning("lost the leader at %s (%s); retrying in %.1f s", self.leader_url, exc, backoff)
                self.connected = trio.Event()
                await trio.sleep(backoff * (0.8 + 0.4 * random.random()))
                backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def send_to_leader(self, message) -> None:
        await self.control.send(message)

    def unload(self, model: str) -> None:
        stage = self.stages.pop(model, None)
        if stage is not None:
            stage.cancel_scope.cancel()
            log.info("unloaded %s", model)


def run_fellow(leader_url: str, join_token: str | None, data_dir: Path, name: str | None,
               standby: bool = False) -> None:
    settings = Settings.from_env()
    fellow = Fellow(leader_url=leader_url, data_dir=data_dir, settings=settings, name=name, join_token=join_token,
                    standby=standby, restart_with=restart_command())
    print(f"Fellow {fellow.name} (key {fingerprint(fellow.public)}) joining {leader_url}", flush=True)
    trio.run(run_until_left, fellow)


def check_fellow(leader_url: str, join_token: str | None, data_dir: Path, name: str | None) -> None:
    """`swarm join --check`: join once (a join token's use is taken: this PC's key is known from then on), print the
    early checks -- what this PC can hold of the leader's models -- and exit."""
    from swarm.fellow.update import open_control

    fellow = Fellow(leader_url=leader_url, data_dir=data_dir, settings=Settings.from_env(), name=name,
                    join_token=join_token)

    async def once() -> None:
        async with open_control(fellow) as channel:
            await fellow.control.enrol(channel)

    trio.run(once)
    print(f"Joined {leader_url} as {fellow.name}. What this PC can hold: {fellow.checks or 'the leader did not say'}",
          flush=True)


def leave_fellow(data_dir: Path, force: bool = False) -> None:
    """`swarm leave`: this machine's running fellow (``data_dir``) hands its stages over and leaves."""
    from swarm.fellow.leave import leave_command

    fellow = Fellow(leader_url=_joined_leader(data_dir), data_dir=data_dir, settings=Settings.from_env())
    print(trio.run(leave_command, fellow, force), flush=True)


def update_fellow(data_dir: Path, force: bool = False) -> None:
    """`swarm update`: this machine's fellow (``data_dir``) to the leader's version of swarm."""
    from swarm.fellow.update import update_command

    fellow = Fellow(leader_url=_joined_leader(data_dir), data_dir=data_dir, settings=Settings.from_env())
    print(trio.run(update_command, fellow, force), flush=True)


def _joined_leader(data_dir: Path) -> str:
    state_path = data_dir / "fellow.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    if not state.get("leader_url"):
        raise AuthError(f"no fellow has joined a leader from {data_dir}: run `swarm join URL --token <join token>` "
                        "first (or give the fellow's --data-dir).")
    return state["leader_url"]
