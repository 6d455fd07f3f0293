"""The fellow's control link to the leader: one outbound websocket carrying a Noise session pinned to the leader's
key (so it works behind a NAT and nobody on the way reads it). Enrolment, heartbeats, and the leader's instructions
(load, unload, requests, Direct links) dispatched to the parts of the fellow that carry them out.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio
import trio_websocket

from swarm import __version__, messages, wire
from swarm import control_links as cl
from swarm import control_messages as cm
from swarm import handover_messages as hm
from swarm.errors import AuthError, LinkClosed, ModelError, ProtocolError
from swarm.fellow import calibration, calibration_process, handover, hardware
from swarm.fellow.memory import IdleTrimmer, release_free_memory
from swarm.fellow.net import outbound_ip
from swarm.mesh.websocket import WebSocketFrameTransport, ws_url
from swarm.tunnel.channel import NoiseChannel
from swarm.tunnel.keys import fingerprint
from swarm.tunnel.tls import context_for

log = logging.getLogger(__name__)

SEND_TIMEOUT_S = 30.0  # a control message the leader has not taken by then means the link is dead
CONNECT_TIMEOUT_S = 10.0
# Both ends say "alive" every ALIVE_S; a link silent for SILENT_S is dead even if no socket said so (a power cut, a
# pulled cable, a laptop lid shut): the fellow reconnects, the leader fails the fellow's stages over. 4 s of silence
# and a check every second: noticed within about 5 s.
ALIVE_S = 1.0
SILENT_S = 4.0
CATCH_UP_S = 1.0  # after a silence seems found, how long the reader gets to catch up with what waits unread


def disk_free(folder) -> int | None:
    """Free bytes on the disk that holds ``folder`` (or the nearest folder above it that exists)."""
    import shutil
    from pathlib import Path

    path = Path(folder).resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


class ControlLink:
    def __init__(self, fellow):
        self.fellow = fellow
        self._channel: NoiseChannel | None = None
        self._lock = trio.Lock()

    async def session(self) -> None:
        """One connection to the leader, from the handshake until it drops."""
        fellow = self.fellow
        await fellow.pin_leader_certificate()
        async with trio.open_nursery() as nursery:
            try:
                with trio.fail_after(CONNECT_TIMEOUT_S):
                    ws = await trio_websocket.connect_websocket_url(
                        nursery, ws_url(fellow.leader_url, "/fellow/link"), max_message_size=1 << 20,
                        ssl_context=context_for(fellow.leader_url),
                    )
            except (OSError, trio_websocket.HandshakeError) as exc:
                raise LinkClosed(f"cannot reach the leader: {exc}") from None
            channel = await NoiseChannel.connect(WebSocketFrameTransport(ws), fellow.private, fellow.leader_public)
            try:
                await self.enrol(channel)
                nursery.start_soon(self._heartbeat, nursery)
                nursery.start_soon(self._say_alive)
                while True:
                    data = await self._receive(channel)
                    try:
                        message = wire.unpack(data)
                    except ProtocolError as exc:  # a leader on another protocol: its update tells us what to do
                        log.warning("skipped a message from the leader: %s", exc)
                        continue
                    await self.dispatch(message)
            finally:
                self._channel = None
                nursery.cancel_scope.cancel()

    @staticmethod
    async def _receive(channel: NoiseChannel) -> bytes:
        """The leader's next message; LinkClosed once it said nothing for SILENT_S. A deadline that passed while this
        process's own loop was held (a long collection, swap) would blame the leader for our stall: what it sent
        then waits unread, so the reader gets CATCH_UP_S more before the link is given up."""
        with trio.move_on_after(SILENT_S):
            return await channel.receive()
        with trio.move_on_after(CATCH_UP_S):
            return await channel.receive()
        raise LinkClosed(f"the leader went silent for {SILENT_S:.0f} s")

    def lent(self, hw: messages.Hardware) -> messages.Hardware:
        """``hw`` within SWARM_SERVE_MEMORY_GB, less what this fellow's stages hold (swarm.fellow.hardware.lent)."""
        fellow = self.fellow
        held = sum(int(s.placement().get("bytes") or 0) for s in fellow.stages.values())
        return hardware.lent(hw, int(fellow.settings.serve_memory_gb * 1e9), held)

    async def enrol(self, channel: NoiseChannel) -> None:
        """Say hello to the leader over ``channel`` and take its welcome: this fellow's id and credential, and the early
        checks. AuthError if the leader refuses it."""
        fellow = self.fellow
        # A plain map: the leader reads it before it knows this fellow's version (swarm.control_messages).
        hello = {
            "t": "hello", "name": fellow.name, "version": __version__, "protocol": wire.PROTOCOL_VERSION,
            "updates": True,  # it installs the leader's version when told to (swarm.fellow.update)
            "drafting": True,  # its stages run guessed tokens and verify them (swarm.stage.drafting)
            "draft_model": True,  # its last stage holds a draft model when sent one (swarm.stage.draft_model)
            "prefix_cache": True,  # its stages carry out prefix cache plans (swarm.stage.prefix_cache)
            "narrowing": True,  # a link may narrow its stage to a sub-range of its layers (swarm.stage.narrow)
            "extending": True,  # it loads what its stage lacks beside it, spliced in at a link (swarm.stage.resplit)
            "kv_extension": True,  # it holds a KV handover's rows of those layers with them (KvImport.extension)
            "disk_free_bytes": disk_free(fellow.cache_dir),  # for the early checks: which stages' files fit here
            "hardware": self.lent(hardware.probe()).to_wire(),
            "serve": {"host": outbound_ip(fellow.leader_url), "port": fellow.serve_port},
            "stages": [stage.summary() for stage in fellow.stages.values()],
            "standby": fellow.standby,
        }
        if fellow.calibration is not None:  # a restarted leader plans with it at once, not after the next heartbeat
            hello["calibration"] = fellow.calibration
        if fellow.join_secret:
            hello["join_token"] = fellow.join_secret
        await channel.send(wire.encode(hello))
        reply = wire.unpack(await channel.receive())
        if isinstance(reply, cm.Refused):
            raise AuthError(f"the leader refused this fellow: {reply.message}")
        if not isinstance(reply, cm.Welcome):
            kind = getattr(reply, "TYPE", None) or reply.get("t")
            raise LinkClosed(f"unexpected first message from the leader: {kind}")
        fellow.fellow_id = reply.fellow_id
        fellow.credential = reply.credential
        fellow.join_secret = None  # enrolled: the key identifies this fellow from now on
        self._channel = channel
        fellow.connected.set()
        log.info("joined %s as %s (fellow %s, key %s)", fellow.leader_url, fellow.name, fellow.fellow_id,
                 fingerprint(fellow.public))
        if reply.checks is not None:
            fellow.checks = reply.checks
            log.info("what this PC can hold: %s", reply.checks)
        leader = reply.leader or {}
        if leader.get("protocol", wire.PROTOCOL_VERSION) != wire.PROTOCOL_VERSION:
            log.warning("the leader runs swarm %s (protocol %s), this fellow swarm %s (protocol %s): it gets no "
                        "stage until it is updated -- run `swarm update` here, or Update on the admin page",
                        leader.get("version"), leader.get("protocol"), __version__, wire.PROTOCOL_VERSION)
        elif leader.get("version", __version__) != __version__:
            log.info("the leader runs swarm %s, this fellow %s (same protocol); `swarm update` installs the "
                     "leader's", leader.get("version"), __version__)
        # Stages whose model the leader no longer counts as ours are stale after a leader restart.
        for model in [m for m in fellow.stages if m not in reply.stages]:
            fellow.unload(model)

    @property
    def up(self) -> bool:
        """Whether the link to the leader is open now."""
        return self._channel is not None

    async def send(self, message: Any) -> None:
        channel = self._channel
        if channel is None:
            raise LinkClosed("not connected to the leader")
        # Shielded: a task cancelled half-way through a send would leave the Noise session unusable and cost the
        # whole control link (and with it the node credential that downloads in flight use).
        with trio.move_on_after(SEND_TIMEOUT_S, shield=True) as scope:
            async with self._lock:
                await channel.send(wire.encode(message))
        if scope.cancelled_caught:
            raise LinkClosed(f"the leader did not take a message within {SEND_TIMEOUT_S:.0f} s")

    async def _say_alive(self) -> None:
        while True:
            await trio.sleep(ALIVE_S)
            await self.send(cm.Alive())

    async def _calibrate(self, key: str, hw_wire: dict) -> None:
        """How fast this fellow runs a layer, for the planner (swarm.fellow.calibration_process: cached for this
        machine's hardware, else measured in a process of its own at the lowest priority); the next heartbeat
        carries it. It runs in the fellow's own nursery, not the link's: a link that drops must not cancel it."""
        fellow = self.fellow
        try:
            fellow.calibration = await calibration_process.calibrate(
                fellow.data_dir, fellow.settings.device, hw_wire, fellow.threads_for(1),
                fellow.settings.calibrate_cpu_s)
            fellow.calibration_key = key
        finally:
            if fellow.calibrating_key == key:
                fellow.calibrating_key = None

    async def _heartbeat(self, nursery: trio.Nursery) -> None:
        fellow = self.fellow
        trimmer = IdleTrimmer()
        hw = self.lent(await trio.to_thread.run_sync(hardware.probe))
        while True:
            if fellow.settings.calibrate:  # when it joins, and again when its hardware changes
                key = calibration.hardware_key(fellow.settings.device, hw.to_wire())
                if key != fellow.calibration_key and key != fellow.calibrating_key:
                    fellow.calibrating_key = key
                    (fellow.nursery or nursery).start_soon(self._calibrate, key, hw.to_wire())
            await trio.sleep(fellow.settings.heartbeat_s)
            hw = self.lent(await trio.to_thread.run_sync(hardware.probe))
            if trimmer.due(any(s.driver.busy for s in fellow.stages.values())):
                await trio.to_thread.run_sync(release_free_memory)  # the last burst's high-water mark goes back
            hops = [s.driver.out_hop.stats() for s in fellow.stages.values() if s.driver.out_hop is not None]
            await self.send(cm.Heartbeat(hw, sorted(fellow.stages), hops,
                                         {name: s.held() for name, s in fellow.stages.items()},
                                         {name: s.placement() for name, s in fellow.stages.items()},
                                         fellow.calibration))

    async def dispatch(self, message: Any) -> None:
        """Hand a message of the leader to the part of the fellow that carries it out (``handlers``, by type)."""
        handler = self.handlers.get(type(message))
        if handler is None:  # a type this fellow does not know (a plain map from a newer leader), or no business here
            log.debug("ignoring control message %s", getattr(message, "TYPE", None) or message.get("t"))
            return
        await handler(message)

    async def _request(self, message: messages.Generate | messages.Cancel) -> None:
        fellow = self.fellow
        stage = fellow.stages.get(message.model)
        if stage is None:
            await self.send(messages.Failed(message.model, message.rid,
                                            f"model {message.model} is not loaded on {fellow.name}", not_loaded=True))
        elif stage.ring_id is None:
            await self.send(messages.Failed(message.model, message.rid,
                                            f"stage {stage.index} of {message.model} on {fellow.name} is not linked "
                                            "into a ring yet"))
        else:
            await stage.driver.deliver(message)

    async def _alive(self, message: cm.Alive) -> None:
        pass  # the link's silence check counts every message; this one says nothing else

    async def _load(self, message: cm.Load) -> None:
        self.fellow.nursery.start_soon(self.fellow.loader.load, message)

    async def _link(self, message: cm.Link) -> None:
        stage = self.fellow.stages.get(message.model)
        if stage is None or stage.load_id != message.load_id:
            await self.send(cm.LinkFailed(message.model, message.ring_id, f"stage {message.index} of {message.model} "
                                                                          f"is not loaded on {self.fellow.name}"))
            return
        try:
            await stage.link(message)
        except ModelError as exc:  # a narrowing it cannot make: the leader rebuilds the ring without this stage
            await self.send(cm.LinkFailed(message.model, message.ring_id, f"stage {message.index} of {message.model} "
                                                                          f"on {self.fellow.name}: {exc}"))
            return
        await self.send(cm.Linked(stage.model, stage.ring_id))

    async def _ring_ready(self, message: cm.RingReady) -> None:
        stage = self.fellow.stages.get(message.model)
        if stage is not None:
            stage.ring_ready(message.ring_id)

    async def _unlink(self, message: cm.Unlink) -> None:
        stage = self.fellow.stages.get(message.model)
        if stage is not None:
            stage.unlink()

    async def _unload(self, message: cm.Unload) -> None:
        self.fellow.loader.cancel(message.model)  # a load still in flight stops too
        self.fellow.unload(message.model)
        await self.send(cm.Unloaded(message.model))

    async def _drop_extension(self, message: cm.DropExtension) -> None:
        """A re-layout given up: what was loaded (or is loading) beside the stage goes; the stage serves on."""
        self.fellow.loader.cancel(message.model, extension_only=True)
        stage = self.fellow.stages.get(message.model)
        if stage is not None:
            stage.drop_extension()

    async def _update(self, message: cm.Update) -> None:
        self.fellow.nursery.start_soon(self.fellow.updater.run, message)

    async def _kv_handover(self, message: hm.KvKeep | hm.KvImport) -> None:
        """A drain's KV handover (swarm.fellow.handover)."""
        self.fellow.nursery.start_soon(handover.answer, self.fellow, self.send, message)

    async def _verify_pick(self, message: cm.VerifyPick) -> None:
        """The leader's spot check of a pass of this stage (swarm.fellow.verify)."""
        stage = self.fellow.stages.get(message.model)
        if stage is not None:
            stage.driver.audits.pick(message.rid, message.picks)

    async def _verify_run(self, message: cm.VerifyRun) -> None:
        self.fellow.checker.submit(message)

    async def _leaving(self, message: cm.Leave | cm.LeaveRefused) -> None:
        self.fellow.leaving.on_message(message)  # swarm.fellow.leave

    async def _punch_ping(self, message: cl.PunchPing) -> None:
        await self.send(cl.PunchPong(message.hop_id, message.role))

    async def _punch_prepare(self, message: cl.PunchPrepare) -> None:
        self.fellow.nursery.start_soon(self.fellow.direct_links.prepare, message)

    async def _punch_start(self, message: cl.PunchStart) -> None:
        self.fellow.nursery.start_soon(self.fellow.direct_links.start, message)

    async def _probe_links(self, message: cl.ProbeLinks) -> None:
        self.fellow.nursery.start_soon(self.fellow.link_probes.run, message)

    @property
    def handlers(self) -> dict[type, Callable[[Any], Awaitable[None]]]:
        """What the fellow does with each message of the leader, by its type."""
        return {
            messages.Generate: self._request, messages.Cancel: self._request, cm.Alive: self._alive,
            cm.Load: self._load, cm.Link: self._link, cm.RingReady: self._ring_ready, cm.Unlink: self._unlink,
            cm.Unload: self._unload, cm.DropExtension: self._drop_extension, cm.Update: self._update,
            cm.VerifyPick: self._verify_pick,
            cm.VerifyRun: self._verify_run, cm.Leave: self._leaving, cm.LeaveRefused: self._leaving,
            cl.PunchPing: self._punch_ping, cl.PunchPrepare: self._punch_prepare, cl.PunchStart: self._punch_start,
            cl.ProbeLinks: self._probe_links, hm.KvKeep: self._kv_handover, hm.KvImport: self._kv_handover,
        }
