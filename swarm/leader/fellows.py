"""The leader's side of each fellow's control link: enrolment, heartbeats, and routing messages to serving."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import trio
from starlette.websockets import WebSocket

from swarm import wire
from swarm.errors import AuthError, ProtocolError, SwarmError
from swarm.messages import Hardware
from swarm.leader.wsframes import ServerWebSocketFrameTransport
from swarm.tunnel.channel import CLEANUP_S, NoiseChannel, close_quietly
from swarm.tunnel.keys import fingerprint

log = logging.getLogger(__name__)

# Both ends say "alive" every ALIVE_S (swarm.fellow.control); a fellow silent for SILENT_S is gone even if its socket
# never closed (a power cut, a pulled cable): its stages fail over. Checked every ALIVE_S: noticed within ~5 s.
ALIVE_S = 1.0
SILENT_S = 4.0


@dataclasses.dataclass(eq=False)
class FellowConn:
    id: int
    name: str
    public_key: bytes
    pool_id: int
    hardware: Hardware
    serve_host: str | None
    serve_port: int | None
    version: str
    channel: NoiseChannel
    connected_at: float
    last_heartbeat: float
    standby: bool = False  # left alone by plain loads: it takes over stages of fellows that drop out
    held: dict = dataclasses.field(default_factory=dict)  # model -> {"requests", "caches"} its stage holds
    last_seen: float = 0.0  # when anything last arrived from it
    credential: str = ""  # this connection's node credential (file downloads, relay); never logged
    # Messages to the fellow wait here for the connection's writer task, so whoever posts one -- the loop reading
    # another fellow's link, a client's request -- never waits on this fellow's network.
    outbox: trio.MemorySendChannel = dataclasses.field(init=False, repr=False)
    _outbox_reader: trio.MemoryReceiveChannel = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.outbox, self._outbox_reader = trio.open_memory_channel(math.inf)

    def post(self, message: Any) -> None:
        """Queue a message for the fellow; it goes out in order. A closed connection drops it."""
        try:
            self.outbox.send_nowait(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            log.debug("dropped a message for %s: its link is closed", self.name)

    async def write_outbox(self) -> None:
        async for message in self._outbox_reader:
            await self.channel.send(wire.encode(message))

    def summary(self) -> dict:
        return {
            "id": self.id,
            "name": self.name,
            "fingerprint": fingerprint(self.public_key),
            "state": "online",
            "hardware": self.hardware.to_wire(),
            "hardware_text": self.hardware.describe(),
            "serve": {"host": self.serve_host, "port": self.serve_port},
            "version": self.version,
            "standby": self.standby,
            "held": self.held,
        }


class FellowHub:
    """Connected fellows by id. ``serving`` gets every message and every disconnect."""

    def __init__(self, store, leader_private: bytes, serving) -> None:
        self.store = store
        self.private = leader_private
        self.serving = serving
        self.online: dict[int, FellowConn] = {}

    async def handle(self, ws: WebSocket) -> None:
        await ws.accept()
        transport = ServerWebSocketFrameTransport(ws)
        try:
            # Any key may open the handshake: a new fellow enrols with a join token inside the encrypted session.
            channel = await NoiseChannel.accept(transport, self.private, lambda key: True)
            hello = wire.decode(await channel.receive())
            if hello.get("t") != "hello":
                raise AuthError("the first message on a fellow link must be hello")
        except SwarmError as exc:
            log.info("refused a fellow link: %s", exc)
            await transport.aclose()
            return
        try:
            conn = await self._admit(channel, hello)
        except AuthError as exc:
            await channel.send(wire.encode({"t": "refused", "message": str(exc)}))
            await transport.aclose()
            return
        previous = self.online.get(conn.id)
        if previous is not None:
            await close_quietly(previous.channel)
        self.online[conn.id] = conn
        log.info("fellow %s (%s) connected: %s", conn.name, conn.id, conn.hardware.describe())
        try:
            keep = self.serving.on_fellow_joined(conn, hello.get("stages") or [])
            conn.post({"t": "welcome", "fellow_id": conn.id, "name": conn.name, "credential": conn.credential,
                       "stages": keep})
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write, conn, nursery.cancel_scope)
                nursery.start_soon(self._watch, conn, nursery.cancel_scope)
                await self._read(conn)
                nursery.cancel_scope.cancel()
        finally:
            conn.outbox.close()
            if self.online.get(conn.id) is conn:
                del self.online[conn.id]
                with trio.move_on_after(CLEANUP_S, shield=True):
                    await self.serving.on_fellow_lost(conn)
            await close_quietly(channel)

    async def _read(self, conn: FellowConn) -> None:
        try:
            while True:
                data = await conn.channel.receive()
                try:
                    message = wire.unpack(data)
                except ProtocolError as exc:  # the link itself is fine: skip what we cannot read
                    log.warning("fellow %s sent a message the leader cannot read: %s", conn.name, exc)
                    continue
                conn.last_seen = trio.current_time()
                if isinstance(message, dict) and message["t"] == "heartbeat":
                    conn.hardware = Hardware.from_wire(message["hardware"])
                    conn.held = message.get("held") or {}
                    conn.last_heartbeat = trio.current_time()
                    await trio.to_thread.run_sync(self.store.touch_fellow, conn.id)
                await self.serving.on_fellow_message(conn, message)
        except SwarmError as exc:
            log.info("fellow %s disconnected: %s", conn.name, exc)

    async def _watch(self, conn: FellowConn, scope: trio.CancelScope) -> None:
        """Say alive; drop a fellow that stopped saying anything."""
        while True:
            await trio.sleep(ALIVE_S)
            if trio.current_time() - conn.last_seen > SILENT_S:
                log.warning("fellow %s went silent for %.0f s: treating it as gone", conn.name, SILENT_S)
                scope.cancel()
                return
            conn.post({"t": "alive"})

    async def _write(self, conn: FellowConn, scope: trio.CancelScope) -> None:
        try:
            await conn.write_outbox()
        except SwarmError as exc:
            log.info("could not write to fellow %s: %s", conn.name, exc)
            scope.cancel()  # the link is broken: end the reader too

    async def _admit(self, channel: NoiseChannel, hello: dict) -> FellowConn:
        key = channel.remote_static
        name = str(hello.get("name") or "fellow")[:64]
        known = await trio.to_thread.run_sync(self.store.fellow_by_key, key)
        if known is None:
            secret = hello.get("join_token")
            if not secret:
                raise AuthError(
                    f"this leader does not know the fellow key {fingerprint(key)}; join with a join token: "
                    "swarm join URL --token <join token>."
                )
            pool_id = await trio.to_thread.run_sync(self.store.check_join_token, secret)
        else:
            pool_id = known.pool_id
            name = known.name
        fellow, credential = await trio.to_thread.run_sync(self.store.enrol_fellow, name, key, pool_id,
                                                           hello.get("standby") is True)
        serve = hello.get("serve") or {}
        now = trio.current_time()
        conn = FellowConn(
            id=fellow.id, name=fellow.name, public_key=key, pool_id=pool_id,
            hardware=Hardware.from_wire(hello["hardware"]),
            serve_host=serve.get("host"), serve_port=serve.get("port"), version=str(hello.get("version", "?")),
            channel=channel, connected_at=now, last_heartbeat=now, standby=fellow.standby, last_seen=now,
        )
        conn.credential = credential
        return conn
