"""The fellow process: `swarm join URL --token T`.

Keeps one outbound, Noise-encrypted control link to the leader (so it works behind a NAT), reports its hardware,
fetches and runs the stages the leader places on it, and links them to their ring neighbours.
"""

from __future__ import annotations

import json
import logging
import random
import socket
from pathlib import Path

import httpx
import trio
import trio_websocket

from swarm import __version__, wire
from swarm.fellow import hardware
from swarm.config import Settings
from swarm.errors import AuthError, LinkClosed, SwarmError, TunnelError, first_leaf
from swarm.fellow.downloads import CredentialRefused, fetch_with_retries
from swarm.tunnel.join_token import parse_join_token
from swarm.mesh import sequencing
from swarm.mesh.hop import HopConfig, OutgoingHop
from swarm.mesh.paths import accept_relay
from swarm.mesh.websocket import WebSocketFrameTransport, ws_url
from swarm.fellow.net import outbound_ip
from swarm.fellow.direct_links import PunchAgent
from swarm.fellow.ring import StageRuntime
from swarm.tunnel.channel import CLEANUP_S, NoiseChannel, StreamFrameTransport
from swarm.tunnel.keys import decode_key, encode_key, fingerprint, load_or_create_identity

log = logging.getLogger(__name__)

# Reconnect backoff after the leader goes away: quick first retries (a leader restart takes a few seconds), capped so
# a fellow left running rejoins within half a minute of the leader coming back.
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
SEND_TIMEOUT_S = 30.0  # a control message the leader has not taken by then means the link is dead


class LoadedStage:
    def __init__(self, runtime: StageRuntime, cancel_scope: trio.CancelScope, hop_in: dict | None, load_id: str,
                 nursery: trio.Nursery):
        self.nursery = nursery  # the stage's tasks: links, tunnels; cancelled on unload
        self.runtime = runtime
        self.cancel_scope = cancel_scope
        self.hop_in = hop_in
        self.load_id = load_id


class Fellow:
    def __init__(self, *, leader_url: str, data_dir: Path, settings: Settings, name: str | None = None,
                 join_token: str | None = None):
        self.leader_url = leader_url.rstrip("/")
        self.data_dir = data_dir
        self.settings = settings
        self.name = name or socket.gethostname()
        self.private, self.public = load_or_create_identity(data_dir / "identity.key")
        self.state_path = data_dir / "fellow.json"
        state = json.loads(self.state_path.read_text()) if self.state_path.exists() else {}
        self.join_secret = None
        if join_token:
            leader_key, self.join_secret = parse_join_token(join_token)
            state["leader_key"] = encode_key(leader_key)
        if "leader_key" not in state:
            raise AuthError("this fellow has not joined a leader yet: run `swarm join URL --token <join token>`.")
        self.leader_public = decode_key(state["leader_key"])
        state["leader_url"] = self.leader_url
        state.setdefault("name", self.name)
        self.name = name or state["name"]
        state["name"] = self.name
        data_dir.mkdir(parents=True, exist_ok=True)
        self.state_path.write_text(json.dumps(state, indent=1))
        self.cache_dir = data_dir / "cache"
        self.fellow_id: int | None = None
        self.credential: str | None = None
        self.stages: dict[str, LoadedStage] = {}
        self.serve_port: int | None = None
        self._control: NoiseChannel | None = None
        self._control_lock = trio.Lock()
        self._resequencers: dict[str, sequencing.Resequencer] = {}
        self.punch = PunchAgent(self)
        self._nursery: trio.Nursery | None = None
        self.connected = trio.Event()

    # --- main loop ------------------------------------------------------------------------------------------------

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await self._start_ring_listener(nursery)
            task_status.started()
            backoff = BACKOFF_FIRST_S
            while True:
                try:
                    try:
                        await self._session()
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
                self._control = None
                await trio.sleep(backoff * (0.8 + 0.4 * random.random()))
                backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def _session(self) -> None:
        async with trio.open_nursery() as nursery:
            try:
                with trio.fail_after(10):
                    ws = await trio_websocket.connect_websocket_url(
                        nursery, ws_url(self.leader_url, "/fellow/link"), max_message_size=1 << 20
                    )
            except (OSError, trio_websocket.HandshakeError) as exc:
                raise LinkClosed(f"cannot reach the leader: {exc}") from None
            channel = await NoiseChannel.connect(WebSocketFrameTransport(ws), self.private, self.leader_public)
            hello = {
                "t": "hello", "name": self.name, "version": __version__,
                "hardware": hardware.probe().to_wire(),
                "serve": {"host": outbound_ip(self.leader_url), "port": self.serve_port},
                "stages": sorted(self.stages),
            }
            if self.join_secret:
                hello["join_token"] = self.join_secret
            await channel.send(wire.encode(hello))
            reply = wire.decode(await channel.receive())
            if reply["t"] == "refused":
                raise AuthError(f"the leader refused this fellow: {reply.get('message')}")
            if reply["t"] != "welcome":
                raise LinkClosed(f"unexpected first message from the leader: {reply['t']}")
            self.fellow_id = int(reply["fellow_id"])
            self.credential = reply["credential"]
            self.join_secret = None  # enrolled: the key identifies this fellow from now on
            self._control = channel
            self.connected.set()
            log.info("joined %s as %s (fellow %s, key %s)", self.leader_url, self.name, self.fellow_id,
                     fingerprint(self.public))
            # Stages whose model the leader no longer counts as ours are stale after a leader restart.
            for model in [m for m in self.stages if m not in reply.get("stages", [])]:
                self._unload(model)
            nursery.start_soon(self._heartbeat)
            try:
                while True:
                    message = wire.decode(await channel.receive())
                    await self._on_control(message)
            finally:
                nursery.cancel_scope.cancel()

    async def send_to_leader(self, message: dict) -> None:
        channel = self._control
        if channel is None:
            raise LinkClosed("not connected to the leader")
        # Shielded: a task cancelled half-way through a send would leave the Noise session unusable and cost the
        # whole control link (and with it the node credential that downloads in flight use).
        with trio.move_on_after(SEND_TIMEOUT_S, shield=True) as scope:
            async with self._control_lock:
                await channel.send(wire.encode(message))
        if scope.cancelled_caught:
            raise LinkClosed(f"the leader did not take a message within {SEND_TIMEOUT_S:.0f} s")

    async def _heartbeat(self) -> None:
        while True:
            await trio.sleep(self.settings.heartbeat_s)
            hw = await trio.to_thread.run_sync(hardware.probe)
            hops = [s.runtime.out_hop.stats() for s in self.stages.values() if s.runtime.out_hop is not None]
            await self.send_to_leader({"t": "heartbeat", "hardware": hw.to_wire(), "stages": sorted(self.stages),
                                       "hops": hops})

    async def _on_control(self, message: dict) -> None:
        kind = message["t"]
        if kind == "load":
            self._nursery.start_soon(self._load, message)
        elif kind == "unload":
            self._unload(message["model"])
            await self.send_to_leader({"t": "unloaded", "model": message["model"]})
        elif kind == "ring_ready":
            # Every stage is loaded: open the outgoing link now, so the first reply does not wait for it.
            stage = self.stages.get(message["model"])
            if stage is not None and stage.runtime.out_hop is not None:
                stage.nursery.start_soon(_open_quietly, stage.runtime.out_hop)
        elif kind == "punch_ping":
            await self.send_to_leader({"t": "punch_pong", "hop_id": message["hop_id"], "role": message["role"]})
        elif kind == "punch_prepare":
            self._nursery.start_soon(self.punch.prepare, message)
        elif kind == "punch_start":
            self._nursery.start_soon(self.punch.start, message)
        elif kind in ("gen", "cancel"):
            stage = self.stages.get(message["model"])
            if stage is None:
                await self.send_to_leader({"t": "failed", "model": message["model"], "rid": message["rid"],
                                           "message": f"model {message['model']} is not loaded on {self.name}",
                                           "streamed": 0, "not_loaded": True})
                return
            await stage.runtime.deliver(message)
        else:
            log.debug("ignoring control message %r", kind)

    # --- loading --------------------------------------------------------------------------------------------------

    async def _report(self, model: str, load_id: str, phase: str, fraction: float) -> None:
        try:
            await self.send_to_leader({"t": "load_progress", "model": model, "load_id": load_id, "phase": phase,
                                       "fraction": round(fraction, 4)})
        except SwarmError:
            pass

    async def _load(self, message: dict) -> None:
        model, load_id = message["model"], message["load_id"]
        self._unload(model)
        try:
            try:
                stage_model = await self._fetch_and_build(message)
            except BaseExceptionGroup as group:
                raise first_leaf(group) from None
        except Exception as exc:
            log.exception("loading %s failed", model) if not isinstance(exc, SwarmError) else None
            text = str(exc) if isinstance(exc, SwarmError) else f"{type(exc).__name__}: {exc}"
            try:
                await self.send_to_leader({"t": "load_failed", "model": model, "load_id": load_id,
                                           "message": f"stage {message['stage']['index']} on {self.name}: {text}"})
            except SwarmError:
                pass
            return
        await self._nursery.start(self._serve_stage, message, stage_model)

    async def _fetch_and_build(self, message: dict):
        from swarm.stage.slice import StageModel, StageSpec  # torch is heavy: import when a stage is placed here
        import torch

        model, load_id, spec_msg = message["model"], message["load_id"], message["stage"]
        files = message["files"]
        total = sum(f["size"] for f in files) or 1
        done_before = 0
        local: dict[str, Path] = {}
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=60.0)) as client:
            for f in files:
                url = f"{self.leader_url}/api/v1/models/{model}/files/{f['path']}"
                base = done_before

                def progress(done, _total, base=base):
                    self._last_progress = (base + done) / total

                self._last_progress = base / total
                async with trio.open_nursery() as n:
                    n.start_soon(self._progress_pump, model, load_id, n.cancel_scope)
                    for attempt in range(2):
                        try:
                            local[f["path"]] = await fetch_with_retries(
                                client, url, self.cache_dir, f["sha256"], f["size"],
                                {"authorization": f"Bearer {self.credential}"}, progress
                            )
                            break
                        except CredentialRefused:
                            if attempt:
                                raise
                            # The control link was re-made meanwhile and the leader issued a new credential:
                            # wait for it, then resume (the partial file is kept).
                            with trio.fail_after(60):
                                await self.connected.wait()
                    n.cancel_scope.cancel()
                done_before += f["size"]
        await self._report(model, load_id, "download", 1.0)
        await self._report(model, load_id, "extract", 1.0)  # shards are verified safetensors: nothing to unpack
        spec = StageSpec(spec_msg["first_layer"], spec_msg["end_layer"], spec_msg["is_first"], spec_msg["is_last"])
        device = self.settings.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        # On CPU compute in float32; on a GPU in the checkpoint's half precision (DESIGN.md, The ring).
        dtype = torch.float32 if device == "cpu" else getattr(torch, message.get("gpu_dtype") or "float16")
        await self._report(model, load_id, "load", 0.0)
        stage_model = await trio.to_thread.run_sync(
            lambda: StageModel.load(message["config"], local, spec, dtype=dtype, device=device)
        )
        await trio.to_thread.run_sync(stage_model.warm_up)
        await self._report(model, load_id, "load", 1.0)
        return stage_model

    async def _progress_pump(self, model, load_id, scope) -> None:
        while True:
            await self._report(model, load_id, "download", getattr(self, "_last_progress", 0.0))
            await trio.sleep(0.5)

    async def _serve_stage(self, message: dict, stage_model, task_status=trio.TASK_STATUS_IGNORED) -> None:
        model, spec_msg = message["model"], message["stage"]
        runtime = None
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                out_hop = None
                hop_out = message.get("hop_out")
                if hop_out:
                    out_hop = OutgoingHop(
                        HopConfig(
                            hop_id=hop_out["hop_id"],
                            peer_public=hop_out["peer_key"],
                            peer_name=hop_out["peer_name"],
                            direct=tuple(hop_out["direct"]) if hop_out.get("direct") else None,
                            transport=hop_out.get("transport", "auto"),
                        ),
                        nursery=nursery,
                        leader_url=self.leader_url,
                        credential=lambda: self.credential,
                        local_private=self.private,
                        connect_timeout=self.settings.direct_connect_timeout_s,
                    )
                if out_hop is not None:
                    async def lost(hop, model=model):
                        try:
                            await self.send_to_leader({"t": "hop_lost", "model": model, "hop_id": hop.config.hop_id,
                                                       "path": hop.path})
                        except SwarmError:
                            pass

                    out_hop.on_lost = lost
                runtime = StageRuntime(
                    model=model,
                    index=spec_msg["index"],
                    num_stages=spec_msg["num_stages"],
                    stage_model=stage_model,
                    out_hop=out_hop,
                    send_to_leader=self.send_to_leader,
                    prefill_chunk=self.settings.serve_prefill_chunk,
                )
                hop_in = message.get("hop_in")
                self.stages[model] = LoadedStage(runtime, scope, hop_in, message["load_id"], nursery)
                await nursery.start(runtime.run)
                if hop_in:
                    nursery.start_soon(self._relay_listener, runtime, hop_in)
                await self.send_to_leader({"t": "loaded", "model": model, "load_id": message["load_id"]})
                task_status.started()
                try:
                    await trio.sleep_forever()
                finally:
                    if out_hop is not None:
                        with trio.move_on_after(CLEANUP_S, shield=True):
                            await out_hop.aclose()
        stage = self.stages.get(model)
        if stage is not None and stage.cancel_scope is scope:
            del self.stages[model]
        if message.get("hop_in"):
            self._resequencers.pop(message["hop_in"]["hop_id"], None)
        del runtime, stage_model
        _free_memory()

    def _unload(self, model: str) -> None:
        stage = self.stages.pop(model, None)
        if stage is not None:
            stage.cancel_scope.cancel()
            log.info("unloaded %s", model)

    # --- incoming ring links --------------------------------------------------------------------------------------

    def _expects(self, key: bytes) -> bool:
        return any(s.hop_in is not None and s.hop_in["peer_key"] == key for s in self.stages.values())

    def _stage_for_hop(self, hop_id: str, key: bytes) -> StageRuntime | None:
        for stage in self.stages.values():
            if stage.hop_in is not None and stage.hop_in["hop_id"] == hop_id and stage.hop_in["peer_key"] == key:
                return stage.runtime
        return None

    async def _pump(self, channel: NoiseChannel, runtime: StageRuntime, hop_id: str) -> None:
        """Ring messages of one incoming path, handed to the stage in the hop's order (see swarm.mesh.sequencing)."""
        order = self._resequencers.setdefault(hop_id, sequencing.Resequencer())
        try:
            while True:
                frame = await channel.receive()
                flag, _ = sequencing.kind(frame)
                if flag == sequencing.PING:
                    await channel.send(sequencing.pong(frame))
                    continue
                for payload in order.push(frame):
                    await runtime.deliver(wire.decode(payload))
        except (TunnelError, SwarmError, OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.info("incoming link of %s closed: %s", runtime.model, exc)
        finally:
            with trio.move_on_after(CLEANUP_S, shield=True):
                try:
                    await channel.aclose()
                except Exception:
                    pass

    async def _on_direct_connection(self, stream: trio.SocketStream) -> None:
        transport = StreamFrameTransport(stream)
        try:
            channel = await NoiseChannel.accept(transport, self.private, self._expects)
        except (SwarmError, OSError, trio.BrokenResourceError) as exc:
            log.info("refused a direct ring connection: %s", exc)
            await transport.aclose()
            return
        hop_id = channel.handshake_payload.decode(errors="replace")
        runtime = self._stage_for_hop(hop_id, channel.remote_static)
        if runtime is None:
            log.info("refused a direct ring connection for an unknown hop")
            await channel.aclose()
            return
        await self._pump(channel, runtime, hop_id)

    async def _start_ring_listener(self, nursery: trio.Nursery) -> None:
        port = self.settings.serve_port
        try:
            listeners = await nursery.start(trio.serve_tcp, self._on_direct_connection, port)
        except OSError as exc:
            log.warning("SWARM_SERVE_PORT %s is taken (%s); listening on a free port instead", port, exc)
            listeners = await nursery.start(trio.serve_tcp, self._on_direct_connection, 0)
        self.serve_port = listeners[0].socket.getsockname()[1]

    async def _relay_listener(self, runtime: StageRuntime, hop_in: dict) -> None:
        """Keep one listener waiting on this stage's relay channel, for whenever the previous stage uses it."""
        while True:
            try:
                try:
                    await self._relay_once(runtime, hop_in)
                except BaseExceptionGroup as group:
                    raise first_leaf(group) from None
            except (SwarmError, OSError, trio_websocket.HandshakeError, trio_websocket.ConnectionClosed) as exc:
                log.info("relay listener for %s: %s", runtime.model, exc)
                await trio.sleep(1.0)

    async def _relay_once(self, runtime: StageRuntime, hop_in: dict) -> None:
        async with trio.open_nursery() as nursery:
            channel = await accept_relay(
                nursery, self.leader_url, hop_in["hop_id"], self.credential, self.private,
                lambda key: key == hop_in["peer_key"],
            )
            await self._pump(channel, runtime, hop_in["hop_id"])
            nursery.cancel_scope.cancel()


async def _open_quietly(hop: OutgoingHop) -> None:
    try:
        await hop.ensure_open()
    except SwarmError as exc:
        log.info("the link to %s is not open yet (%s); the first request opens it", hop.config.peer_name, exc)


def _free_memory() -> None:
    """Hand an unloaded stage's memory back: Python's cycles first, then the CUDA caching allocator's pool."""
    import gc

    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def run_fellow(leader_url: str, join_token: str | None, data_dir: Path, name: str | None) -> None:
    settings = Settings.from_env()
    fellow = Fellow(leader_url=leader_url, data_dir=data_dir, settings=settings, name=name, join_token=join_token)
    print(f"Fellow {fellow.name} (key {fingerprint(fellow.public)}) joining {leader_url}", flush=True)
    trio.run(fellow.run)


