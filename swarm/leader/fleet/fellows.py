"""The leader's side of each fellow's control link: enrolment, heartbeats, and routing messages to serving."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import trio
from starlette.websockets import WebSocket

from swarm import __version__, wire
from swarm import control_messages as cm
from swarm.errors import AuthError, ProtocolError, SwarmError
from swarm.leader.fleet.fellow_conn import FellowConn
from swarm.leader.fleet.wsframes import ServerWebSocketFrameTransport
from swarm.leader.serving.drain import leave_session
from swarm.messages import Hardware
from swarm.tunnel.channel import CLEANUP_S, NoiseChannel, close_quietly, send_last
from swarm.tunnel.keys import fingerprint

if TYPE_CHECKING:
    from swarm.leader.fleet.updates import SelfWheel

log = logging.getLogger(__name__)

# Both ends say "alive" every ALIVE_S (swarm.fellow.control); a fellow silent for SILENT_S is gone even if its socket
# never closed (a power cut, a pulled cable): its stages fail over. Checked every ALIVE_S: noticed within ~5 s.
ALIVE_S = 1.0
SILENT_S = 4.0
CATCH_UP_S = 1.0  # after a silence seems found, how long the readers get to catch up with what waits unread

# Before it is enrolled a connection is a stranger's: it must finish the Noise handshake and say hello within
# HELLO_S (a fellow across two home NATs does both in well under a second) and its hello may be HELLO_MAX_BYTES
# (a real one -- name, hardware of a few GPUs, the stages it holds -- is about 1 KiB).
HELLO_S = 10.0
HELLO_MAX_BYTES = 64 * 1024
# Once enrolled, the control link carries only small messages: heartbeats, tokens, load progress (hidden states
# travel on ring hops, never here). The largest is a batch of tokens with 20 top logprobs each, ~400 bytes a token:
# 4 MiB is ten thousand of those. The tunnel's own 256 MiB ceiling is for ring hops.
CONTROL_MAX_BYTES = 4 * 1024 * 1024
# Messages larger than this are decoded in a worker thread so a big one never stalls the event loop; at most
# DECODE_THREADS at once, so fellows cannot take every worker thread from the database and the password hasher.
DECODE_OFF_LOOP_BYTES = 64 * 1024
DECODE_THREADS = 2
MALFORMED_LOG_EVERY = 1000
TOUCH_EVERY_S = 10.0  # the database's "last seen" of a fellow: a heartbeat a second need not write it each time


class FellowHub:
    """Connected fellows by id. ``serving`` gets every message and every disconnect."""

    def __init__(self, store, leader_private: bytes, serving) -> None:
        self.store = store
        self.private = leader_private
        self.serving = serving
        self.online: dict[int, FellowConn] = {}
        self._decode_limiter = trio.CapacityLimiter(DECODE_THREADS)
        self.updates: SelfWheel | None = None  # set by the app: the leader's own version for fellows

    async def handle(self, ws: WebSocket) -> None:
        await ws.accept()
        transport = ServerWebSocketFrameTransport(ws)
        try:
            with trio.fail_after(HELLO_S):
                # Any key may open the handshake: a new fellow enrols with a join token inside the encrypted session.
                channel = await NoiseChannel.accept(transport, self.private, lambda key: True, timeout=HELLO_S)
                channel.max_message_size = HELLO_MAX_BYTES
                # A plain map, read field by field in _admit: a fellow of any version must be able to enrol and be
                # told to update (swarm.control_messages).
                hello = wire.decode(await channel.receive())
            if hello.get("t") != "hello":
                raise AuthError("the first message on a fellow link must be hello")
        except trio.TooSlowError:
            log.info("refused a fellow link: no hello within %.0f s", HELLO_S)
            await close_quietly(transport)
            return
        except SwarmError as exc:
            log.info("refused a fellow link: %s", exc)
            await close_quietly(transport)
            return
        channel.max_message_size = CONTROL_MAX_BYTES
        if hello.get("purpose") == "update":  # `swarm update` on a fellow's machine: one answer, then goodbye
            await self._update_session(channel, hello)
            await close_quietly(transport)
            return
        if hello.get("purpose") == "leave":  # `swarm leave` on a fellow's machine (swarm.leader.serving.drain)
            await leave_session(self, channel, hello)
            await close_quietly(transport)
            return
        try:
            conn = await self._admit(channel, hello)
        except (SwarmError, KeyError, TypeError, ValueError, AttributeError, RecursionError) as exc:
            # AuthError, or a malformed hello: a ProtocolError, or a field of a stranger's hello the checks missed
            if not isinstance(exc, SwarmError):
                exc = ProtocolError(f"the hello is malformed ({type(exc).__name__}); send the hello of `swarm join`.")
            log.info("refused a fellow: %s", exc)
            await send_last(channel, wire.encode(cm.Refused(str(exc))))
            await close_quietly(transport)
            return
        try:
            # Everything that waits comes before the fellow is online: once it is in self.online, any task may post
            # to it (a ring's link, an unlink), and its welcome must be the first message it reads. So from the
            # registration below to the welcome's post nothing awaits (a "link" ahead of the welcome made the
            # fellow drop the connection and rejoin over and over).
            checks = (await self.checks([conn])).get(conn.id, {})
            previous = self.online.get(conn.id)
            if previous is not None:
                await close_quietly(previous.channel)
            self.online[conn.id] = conn
            log.info("fellow %s (%s) connected: %s", conn.name, conn.id, conn.hardware.describe())
            if conn.outdated:
                log.warning("fellow %s runs swarm %s (protocol %s), this leader %s (protocol %s)", conn.name,
                            conn.version, conn.protocol, __version__, wire.PROTOCOL_VERSION)
                self.serving.start_task(self._prepare_update)  # the wheel is ready by the time someone asks for it
            keep = self.serving.on_fellow_joined(conn, hello.get("stages") or [])
            conn.post(cm.Welcome(conn.id, conn.credential, conn.name, keep,
                                 {"version": __version__, "protocol": wire.PROTOCOL_VERSION}, checks.get("text")))
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

    async def checks(self, conns: list[FellowConn]) -> dict[int, dict]:
        """Early checks (swarm.leader.planning.fit_checks): what each of ``conns`` can hold of the catalogue's
        models."""
        from swarm.leader.planning.fit_checks import fit_report

        models = await trio.to_thread.run_sync(self.store.list_models)
        catalogue = [(m.pool_id, m.name, m.manifest) for m in models if isinstance(m.manifest, dict)]
        settings = self.serving.settings
        contexts = {name: await self.serving.context_of(name) for _, name, _ in catalogue}  # each model's served one
        out = {}
        for conn in conns:
            mine = [(name, manifest) for pool_id, name, manifest in catalogue if pool_id == conn.pool_id]
            try:
                out[conn.id] = fit_report(conn.hardware, conn.disk_free_bytes, mine, device=settings.device,
                                          context_tokens=contexts, kv_cache=settings.serve_kv_cache)
            except (KeyError, TypeError, ValueError) as exc:  # a manifest of an older format: say so, not fail
                out[conn.id] = {"text": f"the early checks could not read the catalogue: {exc}", "models": []}
        return out

    async def ask_update(self, conn: FellowConn) -> None:
        """Tell ``conn`` to install the leader's version of swarm and restart (it reads this at any protocol)."""
        assert self.updates is not None, "the app sets FellowHub.updates before the leader serves"
        offer = await self.updates.offer()
        log.info("asking %s (swarm %s, protocol %s) to update to swarm %s", conn.name, conn.version, conn.protocol,
                 offer["version"])
        conn.post(cm.Update(**offer))

    async def _prepare_update(self) -> None:
        if self.updates is None:
            return
        try:
            await self.updates.offer()
        except SwarmError as exc:
            log.warning("fellows on another version cannot update from this leader: %s", exc)

    async def _update_session(self, channel: NoiseChannel, hello: dict) -> None:
        """Answer `swarm update`: the running fellow is told to update itself; a fellow that is not running gets
        the offer and a node credential to fetch the wheel with."""
        key = channel.remote_static
        try:
            known = await trio.to_thread.run_sync(self.store.fellow_by_key, key)
            if known is None or await trio.to_thread.run_sync(self.store.fellow_key_removed, key):
                raise AuthError(f"this leader has no fellow with key {fingerprint(key)}; join it first with "
                                "`swarm join URL --token <join token>`.")
            assert self.updates is not None, "the app sets FellowHub.updates before the leader serves"
            offer = await self.updates.offer()
            conn = self.online.get(known.id)
            if hello.get("version") == offer["version"] and _protocol(hello) == offer["protocol"] and \
                    hello.get("force") is not True:
                reply: Any = cm.Current(offer["version"])
            elif conn is not None and conn.updates:
                await self.ask_update(conn)
                reply = cm.Updating(conn.name, offer["version"])
            else:
                if conn is not None:
                    credential = conn.credential  # the running fellow keeps its own
                else:
                    _, credential = await trio.to_thread.run_sync(self.store.enrol_fellow, known.name, key,
                                                                  known.pool_id)
                reply = cm.Update(**offer, credential=credential, running=conn is not None)
        except SwarmError as exc:
            log.info("refused an update for key %s: %s", fingerprint(key), exc)
            reply = cm.Refused(str(exc))
        await send_last(channel, wire.encode(reply))

    async def disconnect(self, fellow_id: int) -> bool:
        """End a fellow's control link now (it was removed): its stages fail over as if it had dropped out."""
        conn = self.online.get(fellow_id)
        if conn is None:
            return False
        await close_quietly(conn.channel)
        return True

    async def _read(self, conn: FellowConn) -> None:
        try:
            while True:
                data = await conn.channel.receive()
                try:
                    if len(data) > DECODE_OFF_LOOP_BYTES:
                        message = await trio.to_thread.run_sync(wire.unpack, data, limiter=self._decode_limiter)
                    else:
                        message = wire.unpack(data)
                except ProtocolError as exc:  # the link itself is fine: skip what we cannot read
                    self._malformed(conn, f"a message the leader cannot read: {exc}")
                    continue
                conn.last_seen = trio.current_time()
                try:
                    if isinstance(message, cm.UpdateFailed):
                        conn.update_error = message.message[:500]
                        log.warning("fellow %s could not update: %s", conn.name, conn.update_error)
                        continue
                    if isinstance(message, cm.Heartbeat):
                        conn.hardware, conn.held = message.hardware, message.held
                        if message.calibration is not None:
                            conn.calibration = message.calibration
                        conn.last_heartbeat = trio.current_time()
                        if conn.last_heartbeat - conn.touched_at >= TOUCH_EVERY_S:  # not a write per message
                            conn.touched_at = conn.last_heartbeat
                            await trio.to_thread.run_sync(self.store.touch_fellow, conn.id)
                    await self.serving.on_fellow_message(conn, message)
                except (ProtocolError, KeyError, TypeError, ValueError, AttributeError) as exc:
                    # Decoding checked each message's own fields; the maps inside some (a heartbeat's hops, a
                    # sample's output) are read field by field, and one bad message is skipped, not worth the link.
                    kind = getattr(message, "TYPE", None) or message.get("t")
                    self._malformed(conn, f"a malformed {kind!r} message ({type(exc).__name__}: {exc})")
        except SwarmError as exc:
            log.info("fellow %s disconnected: %s", conn.name, exc)

    @staticmethod
    def _malformed(conn: FellowConn, what: str) -> None:
        """Log a message skipped as malformed: the first few, then one in MALFORMED_LOG_EVERY, so a fellow cannot
        flood the leader's log."""
        conn.malformed += 1
        if conn.malformed <= 5 or conn.malformed % MALFORMED_LOG_EVERY == 0:
            log.warning("fellow %s sent %s (%d malformed so far)", conn.name, what[:300], conn.malformed)

    async def _watch(self, conn: FellowConn, scope: trio.CancelScope) -> None:
        """Say alive; drop a fellow that stopped saying anything."""
        while True:
            await trio.sleep(ALIVE_S)
            conn.post(cm.Alive())
            if trio.current_time() - conn.last_seen > SILENT_S:
                # What it said may still wait unread if this process's own loop was held (a long collection, swap):
                # let the reader catch up before deciding.
                await trio.sleep(CATCH_UP_S)
                if trio.current_time() - conn.last_seen > SILENT_S + CATCH_UP_S:
                    log.warning("fellow %s went silent for %.0f s: treating it as gone", conn.name, SILENT_S)
                    scope.cancel()
                    return

    async def _write(self, conn: FellowConn, scope: trio.CancelScope) -> None:
        try:
            await conn.write_outbox()
        except SwarmError as exc:
            log.info("could not write to fellow %s: %s", conn.name, exc)
            scope.cancel()  # the link is broken: end the reader too

    async def _admit(self, channel: NoiseChannel, hello: dict) -> FellowConn:
        key = channel.remote_static
        # Every field is checked for its type: str() of a 60 kB CBOR bignum as a name raised ValueError (Python's
        # int-to-string limit), a traceback in the log for every stranger who sent one.
        name = hello.get("name") or "fellow"
        if not isinstance(name, str):
            raise ProtocolError("a hello's name must be a string (the fellow's name, as `swarm join --name` gives it).")
        name = name[:64]
        hardware = Hardware.from_wire(hello.get("hardware"))  # a malformed hello is refused before it costs a use
        if await trio.to_thread.run_sync(self.store.fellow_key_removed, key):
            raise AuthError(
                f"the leader's admin removed the fellow with key {fingerprint(key)}; to join again, delete this "
                "fellow's key file and join with a new join token."
            )
        known = await trio.to_thread.run_sync(self.store.fellow_by_key, key)
        if known is None:
            secret = hello.get("join_token")
            if not secret or not isinstance(secret, str):
                raise AuthError(
                    f"this leader does not know the fellow key {fingerprint(key)}; join with a join token: "
                    "swarm join URL --token <join token>."
                )
            pool_id = await trio.to_thread.run_sync(self.store.redeem_join_token, secret)
        else:
            pool_id = known.pool_id
            name = known.name
        fellow, credential = await trio.to_thread.run_sync(self.store.enrol_fellow, name, key, pool_id,
                                                           hello.get("standby") is True)
        serve = hello.get("serve")
        serve = serve if isinstance(serve, dict) else {}
        host, port = serve.get("host"), serve.get("port")
        now = trio.current_time()
        conn = FellowConn(
            id=fellow.id, name=fellow.name, public_key=key, pool_id=pool_id,
            hardware=hardware,
            serve_host=host if isinstance(host, str) else None,
            serve_port=port if isinstance(port, int) and not isinstance(port, bool) else None,
            version=hello["version"][:64] if isinstance(hello.get("version"), str) else "?",
            channel=channel, last_heartbeat=now, standby=fellow.standby, last_seen=now,
            protocol=_protocol(hello), updates=hello.get("updates") is True, drafting=hello.get("drafting") is True,
            draft_model=hello.get("draft_model") is True, prefix_cache=hello.get("prefix_cache") is True,
            narrowing=hello.get("narrowing") is True, extending=hello.get("extending") is True,
            kv_extension=hello.get("kv_extension") is True,
            disk_free_bytes=_count(hello.get("disk_free_bytes")),
            calibration=hello["calibration"] if isinstance(hello.get("calibration"), dict) else None,
        )
        conn.credential = credential
        return conn


def _protocol(hello: dict) -> int:
    """The protocol a hello's sender speaks: its "protocol", else the envelope's "v" (wire.decode checked it is an
    int)."""
    value = hello.get("protocol", hello.get("v"))
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _count(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
